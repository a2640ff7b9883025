"""Grade submissions by running them: one score per exercise, from the master's check cells.

    python -m course_utils.grade SUBMISSION.ipynb [...] [--master-dir notebooks/] [--csv scores.csv]
                                 [--junit grades.xml] [--timeout S] [--cell-timeout S] [-j N]

Each submission is matched to its master by file name (02_cuda_streams.ipynb, or a name containing the
master's stem such as alice_02_cuda_streams.ipynb). The submission's own check cells are dropped and the
master's are put back after the submission's cells that precede them, so an edited or deleted check earns
nothing. The notebook then runs in a fresh kernel (working directory: the master's folder) with per-cell and
whole-notebook time limits and capped output; every cell runs even after errors. Each exercise is
- passed: its check cell ran without error (and did not report a skip);
- failed: the check raised (its message is kept), or never ran (kernel died, time limit);
- skipped: the check needs a GPU and this machine has none (0 points, reported apart);
- not attempted: a solution cell still raises NotImplementedError (or the check hit one).
Running a submission executes the student's code: grade in a container or a throwaway account.
"""

from __future__ import annotations

import argparse
import copy
import csv
import os
import sys
import xml.etree.ElementTree as ET
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path

import nbformat

from . import release
from ._notebook_exec import run_notebook
from .checks import SKIP_MARKER

PASSED, FAILED, SKIPPED, NOT_ATTEMPTED = "passed", "failed", "skipped", "not attempted"


class GradeError(RuntimeError):
    """The grader cannot grade: no master for a submission, a broken master, a kernel that will not start."""


@dataclass
class ExerciseResult:
    grade_id: str
    points: float
    score: float
    status: str
    message: str = ""


@dataclass
class Grade:
    submission: str
    master: str
    exercises: list[ExerciseResult] = field(default_factory=list)
    seconds: float = 0.0
    stopped: str = ""  # why execution ended early (kernel died, time limit), empty otherwise

    @property
    def total(self) -> float:
        return sum(r.score for r in self.exercises)

    @property
    def max_points(self) -> float:
        return sum(r.points for r in self.exercises)

    @property
    def skipped_points(self) -> float:
        return sum(r.points for r in self.exercises if r.status == SKIPPED)

    def by_id(self) -> dict[str, ExerciseResult]:
        return {r.grade_id: r for r in self.exercises}


# ---------------------------------------------------------------------------------------------- masters


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


def assemble(submission, master, name: str = "master"):
    """The notebook to run: the submission's cells with the master's check cells put back.

    Returns (notebook, exercises, roles) where roles maps a cell index of the returned notebook to
    ("check" | "solution", grade_id). A submission cell keeps its place; a master check cell goes just before
    the first submission cell that comes after it in the master (matched by nbgrader grade_id, else cell id),
    so cells a student added after a solution still run before the check.
    """
    exercises = release.exercises(master, name, require_markers=False)
    check_ids = {ex.grade_id for ex in exercises}
    check_cell_ids = {master.cells[ex.check_index].get("id") for ex in exercises} - {None}
    by_gid, by_id = {}, {}
    for i, cell in enumerate(master.cells):
        gid = release.nbgrader_meta(cell).get("grade_id")
        if gid:
            by_gid[gid] = i
        if cell.get("id"):
            by_id.setdefault(cell["id"], i)
    solution_of = {i: ex.grade_id for ex in exercises for i in ex.solution_indices}

    kept = []
    for cell in submission.cells:
        meta = release.nbgrader_meta(cell)
        gid = meta.get("grade_id")
        if meta.get("grade") or gid in check_ids or cell.get("id") in check_cell_ids:
            continue  # the submission's copy of a check cell (edited or not): the master's replaces it
        where = by_gid.get(gid) if gid else None
        if where is None:
            where = by_id.get(cell.get("id"))
        kept.append((cell, where))

    def master_check(ex):
        cell = copy.deepcopy(master.cells[ex.check_index])
        cell.outputs, cell.execution_count = [], None
        return cell

    cells, roles = [], {}
    waiting = sorted(exercises, key=lambda ex: ex.check_index)
    for cell, where in kept:
        while where is not None and waiting and waiting[0].check_index < where:
            ex = waiting.pop(0)
            roles[len(cells)] = ("check", ex.grade_id)
            cells.append(master_check(ex))
        if where is not None and where in solution_of:
            roles[len(cells)] = ("solution", solution_of[where])
        cells.append(copy.deepcopy(cell))
    for ex in waiting:
        roles[len(cells)] = ("check", ex.grade_id)
        cells.append(master_check(ex))
    nb = copy.deepcopy(submission)
    nb.cells = cells
    nb.metadata["kernelspec"] = copy.deepcopy(master.metadata.get("kernelspec", {"name": "python3"}))
    return nb, exercises, roles


# ---------------------------------------------------------------------------------------------- scoring


