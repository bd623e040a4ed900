"""python -m jaxgin.doctor on prepared node images: /sys and /proc files under --root, and fake
builds of the driver's and rdma-core's libraries (tests/fake_node/fake_node.c) found through
LD_LIBRARY_PATH, as the real ones are. Each image is a node the doctor must call ready, degraded or
not ready, for the reason it must name."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from jaxgin import cli, doctor, nccl, transport

ROOT = Path(__file__).resolve().parents[1]
FAKE_SOURCE = Path(__file__).with_name("fake_node") / "fake_node.c"
# Version scripts: the symbol versions the doctor looks up in rdma-core's libraries.
VERBS = "IBVERBS_1.1 { global: ibv_get_device_list; ibv_free_device_list; ibv_get_device_name; local: *; };\n"
VERBS_DMA_BUF = VERBS + "IBVERBS_1.12 { global: ibv_reg_dmabuf_mr; } IBVERBS_1.1;\n"
MLX5 = "MLX5_1.0 { global: mlx5dv_query_device; local: *; };\n"
MLX5_DMA_BUF = MLX5 + "MLX5_1.25 { global: mlx5dv_reg_dmabuf_mr; } MLX5_1.0;\n"
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture(scope="session")
def fake_libraries(tmp_path_factory, require) -> dict[str, Path]:
    """The fake libraries, one build per variant: 'driver' (libcuda and NVML), 'verbs' / 'verbs_old'
    (with / without dma-buf registration), 'mlx5' / 'mlx5_old' (with / without MLX5_1.25)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        require("needs a C compiler (cc) to build the fake driver and rdma-core libraries")
    out = tmp_path_factory.mktemp("fake_node_libraries")
    built = {}
    for variant, script in (("driver", None), ("verbs", VERBS_DMA_BUF), ("verbs_old", VERBS), ("mlx5", MLX5_DMA_BUF),
                            ("mlx5_old", MLX5)):
        command = [cc, "-shared", "-fPIC", "-O1", "-o", str(out / f"{variant}.so"), str(FAKE_SOURCE)]
        if script:
            (out / f"{variant}.map").write_text(script)
            command.append(f"-Wl,--version-script={out / f'{variant}.map'}")
        subprocess.run(command, check=True, capture_output=True, text=True)
        built[variant] = out / f"{variant}.so"
    return built


