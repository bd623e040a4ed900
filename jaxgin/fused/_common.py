"""What the fused ops share: argument checks, tile configurations and their tuning, and the heap
buffers each op configuration keeps for the life of the runtime (through op_support, which also
holds what every op shares)."""

from __future__ import annotations

import dataclasses
import json
import os
import zlib
from collections.abc import Hashable
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax._src import distributed

from jaxgin import op_support, settings
from jaxgin.triton_op import OWN_KERNELS_FP_FUSION, triton_call

DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True)
class TileConfig:
    """One output tile per program: block_m x block_n, the K loop in steps of block_k;
    group_m row tiles share a weight tile while resident (L2 reuse)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 8
    num_stages: int = 3

    def __post_init__(self):
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"TileConfig.{name} must be a power of two >= 16, got {value}")


# Small candidate sets for H200-class GPUs (228 KiB of shared memory per SM); the first is the
# default when tuning is off. 16-bit: wgmma-friendly 128-row tiles; float32 halves block_k.
# Where M is small (K = 7168, N = 2048 on one H200), too few 128 x 128 tiles fill the GPU: in five
# stages, 64 x 64 tiles were 0.91x cuBLAS at M = 256, 128 x 64 0.95-0.98x at M = 512 (128 x 128 in
# three: 0.59x) and 128 x 128 0.97-1.00x at M = 1024 (three stages: 0.73x).
SMALL_M_CANDIDATES = (TileConfig(128, 64, 64, 8, 4, 5), TileConfig(128, 128, 64, 8, 4, 5),
                      TileConfig(64, 64, 64, 8, 4, 5))
CANDIDATES = {
    2: (
        TileConfig(128, 256, 64, 8, 8, 3),
        TileConfig(128, 128, 64, 8, 8, 4),
        TileConfig(128, 256, 64, 8, 8, 4),
        TileConfig(64, 256, 64, 8, 4, 4),
        TileConfig(128, 128, 64, 8, 4, 4),
        *SMALL_M_CANDIDATES,
    ),
    4: (
        TileConfig(128, 128, 32, 8, 8, 3),
        TileConfig(128, 256, 32, 8, 8, 3),
        TileConfig(64, 128, 32, 8, 4, 4),
    ),
}


# Shared memory per SM on Hopper (H100, H200), less the 1 KiB the GPU reserves per program.
SHARED_MEMORY_PER_SM = 228 * 1024
RESERVED_PER_PROGRAM = 1024


def two_programs_registers(tiles: TileConfig, itemsize: int) -> int | None:
    """The most registers per thread that let two programs of `tiles` share an SM (64 Ki registers
    each), where their pipeline buffers let two share it by shared memory; else None (no cap).
    Without the cap, device-library code compiled into a fused kernel (the GIN put) can take an
    8-warp kernel past 128, one program per SM. None too where the cap is above what a thread may
    have anyway (255)."""
    if not _two_programs_fit(tiles, itemsize):
        return None
    registers = 65536 // (2 * 32 * tiles.num_warps)
    return registers if registers < 255 else None


def _two_programs_fit(tiles: TileConfig, itemsize: int) -> bool:
    """Whether two programs' pipeline buffers fit in one SM's shared memory."""
    pipeline = tiles.num_stages * (tiles.block_m + tiles.block_n) * tiles.block_k * itemsize
    return 2 * (pipeline + RESERVED_PER_PROGRAM) <= SHARED_MEMORY_PER_SM


def launch_options(tiles: TileConfig, dtype) -> dict:
    """triton_call's compile options for a fused op's kernel with `tiles`: their warps and stages,
    FMA fusion as measured, and the register cap where two programs share an SM."""
    return dict(num_warps=tiles.num_warps, num_stages=tiles.num_stages, enable_fp_fusion=OWN_KERNELS_FP_FUSION,
                max_registers=two_programs_registers(tiles, np.dtype(dtype).itemsize))


def traced_out_shape(out, programs: int, trace: bool):
    """A fused kernel's out_shape: `out`, and with `trace` beside it the traced kernel's records,
    int32 [programs, 16] (8 int64 words per program)."""
    return (out, jax.core.ShapedArray((programs, 16), jnp.int32)) if trace else out


# Configurations whose pipeline buffers let two programs share an SM: while one stores or fetches
# remote tiles, or waits for rows, or sends the shard, the other computes. They beat one program
# per SM in the fused ops while those ops' wgmma were serialized; the ops' own sets (below) now
# add 128 x 256 tiles.
EXCHANGE_CANDIDATES = {
    2: (
        TileConfig(128, 128, 64, 8, 8, 3),
        TileConfig(128, 128, 64, 8, 4, 3),
    ),
    4: (
        TileConfig(128, 128, 32, 8, 8, 3),
        TileConfig(64, 128, 32, 8, 4, 4),
    ),
}


METHODS = ("auto", "chunked", "triton", "unfused")

# method="auto" runs the chunked method where its exchange hides under the matmul and XLA's
# unfused composition where the matmul is too short for that: the chunked call's fixed costs (its
# bounded waits, stream hand-overs, per-peer cuBLAS calls) came to 30-50 us on 4 x H100, and below
# about 1e11 FLOP of 16-bit matmul per device (~150 us) XLA's composition was as fast or faster,
# whatever the chunk layout (docs/measurements.md, eighth session).
AUTO_CHUNKED_MIN_FLOP = 1e11
# How many 16-bit FLOP a float32 one costs on tensor cores, by jax's matmul precision
# (dot_precision): tf32 runs at half the 16-bit rate, 3 x tf32 a sixth, IEEE float32 on the CUDA
# cores about a sixteenth.
FLOAT32_COST = {"tf32": 2, "tf32x3": 6, "ieee": 16}


@dataclasses.dataclass(frozen=True)
class MethodChoice:
    """Which implementation a fused op runs on GPUs, and why (jaxgin.fused.explain)."""

    op: str
    asked: str  # the op's `method` argument
    method: str  # what runs: "chunked", "triton" or "unfused"
    reason: str

    def __str__(self) -> str:
        return f"{self.op}: method={self.asked!r} runs {self.method!r}: {self.reason}"


def check_method(op: str, method, tiles, methods=METHODS) -> str:
    """The implementation a fused op was asked for, one of the op's `methods`: "auto" (the default:
    see choose_method), "chunked" (cuBLAS per chunk, copy-engine exchange; _chunked.py), "triton"
    (one Triton kernel; _kernels.py) or "unfused" (XLA's matmul, then XLA's collective). Tiles are
    Triton's."""
    if method not in methods:
        raise ValueError(f"{op}: method={method!r}; use one of {', '.join(map(repr, methods))}")
    if tiles is not None and method != "triton":
        raise ValueError(f"{op}: tiles= configures the Triton kernel; pass method='triton' with it "
                         f"(method={method!r} multiplies with cuBLAS, which picks its own tiles)")
    return method