def score(exercises, roles, run) -> list[ExerciseResult]:
    """Each exercise's outcome from the cells that ran (see the module docstring for the rules)."""
    solutions: dict[str, list] = {}
    checks = {}
    for index, (role, gid) in roles.items():
        cell = run.cells.get(index)
        if role == "check":
            checks[gid] = cell
        elif cell is not None:
            solutions.setdefault(gid, []).append(cell)
    results = []
    for ex in exercises:
        sols, check = solutions.get(ex.grade_id, []), checks.get(ex.grade_id)
        bad = [c for c in sols if c.status in ("error", "timeout")]
        if any(c.ename == "NotImplementedError" for c in sols):
            status, message = NOT_ATTEMPTED, "a solution cell still raises NotImplementedError"
        elif check is None or check.status == "not run":
            status, message = FAILED, f"the check did not run: {run.stopped or 'no such cell'}"
        elif check.ename == "NotImplementedError":
            status, message = NOT_ATTEMPTED, "the check hit NotImplementedError (an unfinished solution)"
        elif check.status in ("error", "timeout"):
            status = FAILED
            message = check.evalue if check.ename == "CheckFailed" else f"{check.ename}: {check.evalue}"
            if bad:
                message += f" (a solution cell raised {bad[0].ename}: {bad[0].evalue})"
        elif any(line.startswith(SKIP_MARKER) for line in check.stdout.splitlines()):
            status, message = SKIPPED, "needs a GPU; not graded on this machine"
        else:
            status, message = PASSED, ""
        results.append(ExerciseResult(ex.grade_id, ex.points, ex.points if status == PASSED else 0, status,
                                      message.strip()))
    return results


def grade_notebook(
    submission: str | os.PathLike,
    master: str | os.PathLike | None = None,
    *,
    master_dir: str | os.PathLike = "notebooks",
    timeout: float = 600,
    cell_timeout: float = 120,
    max_cell_output: int = 1_000_000,
    executed_dir: str | os.PathLike | None = None,
) -> Grade:
    """Run one submission against its master (given, or found in master_dir) and score each exercise."""
    submission = Path(submission)
    master = Path(master) if master else find_master(submission, Path(master_dir))
    try:
        master_nb = nbformat.read(master, as_version=4)
    except Exception as e:
        raise GradeError(f"{master}: cannot read the master: {e}") from e
    try:
        exercises = release.exercises(master_nb, str(master))
    except release.ReleaseError as e:
        raise GradeError(f"broken master: {e}") from e
    grade = Grade(str(submission), str(master))
    try:
        sub_nb = nbformat.read(submission, as_version=4)
    except Exception as e:  # not JSON, not a notebook: the submission scores nothing, the class goes on
        grade.stopped = f"cannot read the submission: {str(e)[:300]}"
        grade.exercises = [ExerciseResult(ex.grade_id, ex.points, 0, FAILED, grade.stopped) for ex in exercises]
        return grade
    nb, exercises, roles = assemble(sub_nb, master_nb, str(master))
    kernel = nb.metadata.get("kernelspec", {}).get("name") or "python3"
    try:
        run = run_notebook(nb, cwd=master.resolve().parent, kernel_name=kernel, cell_timeout=cell_timeout,
                           timeout=timeout, max_cell_output=max_cell_output)
    except Exception as e:  # the kernel would not start: the grader's machine, not the student, is at fault
        raise GradeError(f"{submission}: could not run the notebook ({type(e).__name__}: {e})") from e
    grade.exercises = score(exercises, roles, run)
    grade.seconds, grade.stopped = run.seconds, run.stopped
    if executed_dir:
        out = Path(executed_dir) / _label(submission).lstrip(os.sep).replace(os.sep, "__")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(release.dumps(nb), encoding="utf-8")
    return grade


# ---------------------------------------------------------------------------------------------- reports