class NodeImage:
    """A node for the doctor to examine, built up file by file."""

    def __init__(self, root: Path, libraries: dict[str, Path]):
        self.root = root
        self.config = root / "fake_config"  # what the fake libraries answer ($JAXGIN_FAKE_NODE)
        self.lib = root / "fake_lib"  # LD_LIBRARY_PATH
        self.site = root / "fake_site"  # PYTHONPATH: the NCCL package and JAX's CUDA plugin
        for d in (self.config, self.lib, self.site):
            d.mkdir(parents=True)
        self.libraries = libraries
        self.write("proc/sys/kernel/osrelease", "6.8.0-45-generic")
        self.write("sys/class/net/eth0/mtu", "1500")
        self.write("sys/class/net/lo/mtu", "65536")
        # A library every node has, so that none found here is taken from the test machine itself.
        self.rdma_core(dma_buf=True, mlx5=True)

    def write(self, relative: str, text: str) -> None:
        path = self.root / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text + "\n")

    def gpus(self, count: int, *, name: str = H100, cc: str = "9.0", vmm: int = 1, dma_buf: int = 1, gdr_vmm: int = 1,
             cuda: int = 13000, nvlink: bool = True, peer_access: bool = True) -> "NodeImage":
        shutil.copy(self.libraries["driver"], self.lib / "libcuda.so.1")
        shutil.copy(self.libraries["driver"], self.lib / "libnvidia-ml.so.1")
        major, minor = cc.split(".")
        bus = [f"0000:{0x18 + 0x10 * i:02x}:00.0" for i in range(count)]
        (self.config / "gpus").write_text("".join(f"{name}\t{major}\t{minor}\t{b}\t{vmm}\t{dma_buf}\t{gdr_vmm}\n"
                                                  for b in bus))
        (self.config / "p2p").write_text("".join(f"{a}\t{b}\t{int(peer_access)}\t{int(nvlink)}\n"
                                                 for a in range(count) for b in range(a + 1, count)))
        (self.config / "cuda_version").write_text(f"{cuda}\n")
        (self.config / "driver").write_text("580.159.04\n")
        self.jax_cuda_plugin()
        return self

    def no_gpu(self) -> "NodeImage":
        """A driver that finds no GPU (cuInit: CUDA_ERROR_NO_DEVICE)."""
        shutil.copy(self.libraries["driver"], self.lib / "libcuda.so.1")
        return self

    def jax_cuda_plugin(self) -> None:
        for package in ("jax_cuda13_plugin", "jax_plugins/xla_cuda13"):
            self.write(f"fake_site/{package}/__init__.py", "")

    def nccl(self, version: str) -> "NodeImage":
        major, minor, patch = (int(p) for p in version.split("."))
        self.write("fake_site/nvidia/nccl/include/nccl.h", f"#define NCCL_VERSION_CODE {major * 10000 + minor * 100 + patch}")
        self.write("fake_site/nvidia/nccl/lib/libnccl.so.2", "")
        return self

    def rdma_core(self, *, dma_buf: bool, mlx5: bool) -> "NodeImage":
        shutil.copy(self.libraries["verbs" if dma_buf else "verbs_old"], self.lib / "libibverbs.so.1")
        shutil.copy(self.libraries["mlx5" if mlx5 else "mlx5_old"], self.lib / "libmlx5.so.1")
        return self

    def nic(self, name: str, *ports: dict, driver: str = "mlx5_core", listed: bool = True) -> "NodeImage":
        """An RDMA device; each port a dict of state, link_layer, rate and, for RoCE, netdev, mtu, tc."""
        device = self.root / "sys/class/infiniband" / name
        driver_dir = self.root / "sys/bus/pci/drivers" / driver
        driver_dir.mkdir(parents=True, exist_ok=True)
        (device / "device").mkdir(parents=True)
        (device / "device" / "driver").symlink_to(driver_dir)
        for number, port in enumerate(ports or ({},), start=1):
            port = {"state": "4: ACTIVE", "phys_state": "5: LinkUp", "link_layer": "InfiniBand",
                    "rate": "400 Gb/sec (4X NDR)"} | port
            for key in ("state", "phys_state", "link_layer", "rate"):
                self.write(f"sys/class/infiniband/{name}/ports/{number}/{key}", port[key])
            if "netdev" in port:
                self.write(f"sys/class/infiniband/{name}/ports/{number}/gid_attrs/ndevs/0", port["netdev"])
                self.write(f"sys/class/net/{port['netdev']}/mtu", str(port.get("mtu", 9000)))
            if "tc" in port:
                self.write(f"sys/class/infiniband/{name}/tc/{number}/traffic_class", f"Global tclass={port['tc']}")
        if listed:
            with open(self.config / "ibv_devices", "a") as f:
                f.write(name + "\n")
        return self

    def peermem(self) -> "NodeImage":
        self.write("sys/module/nvidia_peermem/version", "580.159.04")
        return self

    def env(self, settings: dict[str, str]) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "JAXGIN_", "LD_LIBRARY_PATH"))}
        return env | {"LD_LIBRARY_PATH": str(self.lib), "JAXGIN_FAKE_NODE": str(self.config),
                      "PYTHONPATH": os.pathsep.join([str(self.site), str(ROOT)])} | settings

    def examine(self, **settings: str) -> dict:
        """The doctor's JSON report on this node (with these NCCL_* / JAXGIN_* settings), its exit
        status checked against its verdict."""
        out = subprocess.run([sys.executable, "-m", "jaxgin.doctor", "--json", "--root", str(self.root)],
                             env=self.env(settings), capture_output=True, text=True, timeout=120)
        assert out.stdout, out.stderr
        report = json.loads(out.stdout)
        assert out.returncode == doctor.EXIT_STATUS[report["verdict"]] == report["exit_status"], (out.returncode, report)
        return report


