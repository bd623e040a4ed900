"""Ring exchange from inside a Triton kernel: every GPU puts a tile to its right neighbour and
waits for its left neighbour's, with no kernel boundary in between; checked on the host.

Needs Triton, nvcc (with its ptxas) and NCCL's headers: pip install -e ".[cuda]" (".[test]" has them
too); on GPUs also PyTorch, which launches the kernel on each GPU and holds its outputs:
pip install -e ".[cuda,torch]". A missing one ends it with one line that names it and the pip
command (exit status 3).

    python examples/triton_ring_put.py

On GPUs (one process, every visible GPU; one GPU is a ring of one, which puts to itself) it
launches the kernel on each GPU. On a machine without GPUs it compiles the kernel and links it
with jaxgin's device library for sm_90a, which is as far as it can go there.
"""

from jaxgin import cli

cli.require(__file__, "triton", why="the kernel is a Triton kernel", install='-e ".[cuda]"')

import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

import tritongin.language as tgl  # noqa: E402

WORDS = 4096
# Triton 3.9 warns at every compile that does not name enable_fp_fusion (its default turns off in
# 3.10). This kernel does no floating-point arithmetic, so either value gives the same code.
FP_FUSION = False


@triton.jit
def ring_put(ctx, tile, inbox, out, data_sig, credit_sig, WORDS: tl.constexpr):
    me = tgl.rank(ctx)
    n = tgl.world_size(ctx)
    offs = tl.arange(0, WORDS)
    tl.store(tile + offs, me * 100000 + offs)  # the tile, computed in registers, staged in the heap
    tgl.put_signal(ctx, inbox, tile, WORDS * 4, (me + 1) % n, data_sig)
    tgl.wait_arrivals(ctx, data_sig, 1)  # the left neighbour's tile is in `inbox`
    tl.store(out + offs, tl.load(inbox + offs))
    tgl.signal(ctx, (me + n - 1) % n, credit_sig, 1)  # the left neighbour may write `inbox` again
    tgl.wait_arrivals(ctx, credit_sig, 1)  # the right neighbour has read what we sent


def run_on_gpus():
    import torch

    import jaxgin
    import tritongin

    jaxgin.initialize()
    n = torch.cuda.device_count()
    tile = tritongin.empty((WORDS,), "int32")
    inbox = tritongin.empty((WORDS,), "int32")
    sig = tritongin.signals(2)
    outs = [torch.empty(WORDS, dtype=torch.int32, device=f"cuda:{d}") for d in range(n)]
    for d in range(n):  # asynchronous launches: all kernels run together
        with torch.cuda.device(d):
            ring_put[(1,)](tritongin.context(d), tile.local(d), inbox.local(d), outs[d], sig[0], sig[1], WORDS=WORDS,
                           enable_fp_fusion=FP_FUSION)
    for d in range(n):
        got = outs[d].cpu().numpy()
        expected = ((d - 1) % n) * 100000 + np.arange(WORDS)
        assert np.array_equal(got, expected), f"GPU {d} received the wrong tile"
    print(f"ring exchange through put_signal on {n} GPUs: every tile arrived intact ({WORDS * 4} bytes each)")
    jaxgin.finalize()


def compile_only():
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {"ctx": "*u8", "tile": "*i32", "inbox": "*i32", "out": "*i32", "data_sig": "i32",
                 "credit_sig": "i32", "WORDS": "constexpr"}
    kernel = triton.compile(ASTSource(ring_put, signature, {"WORDS": WORDS}), target=GPUTarget("cuda", 90, 32),
                            options={"enable_fp_fusion": FP_FUSION})
    print(f"no GPU here: compiled ring_put and linked it with jaxgin's device library for sm_90a "
          f"({len(kernel.asm['cubin'])}-byte cubin); run this on a machine with NVIDIA GPUs to execute it")


if __name__ == "__main__":
    if cli.cuda_gpu_count() >= 1:
        cli.require(__file__, "torch", why="it launches the kernel on every GPU and holds the outputs",
                    install='-e ".[cuda,torch]"')
        cli.run(__file__, run_on_gpus)
    else:
        cli.run(__file__, compile_only)
