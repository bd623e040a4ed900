"""dispatch(fp8=True) on this machine against an oracle that shares no code with jaxgin: numpy and
ml_dtypes compute each block's power-of-two scale, the e4m3 values (one rounding, to nearest even)
and the rounded rows; jaxgin.moe.fp8.quantize / rounded (XLA) and the dispatch kernel are counted
against them, value by value, at benchmarks/moe.py's shapes on one GPU (or on CPU, the reference).

    python tools/check_fp8.py [--tokens 128,4096] [--out DIR]

Prints, and writes to DIR/check_fp8.json, per token count: mismatches of XLA's scales and values,
of fp8.rounded, and of the dispatched rows (kernel) against the oracle, with the first few
mismatches; exit status 1 when any count is not zero.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxgin

HIDDEN, EXPERTS, TOP_K = 7168, 256, 8


def oracle(x: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(scales [T, H / 128], e4m3 values [T, H], rounded rows [T, H] in x's dtype), numpy only."""
    t, h = x.shape
    blocks = x.astype(np.float32).reshape(t, h // 128, 128)
    amax = np.abs(blocks).max(-1).astype(np.float64)
    # the smallest power of two 2^k with amax / 2^k <= 448, k within [-126, 120]; 1 for zeros
    k = np.ceil(np.log2(np.where(amax > 0, amax, 1) / 448))
    k = np.where(amax > 0, np.clip(k, -126, 120), 0)
    scales = np.ldexp(np.float32(1), k.astype(np.int32)).astype(np.float32)
    values = (blocks * (np.float32(1) / scales)[..., None]).astype(ml_dtypes.float8_e4m3fn)
    rows = (values.astype(np.float32) * scales[..., None]).reshape(t, h).astype(x.dtype)
    return scales, values.reshape(t, h), rows


def examples(mask: np.ndarray, **arrays) -> list[dict]:
    return [{"at": [int(i) for i in where], **{name: float(np.asarray(a[tuple(where)], np.float32))
                                                 for name, a in arrays.items()}}
            for where in np.argwhere(mask)[:4]]


def check(mesh: Mesh, tokens: int) -> dict:
    fp8 = jaxgin.moe.fp8
    keys = jax.random.split(jax.random.key(tokens), 2)  # benchmarks/moe.py's inputs
    x = jax.random.normal(keys[0], (tokens, HIDDEN), jnp.float32).astype(jnp.bfloat16)
    weights, ids = jax.jit(lambda v: jaxgin.moe.router(v, TOP_K))(
        jax.random.normal(keys[1], (tokens, EXPERTS), jnp.float32))
    x_host = np.asarray(x)
    scales, values, rows = oracle(x_host)
    q, s = jax.jit(lambda v: jax.lax.optimization_barrier(fp8.quantize(v)))(x)
    q, s = np.asarray(q), np.asarray(s)
    rounded = np.asarray(jax.jit(fp8.rounded)(x))
    capacity = -(-tokens * TOP_K * 5 // 4)

    def dispatched(rows_in, quantized):
        f = lambda v, i, w: jaxgin.moe.dispatch(v, i, w, num_experts=EXPERTS, axis_name="ep",  # noqa: E731
                                                capacity=capacity, fp8=quantized).x
        return np.asarray(jax.jit(jax.shard_map(f, mesh=mesh, in_specs=(P("ep"),) * 3, out_specs=P("ep")))(
            rows_in, ids, weights))

    got = dispatched(x, True)
    want = dispatched(jnp.asarray(rows), False)  # the oracle's rows, dispatched without fp8
    bits = lambda a: a.view(np.uint16 if a.dtype.itemsize == 2 else np.uint8)  # noqa: E731
    value_wrong = bits(q) != bits(values)
    rows_wrong = bits(rounded) != bits(rows)
    kernel_wrong = bits(got) != bits(want)
    return {
        "tokens": tokens, "hidden": HIDDEN, "values": int(x_host.size),
        "xla_scale_mismatches": int((s != scales).sum()),
        "xla_value_mismatches": int(value_wrong.sum()),
        "rounded_mismatches": int(rows_wrong.sum()),
        "dispatch_mismatches": int(kernel_wrong.sum()),
        "xla_value_examples": examples(value_wrong, x=x_host, got=q, want=values),
        "dispatch_examples": examples(kernel_wrong, got=got, want=want),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="128,4096")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    jaxgin.initialize(heap_size=1 << 30)
    mesh = Mesh(np.array(jax.devices()[:1]), ("ep",))
    report = {"platform": jax.devices()[0].platform, "jax": jax.__version__,
              "cases": [check(mesh, int(t)) for t in args.tokens.split(",")]}
    jaxgin.finalize()
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "check_fp8.json").write_text(text + "\n")
    counts = ("xla_scale_mismatches", "xla_value_mismatches", "rounded_mismatches", "dispatch_mismatches")
    return int(any(case[c] for case in report["cases"] for c in counts))


if __name__ == "__main__":
    sys.exit(main())
