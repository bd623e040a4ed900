"""``python -m jaxgin.doctor``: can this node take part in a jaxgin job that spans hosts? Checked on
the node alone, without starting a job, so a node that would hang a large job is found first.

    python -m jaxgin.doctor [--json] [--root DIR]

Checks, each reported in plain words with the fix for what fails: the GPUs, driver and CUDA
version, JAX's CUDA plugin; the NCCL that JAX loads and which of the NCCL features jaxgin uses it
has; peer access and NVLink between the node's GPUs (LSA); RDMA devices (libibverbs and the
kernel's view: port state, link layer, rate, RoCE MTU); GPUDirect RDMA (dma-buf, nvidia-peermem);
which GIN path a job across hosts would take here: GDAKI (the GPU drives the NIC), NCCL's proxy
(a CPU thread posts the GPU's requests to the NIC), jaxgin's host transport (TCP between hosts,
no NIC), or none; and the ``NCCL_*`` / ``JAXGIN_*`` settings in force, those that change the
outcome singled out.

Verdict and exit status: ready (0); degraded (5, ``cli.EXIT_DEGRADED``: a job runs, but slower or
with a known risk, each named); not ready (6, ``cli.EXIT_NOT_READY``: a job would fail or hang).
``--json`` prints the report and what was found as one JSON document. ``--root`` reads ``/sys``
and ``/proc`` from a node image instead of this machine (libraries still load as usual).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from jaxgin import cli, nccl, rdma, transport
from jaxgin import node as node_lib
from jaxgin import settings as settings_lib
from jaxgin.nccl import version_string

OK, INFO, WARN, FAIL = "ok", "info", "warn", "fail"
READY, DEGRADED, NOT_READY = "ready", "degraded", "not ready"
EXIT_STATUS = {READY: 0, DEGRADED: cli.EXIT_DEGRADED, NOT_READY: cli.EXIT_NOT_READY}

INSTALL_CUDA = 'pip install -e ".[cuda]" (from the jaxgin checkout)'
# What jaxgin uses of NCCL, and the release that brought it (NCCL_VERSION_CODE). The C sources
# branch on the same releases; tests/test_doctor.py holds them equal.
NCCL_GIN = 22807  # GIN: NCCL's user guide, "Device-Initiated Communication"
NCCL_GIN_TYPE_QUERY = 22900  # ncclCommQueryProperties says the communicator's GIN type (csrc/runtime/runtime.cu)
NCCL_WEAK_SIGNALS = 23100  # a put's signal covers that put only (csrc/device/impl/transport__funcs.h)
NCCL_TIMED_FLUSH = 23200  # a GIN flush with a timeout (csrc/device/impl/put__funcs.h, bounded_flush)
NCCL_FEATURES = (
    (nccl.MINIMUM_VERSION, "device API (LSA, symmetric windows)"),
    (NCCL_GIN, "GIN"),
    (NCCL_GIN_TYPE_QUERY, "GIN type per communicator"),
    (transport.MIN_NCCL, "RMA plugins (jaxgin's host transport)"),
    (NCCL_WEAK_SIGNALS, "weak signal adds"),
    (NCCL_TIMED_FLUSH, "timed GIN flush"),
)
GDAKI_DMA_BUF_KERNEL = (6, 1)  # NCCL's user guide: GDAKI over dma-buf needs Linux >= 6.1
ROCE_MTU_FOR_4K = 4200  # an interface MTU that gives RoCE a 4096-byte path MTU
NCCL_GIN_TYPES = {2: "proxy", 3: "gdaki"}  # NCCL_GIN_TYPE values (ncclGinType_t)


@dataclasses.dataclass(frozen=True)
class Finding:
    check: str  # 'gpus', 'jax', 'nccl', 'nvlink', 'rdma', 'gpudirect', 'gin', 'settings'
    status: str  # OK, INFO, WARN or FAIL
    what: str
    fix: str = ""


@dataclasses.dataclass(frozen=True)
class Report:
    host: str
    verdict: str
    summary: str
    gin_path: str  # 'gdaki', 'proxy', 'host transport' or 'none'
    findings: tuple[Finding, ...]

    @property
    def exit_status(self) -> int:
        return EXIT_STATUS[self.verdict]


def _flag(settings: dict, name: str) -> str:
    return settings.get(name, "").strip()


def _gpu_findings(s: node_lib.Survey) -> list[Finding]:
    found = [] if s.jax_cuda_plugin else [
        Finding("jax", FAIL, "JAX has no CUDA plugin here (jax-cuda13-plugin and jax-cuda13-pjrt): it would run on the "
                             "CPU", INSTALL_CUDA)]
    if s.gpu_error:
        return [Finding("gpus", FAIL, f"no GPU: {s.gpu_error}",
                        "install the NVIDIA driver (its kernel module and libcuda.so.1) on a node with NVIDIA GPUs, "
                        f"then {INSTALL_CUDA}")] + found
    cuda = f"CUDA {s.cuda_driver // 1000}.{s.cuda_driver % 1000 // 10}" if s.cuda_driver else "CUDA unknown"
    names = sorted({g.name for g in s.gpus})
    archs = sorted({g.compute_capability for g in s.gpus})
    found.insert(0, Finding("gpus", OK, f"{len(s.gpus)} x {', '.join(names)} (compute capability {', '.join(archs)}), "
                                     f"driver {s.driver or 'version unknown'}, {cuda}"))
    if s.cuda_driver is not None and s.cuda_driver < 13000:
        found.append(Finding("gpus", FAIL, f"the driver supports {cuda} only; JAX's CUDA 13 plugin needs a driver for "
                                           "CUDA 13 or newer", "update the NVIDIA driver"))
    old = [g.index for g in s.gpus if float(g.compute_capability) < 7.0]
    if old:
        found.append(Finding("gpus", FAIL, f"GPUs {old} are older than Volta (compute capability 7.0), which NCCL's "
                                           "GIN needs", "run jaxgin on Volta or newer GPUs"))
    no_vmm = [g.index for g in s.gpus if not g.virtual_memory]
    if no_vmm:
        found.append(Finding("gpus", FAIL, f"GPUs {no_vmm} lack CUDA virtual memory management, of which NCCL makes "
                                           "the symmetric windows jaxgin's heap lives in",
                             "update the NVIDIA driver; in a VM, enable the GPU's full passthrough"))
    return found


def _nccl_findings(s: node_lib.Survey) -> list[Finding]:
    if s.nccl_version is None:
        return [Finding("nccl", FAIL, f"no NCCL: {s.nccl_error}", f"{INSTALL_CUDA} (it brings nvidia-nccl-cu13)")]
    has = [name for code, name in NCCL_FEATURES if s.nccl_version >= code]
    lacks = [f"{name} (NCCL >= {version_string(code)})" for code, name in NCCL_FEATURES if s.nccl_version < code]
    where = f"NCCL {version_string(s.nccl_version)} ({s.nccl_library})"
    if s.nccl_version < nccl.MINIMUM_VERSION:
        return [Finding("nccl", FAIL, f"{where} is older than the device API jaxgin is built on",
                        "pip install -U 'nvidia-nccl-cu13>=2.28.9'")]
    found = [Finding("nccl", OK, f"{where}: " + ", ".join(has) + (f"; lacks {', '.join(lacks)}" if lacks else ""))]
    if s.nccl_version < NCCL_TIMED_FLUSH:
        found.append(Finding("nccl", WARN, "a GIN backend that stalls (a NIC queue in error: NVIDIA/nccl#2383) hangs a "
                                           "put in NCCL's untimed flush instead of failing it after JAXGIN_TIMEOUT",
                             "pip install -U 'nvidia-nccl-cu13>=2.32' (the same version on every node)"))
    return found


def _nvlink_findings(s: node_lib.Survey) -> list[Finding]:
    if len(s.gpus) < 2:
        return [Finding("nvlink", INFO, "one GPU: no GPU pairs on this node")] if s.gpus else []
    blocked = [(p.a, p.b) for p in s.pairs if not p.peer_access]
    pcie = [(p.a, p.b) for p in s.pairs if p.peer_access and p.nvlink is False]
    unknown = [(p.a, p.b) for p in s.pairs if p.peer_access and p.nvlink is None]
    found = []
    if blocked:
        # NCCL makes symmetric windows only where every GPU of a host reaches every other
        # (isAllCudaP2p in NCCL 2.30.7's init); without one, initialize() gets no heap.
        found.append(Finding("nvlink", FAIL, f"GPU pairs {blocked} have no CUDA peer access: NCCL makes no symmetric "
                                             "window (jaxgin's heap) for a job that holds both GPUs of such a pair, and "
                                             "jaxgin.initialize() fails",
                             "check `nvidia-smi topo -p2p p` (PCIe ACS or an IOMMU can block peer access: NCCL's "
                             "troubleshooting guide), or give each process of the job GPUs that reach each other "
                             "(CUDA_VISIBLE_DEVICES)"))
    if pcie:
        found.append(Finding("nvlink", WARN, f"GPU pairs {pcie} reach each other over PCIe, not NVLink: LSA works, slower",
                             "check `nvidia-smi topo -m` and `nvidia-smi nvlink -s`"))
    if unknown:
        found.append(Finding("nvlink", WARN, f"cannot tell NVLink from PCIe for GPU pairs {unknown}: {s.nvml_error}",
                             "install the NVIDIA driver's NVML (libnvidia-ml.so.1) with the driver"))
    if not found:
        found.append(Finding("nvlink", OK, f"NVLink and peer access between every pair of the {len(s.gpus)} GPUs (LSA)"))
    return found


def _hca_selected(device: str, port: int, hca: str) -> bool:
    """NCCL_IB_HCA's filter: prefixes ('mlx5'), exact names ('=mlx5_0'), ports ('mlx5_0:1'),
    exclusion ('^mlx5_1')."""
    if not hca:
        return True
    exclude, text = hca.startswith("^"), hca.lstrip("^")
    exact, text = text.startswith("="), text.lstrip("=")
    hit = False
    for item in filter(None, (i.strip() for i in text.split(","))):
        name, _, wanted_port = item.partition(":")
        if (device == name if exact else device.startswith(name)) and (not wanted_port or wanted_port == str(port)):
            hit = True
    return hit != exclude


@dataclasses.dataclass(frozen=True)
class _NicPort:
    device: str
    driver: str | None
    port: rdma.Port


def _usable_ports(s: node_lib.Survey) -> list[_NicPort]:
    """Ports NCCL's own IB transport would use: of devices libibverbs lists, active, InfiniBand or
    Ethernet (RoCE), and selected by NCCL_IB_HCA."""
    hca = _flag(s.settings, "NCCL_IB_HCA")
    return [_NicPort(d.name, d.driver, p) for d in s.rdma_devices if d.name in s.verbs_devices for p in d.ports
            if p.state == "ACTIVE" and p.link_layer in ("InfiniBand", "Ethernet") and _hca_selected(d.name, p.number, hca)]


def _rdma_findings(s: node_lib.Survey, gin_path: str) -> list[Finding]:
    if not s.rdma_devices:
        why = s.verbs_error or "libibverbs lists none"
        return [Finding("rdma", INFO, f"no RDMA device ({why}): GIN has no NIC on this node")]
    found = []
    if s.verbs_error:
        found.append(Finding("rdma", FAIL, f"the kernel has RDMA devices {[d.name for d in s.rdma_devices]}, but "
                                           f"{s.verbs_error}", "install rdma-core (Debian/Ubuntu: libibverbs1 "
                                           "ibverbs-providers; RHEL: rdma-core libibverbs), or DOCA-OFED"))
    unlisted = [d.name for d in s.rdma_devices if not s.verbs_error and d.name not in s.verbs_devices]
    if unlisted:
        found.append(Finding("rdma", WARN, f"libibverbs does not list {unlisted}: their user-space provider is missing",
                             "install rdma-core's providers (Debian/Ubuntu: ibverbs-providers), or DOCA-OFED"))
    settings = s.settings
    for d in s.rdma_devices:
        active = [p for p in d.ports if p.state == "ACTIVE"]
        for p in d.ports:
            where = f"{d.name} port {p.number}"
            if p.state != "ACTIVE":
                found.append(Finding("rdma", WARN, f"{where} is {p.state or 'in an unknown state'} (physical state "
                                                   f"{p.physical_state or 'unknown'}): NCCL uses active ports only",
                                     f"check its cable and switch port (ibstat {d.name}), or leave it out with "
                                     f"NCCL_IB_HCA"))
                continue
            if p.link_layer not in ("InfiniBand", "Ethernet"):
                plugin = (" GIN over EFA comes from the aws-ofi-nccl net plugin (GIN since its 1.21; NVIDIA/nccl#1913 "
                          "for what failed before)") if d.driver == "efa" else ""
                found.append(Finding("rdma", WARN, f"{where}: link layer {p.link_layer or 'unknown'}: NCCL's own GIN "
                                                   "backends use InfiniBand and RoCE ports only." + plugin,
                                     "check the net plugin's own GIN requirements; jaxgin's doctor cannot"))
                continue
            kind = "InfiniBand" if p.link_layer == "InfiniBand" else f"RoCE over {p.netdev or 'an unknown interface'}"
            mtu = f", MTU {p.netdev_mtu}" if p.netdev_mtu else ""
            found.append(Finding("rdma", OK, f"{where}: active, {kind}, {p.rate or 'rate unknown'}{mtu}"))
            gdaki_roce = gin_path == "gdaki" and p.link_layer == "Ethernet"
            if gdaki_roce and p.netdev_mtu is not None and p.netdev_mtu < ROCE_MTU_FOR_4K:
                found.append(Finding("rdma", WARN, f"{where}: {p.netdev} has MTU {p.netdev_mtu}, below the 4096-byte "
                                                   "path MTU that NCCL 2.30.7's GDAKI sets on every queue pair: its puts "
                                                   "hang (NVIDIA/nccl#1957)",
                                     f"set {p.netdev}'s MTU to {ROCE_MTU_FOR_4K} or more on every node and switch, or "
                                     "use NCCL's proxy GIN (NCCL_GIN_TYPE=2)"))
            tc_set = _flag(settings, "NCCL_GIN_IB_TC") or _flag(settings, "NCCL_IB_TC")
            if gdaki_roce and p.traffic_class is not None and not tc_set:
                found.append(Finding("rdma", WARN, f"{where}: the device's global traffic class {p.traffic_class} "
                                                   "applies to the queue pairs the kernel sets up, not to GDAKI's, which "
                                                   "then use class 0, maybe a lossy one (NVIDIA/nccl#2383)",
                                     f"export NCCL_GIN_IB_TC={p.traffic_class}"))
        if len(active) > 1 and _flag(settings, "NCCL_IB_MERGE_NICS") != "0":
            found.append(Finding("rdma", WARN, f"{d.name} has {len(active)} active ports, which NCCL fuses into one NIC; "
                                               "GIN does not support fused NICs (NCCL's user guide)",
                                 "export NCCL_IB_MERGE_NICS=0"))
    if s.mlx5_dma_buf is False and any(d.driver == "mlx5_core" for d in s.rdma_devices):
        found.append(Finding("rdma", WARN, "libmlx5 lacks symbol version MLX5_1.25 (mlx5dv_reg_dmabuf_mr): with such an "
                                           "rdma-core NCCL was seen to report no GIN on ConnectX-7 (deepseek-ai/DeepEP#628)",
                             "update rdma-core or MLNX_OFED / DOCA-OFED to a release whose libmlx5 has MLX5_1.25"))
    return found


def _kernel_at_least(kernel: str | None, wanted: tuple[int, int]) -> bool:
    numbers = []
    for part in (kernel or "").split("-")[0].split(".")[:2]:
        if not part.isdigit():
            return False
        numbers.append(int(part))
    return tuple(numbers) >= wanted


def _gpudirect(s: node_lib.Survey) -> tuple[bool, bool, str]:
    """(dma-buf usable for the proxy, for GDAKI, how GPUDirect RDMA would work in words)."""
    gpus_dma_buf = bool(s.gpus) and all(g.dma_buf for g in s.gpus)
    dma_buf = gpus_dma_buf and bool(s.verbs_dma_buf) and _flag(s.settings, "NCCL_DMABUF_ENABLE") != "0"
    gdaki_dma_buf = dma_buf and _kernel_at_least(s.kernel, GDAKI_DMA_BUF_KERNEL)
    ways = [w for w, on in (("dma-buf", dma_buf), ("nvidia-peermem", s.nvidia_peermem),
                            ("nv_peer_mem", s.legacy_peer_memory)) if on]
    return dma_buf, gdaki_dma_buf, " and ".join(ways)


def _gin(s: node_lib.Survey, ports: list[_NicPort]) -> tuple[str, dict[str, list[str]]]:
    """The GIN path a job across hosts takes here, and why each better one does not."""
    settings = s.settings
    dma_buf, gdaki_dma_buf, _ = _gpudirect(s)
    nccl_version = s.nccl_version or 0
    gin_type = _flag(settings, "NCCL_GIN_TYPE")
    common = []
    if nccl_version < NCCL_GIN:
        common.append(f"NCCL {version_string(nccl_version)} has no GIN (NCCL >= {version_string(NCCL_GIN)})"
                      if nccl_version else "no NCCL")
    if _flag(settings, "NCCL_GIN_ENABLE") == "0":
        common.append("NCCL_GIN_ENABLE=0 switches GIN off")
    no_gdr_vmm = [g.index for g in s.gpus if not g.gpudirect_vmm]
    if no_gdr_vmm:  # NCCL's src/init.cc (2.30.7) requires it of every GPU, for its NIC backends and RMA plugins alike
        common.append(f"GPUs {no_gdr_vmm} lack GPUDirect RDMA on CUDA virtual memory "
                      "(CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED), which NCCL's GIN needs")
    if _flag(settings, "NCCL_CROSS_NIC") == "0":
        # NCCL then offers GIN along rails only, and RMA plugins not at all (src/init.cc, 2.30.7);
        # jaxgin asks for GIN between every pair of ranks.
        common.append("NCCL_CROSS_NIC=0 limits NCCL's GIN to rails, and jaxgin needs it between every pair of ranks")
    nic = list(common)
    if _flag(settings, "NCCL_IB_DISABLE") == "1":
        nic.append("NCCL_IB_DISABLE=1 keeps NCCL off the RDMA devices")
    elif _flag(settings, "NCCL_NET").lower() == "socket":
        nic.append("NCCL_NET=Socket keeps NCCL off the RDMA devices")
    elif not ports:
        nic.append("no RDMA NIC" if not s.rdma_devices else "no active InfiniBand or RoCE port that libibverbs lists"
                   + (" and NCCL_IB_HCA selects" if _flag(settings, "NCCL_IB_HCA") else ""))
    if _flag(settings, "JAXGIN_GIN_TRANSPORT") == "host":
        nic.append("JAXGIN_GIN_TRANSPORT=host puts GIN on jaxgin's host transport")
    gdaki, proxy = list(nic), list(nic)
    if ports:
        if not any(p.driver == "mlx5_core" for p in ports):
            gdaki.append("GDAKI drives NVIDIA ConnectX NICs (mlx5) only")
        if not (s.nvidia_peermem or gdaki_dma_buf):
            gdaki.append("GDAKI needs nvidia-peermem, or dma-buf on Linux >= 6.1")
        if not (s.nvidia_peermem or s.legacy_peer_memory or dma_buf):
            proxy.append("no GPUDirect RDMA (neither dma-buf nor a peer-memory module)")
    if gin_type and gin_type != "3":
        gdaki.append(f"NCCL_GIN_TYPE={gin_type} asks for another backend")
    if gin_type and gin_type != "2":
        proxy.append(f"NCCL_GIN_TYPE={gin_type} asks for another backend")
    host = list(common)
    if nccl_version and nccl_version < transport.MIN_NCCL:
        host.append(f"NCCL {version_string(nccl_version)} loads no RMA plugin (NCCL >= {version_string(transport.MIN_NCCL)})")
    if _flag(settings, "JAXGIN_GIN_TRANSPORT") == "nic":
        host.append("JAXGIN_GIN_TRANSPORT=nic rules it out")
    why_not = {"gdaki": gdaki, "proxy": proxy, "host transport": host}
    path = next((name for name, reasons in why_not.items() if not reasons), "none")
    return path, why_not


def _gin_findings(s: node_lib.Survey) -> tuple[str, list[Finding]]:
    ports = _usable_ports(s)
    path, why_not = _gin(s, ports)
    _, _, gpudirect = _gpudirect(s)
    nics = sorted({p.device for p in ports})
    found = []
    if ports:
        found.append(Finding("gpudirect", OK if gpudirect else WARN,
                             f"GPUDirect RDMA through {gpudirect}" if gpudirect else
                             "no GPUDirect RDMA: the NIC cannot read or write GPU memory",
                             "" if gpudirect else "load nvidia-peermem (sudo modprobe nvidia-peermem), or use the NVIDIA "
                             "driver's open kernel modules on Linux >= 6.1 for dma-buf"))
    if path == "gdaki":
        found.append(Finding("gin", OK, f"GIN through GDAKI on {', '.join(nics)}: the GPU posts its puts to the NIC itself"))
    elif path == "proxy":
        found.append(Finding("gin", OK, f"GIN through NCCL's proxy on {', '.join(nics)}: a CPU thread posts the GPU's "
                                        f"puts (GDAKI is out: {'; '.join(why_not['gdaki'])})"))
    elif path == "host transport":
        transport_set = _flag(s.settings, "JAXGIN_GIN_TRANSPORT") == "host"
        found.append(Finding("gin", WARN, "GIN only through jaxgin's host transport (TCP between hosts, far slower than "
                                          f"a NIC): {'; '.join(why_not['proxy'])}",
                             ("" if transport_set else "jobs across hosts need JAXGIN_GIN_TRANSPORT=host here "
                              "('auto' takes it only with JAXGIN_FORCE_GIN); ") +
                             "for RDMA speed, give the node an RDMA NIC with GPUDirect RDMA"))
    else:
        found.append(Finding("gin", FAIL, "no GIN: a job across hosts fails at jaxgin.initialize() (NCCL reports GIN "
                                          f"type NONE): {'; '.join(dict.fromkeys(why_not['proxy'] + why_not['host transport']))}",
                             _no_gin_fix(s, ports)))
    return path, found


def _no_gin_fix(s: node_lib.Survey, ports: list[_NicPort]) -> str:
    fixes = [f"unset {name}" for name in ("NCCL_GIN_ENABLE", "NCCL_CROSS_NIC") if _flag(s.settings, name) == "0"]
    if any(not g.gpudirect_vmm for g in s.gpus):
        fixes.append("update the NVIDIA driver (GPUDirect RDMA on virtual memory needs a recent one)")
    if (s.nccl_version or 0) < transport.MIN_NCCL:
        fixes.append("pip install -U 'nvidia-nccl-cu13>=2.30' (the same on every node), which brings jaxgin's host "
                     "transport" + ("" if ports else ", or give the node an RDMA NIC with GPUDirect RDMA"))
    if _flag(s.settings, "JAXGIN_GIN_TRANSPORT") == "nic" and not ports:
        fixes.append("JAXGIN_GIN_TRANSPORT=host (no NIC here)")
    return "; ".join(fixes) or "give the node an RDMA NIC with GPUDirect RDMA"


def _interface_selected(interfaces: tuple[str, ...], wanted: str) -> bool:
    """NCCL_SOCKET_IFNAME's filter (prefixes, '=' exact, '^' exclusion) matches an interface here."""
    if wanted.startswith("^"):
        return True
    exact, text = wanted.startswith("="), wanted.lstrip("=")
    items = [i.strip() for i in text.split(",") if i.strip()]
    return any(i == item if exact else i.startswith(item) for i in interfaces for item in items)


