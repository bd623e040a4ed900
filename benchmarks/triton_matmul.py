"""The fused kernels' matmul against cuBLAS on one GPU: which Triton formulation and tile
configuration comes closest, per shape.

Variants (every one a jaxgin.triton_call kernel, timed in a chain inside one jit against XLA's
x @ w, which calls cuBLAS, in the same process; by the GPU's step cycle, the wall clock beside it):
- pointer: the tile code the fused kernels run today (_kernels.matmul_kernel: one program per
  tile, operand tiles loaded through pointers);
- tma: one program per tile, operand tiles loaded through tensor descriptors made on the device
  (TMA), the result stored through one;
- persistent: one program per SM walking the tiles (grouped order), TMA loads and store;
- persistent_ws: the same with Triton's warp specialization of the tile loop;
- copyingS (only when named in --variants, as gpu_round.py's triton_matmul_copying step does):
  pointer, with each program also copying one tile of another array in S slabs folded into its K
  loop (_kernels.matmul_copying_kernel; copying0: the whole tile after the loop, as
  matmul_all_to_all's copy-out does today); the copy is checked bit-exact.
With --tuned FAMILIES, each shape also times the configuration jaxgin.fused's tuner picks from each
named candidate family (what the fused ops would run at that shape; row "tuned_from").

Needs one GPU. Writes triton-matmul.json into --out (default $OUT or .).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from timing import after, best_seconds, device_step_seconds  # noqa: E402  (benchmarks/timing.py)

SHAPES = ((4096, 7168, 2048), (8192, 4096, 4096))
CONFIGS = (  # block_m, block_n, block_k, num_stages, num_warps
    (128, 256, 64, 3, 8),
    (128, 256, 64, 4, 8),
    (128, 128, 64, 3, 8),
    (128, 128, 64, 4, 8),
    (128, 128, 64, 4, 4),
    (128, 128, 64, 5, 4),
    (256, 128, 64, 3, 8),
)
VARIANTS = ("pointer", "tma", "persistent", "persistent_ws")  # the default run (copyingS: see above)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--shapes", default=None,
                        help="comma-separated MxKxN, e.g. 1024x7168x2048 (default: the issue's two, SHAPES)")
    parser.add_argument("--configs", default="all",
                        help="comma-separated BMxBNxBK/STAGES/WARPS, e.g. 128x256x64/3/8 (default: all of CONFIGS)")
    parser.add_argument("--tuned", default="",
                        help="comma-separated candidate families of jaxgin.fused (wide_first, gather, matmul): "
                             "also time the configuration the fused ops' tuner picks from each, per shape")
    args = parser.parse_args()
    configs = CONFIGS if args.configs == "all" else tuple(_config(c) for c in args.configs.split(","))
    shapes = SHAPES if args.shapes is None else tuple(tuple(int(v) for v in s.split("x")) for s in args.shapes.split(","))

    import jax
    import jax.numpy as jnp

    import jaxgin
    from jaxgin import op_support
    from jaxgin.fused import _common, _kernels
    from jaxgin.triton_op import OWN_KERNELS_FP_FUSION, triton_call

    jaxgin.initialize()
    device = jax.devices()[0]
    programs = op_support.sm_count(device)

    def call(variant, x, w, cfg, src=None, with_copy=False):
        bm, bn, bk, stages, warps = cfg
        (m, k), n = x.shape, w.shape[1]
        tiles = -(-m // bm) * -(-n // bn)
        common = dict(out_shape=jax.core.ShapedArray((m, n), x.dtype), num_warps=warps, num_stages=stages,
                      enable_fp_fusion=OWN_KERNELS_FP_FUSION, M=m, N=n, K=k, BM=bm, BN=bn, BK=bk, GROUP_M=8,
                      PRECISION="tf32")
        if variant == "pointer":
            return triton_call(_kernels.matmul_kernel, x, w, grid=(tiles,), **common)
        if variant.startswith("copying"):
            out, copied = triton_call(_kernels.matmul_copying_kernel, x, w, src, grid=(tiles,),
                                      out_shape=(common.pop("out_shape"), jax.core.ShapedArray((m, n), x.dtype)),
                                      PIECES=int(variant[len("copying"):]), **common)
            return (out, jnp.all(copied == src)) if with_copy else out
        if variant == "tma":
            return triton_call(_kernels.matmul_tma_kernel, x, w, grid=(tiles,), **common)
        grid = min(programs, tiles)
        return triton_call(_kernels.matmul_persistent_kernel, x, w, grid=(grid,), PROGRAMS=grid,
                           WARP_SPECIALIZE=variant == "persistent_ws", **common)

    def timed(fn, x, w, repeats, src=None):
        """(device, wall) seconds per call in a chain of `repeats`: the GPU's median step cycle in
        one profiled run (its span per call where no kernel recurs once a step), and the host's
        clock, best of 3. The wall clock moved by up to 40 % between runs on one H200; the device
        time is the one to rank by."""
        @jax.jit
        def loop(x, w, src):
            return jax.lax.fori_loop(0, repeats, lambda _, x: after(x, fn(x, w, src)), x, unroll=True)

        cycle, per_step = device_step_seconds(loop, x, w, src, steps=repeats)
        return (cycle if cycle is not None else per_step), best_seconds(loop, x, w, src, repeats=3) / repeats

    rows = []
    for m, k, n in shapes:
        keys = jax.random.split(jax.random.key(0))
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = jax.random.normal(keys[1], (k, n), jnp.bfloat16)
        expected = jnp.dot(x, w, preferred_element_type=jnp.float32)
        src = jax.random.normal(keys[0], (m, n), jnp.bfloat16)  # what the copying variants copy
        cublas, cublas_wall = timed(lambda x, w, _: x @ w, x, w, args.repeats)
        flops = 2 * m * n * k
        print(f"{m}x{k}x{n} cuBLAS {cublas * 1e6:.1f} us on the device ({flops / cublas / 1e12:.0f} TFLOP/s), "
              f"{cublas_wall * 1e6:.1f} us wall", flush=True)
        runs = [(variant, cfg, None) for variant, cfg in itertools.product(args.variants.split(","), configs)]
        for family in filter(None, args.tuned.split(",")):
            t = _common.choose_tiles(jaxgin.runtime.current(), m, n, k, jnp.bfloat16, "tf32", None, family)
            runs.append(("pointer", (t.block_m, t.block_n, t.block_k, t.num_stages, t.num_warps), family))
        for variant, cfg, family in runs:
            row = {"m": m, "k": k, "n": n, "variant": variant, "config": cfg, "cublas_us": cublas * 1e6,
                   "cublas_wall_us": cublas_wall * 1e6, **({"tuned_from": family} if family else {})}
            try:
                got = jax.jit(lambda x, w, src, cfg=cfg, variant=variant: call(variant, x, w, cfg, src, True))(x, w, src)
                if variant.startswith("copying"):
                    got, row["copy_exact"] = got[0], bool(got[1])
                row["max_rel_err"] = float(jnp.max(jnp.abs(got.astype(jnp.float32) - expected))
                                           / jnp.max(jnp.abs(expected)))
                seconds, wall = timed(lambda x, w, src, cfg=cfg, variant=variant: call(variant, x, w, cfg, src), x, w,
                                      args.repeats, src)
                row.update(us=seconds * 1e6, vs_cublas=cublas / seconds, wall_us=wall * 1e6,
                           vs_cublas_wall=cublas_wall / wall)
                print(f"  {variant if family is None else 'tuned ' + family:14s} {cfg}: {seconds * 1e6:7.1f} us  "
                      f"{cublas / seconds:.3f}x cuBLAS  "
                      f"(wall {wall * 1e6:.1f} us, {cublas_wall / wall:.3f}x)  "
                      f"err {row['max_rel_err']:.2e}" + (f"  copy exact {row['copy_exact']}" if "copy_exact" in row
                                                          else ""), flush=True)
            except Exception as error:  # a configuration this GPU or this Triton cannot run
                row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
                print(f"  {variant:14s} {cfg}: {row['error']}", flush=True)
            rows.append(row)
    import triton

    report = {"device": device.device_kind, "jax": jax.__version__, "triton": triton.__version__, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "triton-matmul.json").write_text(json.dumps(report, indent=1))


def _config(text: str) -> tuple[int, ...]:
    shape, stages, warps = text.split("/")
    return (*(int(v) for v in shape.split("x")), int(stages), int(warps))


if __name__ == "__main__":
    main()
