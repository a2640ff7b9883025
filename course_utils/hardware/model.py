"""The facts `probe()` gathers, as plain dataclasses: GPUs, the links between them, the whole machine."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

# Usable one-direction bandwidth per PCIe lane in GB/s, after line encoding (PCI-SIG specifications):
# gen1/2 use 8b/10b, gen3-5 128b/130b, gen6 PAM4 with FLIT mode (~242/256).
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}

# What nvidia-smi topo -m's codes mean (NVML's topology levels map onto the same codes).
LINK_WORDS = {
    "PIX": "PCIe, one switch",
    "PXB": "PCIe, several switches",
    "PHB": "PCIe via host bridge",
    "NODE": "PCIe via host bridges in one NUMA node",
    "SYS": "PCIe across NUMA nodes (CPU interconnect)",
    "?": "link unknown",
}


@dataclass
class GPUInfo:
    """One GPU. `index` is CUDA's number for it in this process (what `cuda:<index>` means here);
    `physical_index` is NVML's / nvidia-smi's number, which ignores CUDA_VISIBLE_DEVICES."""

    index: int
    name: str
    memory_gib: float | None = None
    compute_capability: str | None = None
    pcie_gen: int | None = None  # the most the GPU and its slot allow (the link idles at a lower generation)
    pcie_width: int | None = None
    uuid: str | None = None  # "GPU-xxxxxxxx-..." as NVML and CUDA_VISIBLE_DEVICES write it
    pci_bus_id: str | None = None  # "0000:18:00.0"
    physical_index: int | None = None

    @property
    def pcie_gbps(self) -> float | None:
        """Theoretical one-direction host<->GPU bandwidth in GB/s, from PCIe generation and width."""
        if self.pcie_gen in PCIE_LANE_GBPS and self.pcie_width:
            return round(PCIE_LANE_GBPS[self.pcie_gen] * self.pcie_width, 1)
        return None


@dataclass
class Topology:
    """How GPUs are connected, in the codes `nvidia-smi topo -m` uses.

    `links[i][j]` is 'X' (self), 'NV<n>' (n bonded NVLinks), 'PIX', 'PXB', 'PHB', 'NODE', 'SYS', or '?'.
    """

    gpus: list[str] = field(default_factory=list)
    links: list[list[str]] = field(default_factory=list)

    def nvlinks(self, i: int, j: int) -> int:
        """Number of NVLinks between GPU i and GPU j (0 when they talk over PCIe or are the same GPU)."""
        m = re.fullmatch(r"NV(\d+)", self.links[i][j])
        return int(m.group(1)) if m else 0

    def describe(self, i: int, j: int) -> str:
        """The link between GPU i and GPU j in words."""
        code = self.links[i][j]
        if code.startswith("NV"):
            return f"NVLink x{self.nvlinks(i, j)}"
        return LINK_WORDS.get(code, code)

    def select(self, order: list[int]) -> Topology:
        """The sub-matrix for the GPUs at rows `order` (physical indices), renumbered 0..len(order)-1."""
        return Topology(gpus=[f"GPU{k}" for k in range(len(order))],
                        links=[[self.links[a][b] for b in order] for a in order])


@dataclass
class Machine:
    """Everything `doctor()` reports, as data. GPU numbers are CUDA's numbers in this process."""

    gpus: list[GPUInfo]
    topology: Topology | None
    peer_access: dict[str, bool] | None  # "i->j": can GPU i read/write GPU j's memory directly
    cpu_cores: int
    cpu_cores_usable: int
    python: str
    torch: str | None
    cuda: str | None
    nccl: str | None
    driver: str | None
    backend: str
    backend_reason: str
    notes: list[str] = field(default_factory=list)
    source: str = "none"  # where the GPU facts came from: "nvml", "nvidia-smi", "CUDA" (a child process) or "none"
    numbering: str | None = None  # how CUDA's GPU numbers here relate to the physical GPUs, and why
    gpus_on_machine: int = 0  # all NVIDIA GPUs NVML / nvidia-smi see, visible to CUDA here or not

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)
