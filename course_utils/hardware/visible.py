"""Which physical GPUs CUDA shows this process, and under which numbers, without initialising CUDA.

CUDA first orders all GPUs (CUDA_DEVICE_ORDER: FASTEST_FIRST by default, or PCI_BUS_ID), then
CUDA_VISIBLE_DEVICES picks from that order: indices into it, or GPU UUIDs (a unique prefix is
enough). CUDA's rules for odd lists, as torch.cuda mirrors them for its NVML-based count: an entry that
is not a valid GPU ends the list (the entries before it stay), a repeated GPU hides every GPU, and an
empty value hides all of them. NVML and nvidia-smi ignore both variables and number GPUs in their own
(PCI bus) order.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from .model import GPUInfo


@dataclass
class Visible:
    """The physical GPUs CUDA shows, in CUDA's order, and how sure that is."""

    gpus: list[GPUInfo]  # index = CUDA's number here; physical_index kept
    numbering: str  # how the numbers were worked out, in words
    certain: bool  # False when CUDA's order had to be assumed
    problems: list[str]


def _strtoul(entry: str) -> int:
    """The integer `entry` starts with, as C's strtoul reads it ('1gpu' -> 1); -1 if none."""
    m = re.match(r"\s*([+-]?\d+)", entry)
    return int(m.group(1)) if m else -1


def parse_visible_devices(value: str | None) -> tuple[list[int] | list[str] | None, list[str]]:
    """CUDA_VISIBLE_DEVICES as CUDA reads it: None (unset: every GPU), a list of indices, or a list of
    UUID prefixes; plus what in it CUDA ignores, in words."""
    if value is None:
        return None, []
    if not value.strip():
        return [], ["CUDA_VISIBLE_DEVICES is empty: CUDA shows no GPU"]
    entries = value.split(",")
    uuid_mode = value.strip().startswith(("GPU-", "MIG-"))
    picked: list = []
    for k, raw in enumerate(entries):
        entry = raw.strip()
        valid = entry.startswith(("GPU-", "MIG-")) if uuid_mode else _strtoul(entry) >= 0
        if not valid:
            rest = ",".join(entries[k:])
            return picked, [f"CUDA_VISIBLE_DEVICES: {entry!r} is not a GPU "
                            f"{'UUID' if uuid_mode else 'index'}, so CUDA ignores {rest!r}"]
        item = entry if uuid_mode else _strtoul(entry)
        if item in picked:
            return [], [f"CUDA_VISIBLE_DEVICES names {entry!r} twice, so CUDA shows no GPU at all"]
        picked.append(item)
    return picked, []


def _bus_key(g: GPUInfo) -> tuple:
    if g.pci_bus_id:
        return tuple(int(x, 16) for x in re.split(r"[:.]", g.pci_bus_id))
    return (1 << 32, g.physical_index or 0)  # unknown bus id: after the known ones, in NVML's order


def cuda_order(gpus: list[GPUInfo], device_order: str | None) -> tuple[list[GPUInfo], str, bool]:
    """All physical GPUs in the order CUDA numbers them before CUDA_VISIBLE_DEVICES picks, the reason,
    and whether it is certain (False: GPUs of different models under FASTEST_FIRST)."""
    by_bus = sorted(gpus, key=_bus_key)
    if (device_order or "").strip().upper() == "PCI_BUS_ID":
        return by_bus, "PCI bus order (CUDA_DEVICE_ORDER=PCI_BUS_ID)", True
    # FASTEST_FIRST, CUDA's default. Assumption (not documented by NVIDIA, seen on every multi-GPU box):
    # GPUs of one model tie on speed and keep PCI bus order, so only mixed models can be reordered.
    if len({(g.name, g.compute_capability) for g in gpus}) <= 1:
        return by_bus, ("PCI bus order (by default CUDA lists the fastest GPU first; GPUs of one model stay"
                        " in bus order)"), True
    return by_bus, ("PCI bus order, assumed: by default CUDA lists the fastest of these different models first,"
                    " so its numbers may differ (CUDA_DEVICE_ORDER=PCI_BUS_ID makes them certain)"), False


def select_visible(gpus: list[GPUInfo], env_value: str | None, device_order: str | None) -> Visible:
    """The GPUs CUDA shows for this CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, numbered as CUDA does."""
    ordered, basis, certain = cuda_order(gpus, device_order)
    picks, problems = parse_visible_devices(env_value)
    numbering = f"CUDA's numbers follow {basis}"
    if picks is None:
        chosen = ordered
    elif picks and isinstance(picks[0], str) and picks[0].startswith("MIG-"):
        return Visible([], "MIG instances are not mapped by this course", True,
                       problems + ["CUDA_VISIBLE_DEVICES names MIG instances; GPU facts are not shown for them"])
    else:
        chosen = []
        for p in picks:
            g = _pick(ordered, p, problems)
            if g is None:
                break  # CUDA stops at the first entry that names no GPU
            if g in chosen:
                problems.append(f"CUDA_VISIBLE_DEVICES names GPU {p!r} twice, so CUDA shows no GPU at all")
                chosen = []
                break
            chosen.append(g)
        numbering = f"CUDA_VISIBLE_DEVICES={env_value} shows {len(chosen)} of {len(gpus)} GPUs, counted in {basis}"
    return Visible([replace(g, index=k) for k, g in enumerate(chosen)], numbering, certain, problems)


def _pick(ordered: list[GPUInfo], entry: int | str, problems: list[str]) -> GPUInfo | None:
    if isinstance(entry, int):
        if entry < len(ordered):
            return ordered[entry]
        problems.append(f"CUDA_VISIBLE_DEVICES: there is no GPU {entry} (this machine has {len(ordered)}),"
                        " so CUDA ignores it and the entries after it")
        return None
    matches = [g for g in ordered if g.uuid and g.uuid.lower().startswith(entry.lower())]
    if len(matches) == 1:
        return matches[0]
    what = "matches several GPUs" if matches else "matches no GPU"
    problems.append(f"CUDA_VISIBLE_DEVICES: {entry!r} {what}, so CUDA ignores it and the entries after it")
    return None


def order_by_uuids(gpus: list[GPUInfo], cuda_uuids: list[str | None]) -> list[GPUInfo] | None:
    """The physical GPUs in the order a CUDA process listed their UUIDs (None if one is not found)."""
    def plain(u: str | None) -> str:
        return (u or "").lower().removeprefix("gpu-")

    by_uuid = {plain(g.uuid): g for g in gpus if g.uuid}
    out = [by_uuid.get(plain(u)) for u in cuda_uuids]
    if any(g is None for g in out):
        return None
    return [replace(g, index=k) for k, g in enumerate(out)]