def choose_method(op: str, asked: str, flop: float, dtype, precision, gin_in_job: bool) -> MethodChoice:
    """What a fused op asked for `asked` runs, for a matmul of `flop` FLOP per device in `dtype`.
    A job with GPUs on other hosts runs the Triton kernel for "chunked" and "auto": it picks each
    peer's path on the device (GIN puts or NVLink stores), while the chunked method's copy engine
    reaches NVLink peers only, so a user never gets an error because a peer is on another host."""
    def choice(method, reason):
        return MethodChoice(op, asked, method, reason)

    if asked in ("triton", "unfused"):
        return choice(asked, "asked for")
    if gin_in_job:
        return choice("triton", "the job has GPUs on other hosts; the Triton kernel reaches them by GIN puts, "
                                "the chunked method's copy engine only NVLink peers")
    if asked == "chunked":
        return choice("chunked", "asked for")
    cost = flop * (FLOAT32_COST[dot_precision(dtype, precision)] if np.dtype(dtype) == np.float32 else 1)
    size = f"the matmul is {flop / 1e9:.3g} GFLOP per device ({np.dtype(dtype).name}" + (
        f", {cost / 1e9:.3g} in 16-bit terms)" if cost != flop else ")")
    if cost >= AUTO_CHUNKED_MIN_FLOP:
        return choice("chunked", f"{size}, enough for the chunked exchange to hide under it "
                                 f"(auto takes it from {AUTO_CHUNKED_MIN_FLOP / 1e9:.3g} GFLOP)")
    return choice("unfused", f"{size}, below the {AUTO_CHUNKED_MIN_FLOP / 1e9:.3g} GFLOP from which the chunked "
                             "exchange hides under it; XLA's matmul then its collective is as fast there")


def plan_method(op: str, plan, dtype, gin_in_job: bool) -> MethodChoice:
    """choose_method for an op's plan (its method, precision and `flop`: its matmul per device)."""
    return choose_method(op, plan.method, plan.flop, dtype, plan.precision, gin_in_job)