def _label(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _num(x: float) -> str:
    return f"{x:g}"


def format_table(grade: Grade) -> str:
    width = max([len("exercise")] + [len(r.grade_id) for r in grade.exercises])
    lines = [f"{grade.submission}  (master {grade.master}, {grade.seconds:.1f} s)"]
    if grade.stopped:
        lines.append(f"  stopped early: {grade.stopped}")
    lines.append(f"  {'exercise':<{width}}  {'points':>7}  {'status':<13}  message")
    for r in grade.exercises:
        msg = r.message.replace("\n", " ")
        msg = msg if len(msg) <= 160 else msg[:157] + "..."
        pts = f"{_num(r.score)}/{_num(r.points)}"
        lines.append(f"  {r.grade_id:<{width}}  {pts:>7}  {r.status:<13}  {msg}".rstrip())
    total = f"{_num(grade.total)}/{_num(grade.max_points)}"
    extra = f"  ({_num(grade.skipped_points)} points skipped: they need a GPU)" if grade.skipped_points else ""
    lines.append(f"  {'total':<{width}}  {total:>7}{extra}")
    return "\n".join(lines)


def write_csv(grades: list[Grade], path: str | os.PathLike) -> None:
    """One row per submission: its score on each exercise, total, max, and notes on what did not pass."""
    ids: list[str] = []
    for g in grades:
        ids += [r.grade_id for r in g.exercises if r.grade_id not in ids]
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(["submission", "master", *ids, "total", "max", "notes"])
        for g in grades:
            got = g.by_id()
            notes = [f"{r.grade_id}: {r.status}" for r in g.exercises if r.status != PASSED]
            if g.stopped:
                notes.insert(0, g.stopped)
            row = [g.submission, Path(g.master).name] + [_num(got[i].score) if i in got else "" for i in ids]
            writer.writerow(row + [_num(g.total), _num(g.max_points), "; ".join(notes)])


def write_junit(grades: list[Grade], path: str | os.PathLike) -> None:
    """JUnit XML: a test suite per submission, a test case per exercise (not attempted counts as a failure)."""
    root = ET.Element("testsuites", name="course_utils.grade")
    for g in grades:
        failures = sum(r.status in (FAILED, NOT_ATTEMPTED) for r in g.exercises)
        skipped = sum(r.status == SKIPPED for r in g.exercises)
        suite = ET.SubElement(root, "testsuite", name=g.submission, tests=str(len(g.exercises)),
                              failures=str(failures), errors="0", skipped=str(skipped), time=f"{g.seconds:.3f}")
        props = ET.SubElement(suite, "properties")
        for key, value in (("master", g.master), ("score", _num(g.total)), ("max", _num(g.max_points)),
                           ("stopped", g.stopped)):
            ET.SubElement(props, "property", name=key, value=value)
        for r in g.exercises:
            case = ET.SubElement(suite, "testcase", classname=Path(g.master).stem, name=r.grade_id)
            cprops = ET.SubElement(case, "properties")
            ET.SubElement(cprops, "property", name="points", value=_num(r.points))
            ET.SubElement(cprops, "property", name="score", value=_num(r.score))
            if r.status in (FAILED, NOT_ATTEMPTED):
                ET.SubElement(case, "failure", type=r.status, message=r.message or r.status).text = r.message
            elif r.status == SKIPPED:
                ET.SubElement(case, "skipped", message=r.message)
    ET.indent(root)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


# ---------------------------------------------------------------------------------------------- command line


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


def _grade_one(args: tuple) -> Grade | str:
    path, master, options = args
    try:
        return grade_notebook(path, master, **options)
    except GradeError as e:
        return str(e)
    except Exception as e:  # a grader bug must not cost the rest of the class its grades
        return f"{path}: the grader failed ({type(e).__name__}: {e})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_utils.grade",
        description="Run submissions and score each exercise with the master's check cells.",
    )
    parser.add_argument("submissions", nargs="+", type=Path, help="submitted notebooks, or folders of them")
    parser.add_argument("--master-dir", type=Path, default=Path("notebooks"), help="the masters (default notebooks/)")
    parser.add_argument("--master", type=Path, help="grade every submission against this master notebook")
    parser.add_argument("--timeout", type=float, default=600, help="seconds per notebook (default 600)")
    parser.add_argument("--cell-timeout", type=float, default=120, help="seconds per cell (default 120)")
    parser.add_argument("--max-output", type=int, default=1_000_000, help="characters of output kept per cell")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="submissions run at once (default 1)")
    parser.add_argument("--csv", type=Path, help="write scores: a row per submission, a column per exercise")
    parser.add_argument("--junit", type=Path, help="write JUnit XML for CI systems")
    parser.add_argument("--executed-dir", type=Path, help="keep each executed notebook (outputs capped) here")
    args = parser.parse_args(argv)
    try:
        subs = _submissions(args.submissions)
        masters = [args.master or find_master(s, args.master_dir) for s in subs]
    except GradeError as e:
        print(f"grade: error: {e}", file=sys.stderr)
        return 2
    options = {"timeout": args.timeout, "cell_timeout": args.cell_timeout, "max_cell_output": args.max_output,
               "executed_dir": args.executed_dir}
    work = [(_label(s), m, options) for s, m in zip(subs, masters, strict=True)]
    grades: list[Grade] = []
    errors: list[str] = []

    def report(result):
        if isinstance(result, str):
            errors.append(result)
            print(f"grade: error: {result}", file=sys.stderr)
        else:
            grades.append(result)
            print(format_table(result), flush=True)

    if args.jobs > 1 and len(work) > 1:
        with ProcessPoolExecutor(min(args.jobs, len(work)), mp_context=get_context("spawn")) as pool:
            for result in pool.map(_grade_one, work):
                report(result)
    else:
        for item in work:
            report(_grade_one(item))
    if len(grades) > 1:
        total = sum(g.total for g in grades)
        print(f"{len(grades)} submissions graded; mean score {_num(round(total / len(grades), 2))}")
    if args.csv:
        write_csv(grades, args.csv)
    if args.junit:
        write_junit(grades, args.junit)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
