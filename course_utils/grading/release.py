"""Student versions of the lesson notebooks: solutions out, outputs cleared, check cells locked.

    python -m course_utils.release notebooks/ OUT/

An exercise is one or more solution cells followed by one check cell (nbgrader-style metadata):
- a solution cell holds the student's part between `### BEGIN SOLUTION` and `### END SOLUTION`;
  the release replaces each such block, markers included, with `raise NotImplementedError()`
  at the indentation of the BEGIN line;
- a check cell has `grade_id` (the exercise id) and `points`; it owns the solution cells between the
  previous check cell and itself.
The release is deterministic (same masters, same bytes) and refuses masters whose structure the grader
could not score: unbalanced markers, a check cell without grade_id or points, a duplicate grade_id.
`course_utils.grading` reads the same structure from the masters.
"""

from __future__ import annotations

import argparse
import copy
import sys
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

BEGIN = "### BEGIN SOLUTION"
END = "### END SOLUTION"
STUB = "raise NotImplementedError()"
# In a wrong-answer file, separates the replacements of an exercise's successive solution blocks.
NEXT_BLOCK = "### NEXT SOLUTION"


class ReleaseError(ValueError):
    """A master notebook's exercise structure is broken; the message names the notebook and the cell."""


@dataclass
class Exercise:
    """One graded exercise of a master notebook (cell indices are positions in that notebook)."""

    grade_id: str
    points: float
    check_index: int
    solution_indices: list[int] = field(default_factory=list)


def nbgrader_meta(cell) -> dict:
    meta = cell.get("metadata", {}).get("nbgrader", {})
    return meta if isinstance(meta, dict) else {}


def is_check_cell(cell) -> bool:
    return bool(nbgrader_meta(cell).get("grade")) and cell.get("cell_type") == "code"


def is_solution_cell(cell) -> bool:
    return bool(nbgrader_meta(cell).get("solution")) and cell.get("cell_type") == "code"


def solution_blocks(source: str, where: str) -> list[tuple[int, int]]:
    """(begin_line, end_line) of each solution block; raise ReleaseError if markers are unbalanced."""
    blocks, begin = [], None
    for i, line in enumerate(source.split("\n")):
        text = line.strip()
        if "BEGIN SOLUTION" in text or "END SOLUTION" in text:
            if text not in (BEGIN, END):
                raise ReleaseError(f"{where}: line {i + 1} {text!r} is not exactly {BEGIN!r} or {END!r}")
        if text == BEGIN:
            if begin is not None:
                raise ReleaseError(f"{where}: {BEGIN!r} on line {i + 1} before the {END!r} of line {begin + 1}")
            begin = i
        elif text == END:
            if begin is None:
                raise ReleaseError(f"{where}: {END!r} on line {i + 1} without a {BEGIN!r} before it")
            blocks.append((begin, i))
            begin = None
    if begin is not None:
        raise ReleaseError(f"{where}: {BEGIN!r} on line {begin + 1} has no {END!r}")
    return blocks


def replace_blocks(source: str, replacements: list[str], where: str = "cell") -> str:
    """Replace solution block k (markers included) by replacements[k], indented like its BEGIN line.

    Blocks beyond len(replacements) are left as they are.
    """
    lines = source.split("\n")
    blocks = solution_blocks(source, where)
    for (begin, end), text in reversed(list(zip(blocks, replacements, strict=False))):
        indent = lines[begin][: len(lines[begin]) - len(lines[begin].lstrip())]
        lines[begin : end + 1] = _reindent(text, indent)
    return "\n".join(lines)


def _reindent(text: str, indent: str) -> list[str]:
    """Lines of `text` moved to `indent`: its common margin (taken from code lines, not comments) is replaced.

    So an answer may be written at column 0 or already at the block's indentation, with or without a
    `# ruff: noqa` line at column 0.
    """
    body = text.strip("\n").split("\n")
    code = [ln for ln in body if ln.strip() and not ln.lstrip().startswith("#")] or [ln for ln in body if ln.strip()]
    margin = min((len(ln) - len(ln.lstrip()) for ln in code), default=0)
    out = []
    for ln in body:
        if not ln.strip():
            out.append("")
        elif ln[:margin].strip() == "":
            out.append(indent + ln[margin:])
        else:  # a comment left of the margin
            out.append(indent + ln.lstrip())
    return out


