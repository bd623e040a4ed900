"""The CUDA context's per-thread stack limit, which NCCL's first kernel launch grows when it needs more
(a launch that waits for the whole device: see docs/guide.md, "GIN without an RDMA NIC").

    python3 tools/probe_stack_limit.py [--out DIR]                         # as NCCL leaves it
    NCCL_SET_STACK_SIZE=1 python3 tools/probe_stack_limit.py [--out DIR]   # NCCL sizes it at init

Needs an NVIDIA GPU. Prints, and writes to DIR/stack_limit.json ({"nccl_set_stack_size", "bytes":
{"jax_started", "jaxgin_initialized", "after_collective", "after_jaxgin_kernels"}}), the first
GPU's primary-context limit after JAX starts, after jaxgin.initialize() (which creates NCCL's
communicator), after one XLA collective, and after jaxgin's own kernels ran once (ppermute,
all_to_all, a mailbox put and wait, MoE dispatch and combine, matmul_all_to_all with
method="triton"): a kernel of jaxgin's that needed more stack than NCCL's would grow it at its
first launch, which waits for the device like NCCL's.
"""

import argparse
import ctypes
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

CU_LIMIT_STACK_SIZE = 0


def stack_limit(ordinal: int = 0) -> int:
    cuda = ctypes.CDLL("libcuda.so.1")
    context = ctypes.c_void_p()
    if cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), ordinal) != 0:
        raise RuntimeError("cuDevicePrimaryCtxRetain failed")
    try:
        cuda.cuCtxPushCurrent_v2(context)
        value = ctypes.c_size_t()
        code = cuda.cuCtxGetLimit(ctypes.byref(value), CU_LIMIT_STACK_SIZE)
        cuda.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))
    finally:
        cuda.cuDevicePrimaryCtxRelease_v2(ordinal)
    if code != 0:
        raise RuntimeError(f"cuCtxGetLimit failed with CUresult {code}")
    return value.value


def run_jaxgin_kernels(jaxgin, mesh) -> None:
    """One call of each jaxgin kernel family on `mesh`, finished before returning."""
    n = mesh.size
    ring = [(i, (i + 1) % n) for i in range(n)]
    box = jaxgin.Mailbox("probe_stack_limit", (256,), jnp.bfloat16)
    experts, top_k, tokens, hidden = 8 * n, 2, 64, 256

    def body(x, w, ids):
        me = jax.lax.axis_index("d")
        a = jaxgin.ppermute(x, "d", ring)
        b = jaxgin.all_to_all(x, "d", 0, 0, tiled=True)
        token = jaxgin.put_signal(x[0, :256], box, peer=(me + 1) % n, axis_name="d")
        c = jaxgin.wait_signal(box, 1, axis_name="d", after=token)
        sent = jaxgin.moe.dispatch(x[:tokens], ids, jnp.ones(ids.shape, jnp.float32), num_experts=experts,
                                   axis_name="d")
        back = jaxgin.moe.combine(sent.x, sent.handle)
        d = jaxgin.fused.matmul_all_to_all(x, w, axis_name="d", method="triton")
        return (a.sum() + b.sum() + c.sum() + back.sum() + d.sum()).astype(jnp.float32)[None]

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P("d"), P(), P("d")), out_specs=P("d")))
    rows = 128 * n
    x = jnp.ones((n * rows, hidden), jnp.bfloat16)
    w = jnp.ones((hidden, 128), jnp.bfloat16)
    ids = (jnp.arange(n * tokens * top_k, dtype=jnp.int32) % experts).reshape(n * tokens, top_k)
    jax.block_until_ready(f(x, w, ids))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=".")
    args = parser.parse_args()
    from jaxgin import cli

    cli.require_gpus(__file__, 1, "it reads the stack limit of its CUDA context")
    import jaxgin

    readings = {}

    def reading(name: str, what: str) -> None:
        readings[name] = stack_limit()
        print(f"{what}: {readings[name]} bytes a thread", flush=True)

    jax.block_until_ready(jnp.ones(8))
    reading("jax_started", "after JAX starts")
    jaxgin.initialize()
    reading("jaxgin_initialized", "after jaxgin.initialize()")
    mesh = Mesh(np.array(jax.devices()), ("d",))
    total = jax.jit(jax.shard_map(lambda a: jax.lax.psum(a, "d"), mesh=mesh, in_specs=P("d"), out_specs=P("d")))
    jax.block_until_ready(total(jnp.ones(4 * len(jax.devices()))))
    reading("after_collective", "after one XLA collective")
    run_jaxgin_kernels(jaxgin, mesh)
    reading("after_jaxgin_kernels", "after jaxgin's kernels ran once")
    jaxgin.finalize()
    report = {"nccl_set_stack_size": os.environ.get("NCCL_SET_STACK_SIZE"), "bytes": readings}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "stack_limit.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
