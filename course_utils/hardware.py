"""What this machine is: GPUs, memory, how they are linked, CPU, versions, and the backend to use.

`probe()` gathers the facts once per process and returns a `Machine`; `doctor()` prints a compact report
of it. Missing tools (no nvidia-smi, no GPU, no NCCL) are reported as such and never raise.

The notebook's own process does not initialise CUDA here: GPU facts come from nvidia-smi, and what only
CUDA can tell (peer access) is asked in a short-lived subprocess. A CUDA context in the notebook would
hold GPU memory for the whole session and get in the way of worker processes.
"""

from __future__ import annotations

import functools
import json
import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass, field

# Usable one-direction bandwidth per PCIe lane in GB/s, after line encoding (PCI-SIG specifications):
# gen1/2 use 8b/10b, gen3-5 128b/130b, gen6 PAM4 with FLIT mode (~242/256).
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


@dataclass
class GPUInfo:
    """One GPU as nvidia-smi (or torch) describes it."""

    index: int
    name: str
    memory_gib: float | None = None
    compute_capability: str | None = None
    pcie_gen: int | None = None
    pcie_width: int | None = None

    @property
    def pcie_gbps(self) -> float | None:
        """Theoretical one-direction host<->GPU bandwidth in GB/s, from PCIe generation and width."""
        if self.pcie_gen in PCIE_LANE_GBPS and self.pcie_width:
            return round(PCIE_LANE_GBPS[self.pcie_gen] * self.pcie_width, 1)
        return None


@dataclass
class Topology:
    """How GPUs are connected, as `nvidia-smi topo -m` reports it.

    `links[i][j]` is the raw code: 'X' (self), 'NV<n>' (n bonded NVLinks), 'PIX', 'PXB', 'PHB', 'NODE', 'SYS'.
    """

    gpus: list[str] = field(default_factory=list)
    links: list[list[str]] = field(default_factory=list)

    def nvlinks(self, i: int, j: int) -> int:
        """Number of NVLinks between GPU i and GPU j (0 when they talk over PCIe or are the same GPU)."""
        m = re.fullmatch(r"NV(\d+)", self.links[i][j])
        return int(m.group(1)) if m else 0

    def describe(self, i: int, j: int) -> str:
        code = self.links[i][j]
        if code.startswith("NV"):
            return f"NVLink x{self.nvlinks(i, j)}"
        return {
            "PIX": "PCIe, one switch",
            "PXB": "PCIe, several switches",
            "PHB": "PCIe via host bridge",
            "NODE": "PCIe via host bridges in one NUMA node",
            "SYS": "PCIe across NUMA nodes (CPU interconnect)",
        }.get(code, code)


@dataclass
class Machine:
    """Everything `doctor()` reports, as data."""

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

    @property
    def gpu_count(self) -> int:
        return len(self.gpus)


def parse_topo_matrix(text: str) -> Topology:
    """Parse the GPU-to-GPU part of `nvidia-smi topo -m` output (NIC rows and the legend are ignored)."""
    # ANSI colour codes appear when nvidia-smi writes to a terminal; drop them.
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln).rstrip() for ln in text.splitlines()]
    # The header is the first line whose first cell is GPU0 and that names no link (rows do).
    header_idx = next((k for k, ln in enumerate(lines) if ln.split() and ln.split()[0] == "GPU0"
                       and "X" not in ln.split()), None)
    if header_idx is None:
        raise ValueError("no GPU header line (GPU0 GPU1 ...) found in nvidia-smi topo -m output")
    header = [c.strip() for c in lines[header_idx].split("\t") if c.strip()]
    gpu_cols = [c for c in header if re.fullmatch(r"GPU\d+", c)]
    n = len(gpu_cols)
    links: list[list[str]] = []
    for ln in lines[header_idx + 1 :]:
        cells = [c.strip() for c in ln.split("\t")]
        if not cells or not re.fullmatch(r"GPU\d+", cells[0]):
            if links and (not ln.strip() or ln.strip().startswith("Legend")):
                break
            continue
        row = cells[1 : 1 + n]
        if len(row) < n:
            raise ValueError(f"row {cells[0]} has {len(row)} entries, expected {n}")
        links.append(row)
    if len(links) != n:
        raise ValueError(f"found {len(links)} GPU rows for {n} GPU columns")
    return Topology(gpus=gpu_cols, links=links)