def exercises(nb, name: str = "notebook", require_markers: bool = True) -> list[Exercise]:
    """The exercises of a master, in order; ReleaseError if the grader could not score them.

    require_markers=False reads a student version (solution blocks already replaced).
    """
    found: list[Exercise] = []
    seen_ids: dict[str, int] = {}
    pending: list[int] = []
    for i, cell in enumerate(nb.cells):
        where = f"{name}, cell {i}"
        if cell.cell_type == "code":
            has_blocks = bool(solution_blocks(cell.source, where))
        else:
            has_blocks = False
        meta = nbgrader_meta(cell)
        gid = meta.get("grade_id")
        if gid is not None:
            if not isinstance(gid, str) or not gid:
                raise ReleaseError(f"{where}: grade_id must be a non-empty string, saw {gid!r}")
            if gid in seen_ids:
                raise ReleaseError(f"{where}: duplicate grade_id {gid!r} (also cell {seen_ids[gid]})")
            seen_ids[gid] = i
        if is_check_cell(cell):
            points = meta.get("points")
            if not gid:
                raise ReleaseError(f"{where}: check cell (nbgrader grade: true) has no grade_id")
            if isinstance(points, bool) or not isinstance(points, int | float) or points < 0:
                raise ReleaseError(f"{where}: check cell {gid!r} needs 'points' (a number >= 0), saw {points!r}")
            if is_solution_cell(cell) or has_blocks:
                raise ReleaseError(f"{where}: check cell {gid!r} must not also hold a solution")
            if not pending:
                raise ReleaseError(f"{where}: check cell {gid!r} has no solution cell before it")
            found.append(Exercise(gid, points, i, pending))
            pending = []
        elif is_solution_cell(cell):
            if require_markers and not has_blocks:
                raise ReleaseError(f"{where}: solution cell {gid!r} has no {BEGIN!r} block; it would be released as is")
            pending.append(i)
        elif has_blocks:
            raise ReleaseError(f"{where}: solution markers in a cell without nbgrader solution metadata")
    if pending:
        raise ReleaseError(f"{name}: solution cell(s) {pending} are not followed by a check cell")
    return found


def student_version(master, name: str = "notebook", completed: tuple[str, ...] | set[str] = ()):
    """A copy of `master` as students get it: solutions stubbed, outputs cleared, check cells locked.

    Exercises named in `completed` keep their solution (markers dropped), as a student who solved them would
    hand them in: tests use it to make submissions.
    """
    found = exercises(master, name)  # validate first
    unknown = sorted(set(completed) - {ex.grade_id for ex in found})
    if unknown:
        raise ReleaseError(f"{name}: no exercise {unknown}")
    keep = {i for ex in found if ex.grade_id in completed for i in ex.solution_indices}
    nb = copy.deepcopy(master)
    for i, cell in enumerate(nb.cells):
        cell.get("metadata", {}).pop("execution", None)
        if cell.cell_type != "code":
            continue
        cell.outputs = []
        cell.execution_count = None
        if is_solution_cell(cell):
            blocks = solution_blocks(cell.source, f"{name}, cell {i}")
            if i in keep:
                lines = cell.source.split("\n")
                answers = ["\n".join(lines[b + 1 : e]) for b, e in blocks]
                cell.source = replace_blocks(cell.source, answers)
            else:
                cell.source = replace_blocks(cell.source, [STUB] * len(blocks))
        if is_check_cell(cell):
            cell.metadata["editable"] = False
            cell.metadata["deletable"] = False
            cell.metadata["nbgrader"]["locked"] = True
    return nb


def unsolved_master(master, name: str = "notebook"):
    """A copy of `master` whose solution blocks hold the stub between their markers: all the grader needs of a
    master to score a notebook, and no solution. Students who may not read the masters check against it."""
    exercises(master, name)  # validate first
    nb = copy.deepcopy(master)
    for i, cell in enumerate(nb.cells):
        if cell.cell_type == "code" and is_solution_cell(cell):
            n = len(solution_blocks(cell.source, f"{name}, cell {i}"))
            cell.source = replace_blocks(cell.source, [f"{BEGIN}\n{STUB}\n{END}"] * n)
    return nb


