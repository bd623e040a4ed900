"""Which of a target's two registrations a call lowers to: the one XLA may record into its command
buffers (CUDA graphs), or the one XLA runs as its own step on its stream.

Recorded calls cost no host work when XLA replays the graph (a jaxgin op of 8 bytes is then the
kernel's few microseconds instead of a handler call and a launch). Three things keep a runtime's
calls out of the graphs, decided once per runtime so that every program of it agrees:

- ``JAXGIN_COMMAND_BUFFERS=0``;
- XLA told to run a graph's commands side by side where no buffer orders them
  (``--xla_gpu_command_buffer_scheduling_mode=CONCURRENT`` or ``CONCURRENT_REGIONS``, or the older
  ``--xla_gpu_graph_enable_concurrent_region=true``): jaxgin's calls on one GPU share its exchange
  channel and call counters, which assume one call at a time. XLA's default (``LHS``) and
  ``SERIALIZE`` keep a graph's commands in program order;
- a job whose GIN peers are served by NCCL's proxy (a CPU thread posts the GPU's puts, as with
  jaxgin's host transport): there every call must pass through its handler, which keeps XLA's
  thread from queueing far ahead of the GPU (csrc/ffi/launch_pacing.cu says why).

The fused ops' chunked method is never recorded (CUDA refuses to nest its cuBLAS calls and
second-stream copies in XLA's graphs), so its target has no twin.
"""

from __future__ import annotations

import os

from jaxgin import settings
from jaxgin.ffi import op_table

_PROXY_GIN = 2  # jaxgin.runtime.GIN_TYPES
_MODE = "--xla_gpu_command_buffer_scheduling_mode"
_OLD_CONCURRENT = "--xla_gpu_graph_enable_concurrent_region"  # deprecated in XLA, still read


def concurrent_flag(xla_flags: str) -> str | None:
    """The flag in `xla_flags` that lets XLA run a graph's commands side by side where no buffer
    orders them, as written there, or None (the last setting of a flag counts, as in XLA)."""
    flags = {}
    for token in xla_flags.split():
        name, _, value = token.partition("=")
        flags[name] = value
    mode = flags.get(_MODE)
    if mode is not None and mode.upper() in ("CONCURRENT", "CONCURRENT_REGIONS", "1", "3"):
        return f"{_MODE}={mode}"
    old = flags.get(_OLD_CONCURRENT)
    if old is not None and old.lower() in ("", "true", "1"):
        return _OLD_CONCURRENT + (f"={old}" if old else "")
    return None


def decide(*, enabled: bool | None, xla_flags: str, proxy_gin_peers: bool) -> tuple[bool, str]:
    """(whether calls lower to the captured twins, why), from the setting, XLA's flags and whether
    the job has GIN peers served by NCCL's proxy."""
    if enabled is False:
        return False, "JAXGIN_COMMAND_BUFFERS=0 keeps jaxgin's calls out of XLA's command buffers"
    flag = concurrent_flag(xla_flags)
    if flag is not None:
        return False, (f"XLA_FLAGS has {flag}: XLA would run jaxgin calls without a data dependency side by side "
                       "inside a graph, and they share each GPU's exchange channel; each call runs as its own step")
    if proxy_gin_peers:
        return False, ("GIN peers are served by NCCL's proxy (a CPU thread posts the GPU's puts): every call runs "
                       "through its handler, which keeps XLA's thread from queueing far ahead of the GPU")
    return True, "XLA may record jaxgin's calls into its command buffers, in program order"


def policy(state) -> tuple[bool, str]:
    """decide() for this runtime, made once (at its first lowering, or at info()) and kept: every
    program of one runtime lowers to the same targets."""
    if state.capture is None:
        from jaxgin import runtime  # runtime imports this package's registration

        proxy = runtime.gin_in_job(state) and state.runtime.device_info(0)["gin_type"] == _PROXY_GIN
        xla_flags = os.environ.get("XLA_FLAGS", "")  # XLA's, read as XLA reads it
        state.capture = decide(enabled=settings.flag("JAXGIN_COMMAND_BUFFERS"), xla_flags=xla_flags,
                               proxy_gin_peers=proxy)
    return state.capture


def target_for(op: str, state) -> str:
    """The custom-call target a call of `op` ("jaxgin.ppermute") lowers to in this runtime."""
    target = op_table.target_of(op)
    if target.capturable and policy(state)[0]:
        state.captured_lowered = True  # finalize() drops programs whose graphs hold this runtime's addresses
        return target.captured_name
    return target.name
