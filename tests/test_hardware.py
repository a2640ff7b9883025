"""course_utils.hardware: NVML (through a fake pynvml that behaves like nvidia-ml-py), the CUDA_VISIBLE_DEVICES
mapping, the nvidia-smi text fallback (captured output), and doctor() on this machine.

The fake keeps the real module's names, signatures, constants and error classes (checked against the real
nvidia-ml-py when it is installed): handles are opaque, calls before nvmlInit fail, facts a GPU lacks raise
NVMLError_NotSupported, and NVML_P2P_CAPS_INDEX_READ is the tuple `(0,)` as in nvidia-ml-py.
"""

from __future__ import annotations

import ctypes
import inspect
import json
import os
import subprocess
import sys
import textwrap
import types
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from course_utils import hardware
from course_utils.hardware import GPUInfo, choose_backend, parse_gpu_query, parse_topo_matrix, smi_text
from course_utils.hardware import report as report_mod
from course_utils.hardware.visible import parse_visible_devices

TOPO = Path(__file__).parent / "data" / "topo"

# ---------------------------------------------------------------------------------------------- fake pynvml


@dataclass
class FakeGPU:
    name: str
    bus: int  # PCI bus number; domain 0, device 0
    mem_mib: int
    cc: tuple[int, int]
    pcie: tuple[int, int] = (5, 16)  # max generation, max width
    nvlinks: list = field(default_factory=list)  # per link: a GPU bus number, "switch", or None (inactive)
    numa: int = 0

    @property
    def uuid(self) -> str:
        return f"GPU-{self.bus:08x}-1111-2222-3333-{self.bus:012x}"

    @property
    def bus_id(self) -> str:
        return f"00000000:{self.bus:02X}:00.0"


