"""Quick check and timing of jaxgin's host transport on GPUs: jaxgin.ppermute / all_to_all with
every peer forced through GIN over the RMA plugin, against jax.lax in the same jitted program.

    JAXGIN_TIMEOUT=10 python tools/transport_smoke.py [--out DIR]

Prints one line per size (equal to lax or not, time per op of each, plugin counters) and writes
transport_smoke.json. Times are per op from a chain of ops inside one jit.

Needs an NVIDIA GPU visible to JAX and NCCL >= 2.30 (pip install -e ".[cuda]"); without a GPU it
says so and exits with status 4 (jaxgin.cli).
"""

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("JAXGIN_FORCE_GIN", "1")
os.environ.setdefault("JAXGIN_GIN_TRANSPORT", "host")
os.environ.setdefault("JAXGIN_TRANSPORT_QUIET", "1")

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import jaxgin
from jaxgin import cli, transport


def per_op_seconds(f, x, chain):
    jax.block_until_ready(f(x))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        jax.block_until_ready(f(x))
        best = min(best, time.perf_counter() - start)
    return best / chain


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", ".")))
    args = parser.parse_args()
    cli.require_gpus(__file__, 1, "it runs jaxgin's ops over the host transport")
    cli.run(__file__, jaxgin.initialize, heap_size="1GiB")
    info = jaxgin.info()
    print({k: info[k] for k in ("gin_type", "gin_transport", "nccl_version", "force_gin")}, flush=True)
    mesh = Mesh(np.array(jax.devices()), ("x",))
    n = mesh.size
    ring = [(i, (i + 1) % n) for i in range(n)]
    rows = []
    for nbytes in (8, 4096, 1 << 20, 16 << 20, 64 << 20):
        size = max(1, nbytes // 4)
        chain = 20 if nbytes <= (1 << 20) else 5
        x = jnp.arange(n * size, dtype=jnp.float32).reshape(n, size)

        def looped(op):
            def body(v):
                for _ in range(chain):
                    v = op(v)
                return v

            return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x")))

        ours = looped(lambda v: jaxgin.ppermute(v, "x", ring))
        theirs = looped(lambda v: jax.lax.ppermute(v, "x", ring))
        equal = bool(np.array_equal(np.asarray(ours(x)), np.asarray(theirs(x))))
        a2a = jax.jit(jax.shard_map(lambda v: jaxgin.all_to_all(v.reshape(n, -1), "x", 0, 0, tiled=True),
                                    mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        ref = jax.jit(jax.shard_map(lambda v: jax.lax.all_to_all(v.reshape(n, -1), "x", 0, 0, tiled=True),
                                    mesh=mesh, in_specs=P("x"), out_specs=P("x")))
        xa = jnp.arange(n * n * max(1, size // n), dtype=jnp.float32).reshape(n, -1)
        equal_a2a = bool(np.array_equal(np.asarray(a2a(xa)), np.asarray(ref(xa))))
        row = {
            "bytes": nbytes, "ppermute_equal": equal, "all_to_all_equal": equal_a2a,
            "jaxgin_us": per_op_seconds(ours, x, chain) * 1e6, "xla_us": per_op_seconds(theirs, x, chain) * 1e6,
            "counters": transport.counters(),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
        if not (equal and equal_a2a):
            print("faults:", jaxgin.device_faults(), flush=True)
    jaxgin.finalize()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "transport_smoke.json").write_text(json.dumps({"info": info, "rows": rows}, indent=1, default=str))
    return 0 if all(r["ppermute_equal"] and r["all_to_all_equal"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
