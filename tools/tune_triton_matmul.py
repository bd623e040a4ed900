"""How fast can the fused ops' Triton tile code multiply, on one GPU? Times, at issue 5's shapes
(bf16, float32 accumulation) with CUDA events in one process:

  cublas                      torch.matmul (cuBLAS), the bar
  pointers                    jaxgin.fused._kernels.matmul_kernel: what the fused kernels use now
                              (one tile per program, pointer loads pipelined by Triton)
  descriptors                 matmul_tma_kernel: the same tiles loaded and stored through tensor
                              descriptors made on the device (TMA), one tile per program
  descriptors_persistent      matmul_persistent_kernel: one program per SM looping over tiles
  descriptors_persistent_ws   the same with Triton's warp specialization

Launched with Triton's own launcher and torch's tensors; benchmarks/triton_matmul.py times the
same kernels the way the fused ops run them (jaxgin.triton_call, against XLA's cuBLAS).

Each variant over a few tile configurations, checked against cuBLAS before timing. A diagnostic
for choosing the fused kernels' matmul, not a test; needs an NVIDIA GPU, Triton and torch
(pip install -e ".[cuda,torch]"); without them it says so and exits with status 4 or 3 (jaxgin.cli).

    python tools/tune_triton_matmul.py [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from jaxgin import cli  # noqa: E402

if __name__ == "__main__":
    cli.require_gpus(__file__, 1, "it times matmuls", through_jax=False)
cli.require(__file__, "torch", why="cuBLAS, the bar, and the CUDA events", install='-e ".[cuda,torch]"')
cli.require(__file__, "triton", why="the tile code", install='-e ".[cuda]"')

import torch  # noqa: E402
import triton  # noqa: E402

from jaxgin.fused._kernels import matmul_kernel, matmul_persistent_kernel, matmul_tma_kernel  # noqa: E402

SHAPES = [(4096, 7168, 2048), (8192, 4096, 4096), (1024, 7168, 2048)]
CONFIGS = [(128, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 256, 64, 8, 3), (128, 256, 64, 8, 4)]
CALLS = 50


def _time(fn) -> float:
    """us per call: CALLS back-to-back calls between two CUDA events, best of 5."""
    fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(CALLS):
            fn()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1e3 / CALLS)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    report = {"device": torch.cuda.get_device_name(0), "triton": triton.__version__, "sms": sms, "shapes": []}
    for m, k, n in SHAPES:
        torch.manual_seed(0)
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        want = torch.matmul(x, w)
        flops = 2 * m * k * n
        row = {"m": m, "k": k, "n": n, "cublas_us": _time(lambda: torch.matmul(x, w)), "variants": {}}
        for bm, bn, bk, warps, stages in CONFIGS:
            out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
            tiles = (m // bm) * (n // bn)
            common = dict(M=m, N=n, K=k, BM=bm, BN=bn, BK=bk, GROUP_M=8, PRECISION="tf32", num_warps=warps,
                          num_stages=stages)
            programs = min(sms, tiles)
            launches = {
                "pointers": lambda: matmul_kernel[(tiles,)](0, x, w, out, **common),
                "descriptors": lambda: matmul_tma_kernel[(tiles,)](0, x, w, out, **common),
                "descriptors_persistent": lambda: matmul_persistent_kernel[(programs,)](
                    0, x, w, out, PROGRAMS=programs, WARP_SPECIALIZE=False, **common),
                "descriptors_persistent_ws": lambda: matmul_persistent_kernel[(programs,)](
                    0, x, w, out, PROGRAMS=programs, WARP_SPECIALIZE=True, **common),
            }
            for name, launch in launches.items():
                key = f"{name} {bm}x{bn}x{bk} w{warps} s{stages}"
                try:
                    out.zero_()
                    launch()
                    torch.cuda.synchronize()
                    err = float((out.float() - want.float()).abs().max() / want.float().abs().max())
                    us = _time(launch)
                    row["variants"][key] = {"us": us, "TFLOPs": flops / us / 1e6, "vs_cublas": row["cublas_us"] / us,
                                            "rel_err": err}
                except Exception as e:  # a variant this Triton cannot build: reported, the others go on
                    row["variants"][key] = {"error": f"{type(e).__name__}: {e}"[:300]}
                print(key, row["variants"][key], flush=True)
        best = max((v for v in row["variants"].items() if "us" in v[1] and v[1]["rel_err"] < 1e-2),
                   key=lambda kv: kv[1]["vs_cublas"], default=None)
        row["best"] = best
        print(f"== {m}x{k}x{n}: cuBLAS {row['cublas_us']:.1f} us ({flops / row['cublas_us'] / 1e6:.0f} TFLOP/s); "
              f"best Triton: {best}", flush=True)
        report["shapes"].append(row)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "triton_matmul.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
