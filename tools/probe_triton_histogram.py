"""Does tl.histogram count right on this GPU? Three ways of counting entries of an [S, K] block of
expert ids, the way jaxgin.moe's routing kernel counts them (_routing_device.py):

  masked_reshaped   a [S, K] load, reshaped to [S * K], counted with the mask reshaped alike
  reshaped_no_mask  the same load, absent entries moved to a bin of their own, counted without a mask
  flat              a flat [S * K] load and mask (what the routing kernel does)

One program per histogram (64 programs, --draws random blocks each); a program is wrong when any
bin differs from numpy's count. On an H200 with Triton 3.6.0 the first way was wrong in every
program at 512 entries and more, and right at 128 (docs/measurements.md, fifteenth session).

    python tools/probe_triton_histogram.py [--draws 10] [--out DIR]

Writes DIR/triton_histogram.json ({"device", "triton", "cases": [{"way", "S", "K", "bins",
"warps", "programs", "wrong"}]}). Needs an NVIDIA GPU visible to JAX and Triton (pip install -e
".[cuda]"); without them it says so and exits with status 4 or 3 (jaxgin.cli).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxgin
from jaxgin import cli

PROGRAMS = 64
WAYS = ("masked_reshaped", "reshaped_no_mask", "flat")
# (S, K, bins, warps): 128 entries (one per thread at 4 warps), then 512 to 2048
SHAPES = ((16, 8, 512, 4), (128, 4, 16, 4), (128, 8, 512, 4), (128, 8, 512, 8), (256, 8, 512, 8))


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def count(ctx, ids, out, LIVE: tl.constexpr, S: tl.constexpr, K: tl.constexpr, B: tl.constexpr,
              WAY: tl.constexpr):
        """out[program] = histogram of rows [0, LIVE) of ids[program] ([S, K], values in [0, B - 1))."""
        base = ids + tl.program_id(0) * S * K
        if WAY == 0 or WAY == 1:
            s = tl.arange(0, S)
            ks = tl.arange(0, K)
            present = (s < LIVE)[:, None] & (ks < K)[None, :]
            v = tl.load(base + s[:, None] * K + ks[None, :], mask=present, other=B - 1)
            if WAY == 0:
                h = tl.histogram(tl.reshape(v, (S * K,)), B, mask=tl.reshape(present, (S * K,)))
            else:
                h = tl.histogram(tl.reshape(v, (S * K,)), B)
        else:
            f = tl.arange(0, S * K)
            present = f // K < LIVE
            h = tl.histogram(tl.load(base + f, mask=present, other=B - 1), B, mask=present)
        tl.store(out + tl.program_id(0) * B + tl.arange(0, B), h)

    return count


def measure(draws: int) -> list[dict]:
    kernel = _kernel()
    rng = np.random.default_rng(0)
    cases = []
    for way_index, way in enumerate(WAYS):
        for s, k, bins, warps in SHAPES:
            live = s * 3 // 4
            call = jax.jit(lambda ids, s=s, k=k, bins=bins, warps=warps, live=live: jaxgin.triton_call(
                kernel, ids, grid=(PROGRAMS,), out_shape=jax.ShapeDtypeStruct((PROGRAMS, bins), jnp.int32),
                num_warps=warps, LIVE=live, S=s, K=k, B=bins, WAY=way_index))
            wrong = 0
            for _ in range(draws):
                ids = rng.integers(0, bins - 1, size=(PROGRAMS, s, k)).astype(np.int32)
                want = np.stack([np.bincount(block[:live].ravel(), minlength=bins) for block in ids])
                if way == "reshaped_no_mask":  # absent entries land in the last bin
                    want[:, bins - 1] += (s - live) * k
                wrong += int((np.asarray(call(ids)) != want).any(axis=1).sum())
            case = dict(way=way, S=s, K=k, bins=bins, warps=warps, programs=PROGRAMS * draws, wrong=wrong)
            print(json.dumps(case), flush=True)
            cases.append(case)
    return cases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=10)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    cli.require_gpus(__file__, 1, "it runs tl.histogram there")
    cli.require(__file__, "triton", why="the kernels it runs", install='-e ".[cuda]"')
    import triton

    cli.run(__file__, jaxgin.initialize)
    report = dict(device=jax.devices()[0].device_kind, triton=triton.__version__, cases=measure(args.draws))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "triton_histogram.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