def fake_pynvml(gpus: list[FakeGPU], *, init_error: int | None = None, p2p: bool = True,
                remote_type: bool = True, remote_pci: bool = True,
                nvml_order: list[int] | None = None) -> types.ModuleType:
    """A pynvml module for `gpus`, enumerated in `nvml_order` (default: as listed, i.e. by bus)."""
    m = types.ModuleType("pynvml")
    codes = {"UNINITIALIZED": 1, "INVALID_ARGUMENT": 2, "NOT_SUPPORTED": 3, "DRIVER_NOT_LOADED": 9,
             "LIBRARY_NOT_FOUND": 12, "UNKNOWN": 999}
    words = {1: "Uninitialized", 2: "Invalid Argument", 3: "Not Supported", 9: "Driver Not Loaded",
             12: "NVML Shared Library Not Found", 999: "Unknown Error"}

    class NVMLError(Exception):  # as nvidia-ml-py: NVMLError(code) builds the subclass for that code
        _valClassMapping: dict = {}

        def __new__(typ, value):
            if typ is NVMLError:
                typ = NVMLError._valClassMapping.get(value, typ)
            obj = Exception.__new__(typ)
            obj.value = value
            return obj

        def __str__(self):
            return words.get(self.value, f"NVML Error with code {self.value}")

    m.NVMLError = NVMLError
    for name, code in codes.items():
        setattr(m, f"NVML_ERROR_{name}", code)
        cls = type("NVMLError_" + name.title().replace("_", ""), (NVMLError,),
                   {"__new__": (lambda c: lambda typ, *a: NVMLError.__new__(typ, c))(code)})
        NVMLError._valClassMapping[code] = cls
        setattr(m, cls.__name__, cls)
    consts = dict(NVML_FEATURE_DISABLED=0, NVML_FEATURE_ENABLED=1, NVML_NVLINK_MAX_LINKS=36,
                  NVML_P2P_CAPS_INDEX_READ=(0,), NVML_P2P_CAPS_INDEX_WRITE=1, NVML_P2P_STATUS_OK=0,
                  NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED=1, NVML_NVLINK_DEVICE_TYPE_GPU=0,
                  NVML_NVLINK_DEVICE_TYPE_SWITCH=2, NVML_TOPOLOGY_SINGLE=10, NVML_TOPOLOGY_MULTIPLE=20,
                  NVML_TOPOLOGY_HOSTBRIDGE=30, NVML_TOPOLOGY_NODE=40, NVML_TOPOLOGY_SYSTEM=50)
    for k, v in consts.items():
        setattr(m, k, v)

    order = [gpus[i] for i in (nvml_order or range(len(gpus)))]
    by_bus = {g.bus: g for g in gpus}
    state = {"refs": 0, "inits": 0}
    m._state = state

    class Handle:  # c_nvmlDevice_t: an opaque pointer, not an index
        def __init__(self, gpu):
            self._gpu = gpu

    def live(fn):
        def wrapper(*args):
            if state["refs"] <= 0:
                raise NVMLError(codes["UNINITIALIZED"])
            return fn(*args)
        wrapper.__signature__ = inspect.signature(fn)
        wrapper.__name__ = fn.__name__
        setattr(m, fn.__name__, wrapper)
        return wrapper

    def nvmlInit():
        if init_error is not None:
            raise NVMLError(init_error)
        state["refs"] += 1
        state["inits"] += 1

    def nvmlShutdown():
        if state["refs"] <= 0:
            raise NVMLError(codes["UNINITIALIZED"])
        state["refs"] -= 1

    m.nvmlInit, m.nvmlShutdown = nvmlInit, nvmlShutdown

    def pci(bus: int):
        return types.SimpleNamespace(busId=f"00000000:{bus:02X}:00.0", busIdLegacy=f"0000:{bus:02X}:00.0",
                                     domain=0, bus=bus, device=0, pciDeviceId=0x233010DE, pciSubSystemId=0)

    def link_target(handle, link):
        if not isinstance(handle, Handle):
            raise ctypes.ArgumentError("argument 1: wrong type")
        links = handle._gpu.nvlinks
        if not links:
            raise NVMLError(codes["NOT_SUPPORTED"])
        if not 0 <= link < len(links):
            raise NVMLError(codes["INVALID_ARGUMENT"])
        return links[link]

    @live
    def nvmlDeviceGetCount():
        return len(order)

    @live
    def nvmlDeviceGetHandleByIndex(index):
        if not isinstance(index, int) or not 0 <= index < len(order):
            raise NVMLError(codes["INVALID_ARGUMENT"])
        return Handle(order[index])

    @live
    def nvmlDeviceGetName(handle):
        return handle._gpu.name

    @live
    def nvmlDeviceGetUUID(handle):
        return handle._gpu.uuid

    @live
    def nvmlDeviceGetPciInfo(handle):
        return pci(handle._gpu.bus)

    @live
    def nvmlDeviceGetMemoryInfo(handle, version=None):
        total = handle._gpu.mem_mib * 2**20
        return types.SimpleNamespace(total=total, free=total - 2**29, used=2**29)

    @live
    def nvmlDeviceGetCudaComputeCapability(handle):
        return handle._gpu.cc

    @live
    def nvmlDeviceGetMaxPcieLinkGeneration(handle):
        return handle._gpu.pcie[0]

    @live
    def nvmlDeviceGetMaxPcieLinkWidth(handle):
        return handle._gpu.pcie[1]

    @live
    def nvmlDeviceGetCurrPcieLinkGeneration(handle):
        return 1  # an idle GPU drops its link to gen1: the current generation is not the limit

    @live
    def nvmlDeviceGetCurrPcieLinkWidth(handle):
        return handle._gpu.pcie[1]

    @live
    def nvmlDeviceGetNvLinkState(device, link):
        return 0 if link_target(device, link) is None else 1

    @live
    def nvmlDeviceGetNvLinkRemotePciInfo(device, link):
        target = link_target(device, link)
        if target is None or not remote_pci:
            raise NVMLError(codes["NOT_SUPPORTED"])
        return pci(0xE0 + link % 4 if target == "switch" else target)  # NVSwitches have buses of their own

    @live
    def nvmlDeviceGetNvLinkRemoteDeviceType(handle, link):
        target = link_target(handle, link)
        if not remote_type or target is None:
            raise NVMLError(codes["NOT_SUPPORTED"])
        return 2 if target == "switch" else 0

    @live
    def nvmlDeviceGetTopologyCommonAncestor(device1, device2):
        a, b = device1._gpu, device2._gpu
        if a.numa != b.numa:
            return 50
        return 10 if abs(a.bus - b.bus) == 1 and min(a.bus, b.bus) % 2 == 0 else 40

    @live
    def nvmlDeviceGetP2PStatus(device1, device2, p2pIndex):
        if not isinstance(p2pIndex, int):  # ctypes cannot pass the tuple NVML_P2P_CAPS_INDEX_READ
            raise ctypes.ArgumentError("argument 3: TypeError: Don't know how to convert parameter 3")
        if device1._gpu is device2._gpu:
            raise NVMLError(codes["INVALID_ARGUMENT"])
        return 0 if p2p else 1

    @live
    def nvmlSystemGetDriverVersion():
        return "570.124.06"

    assert all(isinstance(t, int) and t in by_bus or t in ("switch", None) for g in gpus for t in g.nvlinks)
    return m


