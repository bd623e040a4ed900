"""RDMA devices: what NCCL's GDAKI and proxy GIN backends need.

Two views of them: rdma-core's libibverbs, which lists the devices whose user-space provider is
installed (NCCL opens them through it), and the kernel's sysfs (``/sys/class/infiniband``), which
says per port whether it is up, its link layer (InfiniBand or Ethernet, that is RoCE), its rate,
and for RoCE the network interface whose MTU the port's path MTU follows.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import dataclasses
from pathlib import Path


def verbs_library() -> ctypes.CDLL:
    """rdma-core's libibverbs; OSError when it is not installed."""
    return ctypes.CDLL(ctypes.util.find_library("ibverbs") or "libibverbs.so.1")


def devices() -> list[str]:
    """Names of the RDMA devices (e.g. ['mlx5_0']); [] when libibverbs or a NIC is absent."""
    try:
        verbs = verbs_library()
    except OSError:
        return []
    verbs.ibv_get_device_list.restype = ctypes.POINTER(ctypes.c_void_p)
    verbs.ibv_get_device_list.argtypes = [ctypes.POINTER(ctypes.c_int)]
    verbs.ibv_get_device_name.restype = ctypes.c_char_p
    verbs.ibv_get_device_name.argtypes = [ctypes.c_void_p]
    verbs.ibv_free_device_list.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    count = ctypes.c_int(0)
    listing = verbs.ibv_get_device_list(ctypes.byref(count))
    if not listing:
        return []
    try:
        return [verbs.ibv_get_device_name(listing[i]).decode() for i in range(count.value)]
    finally:
        verbs.ibv_free_device_list(listing)


def has_versioned_symbol(library: ctypes.CDLL, name: str, version: str) -> bool:
    """Whether `library` exports `name` at symbol version `version` (dlvsym), the way NCCL looks
    up the rdma-core entry points it needs (an older rdma-core lacks the newer versions)."""
    for home in (None, "libdl.so.2"):  # glibc >= 2.34 has dlvsym in libc itself
        try:
            dlvsym = getattr(ctypes.CDLL(home), "dlvsym", None)
        except OSError:
            continue
        if dlvsym is not None:
            dlvsym.restype = ctypes.c_void_p
            dlvsym.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_char_p]
            return dlvsym(library._handle, name.encode(), version.encode()) is not None
    raise OSError("found no dlvsym, in this process or in libdl.so.2")


@dataclasses.dataclass(frozen=True)
class Port:
    number: int
    state: str  # 'ACTIVE', 'DOWN', ...
    physical_state: str  # 'LinkUp', 'Disabled', ...
    link_layer: str  # 'InfiniBand', 'Ethernet' (RoCE), or what else the kernel says
    rate: str  # e.g. '400 Gb/sec (4X NDR)'
    netdev: str | None  # RoCE: the network interface of the port's first GID
    netdev_mtu: int | None  # its MTU in bytes
    traffic_class: int | None  # the device's global traffic class for the port (mlx5's tc/<port>), if set


@dataclasses.dataclass(frozen=True)
class Device:
    name: str
    driver: str | None  # the kernel driver of its PCI function, e.g. 'mlx5_core'
    ports: tuple[Port, ...]


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _after_colon(text: str | None) -> str:
    """sysfs writes port states as '4: ACTIVE'."""
    return (text or "").split(":", 1)[-1].strip()


def _netdev(port_dir: Path) -> str | None:
    """The interface of the port's first populated GID (reading an unused GID's entry fails)."""
    ndevs = port_dir / "gid_attrs" / "ndevs"
    if not ndevs.is_dir():
        return None
    for entry in sorted(ndevs.iterdir(), key=lambda p: int(p.name) if p.name.isdigit() else 1 << 30):
        name = _read(entry)
        if name:
            return name
    return None


def _traffic_class(device_dir: Path, port: int) -> int | None:
    """mlx5's per-port global traffic class ('Global tclass=236'), which the kernel applies to the
    queue pairs it modifies."""
    text = _read(device_dir / "tc" / str(port) / "traffic_class") or ""
    value = text.rpartition("=")[2].strip()
    return int(value) if "tclass=" in text and value.isdigit() else None


def sysfs_devices(root: Path = Path("/")) -> list[Device]:
    """The RDMA devices the kernel has, with their ports, from `root`/sys (another root: a node image)."""
    classes = root / "sys" / "class" / "infiniband"
    if not classes.is_dir():
        return []
    found = []
    for device_dir in sorted(classes.iterdir()):
        driver_link = device_dir / "device" / "driver"
        driver = Path(driver_link.resolve()).name if driver_link.exists() else None
        ports = []
        ports_dir = device_dir / "ports"
        for port_dir in sorted(ports_dir.iterdir() if ports_dir.is_dir() else [], key=lambda p: p.name):
            if not port_dir.name.isdigit():
                continue
            netdev = _netdev(port_dir)
            mtu = _read(root / "sys" / "class" / "net" / netdev / "mtu") if netdev else None
            ports.append(Port(int(port_dir.name), _after_colon(_read(port_dir / "state")),
                              _after_colon(_read(port_dir / "phys_state")), _read(port_dir / "link_layer") or "",
                              _read(port_dir / "rate") or "", netdev, int(mtu) if mtu and mtu.isdigit() else None,
                              _traffic_class(device_dir, int(port_dir.name))))
        found.append(Device(device_dir.name, driver, tuple(ports)))
    return found
