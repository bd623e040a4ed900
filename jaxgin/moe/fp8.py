"""FP8 rows for MoE dispatch: e4m3 values with one float32 scale per 128 elements, as DeepEP's
low-latency dispatch sends them, packed into one row of 16-bit words that dispatch moves as it
moves any row.

    q, scales = jaxgin.moe.fp8.quantize(x)        # x [T, H]: q float8_e4m3fn [T, H], scales f32 [T, H / 128]
    x8 = jaxgin.moe.fp8.dequantize(q, scales, x.dtype)
    x8 = jaxgin.moe.fp8.rounded(x)                 # the same, safe inside any jit: what dispatch delivers

A block's scale is a power of two: the smallest 2^k with largest magnitude / 2^k <= 448 (e4m3's
largest finite value), so no value saturates and the largest lands in (224, 448]; an all-zero block
has scale 1. With power-of-two scales, scaling and unscaling are exact multiplications, so every
compiler and the dispatch kernel round alike: only the conversion to e4m3 rounds (once, to nearest
even). A row of H values travels as H bytes of e4m3 and H / 32 bytes of scales: 0.52x the bytes of
bfloat16 (0.26x of float32). dispatch(..., fp8=True) returns rounded(x) (dequantize(quantize(x))
in x's dtype), exactly, in the dispatch layout.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

BLOCK = 128  # elements per scale
E4M3_MAX = 448.0
PACKED_DTYPE = jnp.int16  # what dispatch moves: bits only, never arithmetic on them


def check_hidden(op: str, hidden: int) -> None:
    if hidden % BLOCK:
        raise ValueError(f"{op}: fp8=True needs the hidden size to be a multiple of {BLOCK} (one scale per {BLOCK} "
                         f"values), got {hidden}")


def quantize(x):
    """x [..., H] (H a multiple of 128) -> (e4m3 values [..., H], float32 scales [..., H / 128])."""
    *lead, h = x.shape
    blocks = x.astype(jnp.float32).reshape(*lead, h // BLOCK, BLOCK)
    scales, inverses = power_of_two_scales(jnp.max(jnp.abs(blocks), axis=-1))
    q = jax.lax.bitcast_convert_type(e4m3_bits(blocks * inverses[..., None]), jnp.float8_e4m3fn)
    return q.reshape(*lead, h), scales


def power_of_two_scales(amax):
    """Per block, (2^k, 2^-k) as float32 for the smallest k with amax / 2^k <= 448 = 1.75 * 2^8,
    from amax's exponent and mantissa bits (no division, so the same everywhere); k within
    [-126, 120] so that both are normal numbers; k = 0 for an all-zero block."""
    bits = jax.lax.bitcast_convert_type(amax.astype(jnp.float32), jnp.int32)
    k = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).astype(jnp.int32)
    k = jnp.where(amax > 0, jnp.clip(k, -126, 120), 0)
    as_float = lambda e: jax.lax.bitcast_convert_type((e + 127) << 23, jnp.float32)  # noqa: E731
    return as_float(k), as_float(-k)


def e4m3_bits(v):
    """float32 -> e4m3fn bit patterns (uint8), rounded once to nearest even, in integer arithmetic
    as the dispatch kernel does it, so the reference does not depend on how a backend converts.
    Past 464 in magnitude (and for NaN): NaN; quantize stays within 448."""
    bits = jax.lax.bitcast_convert_type(v.astype(jnp.float32), jnp.int32)
    sign = (bits >> 24) & 0x80
    a = bits & 0x7FFFFFFF
    # 2^-6 and up: round the 20 low bits of exponent|mantissa away, then rebias 127 -> 7
    normal = ((a + 0x7FFFF + ((a >> 20) & 1)) >> 20) - (120 << 3)
    # below: multiples of 2^-9, the mantissa with its leading 1 shifted right by 141 - exponent
    mantissa = (a & 0x7FFFFF) | 0x800000
    shift = jnp.clip(141 - (a >> 23), 1, 31)
    kept = mantissa >> shift
    rest = mantissa - (kept << shift)
    half = jnp.left_shift(jnp.int32(1), shift - 1)
    small = kept + ((rest > half) | ((rest == half) & ((kept & 1) == 1))).astype(jnp.int32)
    code = jnp.where(a >= 0x3C800000, normal, small)
    return (jnp.where(a > 0x43E80000, 0x7F, code) | sign).astype(jnp.uint8)


def dequantize(q, scales, dtype):
    """The values quantize() stands for, in `dtype`."""
    *lead, h = q.shape
    blocks = q.astype(jnp.float32).reshape(*lead, h // BLOCK, BLOCK) * scales[..., None]
    return blocks.reshape(*lead, h).astype(dtype)


def rounded(x, dtype=None):
    """dequantize(quantize(x)) in `dtype` (default x's), the e4m3 rounding kept wherever it is traced:
    XLA may fold a conversion to a narrower type and straight back inside one program (it allows
    excess precision by default, --xla_allow_excess_precision), which would hand back x unrounded.
    The optimization barrier between the two keeps the e4m3 values real."""
    q, scales = jax.lax.optimization_barrier(quantize(x))
    return dequantize(q, scales, x.dtype if dtype is None else dtype)


def packed_width(hidden: int) -> int:
    """16-bit words of one packed row: H bytes of values and 4 * H / 128 bytes of scales."""
    return (hidden + 4 * (hidden // BLOCK)) // 2


def pack(q, scales):
    """[T, H] e4m3 and [T, H / 128] float32 -> [T, packed_width(H)] int16 words (the bytes of both)."""
    t, h = q.shape
    value_bytes = jax.lax.bitcast_convert_type(q, jnp.uint8)
    scale_bytes = jax.lax.bitcast_convert_type(scales, jnp.uint8).reshape(t, -1)
    row = jnp.concatenate([value_bytes, scale_bytes], axis=1)
    return jax.lax.bitcast_convert_type(row.reshape(t, -1, 2), PACKED_DTYPE)


def unpack(words, hidden: int):
    """pack's inverse: [R, packed_width(hidden)] int16 -> ([R, hidden] e4m3, [R, hidden / 128] float32)."""
    rows = words.shape[0]
    row = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(rows, -1)
    q = jax.lax.bitcast_convert_type(row[:, :hidden], jnp.float8_e4m3fn)
    scales = jax.lax.bitcast_convert_type(row[:, hidden:].reshape(rows, -1, 4), jnp.float32)
    return q, scales
