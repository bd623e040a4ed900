"""Bulk data to a peer GPU with Triton's own vector stores through tritongin.peer_ptr (NVLink),
against a plain peer copy (copy engine) of the same bytes, both timed with CUDA events.

    python examples/triton_lsa_bandwidth.py [GiB]

Needs 2 GPUs of one host; without them it compiles and links the kernel for sm_90a and stops.
"""

import sys

import triton
import triton.language as tl

import tritongin.language as tgl


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


def run_on_gpus(gib: float):
    import torch

    import jaxgin
    import tritongin

    jaxgin.initialize(heap_size=f"{int(2 * gib + 1)}GiB")
    nbytes = int(gib * (1 << 30))
    count = nbytes // 4
    src, dst = tritongin.empty((count,), "float32"), tritongin.empty((count,), "float32")
    torch.cuda.set_device(0)
    torch.from_dlpack(src.local(0)).copy_(torch.rand(count, device="cuda:0"))
    ctx, block = tritongin.context(0), 8192
    grid = (triton.cdiv(count, block),)
    seconds = best_seconds(torch, lambda: push[grid](ctx, src.local(0), dst.local(0), count, 1, BLOCK=block,
                                                       num_warps=8))
    torch.cuda.synchronize(1)
    assert torch.equal(torch.from_dlpack(dst.local(1)).cpu(), torch.from_dlpack(src.local(0)).cpu())
    plain_src = torch.from_dlpack(src.local(0))
    plain_dst = torch.empty(count, dtype=torch.float32, device="cuda:1")
    plain = best_seconds(torch, lambda: plain_dst.copy_(plain_src, non_blocking=True))
    triton_gbs, plain_gbs = nbytes / seconds / 1e9, nbytes / plain / 1e9
    print(f"{gib:g} GiB GPU0 -> GPU1: Triton peer_ptr stores {triton_gbs:.0f} GB/s, plain peer copy "
          f"{plain_gbs:.0f} GB/s ({triton_gbs / plain_gbs:.2f}x); data checked")
    jaxgin.finalize()


def compile_only(gpus: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"ctx": "*u8", "src": "*fp32", "dst": "*fp32", "count": "i64", "peer": "i32", "BLOCK": "constexpr"}
    kernel = triton.compile(ASTSource(push, signature, {"BLOCK": 8192}), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 8})
    found = "no GPUs here" if gpus == 0 else f"{gpus} GPU here, this needs 2"
    print(f"{found}: compiled push and linked it with jaxgin's device library for sm_90a "
          f"({len(kernel.asm['cubin'])}-byte cubin); run this on a machine with 2 NVIDIA GPUs to measure")


if __name__ == "__main__":
    try:
        import torch

        gpus = torch.cuda.device_count()
    except ImportError:
        gpus = 0
    if gpus >= 2:
        run_on_gpus(float(sys.argv[1]) if len(sys.argv) > 1 else 1.0)
    else:
        compile_only(gpus)
