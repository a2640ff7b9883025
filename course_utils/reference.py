"""Reference recordings: measurements captured on a real GPU, stored as JSON with their provenance.

On a machine without CUDA a lesson shows a recording instead of a live measurement, drawn by the same
plotting code, and labelled with where and when it was recorded. Recordings live in
course_utils/reference_data/NAME.json (NAME: the notebook's stem) and are made by executing the notebooks
themselves on a GPU box (benchmarks/record_references.py), so recorded and live numbers come from the
same cells:

    rec = Recorder("02_cuda_streams")
    sleep = rec.take("sleep", lambda: measure_sleep_kernels())   # live on a GPU, recorded elsewhere
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

RECORD_ENV = "COURSE_RECORD_DIR"  # set by record_references.py: live measurements are saved there

DATA_DIR = Path(__file__).resolve().parent / "reference_data"


@dataclass
class Recording:
    """One stored measurement: `data` as the live code returns it, and where it came from."""

    name: str
    data: Any
    provenance: dict[str, Any] = field(default_factory=dict)

    @property
    def machine(self) -> str:
        """Its GPUs, counted when there were several ('2x NVIDIA H200'): a learner with one H200 must not read a
        two-GPU recording as made on a machine like theirs."""
        gpu, count = self.provenance.get("gpu", "a GPU"), self.provenance.get("gpu_count")
        return f"{count}x {gpu}" if isinstance(count, int) and count > 1 else gpu

    def label(self) -> str:
        """One line for a plot title or a notebook: 'recorded on <GPUs>, torch <v>, <date>'."""
        p = self.provenance
        vm = ", a virtual machine" if p.get("virtual_machine") else ""
        return (
            f"recorded on {self.machine} (driver {p.get('driver', '?')}{vm}), "
            f"torch {p.get('torch', '?')}, CUDA {p.get('cuda', '?')}, {p.get('date', '?')}"
        )


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=10, check=True,
        ).stdout
        return out.strip().splitlines()[0]
    except Exception:
        return "unknown"


def is_virtual_machine() -> bool:
    """True when this host reports a hypervisor (cpuinfo flag or DMI vendor): VM numbers can differ."""
    try:
        if " hypervisor" in Path("/proc/cpuinfo").read_text():
            return True
    except OSError:
        pass
    vendors = ("kvm", "qemu", "vmware", "virtualbox", "xen", "microsoft corporation", "amazon ec2", "google")
    for f in ("sys_vendor", "product_name"):
        try:
            if any(v in Path(f"/sys/class/dmi/id/{f}").read_text().strip().lower() for v in vendors):
                return True
        except OSError:
            pass
    return False


def gpu_name() -> str:
    """GPU 0's name, from NVML where it can say, so the notebook process opens no CUDA context for it (a
    notebook whose ranks own the GPUs should not hold one of them too)."""
    import torch

    if not torch.cuda.is_initialized():
        try:
            from .hardware import probe

            gpus = probe().gpus
            if gpus:
                return gpus[0].name
        except Exception:  # the facts are a label: fall back to asking CUDA
            pass
    return torch.cuda.get_device_name(0)


def provenance() -> dict[str, Any]:
    """Facts about the machine this process measures on."""
    import torch

    cuda = torch.cuda.is_available()
    return {
        "gpu": gpu_name() if cuda else "none (CPU)",
        "gpu_count": torch.cuda.device_count() if cuda else 0,
        "driver": _driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "virtual_machine": is_virtual_machine(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def save(name: str, data: Any, directory: Path | None = None, **extra: Any) -> Path:
    """Store `data` (JSON-serialisable) as recording `name`, with this machine's provenance."""
    directory = Path(directory) if directory else DATA_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    record = {"name": name, "provenance": {**provenance(), **extra}, "data": data}
    tmp = path.with_suffix(".json.tmp")
    # Keys in the order the notebook made them: a recorded table then prints its rows as the live one above it does.
    tmp.write_text(json.dumps(record, indent=1) + "\n")
    os.replace(tmp, path)  # whole or not at all: a recording run may be stopped at any moment
    return path