def h200(bus, numa=0):
    return FakeGPU("NVIDIA H200", bus, 143771, (9, 0), (5, 16), ["switch"] * 18, numa)


def a100_pcie(bus, peer, numa=0):
    return FakeGPU("NVIDIA A100 80GB PCIe", bus, 81920, (8, 0), (4, 16), [peer] * 12, numa)


def l4(bus, numa=0):
    return FakeGPU("NVIDIA L4", bus, 23034, (8, 9), (4, 16), [], numa)


BOXES = {
    "2xH200 NVSwitch": [h200(0x19), h200(0x3B)],
    "4xA100 bridged pairs": [a100_pcie(0x17, 0x18), a100_pcie(0x18, 0x17),
                             a100_pcie(0xCA, 0xCB, 1), a100_pcie(0xCB, 0xCA, 1)],
    "8xH200 NVSwitch": [h200(b, numa=int(b > 0x80)) for b in (0x19, 0x3B, 0x4C, 0x5D, 0x9B, 0xBB, 0xCB, 0xDB)],
    "8xL4 PCIe": [l4(b, numa=int(b > 0x80)) for b in (0x10, 0x11, 0x20, 0x21, 0x90, 0x91, 0xA0, 0xA1)],
}
MIXED = [FakeGPU("NVIDIA GeForce RTX 3060", 0x17, 12288, (8, 6), (4, 16)),
         FakeGPU("NVIDIA GeForce RTX 4090", 0x65, 24564, (8, 9), (4, 16))]


@pytest.fixture
def box(monkeypatch):
    """Install a fake pynvml for a box, with torch seeing `cuda_count` GPUs; return the fake module.
    The CUDA child is replaced by `child` (a list of UUIDs in CUDA's order) and its calls recorded."""
    import torch
    import torch.distributed as dist

    def install(gpus, *, cuda_count=None, env=None, order=None, child=None, **kw):
        calls: list[bool] = []
        fake = fake_pynvml(gpus, **kw)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        for var, value in (("CUDA_VISIBLE_DEVICES", env), ("CUDA_DEVICE_ORDER", order)):
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, value)
        n = len(gpus) if cuda_count is None else cuda_count
        monkeypatch.setattr(torch.cuda, "is_available", lambda: n > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: n)
        monkeypatch.setattr(dist, "is_nccl_available", lambda: True)
        monkeypatch.setattr(torch.cuda.nccl, "version", lambda: (2, 28, 3))
        monkeypatch.setattr(smi_text.shutil, "which", lambda name: None)  # NVML must not need nvidia-smi

        def fake_child(peer, timeout=120):
            calls.append(peer)
            if child is None:
                return None
            return {"gpus": [{"name": "?", "memory_gib": 1.0, "cc": "0.0", "uuid": u.removeprefix("GPU-")}
                             for u in child], "peer": {}}

        monkeypatch.setattr(report_mod, "cuda_facts", fake_child)
        fake.child_calls = calls
        return fake

    hardware.probe.cache_clear()
    yield install
    hardware.probe.cache_clear()


def probe_report():
    hardware.probe.cache_clear()
    m = hardware.probe()
    return m, hardware.format_report(m)


def test_fake_pynvml_matches_the_real_module():
    """Every name the fake defines exists in nvidia-ml-py with the same parameters and values."""
    real = pytest.importorskip("pynvml", reason="nvidia-ml-py not installed here")
    fake = fake_pynvml(BOXES["2xH200 NVSwitch"])
    names = [n for n in vars(fake) if n.startswith(("nvml", "NVML"))]
    assert len(names) > 30
    for name in names:
        ours, theirs = getattr(fake, name), getattr(real, name)
        if isinstance(ours, type):
            assert issubclass(theirs, real.NVMLError)
            assert theirs(0).value == ours(0).value, name  # same error code behind the class
        elif callable(ours):
            assert list(inspect.signature(ours).parameters) == list(inspect.signature(theirs).parameters), name
        else:
            assert ours == theirs, name
    assert isinstance(real.NVMLError(3), real.NVMLError_NotSupported)
    assert isinstance(fake.NVMLError(3), fake.NVMLError_NotSupported)


