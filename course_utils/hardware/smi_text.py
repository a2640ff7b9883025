"""The fallback when NVML cannot be used from Python: nvidia-smi's text output, parsed.

nvidia-smi numbers GPUs as NVML does (its own order, blind to CUDA_VISIBLE_DEVICES); the caller maps
them to CUDA's numbers.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass

from .model import GPUInfo, Topology

QUERY_FIELDS = ("index", "uuid", "pci.bus_id", "name", "memory.total", "compute_cap",
                "pcie.link.gen.max", "pcie.link.width.max")


@dataclass
class SmiFacts:
    gpus: list[GPUInfo]  # index = physical_index = nvidia-smi's number
    topology: Topology | None
    driver: str | None
    notes: list[str]


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


def normalise_bus_id(bus_id: str | bytes | None) -> str | None:
    """'00000000:18:00.0' (NVML, nvidia-smi) or '0000:18:00.0' -> '0000:18:00.0'; None if unreadable."""
    if isinstance(bus_id, bytes):
        bus_id = bus_id.decode(errors="replace")
    m = re.fullmatch(r"\s*([0-9a-fA-F]+):([0-9a-fA-F]+):([0-9a-fA-F]+)\.([0-7])\s*", bus_id or "")
    if not m:
        return None
    domain, bus, dev, fn = (int(x, 16) for x in m.groups())
    return f"{domain:04x}:{bus:02x}:{dev:02x}.{fn}"


def parse_gpu_query(text: str, fields: tuple[str, ...] = QUERY_FIELDS) -> list[GPUInfo]:
    """Parse `nvidia-smi --query-gpu=<fields> --format=csv,noheader,nounits` (memory in MiB)."""

    def num(s: str | None, kind=int):
        try:
            return kind(s.strip()) if s is not None else None
        except ValueError:  # "[N/A]", "[Not Supported]"
            return None

    gpus = []
    for ln in text.strip().splitlines():
        parts = [p.strip() for p in ln.split(",")]
        if len(parts) != len(fields):
            continue
        row = dict(zip(fields, parts, strict=True))
        index = num(row.get("index"))
        if index is None:
            continue
        mem = num(row.get("memory.total"), float)
        cc = row.get("compute_cap", "")
        uuid = row.get("uuid", "")
        gpus.append(
            GPUInfo(
                index=index,
                name=row.get("name", "?"),
                memory_gib=round(mem / 1024, 1) if mem else None,
                compute_capability=cc if re.fullmatch(r"\d+\.\d+", cc) else None,
                pcie_gen=num(row.get("pcie.link.gen.max")),
                pcie_width=num(row.get("pcie.link.width.max")),
                uuid=uuid if uuid.startswith("GPU-") else None,
                pci_bus_id=normalise_bus_id(row.get("pci.bus_id")),
                physical_index=index,
            )
        )
    return gpus


def run(cmd: list[str], timeout: float = 20) -> str | None:
    """stdout of `cmd`, or None when it is missing, fails or hangs."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def read_smi() -> SmiFacts | None:
    """GPUs, links and driver from nvidia-smi; None when nvidia-smi is not installed."""
    if shutil.which("nvidia-smi") is None:
        return None
    notes: list[str] = []
    query = run(["nvidia-smi", f"--query-gpu={','.join(QUERY_FIELDS)}", "--format=csv,noheader,nounits"])
    if query is None:
        notes.append("nvidia-smi is installed but did not answer (is the NVIDIA driver loaded?)")
        return SmiFacts([], None, None, notes)
    gpus = parse_gpu_query(query)
    driver_out = run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    driver = driver_out.strip().splitlines()[0] if driver_out and driver_out.strip() else None
    topology = None
    if len(gpus) > 1:
        topo_out = run(["nvidia-smi", "topo", "-m"])
        if topo_out:
            try:
                topology = parse_topo_matrix(topo_out)
            except ValueError as exc:
                notes.append(f"could not read nvidia-smi topo -m ({exc})")
            if topology is not None and len(topology.gpus) != len(gpus):
                notes.append("nvidia-smi topo -m and --query-gpu disagree on the GPU count; links not shown")
                topology = None
    return SmiFacts(gpus, topology, driver, notes)
