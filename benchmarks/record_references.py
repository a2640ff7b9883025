"""Regenerate the reference recordings shown by the lessons on machines without CUDA.

Run on a GPU machine from the repository root:   python benchmarks/record_references.py [NAME ...]
Each module below defines RECORDINGS = {name: function}; each function measures on the GPU and returns
JSON-serialisable data, saved with provenance to course_utils/reference_data/NAME.json.
"""

from __future__ import annotations

import argparse
import importlib
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from course_utils import reference  # noqa: E402

# One module per lesson idea; each exposes RECORDINGS.
MODULES = [
    "course_utils.host_device",
    "course_utils.streams",
    "course_utils.events",
    "course_utils.copies",
]


def all_recorders() -> dict:
    recorders = {}
    for name in MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name == name:  # lesson module not written yet
                continue
            raise
        recorders.update(getattr(module, "RECORDINGS", {}))
    return recorders


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="recordings to make (default: all)")
    parser.add_argument("--out", type=Path, default=reference.DATA_DIR, help="where to write the JSON files")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("record_references: needs a CUDA GPU; this machine has none", file=sys.stderr)
        return 2
    recorders = all_recorders()
    unknown = set(args.names) - set(recorders)
    if unknown:
        print(f"unknown recordings {sorted(unknown)}; known: {sorted(recorders)}", file=sys.stderr)
        return 2
    for name in args.names or sorted(recorders):
        t0 = time.perf_counter()
        path = reference.save(name, recorders[name](), directory=args.out)
        print(f"recorded {name} -> {path} ({time.perf_counter() - t0:.1f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
