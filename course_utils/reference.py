"""Reference recordings: measurements captured on a real GPU, stored as JSON with their provenance.

On a machine without CUDA a lesson shows a recording instead of a live measurement, drawn by the same
plotting code, and labelled with where and when it was recorded. Recordings live in
course_utils/reference_data/NAME.json and are made by benchmarks/record_references.py on a GPU box.
"""

from __future__ import annotations

import datetime as _dt
import json
import platform
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

DATA_DIR = Path(__file__).resolve().parent / "reference_data"


@dataclass
class Recording:
    """One stored measurement: `data` as the live code returns it, and where it came from."""

    name: str
    data: Any
    provenance: dict[str, Any] = field(default_factory=dict)

    def label(self) -> str:
        """One line for a plot title or a notebook: 'recorded on <GPU>, torch <v>, <date>'."""
        p = self.provenance
        return (
            f"recorded on {p.get('gpu', '?')} (driver {p.get('driver', '?')}), "
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


def provenance() -> dict[str, Any]:
    """Facts about the machine this process measures on."""
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none (CPU)"
    return {
        "gpu": gpu,
        "gpu_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "driver": _driver_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "host": platform.node(),
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def save(name: str, data: Any, directory: Path | None = None, **extra: Any) -> Path:
    """Store `data` (JSON-serialisable) as recording `name`, with this machine's provenance."""
    directory = Path(directory) if directory else DATA_DIR
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}.json"
    record = {"name": name, "provenance": {**provenance(), **extra}, "data": data}
    path.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
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
