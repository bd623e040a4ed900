"""What a survivor of a dead peer still holds on its GPU after finalize(): runs the dead-peer fault
on 2 processes with NCCL's allocation log on, then, in the survivor after finalize(), finds which of
NCCL's logged allocations are still mapped and releases them through the driver, reporting the GPU's
used memory before and after, and whether JAX's own array buffers are still mapped (XLA allocates
them as virtual memory too). A diagnostic for issue 7, not a test.

    python tools/probe_fault_memory.py [--out DIR]
    python tools/probe_fault_memory.py bare-trap    # the driver alone: what a trapped context leaves
    python tools/probe_fault_memory.py bare-clean   # the same without the trap
    python tools/probe_fault_memory.py bare-vmm     # virtual memory undone in the broken context, no reset
    python tools/probe_fault_memory.py bare-vmm-clean

One process driving every GPU into a starved wait at once is a test scenario instead:
tests/gpu/test_fault_cleanup_gpu.py (reliability_scenarios.py starved), which runs on one GPU too.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "gpu"))

GRANULE = 2 << 20


def _driver():
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemRetainAllocationHandle.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p]
    cuda.cuMemUnmap.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    cuda.cuMemRelease.argtypes = [ctypes.c_uint64]
    cuda.cuMemAddressFree.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    return cuda


def _nccl_allocations(log: Path) -> list[tuple[int, int]]:
    found = []
    for line in log.read_text(errors="replace").splitlines():
        m = re.search(r"Alloc Size (\d+) pointer (0x[0-9a-f]+)", line)
        if m and "Cuda" in line:
            found.append((int(m.group(2), 16), int(m.group(1))))
    return found


def process(rank: int, world: int, address: str, log_dir: Path) -> None:
    import ops_scenarios
    import reliability_scenarios as rs

    used = {}
    jax, jaxgin = ops_scenarios._setup([str(rank), str(world), address],
                                       lambda: used.update(before=rs._gpu_used_mib(rank)))
    used["initialized"] = rs._gpu_used_mib(rank)
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    mesh = ops_scenarios._mesh(jax)
    ring = [(i, (i + 1) % world) for i in range(world)]
    f = jax.jit(jax.shard_map(lambda v: jaxgin.ppermute(v, "x", ring) + 1, mesh=mesh, in_specs=P("x"), out_specs=P("x")))
    x = ops_scenarios._global(jax, mesh, (world, 1024), jnp.float32, 5)
    first = x  # kept alive: its buffer's address is checked after finalize()
    jax_buffers = [s.data.unsafe_buffer_pointer() for s in first.addressable_shards]
    error = ""
    for i in range(200):
        if rank == world - 1 and i == 20:
            os._exit(17)
        try:
            x = f(x)
            jax.block_until_ready(x)
        except Exception as e:
            error = f"{type(e).__name__}: {e}"[:200]
            break
    report = {"rank": rank, "error": error, "fault_cleanup": jaxgin.info()["fault_cleanup"], "used_before_initialize": used["before"],
              "used_after_initialize": used["initialized"], "used_before_finalize": rs._gpu_used_mib(rank)}
    try:
        jaxgin.finalize()
    except Exception as e:
        report["finalize_error"] = str(e)[:300]
    time.sleep(0.5)
    report["used_after_finalize"] = rs._gpu_used_mib(rank)
    logs = sorted(log_dir.glob(f"nccl.*.{os.getpid()}.log"))
    allocations = _nccl_allocations(logs[0]) if logs else []
    report["nccl_logged_allocations"] = len(allocations)
    report["nccl_logged_bytes"] = sum(size for _, size in allocations)
    report["nccl_logged_granule_mib"] = sum(-(-size // GRANULE) * GRANULE for _, size in allocations) >> 20
    cuda = _driver()
    mapped, released, errors = 0, 0, []
    for pointer, size in allocations:
        handle = ctypes.c_uint64()
        r = cuda.cuMemRetainAllocationHandle(ctypes.byref(handle), ctypes.c_void_p(pointer))
        if r != 0:
            continue
        mapped += 1
        extent = -(-size // GRANULE) * GRANULE
        steps = [cuda.cuMemUnmap(pointer, extent), cuda.cuMemRelease(handle), cuda.cuMemRelease(handle),
                 cuda.cuMemAddressFree(pointer, extent)]
        if any(steps):
            errors.append([hex(pointer), size, steps])
        else:
            released += 1
    report.update(still_mapped=mapped, released=released, release_errors=errors[:10])
    # Whether JAX's own arrays are virtual-memory mappings that outlive the reset as well.
    report["jax_buffers_still_mapped"] = [
        cuda.cuMemRetainAllocationHandle(ctypes.byref(ctypes.c_uint64()), ctypes.c_void_p(p)) == 0 for p in jax_buffers]
    time.sleep(0.5)
    report["used_after_releasing_nccl_allocations"] = rs._gpu_used_mib(rank)
    report["pointers"] = [hex(p) for p, _ in allocations[:80]]
    print("RESULT:" + json.dumps(report), flush=True)
    os._exit(0)


TRAP_PTX = b"""
.version 8.0
.target sm_90
.address_size 64
.visible .entry trap_now() { trap; }
"""


def bare_trap(trap: bool = True) -> dict:
    """The same fault without NCCL, JAX or jaxgin: the driver API alone makes the primary context
    on GPU 0, runs a kernel that traps, resets the context, and reports GPU 0's used memory at each
    step, so what a faulted context leaves behind by itself is known."""
    import reliability_scenarios as rs

    cuda = ctypes.CDLL("libcuda.so.1")
    device, context = ctypes.c_int(), ctypes.c_void_p()
    report = {"idle": rs._gpu_used_mib(0)}
    assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
    assert cuda.cuCtxSetCurrent(context) == 0
    report["context"] = rs._gpu_used_mib(0)
    _trap(cuda, report, trap)
    _reset(cuda, device, report)
    return report


def _trap(cuda, report: dict, trap: bool) -> None:
    """Runs the trapping kernel on the current context (or not), then synchronizes: the trap's
    error, sticky from then on; GPU 0's used memory into `report`."""
    import reliability_scenarios as rs

    module, function = ctypes.c_void_p(), ctypes.c_void_p()
    assert cuda.cuModuleLoadData(ctypes.byref(module), ctypes.c_char_p(TRAP_PTX)) == 0
    assert cuda.cuModuleGetFunction(ctypes.byref(function), module, b"trap_now") == 0
    if trap:
        report["launch"] = cuda.cuLaunchKernel(function, 1, 1, 1, 32, 1, 1, 0, None, None, None)
    report["synchronize"] = cuda.cuCtxSynchronize()
    report["faulted"] = rs._gpu_used_mib(0)


