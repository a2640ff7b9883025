"""What the grader runs: the master's cells, with only the submission's solution regions taken from it.

    master = read_master("notebooks/02_cuda_streams.ipynb")     # once per grader run, kept in memory
    regs = regions(master, submission_nb)                        # {master cell index: [region text, ...]}
    program(master, ex, regs)      # the probe's code: setup cells before the exercise, its solution cells
    feedback_notebook(master, regs)  # the whole master with the regions in, for the feedback run

A region is the text a student wrote in place of a `### BEGIN SOLUTION` ... `### END SOLUTION` block. In a
submission the markers are gone (the release replaced the block with `raise NotImplementedError()`), so each
solution cell of the master (found in the submission by its nbgrader grade_id, else its cell id) is aligned
with the submission's cell line by line, and what stands where the master has a block is the region. Code a
student added or changed elsewhere (set-up cells, check cells, cells of their own, the fixed lines around a
block) is not used.
"""

from __future__ import annotations

import copy
import difflib
import os
from dataclasses import dataclass
from pathlib import Path

import nbformat

from . import release

STUB = release.STUB
_SENTINEL = "\x00course-grading-solution-block\x00"


@dataclass(frozen=True)
class MasterExercise:
    """An exercise of a master: its solution cells and the set-up cells that come before them."""

    grade_id: str
    points: float
    check_index: int
    solutions: tuple[int, ...]
    setup: tuple[int, ...]


@dataclass(frozen=True)
class Master:
    path: Path
    nb: nbformat.NotebookNode  # never handed out: copies are
    exercises: tuple[MasterExercise, ...]

    @property
    def name(self) -> str:
        return self.path.name

    def source(self, index: int) -> str:
        return self.nb.cells[index].source


def _is_setup(cell) -> bool:
    return cell.cell_type == "code" and "setup" in (cell.get("metadata", {}).get("tags") or [])


def parse_master(nb, path: str | os.PathLike) -> Master:
    """The exercises of a master notebook; release.ReleaseError if its exercise markup is broken."""
    found = release.exercises(nb, str(path))
    setup = [i for i, c in enumerate(nb.cells) if _is_setup(c)]
    exercises = tuple(MasterExercise(ex.grade_id, ex.points, ex.check_index, tuple(ex.solution_indices),
                                     tuple(i for i in setup if i < min(ex.solution_indices))) for ex in found)
    return Master(Path(path), nb, exercises)


def read_master(path: str | os.PathLike) -> Master:
    """Read and parse a master (OSError, nbformat errors or release.ReleaseError if it cannot be)."""
    return parse_master(nbformat.read(path, as_version=4), path)


# ---------------------------------------------------------------------------------------------- regions


def _find_cell(sub, cell) -> str | None:
    """The source of the submission's counterpart of master `cell`: same nbgrader grade_id, else same cell id."""
    gid = release.nbgrader_meta(cell).get("grade_id")
    if gid:
        for c in sub.cells:
            if c.get("cell_type") == "code" and release.nbgrader_meta(c).get("grade_id") == gid:
                return c.get("source", "")
    cid = cell.get("id")
    if cid:
        for c in sub.cells:
            if c.get("cell_type") == "code" and c.get("id") == cid:
                return c.get("source", "")
    return None


def extract_regions(master_source: str, sub_source: str) -> list[str]:
    """The text standing in `sub_source` where `master_source` has its solution blocks, one per block."""
    blocks = release.solution_blocks(master_source, "master")
    try:
        own = release.solution_blocks(sub_source, "submission")
    except release.ReleaseError:
        own = []
    sub_lines = sub_source.split("\n")
    if len(own) == len(blocks):  # the markers are still there (a master handed in, or kept by the student)
        return ["\n".join(sub_lines[b + 1:e]) for b, e in own]
    lines = master_source.split("\n")
    marked, last = [], 0
    for begin, end in blocks:
        marked += lines[last:begin] + [_SENTINEL]
        last = end + 1
    marked += lines[last:]
    out = [""] * len(blocks)
    k = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, marked, sub_lines, autojunk=False).get_opcodes():
        hits = [i for i in range(i1, i2) if marked[i] == _SENTINEL]
        for n, _ in enumerate(hits):
            if tag != "equal":
                out[k] = "\n".join(sub_lines[j1:j2]) if n == 0 else ""  # two blocks in one change: first gets it
            k += 1
    return out


def regions(master: Master, sub) -> dict[int, list[str] | None]:
    """For every solution cell of the master (by index): the submission's region texts, None if it lacks the cell."""
    out: dict[int, list[str] | None] = {}
    for ex in master.exercises:
        for i in ex.solutions:
            src = _find_cell(sub, master.nb.cells[i])
            out[i] = None if src is None else extract_regions(master.source(i), src)
    return out


def is_stub(text: str) -> bool:
    """True for a region with no work in it: empty, comments only, or the release's `raise NotImplementedError()`."""
    code = [ln.strip() for ln in text.split("\n") if ln.strip() and not ln.strip().startswith("#")]
    return code in ([], [STUB])


def attempted(ex: MasterExercise, regs: dict[int, list[str] | None]) -> bool:
    """False when every block of the exercise is still a stub (or its cells are missing)."""
    return any(regs.get(i) and not all(is_stub(t) for t in regs[i]) for i in ex.solutions)


def _solution_source(master: Master, index: int, regs: dict[int, list[str] | None]) -> str:
    texts = regs.get(index)
    n = len(release.solution_blocks(master.source(index), "master"))
    return release.replace_blocks(master.source(index), texts if texts is not None else [STUB] * n)


def program(master: Master, ex: MasterExercise, regs: dict[int, list[str] | None]) -> list[tuple[str, str]]:
    """(file name for tracebacks, source) of what a probe execs: set-up cells, then the solution cells."""
    stem = master.path.stem
    out = [(f"<{stem} setup cell {i}>", master.source(i)) for i in ex.setup]
    out += [(f"<{stem} solution cell {i}>", _solution_source(master, i, regs)) for i in ex.solutions]
    return out


def feedback_notebook(master: Master, regs: dict[int, list[str] | None]):
    """A copy of the master with the submission's regions in its solution cells, outputs cleared."""
    nb = copy.deepcopy(master.nb)
    for ex in master.exercises:
        for i in ex.solutions:
            nb.cells[i].source = _solution_source(master, i, regs)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    return nb