@pytest.fixture
def image(tmp_path, fake_libraries) -> NodeImage:
    return NodeImage(tmp_path / "node", fake_libraries)


def _statuses(report: dict, check: str) -> list[tuple[str, str, str]]:
    return [(f["status"], f["what"], f["fix"]) for f in report["findings"] if f["check"] == check]


def _warned(report: dict, check: str, text: str) -> tuple[str, str, str]:
    hits = [f for f in _statuses(report, check) if f[0] in ("warn", "fail") and text in f[1]]
    assert hits, json.dumps(report["findings"], indent=1)
    return hits[0]


def infiniband_node(image: NodeImage) -> NodeImage:
    """8 H100 over NVLink, four ConnectX InfiniBand NICs, nvidia-peermem, NCCL 2.32.3: what jaxgin runs best on."""
    image.gpus(8).nccl("2.32.3").peermem()
    for i in range(4):
        image.nic(f"mlx5_{i}")
    return image


def test_infiniband_node_with_peermem_is_ready_for_gdaki(image):
    report = infiniband_node(image).examine()
    assert report["verdict"] == "ready" and report["exit_status"] == 0
    assert report["gin_path"] == "gdaki"
    assert report["summary"] == "8 GPUs, NVLink ready; GIN through GDAKI"
    assert not [f for f in report["findings"] if f["status"] in ("warn", "fail")]
    assert _statuses(report, "gin")[0][1].startswith("GIN through GDAKI on mlx5_0, mlx5_1, mlx5_2, mlx5_3")
    assert _statuses(report, "gpudirect") == [("ok", "GPUDirect RDMA through dma-buf and nvidia-peermem", "")]
    survey = report["survey"]
    assert [g["compute_capability"] for g in survey["gpus"]] == ["9.0"] * 8
    assert survey["verbs_devices"] == ["mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3"]


def test_gin_type_2_picks_the_proxy_and_says_why_not_gdaki(image):
    report = infiniband_node(image).examine(NCCL_GIN_TYPE="2")
    assert (report["verdict"], report["gin_path"]) == ("ready", "proxy")
    assert "GDAKI is out: NCCL_GIN_TYPE=2 asks for another backend" in _statuses(report, "gin")[0][1]
    assert "NCCL_GIN_TYPE=2" in _statuses(report, "settings")[0][1]


def test_gdaki_over_dma_buf_needs_linux_6_1_else_the_proxy(image):
    image.gpus(8).nccl("2.32.3").nic("mlx5_0")
    image.write("proc/sys/kernel/osrelease", "5.15.0-105-generic")
    report = image.examine()
    assert (report["verdict"], report["gin_path"]) == ("ready", "proxy")
    assert "GDAKI needs nvidia-peermem, or dma-buf on Linux >= 6.1" in _statuses(report, "gin")[0][1]


def test_a_nic_gdaki_does_not_drive_leaves_the_proxy(image):
    image.gpus(4).nccl("2.32.3").peermem().nic("bnxt_re0", {"link_layer": "Ethernet", "netdev": "ens1"}, driver="bnxt_en")
    report = image.examine()
    assert (report["verdict"], report["gin_path"]) == ("ready", "proxy")
    assert "GDAKI drives NVIDIA ConnectX NICs (mlx5) only" in _statuses(report, "gin")[0][1]


def _gpu_machine(image: NodeImage, nccl_version: str, verdict: str) -> dict:
    """The GPU machines of this project (4 GPUs over NVLink, no RDMA NIC) with that NCCL: the
    doctor's report, of that verdict."""
    report = image.gpus(4).nccl(nccl_version).examine()
    assert (report["verdict"], report["exit_status"]) == (verdict, doctor.EXIT_STATUS[verdict])
    return report