@pytest.mark.parametrize("name", list(BOXES))
def test_nvml_reads_each_box(box, name):
    gpus = BOXES[name]
    fake = box(gpus)
    m, report = probe_report()
    n = len(gpus)
    assert m.source == "nvml" and m.gpu_count == n == m.gpus_on_machine and m.driver == "570.124.06"
    assert [g.uuid for g in m.gpus] == [g.uuid for g in gpus]
    assert [g.pci_bus_id for g in m.gpus] == [f"0000:{g.bus:02x}:00.0" for g in gpus]
    g0 = m.gpus[0]
    assert (g0.name, g0.compute_capability, g0.pcie_gen, g0.pcie_width) == (
        gpus[0].name, f"{gpus[0].cc[0]}.{gpus[0].cc[1]}", *gpus[0].pcie)
    assert g0.memory_gib == pytest.approx(gpus[0].mem_mib / 1024, abs=0.1)
    assert f"GPU{n - 1}: {gpus[-1].name}" in report and "GB/s each way" in report
    assert len(m.topology.links) == n and m.peer_access is not None and len(m.peer_access) == n * (n - 1)
    assert all(m.topology.links[k][k] == "X" for k in range(n))
    assert fake._state["refs"] == 0, "nvmlShutdown not called"
    assert fake.child_calls == [], "NVML answered everything: no CUDA child process needed"
    assert m.backend == "nccl" and m.notes == []


def test_nvml_link_kinds(box):
    box(BOXES["8xH200 NVSwitch"])
    m, report = probe_report()
    # Through NVSwitches every pair has all 18 links, like nvidia-smi topo -m's NV18 (captured_4gpu_h200).
    assert all(m.topology.nvlinks(i, j) == 18 for i in range(8) for j in range(8) if i != j)
    assert "GPU3-GPU7: NVLink x18, peer access" in report
    smi = parse_topo_matrix((TOPO / "8gpu_nvlink.txt").read_text())
    assert [[c for c in row] for row in m.topology.links] == smi.links

    box(BOXES["4xA100 bridged pairs"])
    m, report = probe_report()
    t = m.topology
    assert t.nvlinks(0, 1) == t.nvlinks(2, 3) == 12 and t.nvlinks(0, 2) == 0
    assert t.links[0][2] == "SYS" and "GPU1-GPU2: PCIe across NUMA nodes" in report

    box(BOXES["8xL4 PCIe"], p2p=False)
    m, report = probe_report()
    t = m.topology
    assert (t.links[0][1], t.links[0][2], t.links[0][4]) == ("PIX", "NODE", "SYS")
    assert not any(m.peer_access.values()) and "GPU0-GPU1: PCIe, one switch, no peer access" in report


def test_nvml_links_without_remote_device_type(box):
    """Older drivers cannot name what a link leads to: a bus that is no GPU's is taken for an NVSwitch."""
    box(BOXES["2xH200 NVSwitch"], remote_type=False)
    assert probe_report()[0].topology.nvlinks(0, 1) == 18
    box(BOXES["4xA100 bridged pairs"], remote_type=False)
    t = probe_report()[0].topology
    assert t.nvlinks(1, 0) == 12 and t.nvlinks(1, 2) == 0
    # In a container that hides the NVSwitches their bus ids may be unreadable: the kind still counts.
    box(BOXES["2xH200 NVSwitch"], remote_pci=False)
    assert probe_report()[0].topology.nvlinks(0, 1) == 18


def test_a_broken_binding_never_stops_the_report(box, monkeypatch):
    fake = box(BOXES["2xH200 NVSwitch"])

    def broken():
        raise RuntimeError("symbol nvmlDeviceGetCount_v2 not found")

    monkeypatch.setattr(fake, "nvmlDeviceGetCount", broken)
    m, report = probe_report()
    assert m.source == "none" and any("NVML failed unexpectedly (RuntimeError" in n for n in m.notes)
    assert "Backend for 2 ranks" in report


