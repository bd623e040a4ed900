"""GPU scenarios for issue 7 (reliability), each run in a fresh process by test_reliability_gpu.py.

    python tests/gpu/reliability_scenarios.py stress OPS            # one process, all visible GPUs
    python tests/gpu/reliability_scenarios.py fault RANK N ADDR     # one of N processes, one GPU each

Each prints one JSON line prefixed with RESULT:.
"""

import json
import os
import sys
import time

import ops_scenarios


def stress(argv):
    """jaxgin.stress: random ops, sizes 0 B - 64 MiB, against jax.lax; memory before and after."""
    jax, jaxgin = ops_scenarios._setup([])
    import numpy as np
    from jax.sharding import Mesh

    from jaxgin import stress as stress_lib

    mesh = Mesh(np.array(jax.devices()), ("x",))
    result = stress_lib.stress(mesh, int(argv[0]), seed=int(os.environ.get("JAXGIN_STRESS_SEED", "0")))
    result["xla_flags"] = os.environ.get("XLA_FLAGS", "")
    jaxgin.finalize()
    print("RESULT:" + json.dumps(result), flush=True)


KILL_AT = 20  # iterations the victim completes before it dies


def fault(argv):
    """The last rank dies mid-loop (os._exit, no finalize); the others must fail with jaxgin's
    named wait timeout, not hang. Reports how long after their last good iteration they failed."""
    jax, jaxgin = ops_scenarios._setup(argv)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    rank, n = int(argv[0]), int(argv[1])
    mesh = ops_scenarios._mesh(jax)
    ring = [(i, (i + 1) % n) for i in range(n)]
    f = jax.jit(jax.shard_map(lambda v: jaxgin.ppermute(v, "x", ring) + 1, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = ops_scenarios._global(jax, mesh, (4, 1024), jnp.float32, 5)
    last_good = time.perf_counter()
    completed, error = 0, ""
    for i in range(10 * KILL_AT):
        if rank == n - 1 and i == KILL_AT:
            os._exit(17)  # the victim: gone without a goodbye
        try:
            x = f(x)
            jax.block_until_ready(x)
            completed += 1
            last_good = time.perf_counter()
        except Exception as e:  # XLA reports the trapped kernel as a CUDA error
            error = f"{type(e).__name__}: {e}"[:400]
            break
    seconds = time.perf_counter() - last_good
    print("RESULT:" + json.dumps({"rank": rank, "completed": completed, "error": error, "seconds_to_error": seconds,
                                  "faults": jaxgin.device_faults(), "timeout_s": jaxgin.info()["timeout_s"]}), flush=True)
    os._exit(0)  # the CUDA context is gone after the trap, and the coordinator's peer is dead


if __name__ == "__main__":
    globals()[sys.argv[1]](sys.argv[2:])
