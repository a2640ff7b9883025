"""The conventions every lesson keeps, checked once for every notebook in notebooks/.

A lesson is one room, found from its notebook's stem (docs/lessons.md): notebooks/07_ring_allreduce.ipynb has
course_utils/checks/ring_allreduce.py, tests/lessons/test_07_ring_allreduce.py, tests/wrong_answers/07_ring_allreduce/
and course_utils/reference_data/07_ring_allreduce.json. An exercise is a solution cell (`<id>_solution`, the answer
between `### BEGIN SOLUTION` and `### END SOLUTION`) followed by a locked check cell `check("<id>", <entry>)`.
Setup cells (tag `setup`, which the grader runs before a submission's solution) are plain, quick Python.
A lesson's own tests (tests/lessons/) hold what is particular to it.
"""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest

from course_utils import checks

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
CHECKS = ROOT / "course_utils" / "checks"
LESSON_TESTS = ROOT / "tests" / "lessons"
WRONG = ROOT / "tests" / "wrong_answers"
RECORDINGS = ROOT / "course_utils" / "reference_data"
# What a setup cell must not call as it runs (it may define functions that do): the grader runs every setup cell
# before each probe, in a sandbox with a time limit, and a setup cell runs before the learner reads anything.
STARTS_WORK = re.compile(r"\bPool\b|\bpool\.run|launch\.run|run_commands|subprocess\.|\.take\b|gpu_sleep|\bbench\.")


def slug(stem: str) -> str:
    """A notebook's stem without its number: the name of its checks module."""
    return stem.split("_", 1)[1]


def code_cells(path: Path) -> list[dict]:
    return [c for c in json.loads(path.read_text())["cells"] if c["cell_type"] == "code"]


def source(cell: dict) -> str:
    return "".join(cell["source"])


def graded(cells: list[dict]) -> dict[str, list[int]]:
    """grade_id -> the indexes of the cells that carry it (a solution may span several cells)."""
    out: dict[str, list[int]] = {}
    for i, c in enumerate(cells):
        gid = c["metadata"].get("nbgrader", {}).get("grade_id")
        if gid:
            out.setdefault(gid, []).append(i)
    return out


def calls_at_run_time(cell_source: str) -> list[str]:
    """The calls a cell makes as it runs, outside the bodies of the functions and classes it defines."""
    found = []

    def visit(node: ast.AST) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            return
        if isinstance(node, ast.Call):
            found.append(ast.unparse(node.func))
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(cell_source))
    return found


def exercise_ids(path: Path) -> list[str]:
    return [c["metadata"]["nbgrader"]["grade_id"] for c in code_cells(path)
            if c["metadata"].get("nbgrader", {}).get("grade")]


LESSONS = [p for p in NOTEBOOKS if exercise_ids(p)]


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_each_exercise_is_a_solution_then_a_locked_check_cell(path):
    cells = code_cells(path)
    where = graded(cells)
    for ex in exercise_ids(path):
        (i,) = where[ex]
        meta = cells[i]["metadata"]["nbgrader"]
        assert meta["locked"] is True and meta["points"] > 0 and meta["schema_version"] == 3, (ex, meta)
        entry = checks.exercise(ex).entry
        assert source(cells[i]).strip() == f'check("{ex}", {entry})', f"{ex}: the check cell is one check() call"
        solutions = where.get(f"{ex}_solution", [])
        assert solutions and all(j < i for j in solutions), f"{ex}: its solution cell(s) come before the check"
        for j in solutions:
            meta = cells[j]["metadata"]["nbgrader"]
            assert meta["solution"] is True and meta["grade"] is False and meta["locked"] is False, (ex, meta)
            assert "### BEGIN SOLUTION" in source(cells[j]) and "### END SOLUTION" in source(cells[j]), ex
        answer = "\n".join(source(cells[j]) for j in solutions)
        assert re.search(rf"^(def|class) {entry}\b|^{entry}\s*=", answer, re.M), f"{ex}: no {entry} defined"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_each_exercise_is_registered_by_its_lessons_checks_module(path):
    module = f"course_utils.checks.{slug(path.stem)}"
    for ex in exercise_ids(path):
        assert ex.startswith(f"ex{path.stem[:2]}_"), f"{ex}: exercise ids start with ex<lesson number>_"
        registered_by = checks.exercise(ex).probe.__module__
        assert registered_by == module or registered_by.startswith(f"{module}_"), f"{ex} is registered outside {module}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_setup_cells_are_plain_quick_python(path):
    cells = code_cells(path)
    setup = [source(c) for c in cells if "setup" in c["metadata"].get("tags", [])]
    for s in setup:
        assert not re.search(r"^\s*[%!]", s, re.M), f"a setup cell runs as plain Python (no magics): {s[:200]}"
        starts = [c for c in calls_at_run_time(s) if STARTS_WORK.search(c)]
        assert not starts, f"a setup cell starts no ranks, processes or measurements: {starts}"
    if exercise_ids(path):
        assert setup, "a lesson with exercises has setup cells (the grader runs them before a solution)"
        assert any("parameters" in c["metadata"].get("tags", []) for c in cells), "tag the parameters cell"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_the_lessons_code_is_in_the_notebook(path):
    """A notebook imports tools from course_utils, never a lesson's checks module (whose judges know the answers)."""
    code = "\n".join(source(c) for c in code_cells(path))
    assert not re.search(r"course_utils\.checks\.\w|from course_utils\.checks import (?!check\b)", code)
    ids = [c["id"] for c in json.loads(path.read_text())["cells"]]
    assert len(ids) == len(set(ids)), "cell ids are unique"


@pytest.mark.parametrize("path", LESSONS, ids=lambda p: p.stem)
def test_a_lesson_with_exercises_has_its_room(path):
    room = [CHECKS / f"{slug(path.stem)}.py", LESSON_TESTS / f"test_{path.stem}.py", WRONG / path.stem]
    missing = [str(p.relative_to(ROOT)) for p in room if not p.exists()]
    assert not missing, f"lesson {path.stem} lacks {missing} (docs/lessons.md)"


def test_every_lesson_file_belongs_to_a_notebook():
    stems = {p.stem for p in NOTEBOOKS}
    slugs = {slug(s) for s in stems}
    # a lesson's checks: checks/<slug>.py, split into checks/<slug>_<part>.py where one file would grow too long
    orphans = [p for p in CHECKS.glob("*.py") if p.stem != "__init__" and p.stem not in slugs
               and not any(p.stem.startswith(f"{s}_") for s in slugs)]
    orphans += [p for p in LESSON_TESTS.glob("test_*.py") if p.stem.removeprefix("test_") not in stems]
    orphans += [p for p in WRONG.iterdir() if p.is_dir() and p.name not in stems]
    orphans += [p for p in RECORDINGS.glob("*.json") if p.stem not in stems]
    assert not orphans, f"named after no notebook (renamed or removed?): {[str(p.relative_to(ROOT)) for p in orphans]}"
    assert {slug(p.stem) for p in LESSONS} <= set(checks.lesson_modules())


def test_setup_rule_sees_calls_made_as_the_cell_runs_only():
    cell = ("import subprocess\npool = launch.Pool(2)\nx = [rec.take('a', 1)]\n"
            "def later():\n    subprocess.run(['true'])\nclass Later:\n    y = 1\n")
    assert [c for c in calls_at_run_time(cell) if STARTS_WORK.search(c)] == ["launch.Pool", "rec.take"]