@pytest.mark.parametrize(
    "env, physical",
    [
        (None, [0, 1, 2, 3]),
        ("2,0", [2, 0]),
        (" 3 , 1", [3, 1]),
        ("1gpu,2x", [1, 2]),  # CUDA reads each entry like strtoul
        ("1,foo,2", [1]),  # an invalid entry ends the list
        ("0,9,1", [0]),  # so does a GPU that does not exist
        ("2,-1,0", [2]),
        ("0,0", []),  # a repeated GPU hides them all
        ("", []),
        ("GPU-000000cb,GPU-00000017-1111", [3, 0]),  # unique UUID prefixes
        ("GPU-000000cb,3", [3]),  # a UUID list ends at the first non-UUID
        ("GPU-0000,1", []),  # an ambiguous prefix names no GPU
        ("GPU-deadbeef", []),
    ],
)
def test_cuda_visible_devices_mapping(box, env, physical):
    gpus = BOXES["4xA100 bridged pairs"]
    box(gpus, env=env, cuda_count=len(physical))
    m, report = probe_report()
    assert [g.physical_index for g in m.gpus] == physical
    assert [g.index for g in m.gpus] == list(range(len(physical)))
    assert [g.uuid for g in m.gpus] == [gpus[p].uuid for p in physical]
    assert m.gpus_on_machine == 4
    if len(physical) > 1:  # links and peer access follow the GPUs, renumbered as CUDA numbers them
        a, b = physical[:2]
        assert m.topology.links[0][1] == ("NV12" if {a, b} in ({0, 1}, {2, 3}) else "SYS")
        assert set(m.peer_access) == {f"{i}->{j}" for i in range(len(physical)) for j in range(len(physical))
                                      if i != j}
    if physical and physical != list(range(len(physical))):
        assert f"GPU0 [nvidia-smi GPU{physical[0]}]: NVIDIA A100" in report
    if env not in (None, "2,0", " 3 , 1", "1gpu,2x", "GPU-000000cb,GPU-00000017-1111"):
        assert any("CUDA_VISIBLE_DEVICES" in n for n in m.notes), m.notes  # what CUDA ignores is said
    if not physical:
        assert "GPUs: none visible here, 4 on the machine" in report and m.backend == "gloo"


def test_parse_visible_devices_rules():
    assert parse_visible_devices(None) == (None, [])
    assert parse_visible_devices("1,0")[0] == [1, 0]
    assert parse_visible_devices("GPU-ab, GPU-cd")[0] == ["GPU-ab", "GPU-cd"]
    picks, problems = parse_visible_devices("0,1,x,2")
    assert picks == [0, 1] and "ignores 'x,2'" in problems[0]
    assert parse_visible_devices("MIG-abc")[0] == ["MIG-abc"]


def test_mig_entries_are_not_mapped(box):
    box(BOXES["2xH200 NVSwitch"], env="MIG-11111111-2222-3333-4444-555555555555", cuda_count=1)
    m, _ = probe_report()
    assert m.gpus == [] and any("MIG" in n for n in m.notes)


def test_pci_bus_id_order_when_nvml_numbers_differently(box):
    """CUDA_DEVICE_ORDER=PCI_BUS_ID numbers by bus id, whatever NVML's own order."""
    gpus = BOXES["4xA100 bridged pairs"]
    box(gpus, nvml_order=[2, 0, 3, 1], order="PCI_BUS_ID", env="0,2")
    m, report = probe_report()
    assert [g.uuid for g in m.gpus] == [gpus[0].uuid, gpus[2].uuid]
    assert [g.physical_index for g in m.gpus] == [1, 0]  # NVML's numbers for those GPUs
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in m.numbering and m.topology.links[0][1] == "SYS"


def test_mixed_models_ask_cuda_in_a_child(box):
    """FASTEST_FIRST may put the 4090 (higher bus) first: NVML cannot tell, so a CUDA child process is asked."""
    fastest_first = [MIXED[1].uuid, MIXED[0].uuid]
    fake = box(MIXED, child=fastest_first)
    m, report = probe_report()
    assert [g.name for g in m.gpus] == ["NVIDIA GeForce RTX 4090", "NVIDIA GeForce RTX 3060"]
    assert [g.physical_index for g in m.gpus] == [1, 0]
    assert fake.child_calls == [False]  # peer access still comes from NVML
    assert "asked of CUDA in a child process" in report and "GPU0 [nvidia-smi GPU1]" in report

    # Index 1 is the 3060 in CUDA's order; by PCI order it would be the 4090. CUDA's answer wins.
    fake = box(MIXED, child=[MIXED[0].uuid], env="1", cuda_count=1)
    m, _ = probe_report()
    assert [g.name for g in m.gpus] == ["NVIDIA GeForce RTX 3060"] and fake.child_calls == [False]

    fake = box(MIXED, child=None)  # child failed: PCI order, said to be an assumption
    m, report = probe_report()
    assert [g.physical_index for g in m.gpus] == [0, 1]
    assert "PCI bus order, assumed" in report and fake.child_calls == [False]

    fake = box(MIXED, order="PCI_BUS_ID")  # certain without CUDA
    m, _ = probe_report()
    assert [g.physical_index for g in m.gpus] == [0, 1] and fake.child_calls == []


def test_cuda_count_disagreeing_with_nvml_asks_cuda(box):
    gpus = BOXES["4xA100 bridged pairs"]
    fake = box(gpus, env="3,1", cuda_count=1, child=[gpus[3].uuid])
    m, _ = probe_report()
    assert fake.child_calls == [False] and [g.physical_index for g in m.gpus] == [3]


