"""Regenerate the reference recordings by executing the lesson notebooks themselves on a GPU.

Run on a GPU machine from the repository root:   python benchmarks/record_references.py [NOTEBOOK_STEM ...]
Each notebook's `reference.Recorder(stem).take(key, measure)` calls measure live and, with
COURSE_RECORD_DIR set (this script sets it), store what they measured. The recordings land in
course_utils/reference_data/<stem>.json with their provenance, so the numbers a CPU learner sees come
from the very cells they read. Default: every notebook that makes a recording.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from course_utils import reference  # noqa: E402


def recording_notebooks() -> list[Path]:
    """Notebooks that take reference measurements (they construct a Recorder)."""
    return [p for p in sorted((ROOT / "notebooks").glob("*.ipynb")) if "Recorder(" in p.read_text()]


def execute(notebook: Path, record_dir: Path, timeout: int) -> None:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(notebook, as_version=4)
    os.environ[reference.RECORD_ENV] = str(record_dir)  # inherited by the kernel
    try:
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(notebook.parent)}}).execute()
    finally:
        os.environ.pop(reference.RECORD_ENV, None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("names", nargs="*", help="notebook stems to record (default: all that record)")
    parser.add_argument("--out", type=Path, default=reference.DATA_DIR, help="where to write the JSON files")
    parser.add_argument("--cell-timeout", type=int, default=600)
    parser.add_argument("--keep-partial", action="store_true",
                        help="when a notebook fails or is stopped, keep the keys it recorded before that")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("record_references: needs a CUDA GPU; this machine has none", file=sys.stderr)
        return 2
    notebooks = {p.stem: p for p in recording_notebooks()}
    unknown = set(args.names) - set(notebooks)
    if unknown:
        print(f"unknown notebooks {sorted(unknown)}; these record: {sorted(notebooks)}", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    failed = []
    for stem in args.names or sorted(notebooks):
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as tmp:
            try:
                execute(notebooks[stem], Path(tmp), args.cell_timeout)
            except Exception as err:  # keep going: one broken notebook should not cost the others' recordings
                print(f"FAILED {stem}: {type(err).__name__}: {str(err)[-2000:]}", file=sys.stderr)
                failed.append(stem)
                partial = Path(tmp) / f"{stem}.json"
                if args.keep_partial and partial.exists():  # what it measured before it stopped, each key whole
                    shutil.copy(partial, args.out / partial.name)
                    print(f"kept the partial recording of {stem}: {args.out / partial.name}", file=sys.stderr)
                continue
            made = Path(tmp) / f"{stem}.json"
            if not made.exists():
                print(f"FAILED {stem}: it ran but recorded nothing (no Recorder({stem!r}).take call?)",
                      file=sys.stderr)
                failed.append(stem)
                continue
            shutil.copy(made, args.out / made.name)
        print(f"recorded {stem} -> {args.out / (stem + '.json')} ({time.perf_counter() - t0:.1f} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
