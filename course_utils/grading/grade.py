"""Grade submissions: each exercise's verdict decided in the grader's process, from plain data.

    python -m course_utils.grade SUBMISSION.ipynb|FOLDER [...] [--master-dir notebooks/] [-j N]
        [--csv scores.csv] [--junit grades.xml] [--executed-dir DIR] [--checks-module MOD_OR_FILE.py ...]
        [--timeout S] [--cell-timeout S] [--max-output N] [--gpus 0,1] [--no-sandbox]

How (see the README's instructor section for why):
1. Each master is read once, into memory. From a submission only the solution regions are taken (what
   stands where the master has `### BEGIN SOLUTION` ... `### END SOLUTION`); everything else comes from
   the master, so edited set-up or check cells, and cells a student added, do not run.
2. For each exercise the grader makes the check's inputs, and a throwaway probe process (a fresh Python in
   bubblewrap: an unprivileged uid in namespaces of its own, nothing of the instructor's mounted, only its
   GPUs' device nodes) runs the master's set-up cells, the solution cells with the submission's regions, and
   the check's `probe`. Its plain-data result comes back as bytes, is decoded without running any code of
   the sender's (and within a size bound), and the check's `judge` decides here. The probe and all it
   started are killed when it answers or times out.
3. --executed-dir runs the whole notebook (master + regions) in a sandboxed kernel, only to hand it back
   as feedback: its outputs never decide anything.
Outcomes: passed; failed (the check's message, the error, or the time limit); skipped (needs a GPU that
this machine lacks; a failure under COURSE_REQUIRE_GPU=1); not attempted (the region is still the stub, or
the solution raised NotImplementedError). On a machine with G GPUs at most one probe of a GPU exercise
runs per GPU at a time; -j N runs N probes (of any submissions) at once, and up to N feedback runs beside them.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .checks_modules import CHECKS_MODULES_ENV
from .grader import GradeError, Grader, Options, visible_gpus  # noqa: F401  (re-exported)
from .report import FAILED, NOT_ATTEMPTED, Grade, format_table, write_csv, write_junit

# ---------------------------------------------------------------------------------------------- one call


def find_master(submission: Path, master_dir: Path) -> Path:
    """The master notebook a submission answers: same file name, else the one master whose stem is in its name."""
    exact = master_dir / submission.name
    if exact.is_file():
        return exact
    masters = sorted(master_dir.glob("*.ipynb"))
    if not masters:
        raise GradeError(f"no master notebooks in {master_dir}/ (use --master-dir)")
    hits = [m for m in masters if m.stem in submission.stem]
    longest = max((len(m.stem) for m in hits), default=0)
    hits = [m for m in hits if len(m.stem) == longest]
    if len(hits) == 1:
        return hits[0]
    names = ", ".join(m.name for m in (hits or masters))
    raise GradeError(f"{submission}: cannot tell which master it answers; name it like one of: {names}")


def _submissions(paths: list[Path]) -> list[Path]:
    found = []
    for p in paths:
        if p.is_dir():
            found += sorted(q for q in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in q.parts)
        elif p.is_file():
            found.append(p)
        else:
            raise GradeError(f"{p}: no such file or folder")
    if not found:
        raise GradeError(f"no notebooks in {', '.join(map(str, paths))}")
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_utils.grade",
        description="Score each exercise of each submission: the master's code with the submission's solutions, "
        "probed in throwaway processes, judged in the grader.",
    )
    parser.add_argument("submissions", nargs="+", type=Path, help="submitted notebooks, or folders of them")
    parser.add_argument("--master-dir", type=Path, default=Path("notebooks"), help="the masters (default notebooks/)")
    parser.add_argument("--master", type=Path, help="grade every submission against this master notebook")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per submission (default 600)")
    parser.add_argument("--cell-timeout", type=float, default=120,
                        help="seconds per exercise probe and per feedback cell (default 120)")
    parser.add_argument("--max-output", type=int, default=1_000_000,
                        help="characters of output kept per cell in the feedback notebooks")
    parser.add_argument("-j", "--jobs", type=int, default=1,
                        help="probes run at once (default 1); GPU exercises: still one per GPU")
    parser.add_argument("--gpus", help="comma-separated GPU ids to use (default: all visible)")
    parser.add_argument("--checks-module", action="append", default=None, metavar="MODULE_OR_FILE",
                        help="also import this module (dotted name or .py file) that registers exercises; "
                        f"repeatable (default: ${CHECKS_MODULES_ENV}, {os.pathsep!r}-separated)")
    parser.add_argument("--csv", type=Path, help="write scores: a row per submission, a column per exercise")
    parser.add_argument("--junit", type=Path, help="write JUnit XML for CI systems")
    parser.add_argument("--executed-dir", type=Path,
                        help="also run each notebook (sandboxed) and keep it here as feedback; verdicts ignore it")
    parser.add_argument("-v", "--verbose", action="store_true", help="show every message in full in the tables")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 unless every exercise passed (or was skipped for want of a GPU): a self-check")
    parser.add_argument("--no-sandbox", action="store_true",
                        help="run students' code without bubblewrap: only for trusted work (your own solutions)")
    args = parser.parse_args(argv)
    modules = args.checks_module
    if modules is None:
        modules = [s for s in os.environ.get(CHECKS_MODULES_ENV, "").split(os.pathsep) if s]
    try:
        subs = _submissions(args.submissions)
        masters = [args.master or find_master(s, args.master_dir) for s in subs]
    except GradeError as e:
        print(f"grade: error: {e}", file=sys.stderr)
        return 2
    options = Options(timeout=args.timeout, cell_timeout=args.cell_timeout, max_cell_output=args.max_output,
                      executed_dir=args.executed_dir, jobs=args.jobs, checks_modules=tuple(modules),
                      gpus=tuple(g for g in args.gpus.split(",") if g) if args.gpus is not None else None,
                      sandbox=not args.no_sandbox)
    grades: list[Grade] = []
    errors: list[str] = []
    try:
        grader = Grader(options)
    except GradeError as e:
        print(f"grade: error: {e}", file=sys.stderr)
        return 2
    with grader:
        for result in grader.grade_all(list(zip(subs, masters, strict=True))):
            if isinstance(result, str):
                errors.append(result)
                print(f"grade: error: {result}", file=sys.stderr)
            else:
                grades.append(result)
                print(format_table(result, verbose=args.verbose), flush=True)
    if len(grades) > 1:
        total = sum(g.total for g in grades)
        print(f"{len(grades)} submissions graded; mean score {round(total / len(grades), 2):g}")
    if args.csv:
        write_csv(grades, args.csv)
    if args.junit:
        write_junit(grades, args.junit)
    if args.strict and any(r.status in (FAILED, NOT_ATTEMPTED) for g in grades for r in g.exercises):
        return 1
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