def substitute(master, answers: dict[str, str], name: str = "notebook"):
    """A copy of `master` with exercise answers replaced: answers[grade_id] replaces its solution blocks.

    The text replaces the first solution block of the exercise; a line `### NEXT SOLUTION` in it starts the
    replacement of the next block (across the exercise's solution cells). Blocks left over keep the master's.
    """
    found = {ex.grade_id: ex for ex in exercises(master, name)}
    unknown = sorted(set(answers) - set(found))
    if unknown:
        raise ReleaseError(f"{name}: no exercise {unknown}; it has {sorted(found)}")
    nb = copy.deepcopy(master)
    for gid, text in answers.items():
        parts = _split_parts(text)
        for i in found[gid].solution_indices:
            cell = nb.cells[i]
            n = len(solution_blocks(cell.source, f"{name}, cell {i}"))
            cell.source = replace_blocks(cell.source, parts[:n], f"{name}, cell {i}")
            parts = parts[n:]
    return nb


def _split_parts(text: str) -> list[str]:
    parts, current = [], []
    for line in text.split("\n"):
        if line.strip() == NEXT_BLOCK:
            parts.append("\n".join(current))
            current = []
        else:
            current.append(line)
    parts.append("\n".join(current))
    return parts


def dumps(nb) -> str:
    """The notebook's bytes as committed: nbformat's JSON, one trailing newline."""
    return nbformat.writes(nb).rstrip("\n") + "\n"


def release(sources: list[Path], out_dir: Path) -> list[tuple[Path, Path, list[Exercise]]]:
    """Validate every master, then write the student versions into out_dir. Returns (master, student, exercises)."""
    paths: list[Path] = []
    for src in sources:
        if src.is_dir():
            paths += sorted(p for p in src.glob("*.ipynb"))
        elif src.suffix == ".ipynb" and src.is_file():
            paths.append(src)
        else:
            raise ReleaseError(f"{src}: not a notebook or a folder of notebooks")
    if not paths:
        raise ReleaseError(f"no notebooks in {', '.join(map(str, sources))}")
    names = [p.name for p in paths]
    clashes = sorted({n for n in names if names.count(n) > 1})
    if clashes:
        raise ReleaseError(f"two masters would be written to the same file: {clashes}")
    out_dir = Path(out_dir)
    owner: dict[str, Path] = {}
    plan = []
    for path in paths:
        if (out_dir / path.name).resolve() == path.resolve():
            raise ReleaseError(f"{path}: the student version would overwrite the master; pick another OUT folder")
        try:
            master = nbformat.read(path, as_version=4)
        except Exception as e:  # invalid JSON, not a notebook
            raise ReleaseError(f"{path}: cannot read the notebook: {e}") from e
        found = exercises(master, str(path))
        for ex in found:  # exercise ids are unique across the course
            if ex.grade_id in owner:
                raise ReleaseError(f"{path}: duplicate grade_id {ex.grade_id!r} (also in {owner[ex.grade_id]})")
            owner[ex.grade_id] = path
        plan.append((path, student_version(master, str(path)), found))
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for path, nb, found in plan:
        target = out_dir / path.name
        target.write_text(dumps(nb), encoding="utf-8")
        written.append((path, target, found))
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m course_utils.release",
        description="Write student versions of master notebooks: solutions replaced by "
        "`raise NotImplementedError()`, outputs cleared, check cells read-only.",
    )
    parser.add_argument("sources", nargs="+", type=Path, help="master notebooks or folders of them (notebooks/)")
    parser.add_argument("out", type=Path, help="folder for the student versions")
    args = parser.parse_args(argv)
    try:
        written = release(args.sources, args.out)
    except ReleaseError as e:
        print(f"release: error: {e}", file=sys.stderr)
        return 2
    for master, student, found in written:
        points = sum(ex.points for ex in found)
        print(f"{master} -> {student}: {len(found)} exercise{'' if len(found) == 1 else 's'}, {points:g} points")
    return 0


if __name__ == "__main__":
    sys.exit(main())