def parse_gpu_query(text: str) -> list[GPUInfo]:
    """Parse `nvidia-smi --query-gpu=index,name,memory.total,compute_cap,pcie.link.gen.max,pcie.link.width.max
    --format=csv,noheader,nounits`."""

    def num(s: str, kind=int):
        s = s.strip()
        try:
            return kind(s)
        except ValueError:  # "[N/A]", "[Not Supported]"
            return None

    gpus = []
    for ln in text.strip().splitlines():
        parts = [p.strip() for p in ln.split(",")]
        if len(parts) < 6:
            continue
        mem = num(parts[2], float)
        gpus.append(
            GPUInfo(
                index=int(parts[0]),
                name=parts[1],
                memory_gib=round(mem / 1024, 1) if mem else None,
                compute_capability=parts[3] if re.fullmatch(r"\d+\.\d+", parts[3]) else None,
                pcie_gen=num(parts[4]),
                pcie_width=num(parts[5]),
            )
        )
    return gpus


def _run(cmd: list[str], timeout: float = 20) -> str | None:
    if shutil.which(cmd[0]) is None:
        return None
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


_PEER_SCRIPT = """
import json, torch
n = torch.cuda.device_count()
props = [torch.cuda.get_device_properties(i) for i in range(n)]
print(json.dumps({
    "peer": {f"{i}->{j}": torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j},
    "gpus": [[p.name, p.total_memory / 2**30, f"{p.major}.{p.minor}"] for p in props],
}))
"""


def _cuda_facts_in_subprocess() -> dict | None:
    """Peer access and device properties, asked in a child so this process keeps no CUDA context."""
    try:
        res = subprocess.run([sys.executable, "-c", _PEER_SCRIPT], capture_output=True, text=True, timeout=120)
        return json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def choose_backend(gpu_count: int, nccl_available: bool, nproc: int = 2) -> tuple[str, str]:
    """The process-group backend the course uses for `nproc` ranks, and why."""
    if gpu_count >= nproc and nccl_available:
        return "nccl", f"{gpu_count} GPU(s) and NCCL: one rank per GPU for up to {gpu_count} ranks"
    if gpu_count == 0:
        return "gloo", "no CUDA GPU: ranks run on the CPU with gloo"
    if not nccl_available:
        return "gloo", "this torch build has no NCCL: ranks use gloo on the CPU"
    return "gloo", f"{gpu_count} GPU(s) for {nproc} ranks: NCCL needs one GPU per rank, so gloo on the CPU"


