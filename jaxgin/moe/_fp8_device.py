"""jaxgin.moe.fp8's row format on the device: the dispatch kernel quantizes rows as it stages them
for other GPUs and dequantizes them as it places them (jaxgin/moe/_kernels.py), so only e4m3 bytes
and their scales cross NVLink or the network, and no XLA program rewrites the rows before or after.

A staged row is fp8.pack's layout: H bytes of e4m3 values, then H / 128 float32 scales (little
endian), SW = fp8.packed_width(H) 16-bit words in all. The arithmetic is fp8.quantize's and
fp8.dequantize's operation for operation (power-of-two scales, so exact multiplications and one
rounding to nearest even), so the placed rows equal fp8.rounded(x) bit for bit.

Compiled, the conversions are the GPU's own (cvt to and from e4m3x2, cvt.rn to bfloat16): a few
instructions per pair of values. Triton's interpreter converts through numpy with other rounding, so
there the same roundings run in integer arithmetic (to_e4m3, from_e4m3), checked against the
reference by tests/triton_interpreter.py.
"""

import os

import triton
import triton.language as tl

BLOCK: tl.constexpr = tl.constexpr(128)  # values per scale (jaxgin.moe.fp8.BLOCK)


def _interpreting() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs, "runtime") and hasattr(knobs.runtime, "interpret"):
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# read once, as Triton reads TRITON_INTERPRET once when a kernel is defined
CONVERT_IN_HARDWARE: tl.constexpr = tl.constexpr(not _interpreting())


@triton.jit
def to_e4m3(v):
    """float32 -> e4m3fn bits (int32, 0..255), rounded to nearest even, in integer arithmetic (the
    interpreter's path); past 464 in magnitude, NaN where the GPU's conversion saturates to 448
    (quantize stays within 448, where the two agree)."""
    bits = v.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # 2^-6 and up: round the 20 low bits of exponent|mantissa away (a carry may raise the exponent),
    # then rebias the exponent from 127 to 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # below: multiples of 2^-9, the mantissa with its leading 1 shifted right by 141 - exponent
    man = (a & 0x7FFFFF) | 0x800000
    shift = tl.minimum(141 - (a >> 23), 31)
    kept = man >> shift
    rest = man - (kept << shift)
    half = 1 << (shift - 1)
    small = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).to(tl.int32)
    code = tl.where(a >= 0x3C800000, normal, small)
    return tl.where(a > 0x43E80000, 0x7F, code) | sign


@triton.jit
def from_e4m3(code):
    """e4m3fn bits (int32, 0..255) -> float32, exactly."""
    e = (code >> 3) & 0xF
    m = code & 7
    normal = (((e + 120) << 23) | (m << 20)).to(tl.float32, bitcast=True)
    magnitude = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
    magnitude = tl.where((e == 15) & (m == 7), float("nan"), magnitude)
    # the sign as a bit: a negation compiles to 0 - x on the GPU, which turns -0 into +0
    return (magnitude.to(tl.int32, bitcast=True) | ((code & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def quantize(rows, BT: tl.constexpr, BH: tl.constexpr):
    """rows [BT, BH] (BH a multiple of 128, any float dtype) -> (e4m3fn bits [BT, BH] uint8, float32
    scales [BT, BH / 128]): a block's scale is jaxgin.moe.fp8.power_of_two_scales' power of two;
    values are multiplied by its inverse (exactly) and rounded to nearest even."""
    NB: tl.constexpr = BH // BLOCK
    v = tl.reshape(rows.to(tl.float32), (BT, NB, BLOCK))
    amax = tl.max(tl.abs(v), axis=2)
    bits = amax.to(tl.int32, bitcast=True)
    k = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    k = tl.where(amax > 0, tl.minimum(tl.maximum(k, -126), 120), 0)
    scale = ((k + 127) << 23).to(tl.float32, bitcast=True)
    inverse = ((127 - k) << 23).to(tl.float32, bitcast=True)
    q = v * tl.broadcast_to(inverse[:, :, None], (BT, NB, BLOCK))
    if CONVERT_IN_HARDWARE:
        codes = q.to(tl.float8e4nv, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True)
    else:
        codes = to_e4m3(q).to(tl.uint8)
    return tl.reshape(codes, (BT, BH)), scale


@triton.jit
def dequantize(q, scale, dtype: tl.constexpr, BT: tl.constexpr, BH: tl.constexpr):
    """quantize's inverse: e4m3fn bits [BT, BH] uint8 and float32 scales [BT, BH / 128] -> [BT, BH]
    in dtype."""
    NB: tl.constexpr = BH // BLOCK
    if CONVERT_IN_HARDWARE:
        values = q.to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        values = from_e4m3(q.to(tl.int32))
    v = tl.reshape(tl.reshape(values, (BT, NB, BLOCK)) * scale[:, :, None], (BT, BH))
    if dtype == tl.float32:
        return v
    if dtype == tl.bfloat16 and not CONVERT_IN_HARDWARE:
        # round to nearest even in integer arithmetic, as the GPU's conversion does (Triton's
        # interpreter truncates); the values are finite
        bits = v.to(tl.int32, bitcast=True)
        return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return v.to(dtype, fp_downcast_rounding="rtne")


@triton.jit
def store_quantized(to, row, q, scale, h0, ok_rows, H: tl.constexpr, SW: tl.constexpr, BT: tl.constexpr,
                    BH: tl.constexpr):
    """quantize's (q, scale) of columns h0 .. h0 + BH of [BT] rows into staged rows `row` of the
    16-bit area `to` (SW words a row); rows where ok_rows is false are left alone."""
    base = to.to(tl.pointer_type(tl.uint8)) + row.to(tl.int64)[:, None] * (2 * SW)
    h = h0 + tl.arange(0, BH)
    tl.store(base + h[None, :], q, mask=ok_rows[:, None] & (h < H)[None, :])
    j = h0 // BLOCK + tl.arange(0, BH // BLOCK)
    scales = (base + H).to(tl.pointer_type(tl.float32))
    tl.store(scales + j[None, :], scale, mask=ok_rows[:, None] & (j < H // BLOCK)[None, :])


@triton.jit
def load_rows(src, row, h0, ok_rows, dtype: tl.constexpr, H: tl.constexpr, SW: tl.constexpr, BT: tl.constexpr,
              BH: tl.constexpr):
    """What store_quantized staged at columns h0 .. h0 + BH of rows `row` of `src`, dequantized to dtype
    (zeros where ok_rows is false). Loads bypass L1 (.cg): a peer or a NIC wrote them."""
    base = src.to(tl.pointer_type(tl.uint8)) + row.to(tl.int64)[:, None] * (2 * SW)
    h = h0 + tl.arange(0, BH)
    q = tl.load(base + h[None, :], mask=ok_rows[:, None] & (h < H)[None, :], other=0, cache_modifier=".cg")
    j = h0 // BLOCK + tl.arange(0, BH // BLOCK)
    scales = (base + H).to(tl.pointer_type(tl.float32))
    scale = tl.load(scales + j[None, :], mask=ok_rows[:, None] & (j < H // BLOCK)[None, :], other=1.0,
                    cache_modifier=".cg")
    return dequantize(q, scale, dtype, BT, BH)
