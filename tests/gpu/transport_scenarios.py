"""GPU scenarios for jaxgin's host transport: issue 3's op scenarios with every peer routed through
GIN (JAXGIN_FORCE_GIN=1) and GIN carried by the NCCL RMA plugin (JAXGIN_GIN_TRANSPORT=host).

    python tests/gpu/transport_scenarios.py NAME [RANK N ADDR]

NAME is one of ops_scenarios.py's. Adds to its result what jaxgin.info() said right after
initialize (GIN type, transport) and what the plugin moved (jaxgin.transport.counters()), so the
test can tell the traffic really went through the plugin. With JAXGIN_TEST_HOST_PER_PROCESS=1 each
process claims its own host identity, so the processes reach each other over TCP.
"""

import contextlib
import io
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import job  # noqa: E402


def main(argv):
    os.environ.setdefault("JAXGIN_FORCE_GIN", "1")
    os.environ.setdefault("JAXGIN_GIN_TRANSPORT", "host")
    os.environ.setdefault("JAXGIN_TRANSPORT_QUIET", "1")
    if len(argv) > 1 and os.environ.get("JAXGIN_TEST_HOST_PER_PROCESS") == "1":
        os.environ["JAXGIN_TRANSPORT_HOST_ID"] = f"test-host-{argv[1]}"
    import ops_scenarios

    import jaxgin
    from jaxgin import transport

    seen = []
    original = jaxgin.initialize

    def initialize(*args, **kwargs):
        original(*args, **kwargs)
        info = jaxgin.info()
        seen.append({k: info[k] for k in ("gin_type", "gin_transport", "nccl_version", "force_gin", "lsa_team_size")})

    jaxgin.initialize = initialize
    scenario = getattr(ops_scenarios, argv[0])
    captured = io.StringIO()
    with contextlib.redirect_stdout(captured):  # the scenario prints its own RESULT line
        scenario(argv[1:])
    lines = captured.getvalue().splitlines()
    print("\n".join(line for line in lines if not line.startswith("RESULT:")))
    result = json.loads([line for line in lines if line.startswith("RESULT:")][-1][len("RESULT:"):])
    result["transport_info"] = seen[0] if seen else None
    result["transport"] = transport.counters()
    job.report(result)


if __name__ == "__main__":
    main(sys.argv[1:])
