"""``python -m jaxgin.info``: what jaxgin finds on this machine and what it runs on.

Prints the toolchain and NCCL it would use, then initializes jaxgin and prints ``jaxgin.info()``
as JSON (or the error that stopped it).
"""

import json
import sys

import jax

import jaxgin
from jaxgin import build, nccl, rdma
from jaxgin.errors import JaxginError


def main() -> int:
    facts: dict = {"jax": jax.__version__, "jax_backend": jax.default_backend(), "rdma_devices": rdma.devices()}
    for name, probe in (("nvcc", lambda: str(build.find_nvcc())), ("nccl_package", lambda: _nccl_package(nccl))):
        try:
            facts[name] = probe()
        except JaxginError as e:
            facts[name] = f"unavailable: {e}"
    print(json.dumps({"environment": facts}, indent=2))
    try:
        jaxgin.initialize()
        print(json.dumps({"info": jaxgin.info()}, indent=2))
    except JaxginError as e:
        print(e, file=sys.stderr)
        return 1
    finally:
        jaxgin.finalize()
    return 0


def _nccl_package(nccl) -> str:
    install = nccl.packaged_install()
    return f"{install.version_string} at {install.library}" if install else "not installed"


if __name__ == "__main__":
    sys.exit(main())