def available(directory: Path | None = None) -> list[str]:
    directory = Path(directory) if directory else DATA_DIR
    return sorted(p.stem for p in directory.glob("*.json"))


def load(name: str, directory: Path | None = None) -> Recording:
    """Load recording `name`; a missing one is a clear error naming the command that makes it."""
    directory = Path(directory) if directory else DATA_DIR
    path = directory / f"{name}.json"
    if not path.exists():
        raise FileNotFoundError(
            f"no reference recording {name!r} in {directory} (have: {available(directory) or 'none'}). "
            "Make it on a GPU machine with: python benchmarks/record_references.py"
        )
    record = json.loads(path.read_text())
    return Recording(name=record["name"], data=record["data"], provenance=record["provenance"])


class Recorder:
    """One notebook's GPU measurements: live where CUDA is, from its reference recording elsewhere.

    `take(key, measure)` runs `measure()` on a GPU and returns its (JSON-serialisable) result; when the
    notebook is executed by benchmarks/record_references.py (COURSE_RECORD_DIR set), the result is also
    saved under `key` in the recording. Without CUDA it returns the recorded value, or None when the
    recording (or that key) does not exist yet, so a lesson goes on and shows what this machine can.
    Each call prints one line saying where the numbers come from.
    """

    def __init__(self, name: str, live: bool | None = None, directory: Path | None = None, quiet: bool = False):
        if live is None:
            import torch

            live = torch.cuda.is_available()
        self.name, self.live, self.quiet = name, live, quiet
        self.directory = Path(directory) if directory else DATA_DIR
        self._record_dir = os.environ.get(RECORD_ENV) if live else None
        self._taken: dict[str, Any] = {}
        self._stored: Recording | None = None

    @property
    def recording(self) -> Recording | None:
        """The stored recording (None if it is not made yet); loaded once."""
        if self._stored is None and (self.directory / f"{self.name}.json").exists():
            self._stored = load(self.name, self.directory)
        return self._stored

    @property
    def here(self) -> str:
        """Where a verdict's numbers come from, as it should say so: "on this machine" when measured live, else
        "in the recording (<its GPUs>)", so that a learner without a GPU never reads a recorded number as theirs."""
        if self.live:
            return "on this machine"
        rec = self.recording
        return f"in the recording ({rec.machine})" if rec else "in the recording"

    def titled(self, title: str) -> str:
        """A plot's title, marked " [recorded on <its GPUs>]" when its data comes from the recording: a plot is
        often read apart from the line above it that says so."""
        if self.live:
            return title
        rec = self.recording
        return f"{title} [recorded on {rec.machine}]" if rec else f"{title} [recorded]"

    def _say(self, line: str) -> None:
        if not self.quiet:
            print(line)

    def take(self, key: str, measure: Callable[[], Any]) -> Any:
        """Measure `key` live, or return its recorded value (None when there is none yet)."""
        if self.live:

            data = measure()
            try:
                data = json.loads(json.dumps(data))  # what a recording would hold, so live == recorded code paths
            except TypeError as err:
                raise TypeError(f"{self.name}/{key}: a measurement must be JSON data (numbers, str, lists, "
                                f"dicts; spans as Span.to_dict()): {err}") from None
            self._taken[key] = data
            if self._record_dir:
                save(self.name, self._taken, directory=Path(self._record_dir))
            self._say(f"[{key}: measured live on {gpu_name()}]")
            return data
        rec = self.recording
        if rec is None:
            self._say(f"[{key}: no GPU here and no reference recording {self.name!r} yet; not shown. Make it on a "
                      f"GPU: python benchmarks/record_references.py {self.name}]")
            return None
        if key not in rec.data:
            # A learner cannot mend this (a recording may need more GPUs than theirs): say what is missing and why.
            self._say(f"[{key}: not shown: the recording (made on {rec.machine}, {rec.provenance.get('date', '?')}) "
                      f"is older than this cell; the course remakes it with python benchmarks/record_references.py "
                      f"{self.name}]")
            return None
        self._say(f"[{key}: {rec.label()}]")
        return rec.data[key]