def test_cpu_torch_on_a_gpu_box(box):
    box(BOXES["2xH200 NVSwitch"], cuda_count=0)
    m, report = probe_report()
    assert m.gpu_count == 2 and m.backend == "gloo" and m.topology.nvlinks(0, 1) == 18
    assert any("torch cannot use them" in n for n in m.notes)


def test_no_driver_says_so_plainly(box, monkeypatch):
    box([], cuda_count=0, init_error=12)  # libnvidia-ml.so.1 missing: NVMLError_LibraryNotFound
    m, report = probe_report()
    assert m.gpus == [] and m.notes == [] and m.source == "none"
    assert hardware.NO_GPU in report and "not found" not in report and "note:" not in report

    monkeypatch.setitem(sys.modules, "pynvml", None)  # nvidia-ml-py not installed, no nvidia-smi either
    m, report = probe_report()
    assert hardware.NO_GPU in report and m.notes == []


def test_driver_not_loaded_is_a_note(box):
    box([], cuda_count=0, init_error=9)
    m, report = probe_report()
    assert hardware.NO_GPU in report
    assert not any("Driver Not Loaded" in n for n in m.notes)  # no GPU seen anywhere: nothing to explain
    # ... but when torch sees a GPU, why NVML failed is said beside it
    box([], cuda_count=1, init_error=9, child=["GPU-12345678-aaaa-bbbb-cccc-1234567890ab"])
    m, report = probe_report()
    assert any("Driver Not Loaded" in n for n in m.notes)


# ------------------------------------------------------------------------------------ nvidia-smi fallback


@pytest.mark.parametrize(
    "name, n, pair, nvlinks, code",
    [
        ("captured_2gpu_h200_nvlink.txt", 2, (0, 1), 18, "NV18"),
        ("2gpu_nvlink.txt", 2, (0, 1), 18, "NV18"),
        ("2gpu_pcie.txt", 2, (0, 1), 0, "SYS"),
        ("captured_4gpu_h200_nvlink.txt", 4, (1, 3), 18, "NV18"),
        ("4gpu_nvlink.txt", 4, (1, 3), 4, "NV4"),
        ("4gpu_pcie.txt", 4, (2, 3), 0, "PXB"),
        ("8gpu_nvlink.txt", 8, (0, 7), 18, "NV18"),
        ("8gpu_pcie.txt", 8, (0, 5), 0, "SYS"),
    ],
)
def test_parse_topo_captures(name, n, pair, nvlinks, code):
    topo = parse_topo_matrix((TOPO / name).read_text())
    assert topo.gpus == [f"GPU{i}" for i in range(n)]
    assert len(topo.links) == n and all(len(r) == n for r in topo.links)
    i, j = pair
    assert topo.links[i][j] == code
    assert topo.nvlinks(i, j) == nvlinks == topo.nvlinks(j, i)
    assert all(topo.links[k][k] == "X" and topo.nvlinks(k, k) == 0 for k in range(n))
    # NIC columns/rows in the 8-GPU capture must not leak into the GPU matrix.
    assert not any(c.startswith("NIC") or "-" in c for row in topo.links for c in row)


def test_parse_topo_pcie_layout_details():
    topo = parse_topo_matrix((TOPO / "4gpu_pcie.txt").read_text())
    assert topo.links[0][1] == "PIX" and topo.describe(0, 1) == "PCIe, one switch"
    assert topo.describe(0, 2).startswith("PCIe across NUMA")
    nv = parse_topo_matrix((TOPO / "8gpu_nvlink.txt").read_text())
    assert nv.describe(3, 4) == "NVLink x18"
    sub = topo.select([3, 0])
    assert sub.gpus == ["GPU0", "GPU1"] and sub.links == [["X", topo.links[3][0]], [topo.links[0][3], "X"]]


def test_parse_topo_rejects_garbage():
    with pytest.raises(ValueError, match="no GPU header"):
        parse_topo_matrix("No devices were found\n")
    truncated = "\n".join((TOPO / "4gpu_nvlink.txt").read_text().splitlines()[:3])
    with pytest.raises(ValueError, match="GPU rows"):
        parse_topo_matrix(truncated)


def test_parse_topo_ignores_ansi_colour():
    text = (TOPO / "2gpu_nvlink.txt").read_text().replace("GPU0\tGPU1", "\x1b[4mGPU0\x1b[0m\t\x1b[4mGPU1\x1b[0m", 1)
    assert parse_topo_matrix(text).nvlinks(0, 1) == 18


