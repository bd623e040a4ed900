"""jaxgin.fault_watch on CPU: after a recorded device fault, a process whose thread still waits for
device results past the grace period ends with the fault named; one that moved on is left alone."""

import subprocess
import sys
import textwrap
import threading
import time

import pytest

from jaxgin import fault_watch

FAULT = "device-side wait timed out after 2.000000 s at rank 1 (CUDA device 0), CTA 0, in jaxgin.wait_signal"


def _run(body: str, timeout: float = 30) -> subprocess.CompletedProcess:
    """`body` in a fresh process with a watch over a fault record that appears after 0.3 s."""
    script = textwrap.dedent("""
        import time
        from jaxgin import fault_watch
        start = time.monotonic()
        faults = lambda: FAULT if time.monotonic() - start > 0.3 else ""
        watch = fault_watch.FaultWatch(faults, grace_s=1.0, poll_s=0.05).start()
    """).replace("FAULT", repr(FAULT)) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)


def test_a_thread_still_waiting_after_the_grace_ends_the_process_naming_the_fault():
    started = time.monotonic()
    proc = _run("""
        def block_until_ready():  # where JAX waits for a device result that never comes
            time.sleep(60)
        block_until_ready()
    """)
    assert proc.returncode == fault_watch.FAULT_EXIT_CODE, proc
    assert time.monotonic() - started < 20
    assert FAULT in proc.stderr and "still waits for device results" in proc.stderr, proc.stderr
    assert "block_until_ready" in proc.stderr  # the waiting thread's stack


def test_a_program_that_moved_on_is_left_alone():
    proc = _run("""
        time.sleep(2.5)  # the fault was reported to it (an exception); it does other work
        watch.stop()
        print("done")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc
    assert FAULT in proc.stderr  # said on stderr at once all the same


def test_no_fault_no_report():
    calls, ended = [], []
    watch = fault_watch.FaultWatch(lambda: calls.append(1) or "", grace_s=0.1, poll_s=0.01,
                                   end_process=ended.append).start()
    time.sleep(0.2)
    watch.stop()
    assert len(calls) > 3  # it did poll
    assert ended == []  # (the watch's own thread would end the process: recorded here, asserted here)


NCCL_ERROR = ("rank 1 (CUDA device 0): NCCL's communicator reports an asynchronous error, remote process exited "
              "or there was a network error: its GIN backend may have stopped taking this GPU's puts")


def _run_behind_nccl(body: str, fault_after: float | None = None, timeout: float = 30) -> subprocess.CompletedProcess:
    """`body` in a fresh process whose watch reads NCCL's error from 0.2 s on (timeout 1 s, grace
    1 s), and a device fault from `fault_after` seconds on (never when None)."""
    script = textwrap.dedent("""
        import time
        from jaxgin import fault_watch
        start = time.monotonic()
        faults = lambda: FAULT if FAULT_AFTER is not None and time.monotonic() - start > FAULT_AFTER else ""
        nccl = lambda: NCCL_ERROR if time.monotonic() - start > 0.2 else ""
        watch = fault_watch.FaultWatch(faults, grace_s=1.0, poll_s=0.05, read_communicator_errors=nccl,
                                       timeout_s=1.0).start()
    """).replace("FAULT_AFTER", repr(fault_after)).replace("FAULT", repr(FAULT)).replace(
        "NCCL_ERROR", repr(NCCL_ERROR)) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=timeout)


WAIT_FOR_GOOD = """
    def block_until_ready():  # a kernel spins inside NCCL: the result never comes
        time.sleep(60)
    block_until_ready()
"""


def test_a_wait_behind_nccls_error_with_no_device_fault_ends_the_process_naming_it():
    """Issue 51's fifth risk: NCCL's GIN progress ended at an error, a kernel spins in NCCL's post
    for a queue slot, no bounded wait ever runs: the rank ends, naming NCCL's error."""
    started = time.monotonic()
    proc = _run_behind_nccl(WAIT_FOR_GOOD)
    assert proc.returncode == fault_watch.FAULT_EXIT_CODE, proc
    assert 2.0 <= time.monotonic() - started < 20  # not before timeout + grace
    assert NCCL_ERROR in proc.stderr and "still waits for device results" in proc.stderr, proc.stderr
    assert "no longer drains" in proc.stderr and "block_until_ready" in proc.stderr, proc.stderr


def test_a_device_fault_after_nccls_error_takes_over():
    """A dead peer under a transport that reports it (NCCL's error) whose kernels reach their
    bounded waits: the device fault is what ends the rank, and the words are the fault's."""
    proc = _run_behind_nccl(WAIT_FOR_GOOD, fault_after=0.5)
    assert proc.returncode == fault_watch.FAULT_EXIT_CODE, proc
    assert FAULT in proc.stderr and "a CUDA context in error never delivers" in proc.stderr, proc.stderr
    assert "no longer drains" not in proc.stderr, proc.stderr


def test_a_program_that_moved_on_after_nccls_error_is_left_alone():
    proc = _run_behind_nccl("""
        time.sleep(3.0)  # past timeout + grace, waiting for nothing
        watch.stop()
        print("done")
    """)
    assert proc.returncode == 0 and proc.stdout.strip() == "done", proc
    assert NCCL_ERROR in proc.stderr  # said once, at once
    assert proc.stderr.count("NCCL reports an error") == 1, proc.stderr


def test_waiting_threads_finds_a_thread_in_a_jax_wait():
    release = threading.Event()

    def try_to_block():
        release.wait(10)

    t = threading.Thread(target=try_to_block)
    t.start()
    try:
        time.sleep(0.05)
        found = fault_watch.waiting_threads()
        assert t.ident in found and any("try_to_block" in line for line in found[t.ident])
        assert threading.get_ident() not in found
    finally:
        release.set()
        t.join()


def test_a_bad_grace_setting_is_named(monkeypatch):
    from jaxgin import runtime
    from jaxgin.errors import JaxginError

    monkeypatch.setenv("JAXGIN_FAULT_GRACE", "soon")
    with pytest.raises(JaxginError, match="JAXGIN_FAULT_GRACE must be a positive number of seconds, got 'soon'"):
        runtime._fault_grace_s()
    monkeypatch.setenv("JAXGIN_FAULT_GRACE", "12.5")
    assert runtime._fault_grace_s() == 12.5
