"""Development probe: does XLA put jaxgin's custom calls into command buffers? Dumps optimized HLO."""
import os
import sys

os.environ["XLA_FLAGS"] = (f"--xla_gpu_enable_command_buffer=FUSION,CUSTOM_CALL --xla_gpu_graph_min_graph_size=1 "
                           f"--xla_dump_to={os.environ['OUT']}/dump --xla_dump_hlo_as_text")
import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

import jaxgin

jaxgin.initialize(heap_size="1GiB")
print({k: v for k, v in jaxgin.info().items() if "command" in k})
mesh = Mesh(np.array(jax.devices()), ("x",))
n = mesh.size
ring = [(i, (i + 1) % n) for i in range(n)]


def body(v):
    for _ in range(5):
        v = jaxgin.ppermute(v, "x", ring) * 2
    return v


f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
x = jax.device_put(np.ones((n * 4, 128), np.float32))
before = jaxgin.runtime.current().backend_lib.ffi_calls()
for _ in range(20):
    y = f(x)
jax.block_until_ready(y)
after = jaxgin.runtime.current().backend_lib.ffi_calls()
print("exchange handler calls for 20 runs x 5 ops x", n, "devices:", after["exchange"] - before["exchange"])
