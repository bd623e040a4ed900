"""``python -m jaxgin.info``: what jaxgin finds on this machine and what it runs on.

Prints one JSON document: ``environment`` (JAX, its backend and devices, the nvcc and NCCL jaxgin
would use), then ``info``, what ``jaxgin.initialize()`` brings up here (``jaxgin.info()``), or
``error``, the message that stopped it (also on stderr; exit status 1).
"""

import json
import sys

import jax

import jaxgin
from jaxgin import build, nccl, rdma
from jaxgin.errors import JaxginError

CPU_DEVICES_FLAG = "--xla_force_host_platform_device_count"


def main() -> int:
    facts: dict = {"jax": jax.__version__, "jax_backend": jax.default_backend(), "jax_devices": len(jax.devices()),
                   "rdma_devices": rdma.devices()}
    for name, probe in (("nvcc", lambda: str(build.find_nvcc())), ("nccl_package", lambda: _nccl_package(nccl))):
        try:
            facts[name] = probe()
        except JaxginError as e:
            facts[name] = f"unavailable: {e}"
    report: dict = {"environment": facts}
    status = 0
    try:
        jaxgin.initialize()
        report["info"] = jaxgin.info()
        if report["info"]["backend"] == "reference":
            report["reference_mode"] = (
                f"no GPU: no NCCL and no heap allocated (heap_bytes is what ops are checked against, as on GPUs); "
                f"ops run as jax.lax collectives over this process's {len(jax.devices())} CPU device(s). "
                f"XLA_FLAGS={CPU_DEVICES_FLAG}=N gives a process N of them; the examples use 4"
            )
    except (JaxginError, ValueError) as e:  # ValueError: a bad setting in the environment (JAXGIN_TIMEOUT=...)
        report["error"] = str(e)
        print(e, file=sys.stderr)
        status = 1
    finally:
        jaxgin.finalize()
    print(json.dumps(report, indent=2))
    return status


def _nccl_package(nccl) -> str:
    install = nccl.packaged_install()
    return f"{install.version_string} at {install.library}" if install else "not installed"


if __name__ == "__main__":
    sys.exit(main())
