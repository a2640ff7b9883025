"""GPU facts through NVML (`import pynvml`, from the nvidia-ml-py package): the driver's own view,
read without creating a CUDA context.

NVML numbers GPUs its own way and ignores CUDA_VISIBLE_DEVICES; `visible.py` maps its GPUs to CUDA's
numbers. Every pair's link is read here in nvidia-smi topo -m's codes, so both sources look alike.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from .model import GPUInfo, Topology
from .smi_text import normalise_bus_id

# NVML's nvmlGpuTopologyLevel_t -> nvidia-smi topo -m's code for the same path.
TOPOLOGY_CODES = {0: "PIX", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}
# nvmlGpuP2PCapsIndex_t. Written out because pynvml's NVML_P2P_CAPS_INDEX_READ is `0,` (a tuple: a
# stray comma in nvidia-ml-py), which ctypes refuses as an argument.
P2P_READ, P2P_WRITE, P2P_STATUS_OK = 0, 1, 0
NVLINK_GPU, NVLINK_SWITCH = 0, 2  # nvmlNvLinkDeviceType_t


class NvmlUnavailable(Exception):
    """NVML cannot be used here. `no_driver` is True when there is no NVIDIA driver at all."""

    def __init__(self, reason: str, no_driver: bool = False):
        super().__init__(reason)
        self.no_driver = no_driver


@dataclass
class NvmlFacts:
    gpus: list[GPUInfo]  # in NVML's order; index = physical_index = NVML's number
    topology: Topology | None  # physical numbering; None for fewer than 2 GPUs
    peer: dict[tuple[int, int], bool | None]  # (a, b) physical -> can a reach b's memory (read and write)
    driver: str | None
    notes: list[str]


def _bus(pci: Any) -> str | None:
    """The normalised bus id in an nvmlPciInfo_t (busIdLegacy on old nvidia-ml-py versions)."""
    return normalise_bus_id(getattr(pci, "busId", None) or getattr(pci, "busIdLegacy", None))


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def read_nvml() -> NvmlFacts:
    """Every GPU NVML sees, their links and peer access. Raises NvmlUnavailable when NVML cannot start."""
    try:
        import pynvml
    except ImportError as exc:
        raise NvmlUnavailable("nvidia-ml-py (pynvml) is not installed") from exc
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        no_driver = isinstance(exc, getattr(pynvml, "NVMLError_LibraryNotFound", ()))
        raise NvmlUnavailable(f"NVML did not start: {exc}", no_driver=no_driver) from exc
    try:
        return _read(pynvml)
    except pynvml.NVMLError as exc:  # a failure in the basics (count, handles): fall back to nvidia-smi
        raise NvmlUnavailable(f"NVML failed: {exc}") from exc
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass


def _read(nv) -> NvmlFacts:
    notes: list[str] = []
    handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]

    def ask(fn: str, *args, default=None):
        """One optional fact, or `default`: NVML says NOT_SUPPORTED for many facts on some GPUs or
        drivers, and an older nvidia-ml-py may lack the function."""
        try:
            return getattr(nv, fn)(*args)
        except Exception:  # NVMLError, AttributeError, ctypes.ArgumentError: the fact stays unknown
            return default

    gpus = []
    for i, h in enumerate(handles):
        mem = ask("nvmlDeviceGetMemoryInfo", h)
        cc = ask("nvmlDeviceGetCudaComputeCapability", h)
        pci = ask("nvmlDeviceGetPciInfo", h)
        gpus.append(GPUInfo(
            index=i,
            name=_text(ask("nvmlDeviceGetName", h, default="?")),
            memory_gib=round(mem.total / 2**30, 1) if mem is not None else None,
            compute_capability=f"{cc[0]}.{cc[1]}" if cc else None,
            # Max: the best the GPU and its slot allow. The current link drops to gen1 when the GPU idles.
            pcie_gen=ask("nvmlDeviceGetMaxPcieLinkGeneration", h),
            pcie_width=ask("nvmlDeviceGetMaxPcieLinkWidth", h),
            uuid=_text(ask("nvmlDeviceGetUUID", h, default="")) or None,
            pci_bus_id=_bus(pci),
            physical_index=i,
        ))
    driver = ask("nvmlSystemGetDriverVersion")
    topology = _topology(nv, handles, gpus, ask) if len(gpus) > 1 else None
    peer: dict[tuple[int, int], bool | None] = {}
    for a, ha in enumerate(handles):
        for b, hb in enumerate(handles):
            if a != b:
                r = ask("nvmlDeviceGetP2PStatus", ha, hb, P2P_READ)
                w = ask("nvmlDeviceGetP2PStatus", ha, hb, P2P_WRITE)
                peer[a, b] = None if r is None or w is None else (r == P2P_STATUS_OK and w == P2P_STATUS_OK)
    if any(v is None for v in peer.values()):
        notes.append("NVML could not say whether some GPU pairs have peer access")
    return NvmlFacts(gpus, topology, peer, _text(driver) if driver else None, notes)


def _nvlinks(nv, handles, gpus, ask) -> tuple[list[Counter], list[int]]:
    """For each GPU: NVLinks straight to each other GPU (by bus id), and NVLinks into NVSwitches."""
    bus_ids = {g.pci_bus_id for g in gpus if g.pci_bus_id}
    max_links = getattr(nv, "NVML_NVLINK_MAX_LINKS", 18)
    enabled = getattr(nv, "NVML_FEATURE_ENABLED", 1)
    direct: list[Counter] = []
    to_switch: list[int] = []
    for h in handles:
        peers: Counter = Counter()
        switch = 0
        for link in range(max_links):
            # GPUs without NVLink answer NOT_SUPPORTED, links past the GPU's last INVALID_ARGUMENT.
            if ask("nvmlDeviceGetNvLinkState", h, link) != enabled:
                continue
            remote = ask("nvmlDeviceGetNvLinkRemotePciInfo", h, link)
            bus = _bus(remote)
            kind = ask("nvmlDeviceGetNvLinkRemoteDeviceType", h, link)
            if kind == NVLINK_SWITCH or (kind is None and bus not in bus_ids):
                # Older drivers cannot say what the link leads to: an active link to no GPU NVML shows us
                # (or to a bus it cannot name) goes to an NVSwitch, the only other NVLink peer on x86.
                switch += 1
            elif kind in (None, NVLINK_GPU) and bus in bus_ids:
                peers[bus] += 1
        direct.append(peers)
        to_switch.append(switch)
    return direct, to_switch


def _topology(nv, handles, gpus, ask) -> Topology:
    direct, to_switch = _nvlinks(nv, handles, gpus, ask)
    n = len(gpus)
    links = [["X"] * n for _ in range(n)]
    for a in range(n):
        for b in range(n):
            if a == b:
                continue
            count = max(direct[a][gpus[b].pci_bus_id], direct[b][gpus[a].pci_bus_id])
            if to_switch[a] and to_switch[b]:
                # Through NVSwitches every GPU reaches every other one with all its switch links at once
                # (nvidia-smi topo -m shows NV18 between each pair of an HGX H100).
                count += min(to_switch[a], to_switch[b])
            if count:
                links[a][b] = f"NV{count}"
            else:
                level = ask("nvmlDeviceGetTopologyCommonAncestor", handles[a], handles[b])
                links[a][b] = TOPOLOGY_CODES.get(level, "?")
    return Topology(gpus=[f"GPU{k}" for k in range(n)], links=links)