def _smi_query(n: int, name="NVIDIA A100-SXM4-80GB", gen="4") -> str:
    return "".join(f"{i}, GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}, 00000000:{0x10 * (i + 1):02X}:00.0, {name}, "
                   f"81920, 8.0, {gen}, 16\n" for i in range(n))


def test_parse_gpu_query_and_pcie_limit():
    text = ("0, GPU-aa, 00000000:18:00.0, NVIDIA H100 80GB HBM3, 81559, 9.0, 5, 16\n"
            "1, GPU-bb, 00000000:3B:00.0, Tesla T4, 15360, 7.5, [N/A], [N/A]\n")
    a, b = parse_gpu_query(text)
    assert (a.index, a.name, a.compute_capability, a.uuid, a.pci_bus_id) == (
        0, "NVIDIA H100 80GB HBM3", "9.0", "GPU-aa", "0000:18:00.0")
    assert (a.pcie_gen, a.pcie_width) == (5, 16)
    assert a.memory_gib == pytest.approx(79.6, abs=0.1)
    assert a.pcie_gbps == pytest.approx(63.0, abs=0.1)  # PCI-SIG: gen5 x16, 128b/130b
    assert b.pcie_gen is None and b.pcie_gbps is None and b.physical_index == 1
    assert GPUInfo(0, "x", pcie_gen=3, pcie_width=8).pcie_gbps == pytest.approx(7.9, abs=0.1)
    assert parse_gpu_query("0, NVIDIA H100, 81559, 9.0, 5, 16\n") == []  # wrong column count: skipped


def test_choose_backend():
    assert choose_backend(0, True)[0] == "gloo"
    assert choose_backend(2, True)[0] == "nccl"
    assert choose_backend(1, True, nproc=2)[0] == "gloo"
    assert choose_backend(4, False)[0] == "gloo"
    assert "no NCCL" in choose_backend(4, False)[1]


