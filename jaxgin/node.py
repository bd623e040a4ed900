"""What one node offers jaxgin, read without starting a job: its GPUs and driver (the CUDA
driver API), peer access and NVLink between the GPUs (CUDA, NVML), the NCCL that JAX's CUDA plugin
would load, RDMA devices (``jaxgin.rdma``), GPUDirect RDMA (dma-buf, nvidia-peermem), the kernel,
the network interfaces, and the ``NCCL_*`` / ``JAXGIN_*`` settings in force.

``survey(root)`` reads ``/sys`` and ``/proc`` under `root` (``/``, or a node image) and loads
the driver's and rdma-core's libraries by their usual names, so ``LD_LIBRARY_PATH`` picks them
as it would for the job. ``jaxgin.doctor`` judges what it finds.
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import socket
from collections.abc import Mapping
from pathlib import Path

from jaxgin import cli, nccl, rdma
from jaxgin.errors import NcclError

# CUdevice_attribute values (cuda.h)
_COMPUTE_CAPABILITY_MAJOR = 75
_COMPUTE_CAPABILITY_MINOR = 76
_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102  # cuMem*: NCCL's symmetric windows are made of it
_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED = 110  # NCCL offers GIN only where every GPU has it
_DMA_BUF_SUPPORTED = 124
_CUDA_ERROR_NO_DEVICE = 100
_NVML_P2P_CAPS_INDEX_NVLINK = 2  # nvmlGpuP2PCapsIndex_t
_NVML_P2P_STATUS_OK = 0
# The kernel files by which NCCL finds a GPUDirect RDMA peer-memory module (src/transport/net_ib/gdr.cc).
NVIDIA_PEERMEM = "/sys/module/nvidia_peermem/version"
LEGACY_PEER_MEMORY = ("/sys/kernel/mm/memory_peers/nv_mem/version", "/sys/kernel/mm/memory_peers/nv_mem_nc/version")
JAX_CUDA_PLUGINS = ("jax_cuda13_plugin", "jax_plugins.xla_cuda13")  # jax-cuda13-plugin, jax-cuda13-pjrt


@dataclasses.dataclass(frozen=True)
class Gpu:
    index: int  # CUDA's ordinal (CUDA_VISIBLE_DEVICES applies)
    name: str
    compute_capability: str  # e.g. '9.0'
    pci_bus_id: str
    virtual_memory: bool
    dma_buf: bool
    gpudirect_vmm: bool  # GPUDirect RDMA on cuMem allocations


@dataclasses.dataclass(frozen=True)
class GpuPair:
    a: int
    b: int
    peer_access: bool  # both ways
    nvlink: bool | None  # None: NVML could not tell


@dataclasses.dataclass(frozen=True)
class Survey:
    host: str
    driver: str | None  # the NVIDIA driver's version (NVML)
    cuda_driver: int | None  # the CUDA version the driver supports, e.g. 13000
    gpu_error: str  # why no GPU can be used ('' when some can)
    gpus: tuple[Gpu, ...]
    pairs: tuple[GpuPair, ...]
    nvml_error: str
    jax_cuda_plugin: bool
    nccl_version: int | None
    nccl_library: str | None
    nccl_error: str
    verbs_error: str  # why libibverbs did not load ('' when it did)
    verbs_devices: tuple[str, ...]
    verbs_dma_buf: bool | None  # libibverbs registers dma-buf memory (ibv_reg_dmabuf_mr, IBVERBS_1.12)
    mlx5_dma_buf: bool | None  # libmlx5 has MLX5_1.25 (mlx5dv_reg_dmabuf_mr); None: no libmlx5
    rdma_devices: tuple[rdma.Device, ...]
    nvidia_peermem: bool
    legacy_peer_memory: bool  # nv_peer_mem (MLNX_OFED's older module)
    kernel: str | None
    interfaces: tuple[str, ...]
    settings: dict[str, str]

    def to_json(self) -> dict:
        return dataclasses.asdict(self)


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _error_name(cuda, code: int) -> str:
    name = ctypes.c_char_p()
    if cuda.cuGetErrorName(code, ctypes.byref(name)) == 0 and name.value:
        return f"{name.value.decode()} ({code})"
    return f"CUDA error {code}"


def _gpus() -> tuple[int | None, str, tuple[Gpu, ...], dict[tuple[int, int], bool]]:
    """(the driver's CUDA version, why no GPU can be used, the GPUs, peer access per ordered pair)."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return None, f"no NVIDIA driver: libcuda.so.1 does not load ({e})", (), {}
    code = cuda.cuInit(0)
    version = ctypes.c_int(0)
    cuda.cuDriverGetVersion(ctypes.byref(version))
    if code == _CUDA_ERROR_NO_DEVICE:
        return version.value, "the NVIDIA driver finds no GPU (cuInit: CUDA_ERROR_NO_DEVICE)", (), {}
    if code != 0:
        return version.value, f"the NVIDIA driver does not start: cuInit failed with {_error_name(cuda, code)}", (), {}
    count = ctypes.c_int(0)
    cuda.cuDeviceGetCount(ctypes.byref(count))
    gpus, handles = [], []
    for index in range(count.value):
        handle = ctypes.c_int(0)
        cuda.cuDeviceGet(ctypes.byref(handle), index)
        name = ctypes.create_string_buffer(256)
        cuda.cuDeviceGetName(name, 256, handle)
        bus = ctypes.create_string_buffer(64)
        cuda.cuDeviceGetPCIBusId(bus, 64, handle)

        def attribute(code: int) -> int:
            value = ctypes.c_int(0)
            return value.value if cuda.cuDeviceGetAttribute(ctypes.byref(value), code, handle) == 0 else 0

        gpus.append(Gpu(index, name.value.decode(),
                        f"{attribute(_COMPUTE_CAPABILITY_MAJOR)}.{attribute(_COMPUTE_CAPABILITY_MINOR)}",
                        bus.value.decode(), bool(attribute(_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED)),
                        bool(attribute(_DMA_BUF_SUPPORTED)), bool(attribute(_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED))))
        handles.append(handle)
    access = {}
    for i, a in enumerate(handles):
        for j, b in enumerate(handles):
            if i != j:
                can = ctypes.c_int(0)
                access[i, j] = cuda.cuDeviceCanAccessPeer(ctypes.byref(can), a, b) == 0 and bool(can.value)
    return version.value, "", tuple(gpus), access


def _nvml(gpus: tuple[Gpu, ...]) -> tuple[str | None, str, dict[tuple[int, int], bool]]:
    """(the driver version, why NVML could not answer, NVLink per GPU pair), GPUs matched by PCI bus id."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError as e:
        return None, f"NVML's libnvidia-ml.so.1 does not load ({e})", {}
    nvml.nvmlErrorString.restype = ctypes.c_char_p
    code = nvml.nvmlInit_v2()
    if code != 0:
        return None, f"nvmlInit failed: {nvml.nvmlErrorString(code).decode()}", {}
    try:
        version = ctypes.create_string_buffer(96)
        driver = version.value.decode() if nvml.nvmlSystemGetDriverVersion(version, 96) == 0 else None
        handles = []
        for gpu in gpus:
            handle = ctypes.c_void_p()
            code = nvml.nvmlDeviceGetHandleByPciBusId_v2(gpu.pci_bus_id.encode(), ctypes.byref(handle))
            if code != 0:
                return driver, f"NVML does not know GPU {gpu.index} ({gpu.pci_bus_id}): {nvml.nvmlErrorString(code).decode()}", {}
            handles.append(handle)
        nvlink = {}
        for i in range(len(gpus)):
            for j in range(i + 1, len(gpus)):
                status = ctypes.c_int(-1)
                code = nvml.nvmlDeviceGetP2PStatus(handles[i], handles[j], _NVML_P2P_CAPS_INDEX_NVLINK, ctypes.byref(status))
                nvlink[i, j] = code == 0 and status.value == _NVML_P2P_STATUS_OK
        return driver, "", nvlink
    finally:
        nvml.nvmlShutdown()


def _verbs() -> tuple[str, tuple[str, ...], bool | None, bool | None]:
    """(why libibverbs did not load, the devices it lists, its dma-buf entry point, libmlx5's)."""
    try:
        verbs = rdma.verbs_library()
    except OSError as e:
        return f"rdma-core's libibverbs.so.1 does not load ({e})", (), None, None
    dma_buf = rdma.has_versioned_symbol(verbs, "ibv_reg_dmabuf_mr", "IBVERBS_1.12")
    try:
        mlx5 = rdma.has_versioned_symbol(ctypes.CDLL("libmlx5.so.1"), "mlx5dv_reg_dmabuf_mr", "MLX5_1.25")
    except OSError:
        mlx5 = None
    return "", tuple(rdma.devices()), dma_buf, mlx5


def survey(root: Path = Path("/"), env: Mapping[str, str] | None = None) -> Survey:
    env = os.environ if env is None else env
    cuda_driver, gpu_error, gpus, access = _gpus()
    driver, nvml_error, nvlink = _nvml(gpus) if gpus else (None, "", {})
    pairs = tuple(GpuPair(i, j, access.get((i, j), False) and access.get((j, i), False), nvlink.get((i, j)))
                  for i in range(len(gpus)) for j in range(i + 1, len(gpus)))
    try:
        install = nccl.packaged_install()
        nccl_error = "" if install else "the nvidia-nccl-cu13 package is not installed"
    except NcclError as e:
        install, nccl_error = None, str(e)
    verbs_error, verbs_devices, verbs_dma_buf, mlx5_dma_buf = _verbs()
    net = root / "sys" / "class" / "net"
    return Survey(
        host=socket.gethostname(),
        driver=driver,
        cuda_driver=cuda_driver,
        gpu_error=gpu_error or ("" if gpus else "the NVIDIA driver lists no GPU"),
        gpus=gpus,
        pairs=pairs,
        nvml_error=nvml_error,
        jax_cuda_plugin=all(cli.installed(m) for m in JAX_CUDA_PLUGINS),
        nccl_version=install.version if install else None,
        nccl_library=str(install.library) if install else None,
        nccl_error=nccl_error,
        verbs_error=verbs_error,
        verbs_devices=verbs_devices,
        verbs_dma_buf=verbs_dma_buf,
        mlx5_dma_buf=mlx5_dma_buf,
        rdma_devices=tuple(rdma.sysfs_devices(root)),
        nvidia_peermem=(root / NVIDIA_PEERMEM.lstrip("/")).exists(),
        legacy_peer_memory=any((root / p.lstrip("/")).exists() for p in LEGACY_PEER_MEMORY),
        kernel=_read(root / "proc" / "sys" / "kernel" / "osrelease"),
        interfaces=tuple(sorted(p.name for p in net.iterdir())) if net.is_dir() else (),
        settings={k: v for k, v in sorted(env.items()) if k.startswith(("NCCL_", "JAXGIN_"))},
    )
