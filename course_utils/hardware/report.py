"""`probe()` gathers the machine's facts from NVML (else nvidia-smi, else a CUDA child process) and
torch; `doctor()` prints them. Neither initialises CUDA in the calling process."""

from __future__ import annotations

import functools
import os
import platform
from typing import NamedTuple

from .cuda_child import cuda_facts
from .model import GPUInfo, Machine, Topology
from .nvml import NvmlUnavailable, read_nvml
from .smi_text import read_smi
from .visible import Visible, order_by_uuids, select_visible

SOURCE_NAMES = {"nvml": "NVML", "nvidia-smi": "nvidia-smi", "CUDA": "CUDA", "none": "nothing"}
NO_GPU = ("No NVIDIA GPU on this machine: the course runs on the CPU (gloo) and shows GPU measurements "
          "from reference recordings.")


def choose_backend(gpu_count: int, nccl_available: bool, nproc: int = 2) -> tuple[str, str]:
    """The process-group backend the course uses for `nproc` ranks, and why."""
    if gpu_count >= nproc and nccl_available:
        return "nccl", f"{gpu_count} GPU(s) and NCCL: one rank per GPU for up to {gpu_count} ranks"
    if gpu_count == 0:
        return "gloo", "no CUDA GPU: ranks run on the CPU with gloo"
    if not nccl_available:
        return "gloo", "this torch build has no NCCL: ranks use gloo on the CPU"
    return "gloo", f"{gpu_count} GPU(s) for {nproc} ranks: NCCL needs one GPU per rank, so gloo on the CPU"


def _torch_facts(notes: list[str]) -> tuple[str | None, str | None, int, bool, str | None]:
    """torch's version, CUDA version, visible GPU count, NCCL availability and version.

    `device_count()` asks the CUDA driver for a count; it creates no context and leaves
    `torch.cuda.is_initialized()` False.
    """
    try:
        import torch
        import torch.distributed as dist

        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        nccl_ok = dist.is_available() and dist.is_nccl_available()
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if nccl_ok and count else None
        return torch.__version__, torch.version.cuda, count, nccl_ok, nccl
    except Exception as exc:  # torch missing or broken: still report the rest
        notes.append(f"torch could not be imported ({exc})")
        return None, None, 0, False, None


class _Physical(NamedTuple):
    """The machine's GPUs as the driver numbers them, and where the facts came from."""

    gpus: list[GPUInfo]
    topology: Topology | None
    nvml_peer: dict[tuple[int, int], bool | None] | None
    driver: str | None
    source: str  # a key of SOURCE_NAMES


def _physical_gpus(notes: list[str], cuda_count: int) -> _Physical:
    """Every GPU on the machine, from NVML, else from nvidia-smi (`_Physical([], ...)` when neither has any)."""
    try:
        facts = read_nvml()
        found = _Physical(facts.gpus, facts.topology, facts.peer, facts.driver, "nvml")
        notes += facts.notes
        return found
    except NvmlUnavailable as exc:
        # No driver library at all is the ordinary CPU machine, not a problem worth a note.
        nvml_problem = None if exc.no_driver else str(exc)
    except Exception as exc:  # never let a broken binding stop the report
        nvml_problem = f"NVML failed unexpectedly ({type(exc).__name__}: {exc})"
    found = _Physical([], None, None, None, "none")
    smi = read_smi()  # None when nvidia-smi is not installed
    if smi is not None:
        notes += smi.notes
        if smi.gpus:
            found = _Physical(smi.gpus, smi.topology, None, smi.driver, "nvidia-smi")
    if nvml_problem and (found.gpus or cuda_count):
        notes.append(f"{nvml_problem}; GPU facts from {'nvidia-smi' if found.gpus else 'CUDA'} instead")
    return found


def _ask_cuda(physical: _Physical, visible: Visible | None, cuda_count: int, notes: list[str]) -> dict | None:
    """CUDA's own facts, from a child process, only when NVML cannot settle them: CUDA's order is uncertain,
    the counts disagree, or there is no NVML to say which pairs have peer access."""
    peer_from_child = physical.source != "nvml" and cuda_count > 1
    child = None
    if cuda_count and (not physical.gpus or not visible.certain or len(visible.gpus) != cuda_count
                       or peer_from_child):
        child = cuda_facts(peer=peer_from_child)
        if child is None:
            notes.append("CUDA is visible but a child process could not query it")
    return child


def _visible_gpus(physical: _Physical, cuda_count: int, env: str | None,
                  notes: list[str]) -> tuple[list[GPUInfo], str | None, str, dict | None]:
    """The GPUs this process may use, numbered as CUDA numbers them: (the GPUs, how the numbers were worked
    out, where the facts came from, CUDA's facts from a child process or None)."""
    source = physical.source
    visible = select_visible(physical.gpus, env, os.environ.get("CUDA_DEVICE_ORDER")) if physical.gpus else None
    gpus = visible.gpus if visible else []
    numbering = visible.numbering if visible else None
    notes += visible.problems if visible else []
    child = _ask_cuda(physical, visible, cuda_count, notes)
    if child is None:
        return gpus, numbering, source, None
    if not physical.gpus:
        notes.append("no NVML and no nvidia-smi: GPU links and PCIe facts unknown")
        return _gpus_from_child(child), "CUDA's numbers", "CUDA", child
    mapped = order_by_uuids(physical.gpus, [g["uuid"] for g in child["gpus"]])
    if mapped is not None:
        return mapped, "CUDA's numbers, asked of CUDA in a child process" + (
            f" (CUDA_VISIBLE_DEVICES={env})" if env is not None else ""), source, child
    if not visible.certain or len(gpus) != cuda_count:
        notes.append(f"could not match CUDA's GPUs to {SOURCE_NAMES[source]}'s by UUID: GPU numbers may differ")
    return gpus, numbering, source, child


