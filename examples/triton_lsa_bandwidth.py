"""Bulk data to a peer GPU with Triton's own vector stores through tritongin.peer_ptr (NVLink),
against a plain peer copy (copy engine) of the same bytes, both timed with CUDA events.

Needs Triton, nvcc (with its ptxas) and NCCL's headers: pip install -e ".[cuda]" (".[test]" has them
too); with 2 GPUs also PyTorch, which fills, checks and copies the buffers and times both:
pip install -e ".[cuda,torch]". A missing one ends it with one line that names it and the pip
command (exit status 3).

    python examples/triton_lsa_bandwidth.py [SIZE]      # SIZE: bytes to move, default 1GiB

Measures on 2 GPUs of one host; with fewer it compiles and links the kernel for sm_90a and stops.
"""

import argparse

from jaxgin import cli, sizes

cli.require(__file__, "triton", why="the kernel is a Triton kernel", install='-e ".[cuda]"')

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import tritongin.language as tgl  # noqa: E402

# Triton 3.9 warns at every compile that does not name enable_fp_fusion (its default turns off in
# 3.10). The kernel only moves data, so either value gives the same code.
FP_FUSION = False


@triton.jit
def push(ctx, src, dst, count, peer, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < count
    tl.store(tgl.peer_ptr(ctx, dst, peer) + offs, tl.load(src + offs, mask=mask), mask=mask)


def best_seconds(torch, fn, repeats=5):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop) / 1000)
    return min(times)


def run_on_gpus(nbytes: int):
    import torch

    import jaxgin
    import tritongin

    jaxgin.initialize(heap_size=2 * nbytes + (1 << 30))
    count = nbytes // 4
    nbytes = count * 4  # float32 words
    src, dst = tritongin.empty((count,), "float32"), tritongin.empty((count,), "float32")
    torch.cuda.set_device(0)
    torch.from_dlpack(src.local(0)).copy_(torch.rand(count, device="cuda:0"))
    ctx, block = tritongin.context(0), 8192
    grid = (triton.cdiv(count, block),)
    seconds = best_seconds(torch, lambda: push[grid](ctx, src.local(0), dst.local(0), count, 1, BLOCK=block,
                                                       num_warps=8, enable_fp_fusion=FP_FUSION))
    torch.cuda.synchronize(1)
    assert torch.equal(torch.from_dlpack(dst.local(1)).cpu(), torch.from_dlpack(src.local(0)).cpu())
    plain_src = torch.from_dlpack(src.local(0))
    plain_dst = torch.empty(count, dtype=torch.float32, device="cuda:1")
    plain = best_seconds(torch, lambda: plain_dst.copy_(plain_src, non_blocking=True))
    triton_gbs, plain_gbs = nbytes / seconds / 1e9, nbytes / plain / 1e9
    print(f"{nbytes / (1 << 30):g} GiB GPU0 -> GPU1: Triton peer_ptr stores {triton_gbs:.0f} GB/s, plain peer copy "
          f"{plain_gbs:.0f} GB/s ({triton_gbs / plain_gbs:.2f}x); data checked")
    jaxgin.finalize()


def compile_only(gpus: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"ctx": "*u8", "src": "*fp32", "dst": "*fp32", "count": "i64", "peer": "i32", "BLOCK": "constexpr"}
    kernel = triton.compile(ASTSource(push, signature, {"BLOCK": 8192}), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 8, "enable_fp_fusion": FP_FUSION})
    found = "no GPUs here" if gpus == 0 else f"{gpus} GPU here, this needs 2"
    print(f"{found}: compiled push and linked it with jaxgin's device library for sm_90a "
          f"({len(kernel.asm['cubin'])}-byte cubin); run this on a machine with 2 NVIDIA GPUs to measure")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("size", nargs="?", type=sizes.argument("SIZE", minimum=4), default=1 << 30,
                        help="bytes to move, e.g. 256MiB, 1GiB (default 1GiB)")
    args = parser.parse_args()
    gpus = cli.cuda_gpu_count()
    if gpus >= 2:
        cli.require(__file__, "torch", why="it fills, checks and copies the buffers and times both",
                    install='-e ".[cuda,torch]"')
        cli.run(__file__, run_on_gpus, args.size)
    else:
        cli.run(__file__, compile_only, gpus)