@functools.cache
def probe() -> Machine:
    """Gather the machine's facts (cached for the process). Never raises for a missing tool or GPU."""
    notes: list[str] = []
    try:
        import torch
        import torch.distributed as dist

        torch_version = torch.__version__
        cuda_version = torch.version.cuda
        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        nccl_ok = dist.is_available() and dist.is_nccl_available()
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if nccl_ok and cuda_count else None
    except Exception as exc:  # torch missing or broken: still report the rest
        torch_version = cuda_version = nccl = None
        cuda_count, nccl_ok = 0, False
        notes.append(f"torch could not be imported ({exc})")

    query = _run(
        [
            "nvidia-smi",
            "--query-gpu=index,name,memory.total,compute_cap,pcie.link.gen.max,pcie.link.width.max",
            "--format=csv,noheader,nounits",
        ]
    )
    gpus = parse_gpu_query(query) if query else []
    driver_out = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    driver = driver_out.strip().splitlines()[0] if driver_out and driver_out.strip() else None
    if query is None:
        notes.append("nvidia-smi not found or not working: GPU links and PCIe facts unknown")

    topology = None
    topo_out = _run(["nvidia-smi", "topo", "-m"]) if len(gpus) > 1 else None
    if topo_out:
        try:
            topology = parse_topo_matrix(topo_out)
        except ValueError as exc:
            notes.append(f"could not read nvidia-smi topo -m ({exc})")

    peer = None
    if cuda_count:
        facts = _cuda_facts_in_subprocess()
        if facts is None:
            notes.append("CUDA is visible but a child process could not query it")
        else:
            peer = facts["peer"] or None
            if not gpus:  # no nvidia-smi: take names and memory from torch
                gpus = [
                    GPUInfo(index=i, name=name, memory_gib=round(mem, 1), compute_capability=cc)
                    for i, (name, mem, cc) in enumerate(facts["gpus"])
                ]
    if gpus and cuda_count and len(gpus) != cuda_count:
        notes.append(f"nvidia-smi lists {len(gpus)} GPUs, torch sees {cuda_count} (CUDA_VISIBLE_DEVICES?)")
        gpus = gpus[:cuda_count] if cuda_count < len(gpus) else gpus
    if gpus and not cuda_count:
        notes.append("nvidia-smi sees GPUs but torch cannot use them (CPU build of torch, or a driver mismatch)")
        gpus_for_backend = 0
    else:
        gpus_for_backend = len(gpus) if cuda_count else 0
    backend, reason = choose_backend(gpus_for_backend, nccl_ok, nproc=2)

    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        usable = os.cpu_count() or 1
    return Machine(
        gpus=gpus,
        topology=topology,
        peer_access=peer,
        cpu_cores=os.cpu_count() or 1,
        cpu_cores_usable=usable,
        python=platform.python_version(),
        torch=torch_version,
        cuda=cuda_version,
        nccl=nccl,
        driver=driver,
        backend=backend,
        backend_reason=reason,
        notes=notes,
    )


def format_report(m: Machine) -> str:
    """The text `doctor()` prints."""
    out = []
    out.append(f"Python {m.python} | torch {m.torch or 'missing'} | CUDA {m.cuda or 'none (CPU build)'}"
               f" | NCCL {m.nccl or 'n/a'} | driver {m.driver or 'n/a'}")
    out.append(f"CPU: {m.cpu_cores} cores ({m.cpu_cores_usable} usable by this process)")
    if not m.gpus:
        out.append("GPUs: none. CUDA demos show reference recordings; multi-rank lessons run on the CPU with gloo.")
    else:
        out.append(f"GPUs: {m.gpu_count}")
        for g in m.gpus:
            pcie = f"PCIe gen{g.pcie_gen} x{g.pcie_width} (~{g.pcie_gbps} GB/s each way)" if g.pcie_gbps else "PCIe ?"
            mem = f"{g.memory_gib} GiB" if g.memory_gib else "? GiB"
            out.append(f"  GPU{g.index}: {g.name}, {mem}, compute capability {g.compute_capability or '?'}, {pcie}")
    if m.topology and m.gpu_count > 1:
        out.append("Links between GPUs:")
        n = len(m.topology.gpus)
        for i in range(n):
            for j in range(i + 1, n):
                peer = ""
                if m.peer_access is not None:
                    ok = m.peer_access.get(f"{i}->{j}")
                    peer = ", peer access" if ok else ", no peer access"
                out.append(f"  GPU{i}-GPU{j}: {m.topology.describe(i, j)}{peer}")
    elif m.gpu_count > 1 and m.peer_access is not None:
        pairs = ", ".join(f"{k}: {'yes' if v else 'no'}" for k, v in m.peer_access.items())
        out.append(f"Peer access: {pairs}")
    out.append(f"Backend for 2 ranks: {m.backend} ({m.backend_reason})")
    out.extend(f"note: {n}" for n in m.notes)
    return "\n".join(out)


def doctor() -> Machine:
    """Print a compact report of this machine and return the same facts as a `Machine`."""
    m = probe()
    print(format_report(m))
    return m