def _settings_findings(s: node_lib.Survey) -> list[Finding]:
    settings = s.settings
    shown = " ".join(f"{k}={v}" for k, v in settings.items()) or "none"
    found = [Finding("settings", INFO, f"NCCL_* and JAXGIN_* in force: {shown}")]
    for name, why in (("NCCL_CUMEM_ENABLE", "NCCL's symmetric windows are made of CUDA virtual memory"),
                      ("NCCL_WIN_ENABLE", "jaxgin's heap is an NCCL window")):
        if _flag(settings, name) == "0":
            found.append(Finding("settings", FAIL, f"{name}=0: jaxgin.initialize() fails, as {why}", f"unset {name}"))
    gin_type = _flag(settings, "NCCL_GIN_TYPE")
    if gin_type and not gin_type.lstrip("-").isdigit():
        found.append(Finding("settings", FAIL, f"NCCL_GIN_TYPE={gin_type!r} is not a GIN type number",
                             "unset it (NCCL picks), or 2 (proxy) or 3 (GDAKI)"))
    ifname = _flag(settings, "NCCL_SOCKET_IFNAME")
    if ifname and s.interfaces and not _interface_selected(s.interfaces, ifname):
        found.append(Finding("settings", FAIL, f"NCCL_SOCKET_IFNAME={ifname} names no interface of this node "
                                               f"({', '.join(s.interfaces)}): NCCL's bootstrap fails or hangs in "
                                               "jaxgin.initialize()", "name an interface every node has, or unset it"))
    hca = _flag(settings, "NCCL_IB_HCA")
    if hca and s.rdma_devices and not any(_hca_selected(d.name, p.number, hca) for d in s.rdma_devices for p in d.ports):
        found.append(Finding("settings", WARN, f"NCCL_IB_HCA={hca} selects none of this node's RDMA devices "
                                               f"({', '.join(d.name for d in s.rdma_devices)})",
                             "name this node's devices (mlx5_0,mlx5_1 or a prefix such as mlx5), or unset it"))
    plugin = _flag(settings, "NCCL_RMA_PLUGIN")
    if plugin and not Path(plugin).is_file():
        found.append(Finding("settings", FAIL, f"NCCL_RMA_PLUGIN={plugin} does not exist: NCCL finds no RMA plugin",
                             "unset it (jaxgin sets it for its host transport) or point it at the plugin"))
    if _flag(settings, "NCCL_NET_PLUGIN"):
        found.append(Finding("settings", WARN, f"NCCL_NET_PLUGIN={settings['NCCL_NET_PLUGIN']}: GIN over an external "
                                               "net plugin depends on that plugin's GIN support (NVIDIA/nccl#1913: "
                                               "aws-ofi-nccl on EFA with NCCL 2.28.9)", "check the plugin's GIN support"))
    for name, check in (("JAXGIN_GIN_TRANSPORT", lambda: transport.requested(None)),
                        ("JAXGIN_FORCE_GIN", lambda: settings_lib.flag("JAXGIN_FORCE_GIN"))):
        try:
            check()
        except ValueError as e:
            found.append(Finding("settings", FAIL, f"{e}", f"fix or unset {name}"))
    return found