def _smi_box(box, monkeypatch, query, topo, **kw):
    """No nvidia-ml-py; nvidia-smi answers with canned text."""
    fake = box([], **kw)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    answers = {"--query-gpu=" + ",".join(smi_text.QUERY_FIELDS): query,
               "--query-gpu=driver_version": "550.54.15\n" * 4, "topo": topo}
    monkeypatch.setattr(smi_text.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(smi_text, "run", lambda cmd, timeout=20: answers[cmd[1]])
    return fake


def test_smi_fallback_four_gpu_box_with_cpu_torch(box, monkeypatch):
    """The whole probe on canned nvidia-smi answers: links and PCIe appear; a CPU torch is flagged."""
    _smi_box(box, monkeypatch, _smi_query(4), (TOPO / "4gpu_nvlink.txt").read_text(), cuda_count=0)
    m, report = probe_report()
    assert m.source == "nvidia-smi" and m.gpu_count == 4 and m.driver == "550.54.15"
    assert "GPU1-GPU3: NVLink x4" in report and "PCIe gen4 x16" in report
    assert m.backend == "gloo" and any("torch cannot use them" in n for n in m.notes)
    assert any("nvidia-ml-py (pynvml) is not installed" in n for n in m.notes)


def test_smi_fallback_maps_visible_devices_through_cuda(box, monkeypatch):
    """Without NVML, CUDA's own UUID list (from the child) decides which nvidia-smi rows are ours."""
    uuids = [f"GPU-{i:08x}-aaaa-bbbb-cccc-{i:012x}" for i in range(4)]
    fake = _smi_box(box, monkeypatch, _smi_query(4), (TOPO / "4gpu_nvlink.txt").read_text(),
                    env="3,1", cuda_count=2, child=[uuids[3], uuids[1]])
    m, report = probe_report()
    assert [g.physical_index for g in m.gpus] == [3, 1] and fake.child_calls == [True]
    assert m.topology.links[0][1] == "NV4" and "GPU0 [nvidia-smi GPU3]" in report


def test_smi_installed_but_broken(box, monkeypatch):
    box([], cuda_count=0)
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(smi_text.shutil, "which", lambda name: "/usr/bin/nvidia-smi")
    monkeypatch.setattr(smi_text, "run", lambda cmd, timeout=20: None)
    m, report = probe_report()
    assert hardware.NO_GPU in report and any("did not answer" in n for n in m.notes)


# ------------------------------------------------------------------------------------------- this machine


def test_doctor_reports_this_machine(capsys):
    import torch

    hardware.probe.cache_clear()
    m = hardware.doctor()
    out = capsys.readouterr().out
    assert f"torch {torch.__version__}" in out
    assert m.torch == torch.__version__
    assert m.cpu_cores >= 1 and m.cpu_cores_usable >= 1
    assert m.backend in {"gloo", "nccl"}
    assert f"Backend for 2 ranks: {m.backend}" in out
    if torch.cuda.is_available():
        assert m.gpu_count == torch.cuda.device_count()
        assert all(f"GPU{g.index}" in out and g.name in out for g in m.gpus)
    elif not m.gpus_on_machine:
        assert m.gpus == [] and hardware.NO_GPU in out and "note:" not in out


def test_doctor_does_not_initialise_cuda():
    """Checked in a fresh interpreter: other tests in this worker may have initialised CUDA already."""
    code = "import torch, course_utils as cu; cu.doctor(); print('initialised:', torch.cuda.is_initialized())"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "initialised: False"


# ------------------------------------------------------------------------------------------------ on a GPU

_COMPARE = textwrap.dedent("""
    import json, torch
    from course_utils.hardware import probe, nvml
    m = probe()
    out = {"initialised_after_probe": torch.cuda.is_initialized(), "source": m.source,
           "gpus": [[g.name, g.uuid, g.memory_gib, g.compute_capability] for g in m.gpus],
           "links": m.topology.links if m.topology else None, "peer": m.peer_access, "notes": m.notes}
    n = torch.cuda.device_count()
    props = [torch.cuda.get_device_properties(i) for i in range(n)]
    out["torch"] = [[p.name, "GPU-" + str(p.uuid), p.total_memory / 2**30, f"{p.major}.{p.minor}"] for p in props]
    out["torch_peer"] = {f"{i}->{j}": torch.cuda.can_device_access_peer(i, j)
                         for i in range(n) for j in range(n) if i != j}
    out["all_uuids"] = [g.uuid for g in nvml.read_nvml().gpus]
    print(json.dumps(out))
""")


def _compare_in_child(env_changes: dict) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    env.update(env_changes)
    res = subprocess.run([sys.executable, "-c", _COMPARE], capture_output=True, text=True, timeout=300, env=env,
                         cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["initialised_after_probe"] is False
    assert out["source"] == "nvml", out["notes"]  # nvidia-ml-py is a runtime dependency
    assert len(out["gpus"]) == len(out["torch"]), out
    for (name, uuid, mem, cc), (t_name, t_uuid, t_mem, t_cc) in zip(out["gpus"], out["torch"], strict=True):
        assert (name, uuid, cc) == (t_name, t_uuid, t_cc)
        assert mem == pytest.approx(t_mem, rel=0.03)  # NVML's total includes memory the driver reserves
    return out


@pytest.mark.gpu
def test_nvml_matches_torch_on_this_gpu_box():
    """NVML's GPUs, in CUDA's numbering, are torch's GPUs: names, UUIDs, memory, compute capability."""
    out = _compare_in_child({})
    uuids = out["all_uuids"]
    last = _compare_in_child({"CUDA_VISIBLE_DEVICES": str(len(uuids) - 1)})
    assert [g[1] for g in last["gpus"]] == [uuids[-1]]
    by_uuid = _compare_in_child({"CUDA_VISIBLE_DEVICES": uuids[-1][:12]})  # a UUID prefix
    assert [g[1] for g in by_uuid["gpus"]] == [uuids[-1]]


@pytest.mark.multigpu
def test_nvml_matches_torch_with_reordered_gpus_and_peer_access():
    """Reordered CUDA_VISIBLE_DEVICES, PCI_BUS_ID order, NVML's peer access against CUDA's, NVML's links
    against nvidia-smi topo -m."""
    out = _compare_in_child({})
    assert out["peer"] == out["torch_peer"]
    uuids = out["all_uuids"]
    rev = _compare_in_child({"CUDA_VISIBLE_DEVICES": "1,0"})
    assert [g[1] for g in rev["gpus"]] == [uuids[1], uuids[0]] or rev["gpus"][0][0] != rev["gpus"][1][0]
    assert rev["peer"] == rev["torch_peer"]
    _compare_in_child({"CUDA_VISIBLE_DEVICES": "1,0", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    _compare_in_child({"CUDA_VISIBLE_DEVICES": f"{uuids[-1]},{uuids[0]}"})
    smi = smi_text.run(["nvidia-smi", "topo", "-m"])
    if smi and len(set(g[0] for g in out["gpus"])) == 1:  # one model: CUDA's order is nvidia-smi's
        assert out["links"] == parse_topo_matrix(smi).links