def test_four_gpus_without_a_nic_are_nvlink_ready_with_gin_through_the_host_transport_only(image):
    report = _gpu_machine(image, "2.32.3", "degraded")
    assert report["summary"] == "4 GPUs, NVLink ready; GIN through the host transport only (no RDMA NIC)"
    status, what, fix = _warned(report, "gin", "GIN only through jaxgin's host transport")
    assert "no RDMA NIC" in what and "JAXGIN_GIN_TRANSPORT=host" in fix
    assert _statuses(report, "nvlink") == [("ok", "NVLink and peer access between every pair of the 4 GPUs (LSA)", "")]
    # Once set, the fix is not asked for again; the node stays degraded (TCP between hosts).
    report = image.examine(JAXGIN_GIN_TRANSPORT="host")
    assert report["verdict"] == "degraded" and "JAXGIN_GIN_TRANSPORT=host" not in _warned(report, "gin", "host transport")[2]


def test_no_nic_and_nccl_before_2_30_leaves_no_gin(image):
    """The same machine with the NCCL of its image (2.28.9): no RMA plugins, so no GIN at all."""
    report = _gpu_machine(image, "2.28.9", "not ready")
    assert report["gin_path"] == "none"
    status, what, fix = _warned(report, "gin", "no GIN")
    assert "NCCL 2.28.9 loads no RMA plugin (NCCL >= 2.30.0)" in what and "nvidia-nccl-cu13>=2.30" in fix
    assert "RMA plugins (jaxgin's host transport) (NCCL >= 2.30.0)" in _statuses(report, "nccl")[0][1].split("; lacks ")[1]


def test_no_gpu_is_not_ready_and_says_what_to_install(image):
    image.no_gpu().nccl("2.32.3")
    report = image.examine()
    assert report["verdict"] == "not ready" and report["summary"].startswith("no GPU;")
    status, what, fix = _warned(report, "gpus", "no GPU")
    assert "CUDA_ERROR_NO_DEVICE" in what
    assert "install the NVIDIA driver" in fix and 'pip install -e ".[cuda]"' in fix


@pytest.mark.skipif(cli.cuda_gpu_count() > 0, reason="this machine has GPUs")
def test_this_cpu_machine_has_no_gpu():
    """The doctor on the machine the tests run on, nothing faked."""
    out = subprocess.run([sys.executable, "-m", "jaxgin.doctor"], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if not k.startswith(("NCCL_", "JAXGIN_"))})
    assert out.returncode == cli.EXIT_NOT_READY, out.stdout + out.stderr
    last = out.stdout.splitlines()[-1]
    assert last.startswith("verdict: not ready (exit status 6): no GPU;"), out.stdout
    assert re.search(r"fail +gpus +no GPU: ", out.stdout) and 'fix: install the NVIDIA driver' in out.stdout


def test_gpus_without_gpudirect_on_virtual_memory_get_no_gin(image):
    image.gpus(4, gdr_vmm=0).nccl("2.32.3").peermem().nic("mlx5_0")
    report = image.examine()
    assert (report["verdict"], report["gin_path"]) == ("not ready", "none")
    _warned(report, "gin", "GPUs [0, 1, 2, 3] lack GPUDirect RDMA on CUDA virtual memory")


def test_a_driver_for_cuda_12_is_not_ready(image):
    image.gpus(2, cuda=12080).nccl("2.32.3")
    status, what, fix = _warned(image.examine(), "gpus", "the driver supports CUDA 12.8 only")
    assert status == "fail" and fix == "update the NVIDIA driver"


def test_nccl_without_the_timed_flush_is_degraded(image):
    infiniband_node(image).nccl("2.31.2")
    report = image.examine()
    assert (report["verdict"], report["gin_path"]) == ("degraded", "gdaki")
    status, what, fix = _warned(report, "nccl", "hangs a put in NCCL's untimed flush")
    assert "NVIDIA/nccl#2383" in what and "nvidia-nccl-cu13>=2.32" in fix