def examine(s: node_lib.Survey) -> Report:
    """The findings about a surveyed node, and the verdict they make."""
    gpu = _gpu_findings(s)
    gin_path, gin = _gin_findings(s)
    findings = gpu + _nccl_findings(s) + _nvlink_findings(s) + _rdma_findings(s, gin_path) + gin + _settings_findings(s)
    statuses = {f.status for f in findings}
    verdict = NOT_READY if FAIL in statuses else DEGRADED if WARN in statuses else READY
    if s.gpu_error:
        gpus = "no GPU"
    elif len(s.gpus) > 1:
        nvlinked = all(p.peer_access and p.nvlink for p in s.pairs)
        gpus = f"{len(s.gpus)} GPUs, " + ("NVLink ready" if nvlinked else "not every pair over NVLink")
    else:
        gpus = "1 GPU"
    gin_words = {"gdaki": "GIN through GDAKI", "proxy": "GIN through NCCL's proxy",
                 "host transport": "GIN through the host transport only", "none": "no GIN"}[gin_path]
    if gin_path == "host transport" and not _usable_ports(s):
        gin_words += " (no RDMA NIC)"
    return Report(s.host, verdict, f"{gpus}; {gin_words}", gin_path, tuple(findings))


def render(report: Report) -> str:
    lines = [f"jaxgin doctor on {report.host}"]
    for f in report.findings:
        lines.append(f"  {f.status:<5} {f.check:<10} {f.what}")
        if f.fix:
            lines.append(f"  {'':<5} {'':<10} fix: {f.fix}")
    lines.append(f"verdict: {report.verdict} (exit status {report.exit_status}): {report.summary}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m jaxgin.doctor", description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", action="store_true", help="print the report and the survey as one JSON document")
    parser.add_argument("--root", type=Path, default=Path("/"), help="read /sys and /proc under this directory")
    args = parser.parse_args(argv)
    survey = node_lib.survey(args.root)
    report = examine(survey)
    if args.json:
        print(json.dumps({"verdict": report.verdict, "exit_status": report.exit_status, "summary": report.summary,
                          "gin_path": report.gin_path, "host": report.host,
                          "findings": [dataclasses.asdict(f) for f in report.findings], "survey": survey.to_json()},
                         indent=1))
    else:
        print(render(report))
    return report.exit_status


if __name__ == "__main__":
    sys.exit(main())