def _reset(cuda, device, report: dict) -> None:
    """Releases the primary context and resets it; GPU 0's used memory afterwards into `report`."""
    import reliability_scenarios as rs

    cuda.cuDevicePrimaryCtxRelease(device)
    report["reset"] = cuda.cuDevicePrimaryCtxReset(device)
    time.sleep(0.5)
    report["after_reset"] = rs._gpu_used_mib(0)


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocationProp(ctypes.Structure):  # CUmemAllocationProp
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int), ("location", _Location),
                ("win32HandleMetaData", ctypes.c_void_p), ("allocFlags", ctypes.c_uint8 * 8)]


class _AccessDesc(ctypes.Structure):  # CUmemAccessDesc
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


def bare_vmm(trap: bool = True, gib: int = 1) -> dict:
    """Whether virtual memory can be returned from a context in error *without* a reset: the driver
    alone maps `gib` GiB of CUDA virtual memory on GPU 0 (as NCCL maps the heap), runs a kernel that
    traps, then unmaps, releases and frees that memory in the broken context, reporting each call's
    result and GPU 0's used memory, and only then resets. finalize() resets the GPU today, which
    destroys the context under XLA (its thread then crashed in cuStreamIsCapturing); if these
    calls succeed and the memory comes back, finalize() can undo NCCL's allocations and leave the
    context alone."""
    import reliability_scenarios as rs

    cuda = ctypes.CDLL("libcuda.so.1")
    for name in ("cuMemCreate", "cuMemAddressReserve", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease",
                 "cuMemAddressFree"):
        getattr(cuda, name).restype = ctypes.c_int
    cuda.cuMemCreate.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.POINTER(_AllocationProp),
                                 ctypes.c_ulonglong]
    cuda.cuMemAddressReserve.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_size_t, ctypes.c_size_t,
                                         ctypes.c_uint64, ctypes.c_ulonglong]
    cuda.cuMemMap.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_uint64, ctypes.c_ulonglong]
    cuda.cuMemSetAccess.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(_AccessDesc), ctypes.c_size_t]
    cuda.cuMemUnmap.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    cuda.cuMemRelease.argtypes = [ctypes.c_uint64]
    cuda.cuMemAddressFree.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    device, context = ctypes.c_int(), ctypes.c_void_p()
    report = {"idle": rs._gpu_used_mib(0)}
    assert cuda.cuInit(0) == 0 and cuda.cuDeviceGet(ctypes.byref(device), 0) == 0
    assert cuda.cuDevicePrimaryCtxRetain(ctypes.byref(context), device) == 0
    assert cuda.cuCtxSetCurrent(context) == 0
    size = gib << 30
    prop = _AllocationProp(type=1, requestedHandleTypes=0, location=_Location(type=1, id=0))  # pinned, on GPU 0
    handle, address = ctypes.c_uint64(), ctypes.c_uint64()
    report["create"] = cuda.cuMemCreate(ctypes.byref(handle), size, ctypes.byref(prop), 0)
    report["reserve"] = cuda.cuMemAddressReserve(ctypes.byref(address), size, 0, 0, 0)
    report["map"] = cuda.cuMemMap(address, size, 0, handle, 0)
    access = _AccessDesc(location=_Location(type=1, id=0), flags=3)  # read and write
    report["set_access"] = cuda.cuMemSetAccess(address, size, ctypes.byref(access), 1)
    report["mapped"] = rs._gpu_used_mib(0)
    _trap(cuda, report, trap)
    report["unmap_in_broken_context"] = cuda.cuMemUnmap(address, size)
    report["release_in_broken_context"] = cuda.cuMemRelease(handle)
    report["address_free_in_broken_context"] = cuda.cuMemAddressFree(address, size)
    time.sleep(0.5)
    report["after_release"] = rs._gpu_used_mib(0)
    _reset(cuda, device, report)
    return report


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("bare-trap", "bare-clean"):
        print(json.dumps(bare_trap(trap=sys.argv[1] == "bare-trap")))
        return
    if len(sys.argv) > 1 and sys.argv[1] in ("bare-vmm", "bare-vmm-clean"):
        print(json.dumps(bare_vmm(trap=sys.argv[1] == "bare-vmm")))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "process":
        process(int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], Path(sys.argv[2]))
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp"))
    args = parser.parse_args()
    from harness import result, start_processes

    log_dir = Path(args.out)
    env = {"JAXGIN_TIMEOUT": "5", "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "NCCL_DEBUG": "INFO",
           "NCCL_DEBUG_SUBSYS": "ALLOC", "NCCL_DEBUG_FILE": str(log_dir / "nccl.%h.%p.log")}
    finished = start_processes(Path(__file__), ["process", str(log_dir)], 2, timeout=180, env=env)
    for code, out, err in finished:
        if code == 0:
            print(json.dumps(result(out), indent=1))
        else:
            print(f"exit {code}: {err[-1500:]}")


if __name__ == "__main__":
    main()