def test_roce_below_a_4k_mtu_warns_of_the_gdaki_hang(image):
    image.gpus(8).nccl("2.32.3").peermem().nic("mlx5_0", {"link_layer": "Ethernet", "netdev": "ens1np0", "mtu": 1500})
    report = image.examine()
    assert (report["verdict"], report["gin_path"]) == ("degraded", "gdaki")
    status, what, fix = _warned(report, "rdma", "ens1np0 has MTU 1500")
    assert "NVIDIA/nccl#1957" in what and "MTU to 4200" in fix and "NCCL_GIN_TYPE=2" in fix
    assert "mlx5_0 port 1: active, RoCE over ens1np0, 400 Gb/sec (4X NDR), MTU 1500" in [
        w for s, w, _ in _statuses(report, "rdma") if s == "ok"]
    # NCCL's proxy follows the port's MTU: the fix it names clears the warning.
    report = image.examine(NCCL_GIN_TYPE="2")
    assert (report["verdict"], report["gin_path"]) == ("ready", "proxy")


def test_roce_traffic_class_the_gdaki_queues_miss(image):
    image.gpus(8).nccl("2.32.3").peermem().nic("mlx5_0", {"link_layer": "Ethernet", "netdev": "ens1np0", "tc": 236})
    status, what, fix = _warned(image.examine(), "rdma", "global traffic class 236")
    assert "NVIDIA/nccl#2383" in what and fix == "export NCCL_GIN_IB_TC=236"
    assert image.examine(NCCL_GIN_IB_TC="236")["verdict"] == "ready"


def test_a_dual_port_nic_needs_merge_nics_off(image):
    image.gpus(8).nccl("2.32.3").peermem().nic("mlx5_0", {}, {})
    status, what, fix = _warned(image.examine(), "rdma", "mlx5_0 has 2 active ports")
    assert fix == "export NCCL_IB_MERGE_NICS=0"
    assert image.examine(NCCL_IB_MERGE_NICS="0")["verdict"] == "ready"


def test_a_port_down_and_a_device_without_its_provider(image):
    infiniband_node(image).nic("mlx5_4", {"state": "1: DOWN", "phys_state": "3: Disabled"})
    image.nic("mlx5_5", listed=False)
    report = image.examine()
    assert (report["verdict"], report["gin_path"]) == ("degraded", "gdaki")
    _warned(report, "rdma", "mlx5_4 port 1 is DOWN (physical state Disabled)")
    status, what, fix = _warned(report, "rdma", "libibverbs does not list ['mlx5_5']")
    assert "ibverbs-providers" in fix


def test_old_rdma_core_without_dma_buf_and_no_peermem_has_no_gpudirect(image):
    image.gpus(8).nccl("2.32.3").nic("mlx5_0").rdma_core(dma_buf=False, mlx5=False)
    report = image.examine()
    assert (report["verdict"], report["gin_path"]) == ("degraded", "host transport")
    status, what, fix = _warned(report, "gpudirect", "no GPUDirect RDMA")
    assert "modprobe nvidia-peermem" in fix
    _warned(report, "rdma", "libmlx5 lacks symbol version MLX5_1.25")
    assert "no GPUDirect RDMA (neither dma-buf nor a peer-memory module)" in _warned(report, "gin", "host transport")[1]


def test_gpus_over_pcie_and_without_peer_access(image):
    image.gpus(2, nvlink=False).nccl("2.32.3")
    _warned(image.examine(), "nvlink", "GPU pairs [(0, 1)] reach each other over PCIe, not NVLink")
    image.gpus(2, peer_access=False)
    report = image.examine()
    assert report["verdict"] == "not ready" and report["summary"].startswith("2 GPUs, not every pair over NVLink;")
    assert _warned(report, "nvlink", "GPU pairs [(0, 1)] have no CUDA peer access")[0] == "fail"