def _gpus_from_child(child: dict) -> list[GPUInfo]:
    return [GPUInfo(index=i, name=g["name"], memory_gib=round(g["memory_gib"], 1),
                    compute_capability=g["cc"], uuid=g["uuid"] and f"GPU-{g['uuid']}")
            for i, g in enumerate(child["gpus"])]


def _peer_access(gpus: list[GPUInfo], nvml_peer: dict | None, child: dict | None) -> dict[str, bool] | None:
    """Which pairs of visible GPUs can reach each other's memory, keyed "a->b" in CUDA's numbers."""
    if nvml_peer is not None and len(gpus) > 1:
        return {f"{a.index}->{b.index}": ok for a in gpus for b in gpus if a is not b
                if (ok := nvml_peer.get((a.physical_index, b.physical_index))) is not None}
    if child is not None and child["peer"]:
        return child["peer"]
    return None


def _count_notes(gpus: list[GPUInfo], cuda_count: int, cuda_version: str | None, source: str,
                 env: str | None) -> list[str]:
    """Notes for GPUs the driver's tools see but torch does not (or not as many)."""
    notes = []
    if gpus and cuda_count and len(gpus) != cuda_count:
        notes.append(f"{SOURCE_NAMES[source]} finds {len(gpus)} GPU(s) for CUDA_VISIBLE_DEVICES={env},"
                     f" torch sees {cuda_count}")
    if gpus and not cuda_count:
        why = "this torch is a CPU build" if cuda_version is None else "is the driver older than torch's CUDA?"
        notes.append(f"{SOURCE_NAMES[source]} sees GPUs but torch cannot use them ({why})")
    return notes


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@functools.cache
def probe() -> Machine:
    """Gather the machine's facts (cached for the process). Never raises for a missing tool or GPU."""
    notes: list[str] = []
    torch_version, cuda_version, cuda_count, nccl_ok, nccl = _torch_facts(notes)
    physical = _physical_gpus(notes, cuda_count)
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    gpus, numbering, source, child = _visible_gpus(physical, cuda_count, env, notes)
    peer = _peer_access(gpus, physical.nvml_peer, child)
    notes += _count_notes(gpus, cuda_count, cuda_version, source, env)
    backend, reason = choose_backend(cuda_count, nccl_ok, nproc=2)
    topology = physical.topology
    return Machine(
        gpus=gpus,
        topology=topology.select([g.physical_index for g in gpus]) if topology and len(gpus) > 1 else None,
        peer_access=peer or None,
        cpu_cores=os.cpu_count() or 1,
        cpu_cores_usable=_usable_cores(),
        python=platform.python_version(),
        torch=torch_version,
        cuda=cuda_version,
        nccl=nccl,
        driver=physical.driver,
        backend=backend,
        backend_reason=reason,
        notes=notes,
        source=source,
        numbering=numbering,
        gpus_on_machine=len(physical.gpus) or len(gpus),
    )


def _gpu_line(g: GPUInfo) -> str:
    pcie = f"PCIe gen{g.pcie_gen} x{g.pcie_width} (~{g.pcie_gbps} GB/s each way)" if g.pcie_gbps else "PCIe ?"
    mem = f"{g.memory_gib} GiB" if g.memory_gib else "? GiB"
    phys = f" [nvidia-smi GPU{g.physical_index}]" if g.physical_index not in (None, g.index) else ""
    return f"  GPU{g.index}{phys}: {g.name}, {mem}, compute capability {g.compute_capability or '?'}, {pcie}"


def format_report(m: Machine) -> str:
    """The text `doctor()` prints."""
    out = [f"Python {m.python} | torch {m.torch or 'missing'} | CUDA {m.cuda or 'none (CPU build)'}"
           f" | NCCL {m.nccl or 'n/a'} | driver {m.driver or 'n/a'}",
           f"CPU: {m.cpu_cores} cores ({m.cpu_cores_usable} usable by this process)"]
    if not m.gpus and not m.gpus_on_machine:
        out.append(NO_GPU)
    elif not m.gpus:
        out.append(f"GPUs: none visible here, {m.gpus_on_machine} on the machine (CUDA_VISIBLE_DEVICES="
                   f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r}): the course runs on the CPU (gloo) and shows"
                   " GPU measurements from reference recordings.")
    else:
        of = f" of {m.gpus_on_machine} on the machine" if m.gpus_on_machine > m.gpu_count else ""
        out.append(f"GPUs: {m.gpu_count}{of} (facts from {SOURCE_NAMES.get(m.source, m.source)})")
        out.extend(_gpu_line(g) for g in m.gpus)
        if m.gpus_on_machine > 1 and m.numbering:
            out.append(f"GPU numbering: {m.numbering}")
    if m.gpu_count > 1 and (m.topology or m.peer_access):
        out.append("Links between GPUs:")
        for i in range(m.gpu_count):
            for j in range(i + 1, m.gpu_count):
                link = m.topology.describe(i, j) if m.topology else "link unknown"
                ok = (m.peer_access or {}).get(f"{i}->{j}")
                peer = "" if ok is None else (", peer access" if ok else ", no peer access")
                out.append(f"  GPU{i}-GPU{j}: {link}{peer}")
    out.append(f"Backend for 2 ranks: {m.backend} ({m.backend_reason})")
    out.extend(f"note: {n}" for n in m.notes)
    return "\n".join(out)


def doctor() -> Machine:
    """Print a compact report of this machine and return the same facts as a `Machine`."""
    m = probe()
    print(format_report(m))
    return m