def by_method(op: str, state, plan, dtype, unfused, chunked, triton):
    """The op on GPUs as plan_method picks it: `unfused()` (XLA's composition), `chunked()` (the
    chunked custom call) or `triton(gin_in_job)` (the Triton kernel; Triton checked present first)."""
    gin = op_support.gin_in_job(state)
    method = plan_method(op, plan, dtype, gin).method
    if method == "unfused":
        return unfused()
    if method == "chunked":
        return chunked()
    op_support.require_tritongin(op)
    return triton(gin)


@dataclasses.dataclass(frozen=True)
class MatmulPlan:
    """What every fused op's plan starts with: the mesh axes it runs over, their size, and its
    matmul's shape per device (x [m, k], w [k, n]). Each op's plan adds its own fields after these."""

    names: tuple[Hashable, ...]
    size: int
    m: int
    n: int
    k: int


# Programs per source that copy a GIN source's tiles out of the receive area after the matmul (see
# _kernels.matmul_all_to_all_kernel): enough together to fill the GPU, at least one per source.
GIN_COPY_PROGRAMS = 128


def gin_copiers(size: int, tiles: int) -> int:
    return max(1, min(tiles, GIN_COPY_PROGRAMS // size))


def check_operands(op: str, x, w):
    x, w = jnp.asarray(x), jnp.asarray(w)
    if x.ndim != 2 or w.ndim != 2:
        raise ValueError(f"{op}: x and w must be 2-D ([M, K] and [K, N]), got x{list(x.shape)} and w{list(w.shape)}")
    if x.shape[1] != w.shape[0]:
        raise ValueError(f"{op}: x is [M, K] = {list(x.shape)} and w [K, N] = {list(w.shape)}: K differs")
    for name, a in (("x", x), ("w", w)):
        if a.dtype.name not in DTYPES:
            raise TypeError(f"{op}: {name} has dtype {a.dtype.name}; supported: {', '.join(DTYPES)}")
    if x.dtype != w.dtype:
        raise TypeError(f"{op}: x is {x.dtype.name} but w is {w.dtype.name}; cast one so both have the same dtype")
    return x, w


def dot_precision(dtype, precision) -> str:
    """Triton's input_precision for float32 operands, following jax's matmul precision: tf32 by
    default (as XLA on these GPUs), 3 x tf32 for HIGH, IEEE float32 for HIGHEST."""
    if np.dtype(dtype) != np.float32:
        return "tf32"  # unused for 16-bit operands
    setting = precision if precision is not None else jax.config.jax_default_matmul_precision
    name = str(getattr(setting, "name", setting)).lower()
    if name in ("highest", "float32"):
        return "ieee"
    if name in ("high", "bfloat16_3x", "tensorfloat32_3x"):
        return "tf32x3"
    return "tf32"


def lax_precision(precision):
    return None if precision is None else jax.lax.Precision(precision)


@dataclasses.dataclass
class OpBuffers:
    exchange: object  # SymmetricArray: two halves of every peer's slot
    flags: object  # int64 readiness flags, zero at first (see _kernels.py)
    state: object  # int64[_kernels.STATE_WORDS]: call counter, finished programs, start order
    gin_area: object = None  # SymmetricArray: GIN staging / receive area (jobs with GIN peers)
    signals: int = 0  # first of the op's signals (jobs with GIN peers)


def op_buffers(state, key, shape, dtype, flags: int, gin_area_shape=None, signals: int = 0) -> OpBuffers:
    """One set of heap buffers per op configuration (op_support.placed): the flags and counters
    start at zero on every GPU, as the kernels need. A job with GIN peers also gets the op's GIN
    area (`gin_area_shape`, if the op needs one beside the exchange buffer) and `signals` signals,
    kept like the buffers: the kernels count arrivals on them for the life of the runtime."""
    from jaxgin.fused import _kernels  # needs Triton: only the Triton kernels' lowering gets here

    return op_support.placed(state, ("fused",) + tuple(key), lambda: OpBuffers(
        op_support.heap_array(state, shape, dtype),
        op_support.heap_array(state, (flags,), np.int64),
        op_support.heap_array(state, (_kernels.STATE_WORDS,), np.int64),
        op_support.heap_array(state, gin_area_shape, dtype) if gin_area_shape is not None else None,
        state.signals.allocate(signals) if signals else 0,
    ))


# ---------------------------------------------------------------------------------------------
# Tile configuration: explicit, else tuned once per (GPU, shape, dtype) on the matmul alone, else
# the first candidate. Every process must use the same configuration (the grid and the signal
# counts depend on it), so in a multi-process job process 0 tunes and publishes its choice.

_chosen: dict[str, TileConfig] = {}


def _tuning_enabled() -> bool:
    return settings.get("JAXGIN_FUSED_AUTOTUNE") not in ("0", "false", "no")


def _cache_file() -> Path:
    from jaxgin import build  # not at import: `python -m jaxgin.build` must find it unloaded (jaxgin.runtime)

    return build.default_cache_dir() / "fused-tiles.json"


# all_gather_matmul: the exchange configurations with 8 warps only (its senders copy num_warps
# rows at a time, and at 4 warps the op was slower though the matmul alone was faster), and
# 16-bit 128 x 256 tiles, 10 % faster end to end at 8192 x 4096 x 4096 once their wgmma were
# pipelined (docs/measurements.md), and for few rows 128 x 64 and 128 x 128 tiles in five stages
# (as SMALL_M_CANDIDATES, at 8 warps). The senders share the tiles' waves: see sender_waves.
GATHER_CANDIDATES = {2: (*(t for t in EXCHANGE_CANDIDATES[2] if t.num_warps == 8), TileConfig(128, 256, 64, 8, 8, 4),
                         TileConfig(128, 64, 64, 8, 8, 5), TileConfig(128, 128, 64, 8, 8, 5)),
                     4: tuple(t for t in EXCHANGE_CANDIDATES[4] if t.num_warps == 8)}

# matmul_all_to_all and matmul_reduce_scatter: 16-bit 128 x 256 tiles (one program per SM) first,
# then the exchange configurations and those for few rows. Once their wgmma were no longer
# serialized, 128 x 256 was the fastest at both of issue 44's shapes: matmul_all_to_all 1.12x /
# 1.14x XLA against 1.00-1.03x for 128 x 128, the folded reduce-scatter 3 % / 11 % faster
# (docs/measurements.md).
WIDE_FIRST_CANDIDATES = {2: (TileConfig(128, 256, 64, 8, 8, 4), *EXCHANGE_CANDIDATES[2], *SMALL_M_CANDIDATES),
                         4: EXCHANGE_CANDIDATES[4]}

# Candidate sets by name: "matmul" (CANDIDATES), "gather" (GATHER_CANDIDATES), "wide_first"
# (WIDE_FIRST_CANDIDATES).
FAMILIES = {"matmul": CANDIDATES, "gather": GATHER_CANDIDATES, "wide_first": WIDE_FIRST_CANDIDATES}


def programs_per_sm(tiles: TileConfig, itemsize: int) -> int:
    """How many programs of `tiles` an SM holds at once: two where their pipeline buffers fit
    together (launch_options caps the registers to match), else one."""
    return 2 if _two_programs_fit(tiles, itemsize) else 1


def sender_waves(tiles: TileConfig, m: int, n: int, itemsize: int, senders: int, sms: int) -> float:
    """How much longer a kernel whose grid is `senders` programs before the tiles of an m x n
    matmul runs than the tiles alone, counted in waves of programs (SMs x programs per SM): the
    senders take slots of the first wave, and a grid that spills into one more wave pays it whole."""
    slots = sms * programs_per_sm(tiles, itemsize)
    count = -(-m // tiles.block_m) * -(-n // tiles.block_n)
    return -(-(count + senders) // slots) / -(-count // slots)


def choose_tiles(state, m: int, n: int, k: int, dtype, precision: str, tiles: TileConfig | None,
                 family: str = "matmul", senders: int = 0) -> TileConfig:
    """`tiles` if given, else the fastest of the `family` candidate set (FAMILIES) for the matmul
    alone, tuned once per GPU kind, shape and family. `senders`: programs the kernel runs before
    its tiles; each candidate's time is scaled by sender_waves."""
    if tiles is not None:
        if not isinstance(tiles, TileConfig):
            raise TypeError(f"tiles must be a jaxgin.fused.TileConfig, got {type(tiles).__name__}")
        return tiles
    dtype = np.dtype(dtype)
    candidates = FAMILIES[family][min(dtype.itemsize, 4)]
    if not _tuning_enabled() or len(candidates) == 1:
        return candidates[0]
    device = state.local_devices[0]
    key = (f"{device.device_kind}|{m}x{n}x{k}|{dtype.name}|{precision}" + ("" if family == "matmul" else f"|{family}")
           + (f"|{senders} senders" if senders else "") + f"|among {candidates_fingerprint(candidates)}")
    if key in _chosen:
        return _chosen[key]
    sms = op_support.sm_count(device)

    def scale(c: TileConfig) -> float:  # 1.0 for every candidate without senders
        return sender_waves(c, m, n, dtype.itemsize, senders, sms)

    choice = _agreed(key, lambda: _tune(key, state, m, n, k, dtype, precision, candidates, scale))
    _chosen[key] = choice
    return choice


def candidates_fingerprint(candidates) -> str:
    """A short name for a candidate set: a choice cached among other candidates is not reused."""
    return f"{zlib.crc32(repr(tuple(candidates)).encode()):08x}"


def _agreed(key: str, tune) -> TileConfig:
    if jax.process_count() == 1:
        return tune()
    client = distributed.global_state.client
    kv_key = f"jaxgin/fused-tiles/{key}"
    if jax.process_index() == 0:
        choice = tune()
        client.key_value_set(kv_key, json.dumps(dataclasses.asdict(choice)), allow_overwrite=True)
        return choice
    return TileConfig(**json.loads(client.blocking_key_value_get(kv_key, 600_000)))


def _tune(key, state, m, n, k, dtype, precision, candidates, scale) -> TileConfig:
    path = _cache_file()
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        saved = {}
    if key in saved:
        return TileConfig(**saved[key])
    device = state.local_devices[0]
    times = op_support.outside_trace(lambda: {c: time_matmul(c, m, n, k, dtype, precision, device=device) for c in candidates})
    best = min(times, key=lambda c: times[c] * scale(c))
    saved[key] = dataclasses.asdict(best)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(saved, indent=1))
        tmp.replace(path)
    except OSError:
        pass  # an unwritable cache only costs tuning again next time
    return best


def matmul(x, w, tiles: TileConfig, precision: str = "tf32"):
    """x @ w with the fused kernels' tile code alone, as one XLA op (no communication)."""
    from jaxgin.fused import _kernels  # needs Triton (optional: GPU lowering only)

    (m, k), n = x.shape, w.shape[1]
    tm, tn = -(-m // tiles.block_m), -(-n // tiles.block_n)
    return triton_call(
        _kernels.matmul_kernel, x, w, grid=(tm * tn,), out_shape=jax.core.ShapedArray((m, n), x.dtype),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, enable_fp_fusion=OWN_KERNELS_FP_FUSION,
        M=m, N=n, K=k, BM=tiles.block_m, BN=tiles.block_n, BK=tiles.block_k, GROUP_M=tiles.group_m,
        PRECISION=precision,
        pure=True,
    )


def time_matmul(tiles: TileConfig, m, n, k, dtype, precision, *, device, repeats: int = 20) -> float:
    """Seconds per call of the tile code alone on `device`, by the GPU's own clock: a chain of
    `repeats` calls between two stamps (_kernels.clock_kernel), the best of 3 runs. The host's wall
    clock moved by up to 40 % between runs of such chains on one H200 and misranked configurations
    (docs/measurements.md, thirty-sixth session); the device's time between the stamps does not
    include the host's launches."""
    from jaxgin.fused import _kernels  # needs Triton (optional: GPU lowering only)

    keys = jax.random.split(jax.random.key(0))
    x = jax.device_put(jax.random.normal(keys[0], (m, k), dtype), device)
    w = jax.device_put(jax.random.normal(keys[1], (k, n), dtype), device)
    stamp = jax.core.ShapedArray((2,), jnp.int32)  # one int64: XLA outside x64 mode has no int64 arrays

    @jax.jit
    def chain(x, w):
        # Each call is ordered after the one before by an optimization barrier over x and its result:
        # no copy and no work between the calls, only the order.
        start = triton_call(_kernels.clock_kernel, x, grid=(1,), out_shape=stamp, num_warps=1, pure=True)
        x, _ = jax.lax.optimization_barrier((x, start))
        for _ in range(repeats):
            x, _ = jax.lax.optimization_barrier((x, matmul(x, w, tiles, precision)))
        return start, triton_call(_kernels.clock_kernel, x, grid=(1,), out_shape=stamp, num_warps=1, pure=True)

    def run() -> float:
        start, end = (np.asarray(s).view(np.int64)[0] for s in chain(x, w))
        return (end - start) * 1e-9 / repeats

    try:
        run()  # compiles, and fails for a configuration this GPU cannot run (shared memory, registers)
    except Exception:
        return float("inf")
    return min(run() for _ in range(3))


def row_groups(tile_rows: int, limit: int = 32) -> tuple[int, int]:
    """(groups, tile rows per group): a shard's row tiles are announced in at most `limit` groups."""
    per = -(-tile_rows // limit)
    return -(-tile_rows // per), per