@pytest.mark.parametrize("settings, check, text, fix, verdict", [
    ({"NCCL_GIN_ENABLE": "0"}, "gin", "NCCL_GIN_ENABLE=0 switches GIN off", "unset NCCL_GIN_ENABLE", "not ready"),
    ({"NCCL_CROSS_NIC": "0"}, "gin", "NCCL_CROSS_NIC=0 limits NCCL's GIN to rails", "unset NCCL_CROSS_NIC", "not ready"),
    ({"NCCL_SOCKET_IFNAME": "ib0"}, "settings", "NCCL_SOCKET_IFNAME=ib0 names no interface of this node",
     "name an interface every node has", "not ready"),
    ({"NCCL_CUMEM_ENABLE": "0"}, "settings", "NCCL_CUMEM_ENABLE=0", "unset NCCL_CUMEM_ENABLE", "not ready"),
    ({"NCCL_IB_HCA": "=mlx5_9"}, "settings", "NCCL_IB_HCA==mlx5_9 selects none of this node's RDMA devices",
     "name this node's devices", "degraded"),
    ({"NCCL_IB_DISABLE": "1"}, "gin", "NCCL_IB_DISABLE=1 keeps NCCL off the RDMA devices", "JAXGIN_GIN_TRANSPORT=host",
     "degraded"),
    ({"NCCL_NET_PLUGIN": "ofi"}, "settings", "NVIDIA/nccl#1913", "check the plugin's GIN support", "degraded"),
    ({"JAXGIN_GIN_TRANSPORT": "tcp"}, "settings", "JAXGIN_GIN_TRANSPORT='tcp'", "fix or unset JAXGIN_GIN_TRANSPORT",
     "not ready"),
    ({"NCCL_RMA_PLUGIN": "/nonexistent/libplugin.so"}, "settings", "does not exist", "unset it", "not ready"),
])
def test_settings_that_change_the_outcome(image, settings, check, text, fix, verdict):
    report = infiniband_node(image).examine(**settings)
    assert report["verdict"] == verdict
    assert fix in _warned(report, check, text)[2]
    shown = _statuses(report, "settings")[0][1]
    assert all(f"{k}={v}" in shown for k, v in settings.items())


def test_the_plain_report_names_each_failure_and_its_fix(image):
    image.gpus(4).nccl("2.28.9")
    out = subprocess.run([sys.executable, "-m", "jaxgin.doctor", "--root", str(image.root)], env=image.env({}),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == cli.EXIT_NOT_READY
    lines = out.stdout.splitlines()
    assert lines[0].startswith("jaxgin doctor on ")
    failed = [i for i, line in enumerate(lines) if re.match(r"  fail +gin +no GIN", line)]
    assert failed and lines[failed[0] + 1].strip().startswith("fix: pip install -U 'nvidia-nccl-cu13>=2.30'")
    assert lines[-1] == "verdict: not ready (exit status 6): 4 GPUs, NVLink ready; no GIN"


def test_nccl_releases_match_the_c_sources():
    """The releases the doctor names for each NCCL feature are those the C sources branch on."""
    csrc = ROOT / "csrc"

    def gates(path: str) -> set[int]:
        found = re.findall(r"NCCL_VERSION_CODE\s*[<>]=?\s*NCCL_VERSION\((\d+),\s*(\d+),\s*(\d+)\)", (csrc / path).read_text())
        return {int(a) * 10000 + int(b) * 100 + int(c) for a, b, c in found}

    assert doctor.NCCL_GIN_TYPE_QUERY in gates("runtime/runtime.cu")
    assert doctor.NCCL_WEAK_SIGNALS in gates("device/impl/transport__funcs.h")
    assert doctor.NCCL_TIMED_FLUSH in gates("device/impl/put__funcs.h")
    assert dict(doctor.NCCL_FEATURES)[nccl.MINIMUM_VERSION].startswith("device API")
    assert "host transport" in dict(doctor.NCCL_FEATURES)[transport.MIN_NCCL]


@pytest.mark.parametrize("hca, selected", [
    ("", ["mlx5_0:1", "mlx5_1:1", "mlx5_10:1", "ib0:1"]),
    ("mlx5", ["mlx5_0:1", "mlx5_1:1", "mlx5_10:1"]),
    ("=mlx5_1", ["mlx5_1:1"]),
    ("mlx5_1", ["mlx5_1:1", "mlx5_10:1"]),
    ("^mlx5_1", ["mlx5_0:1", "ib0:1"]),
    ("mlx5_0:2,ib0", ["ib0:1"]),
])
def test_nccl_ib_hca_selects_like_nccl(hca, selected):
    ports = [("mlx5_0", 1), ("mlx5_1", 1), ("mlx5_10", 1), ("ib0", 1)]
    assert [f"{d}:{p}" for d, p in ports if doctor._hca_selected(d, p, hca)] == selected
