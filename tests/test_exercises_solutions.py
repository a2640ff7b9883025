"""Real lessons, graded as students hand them in.

A fresh student version scores zero; the student version with every other exercise solved (the 1st, 3rd, ...)
scores exactly those. Solved exercises must pass (or skip for want of a GPU, never under COURSE_REQUIRE_GPU=1);
unsolved ones must be "not attempted", and leaving them unsolved must not break the exercises after them (on
CPU, a CUDA-only check may skip before it reaches the unsolved code: "skipped", 0 points). Masters' full marks
are also proven by `pytest --nbmake notebooks` (a check that fails makes its notebook fail). Exercises are
discovered in notebooks/*.ipynb when the tests run.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from course_utils import checks, grade, release

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def _has_exercises(path: Path) -> bool:
    nb = nbformat.read(path, as_version=4)
    return any(release.nbgrader_meta(c) or "BEGIN SOLUTION" in c.source for c in nb.cells)


LESSONS = [p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if _has_exercises(p)]
PARAMS = LESSONS or [pytest.param(None, marks=pytest.mark.skip(reason="no notebook in notebooks/ has exercises yet"))]


def right_outcomes() -> set[str]:
    return {"passed"} if checks.require_gpu_mode() else {"passed", "skipped"}


@pytest.mark.slow
@pytest.mark.parametrize("master", PARAMS, ids=lambda p: p.stem if p else "none")
def test_student_version_scores_exactly_its_solved_exercises(master, tmp_path):
    nb = nbformat.read(master, as_version=4)
    exercises = release.exercises(nb, str(master))
    solved = {ex.grade_id for ex in exercises[0::2]}
    submission = tmp_path / master.name
    submission.write_text(release.dumps(release.student_version(nb, str(master), completed=solved)))
    g = grade.grade_notebook(submission, master)
    got = {r.grade_id: r for r in g.exercises}
    assert list(got) == [ex.grade_id for ex in exercises]
    report = grade.format_table(g)
    for ex in exercises:
        if ex.grade_id in solved:
            assert got[ex.grade_id].status in right_outcomes(), report
        else:  # a CUDA-only check skips on CPU before it reaches an unsolved function: skipped, 0 points
            assert got[ex.grade_id].status in {"not attempted"} | (right_outcomes() - {"passed"}), report
    assert g.total == sum(r.points for r in g.exercises if r.status == "passed"), report
    assert g.total == sum(ex.points for ex in exercises if ex.grade_id in solved and got[ex.grade_id].status
                          == "passed")
    assert not g.stopped, report


@pytest.mark.slow
@pytest.mark.parametrize("master", PARAMS, ids=lambda p: p.stem if p else "none")
def test_fresh_student_version_scores_zero(master, tmp_path):
    nb = nbformat.read(master, as_version=4)
    exercises = release.exercises(nb, str(master))
    submission = tmp_path / master.name
    submission.write_text(release.dumps(release.student_version(nb, str(master))))
    g = grade.grade_notebook(submission, master)
    report = grade.format_table(g)
    assert g.total == 0, report
    assert [r.grade_id for r in g.exercises] == [ex.grade_id for ex in exercises]
    # On CPU a CUDA-only check may skip before it reaches the unsolved code; otherwise: not attempted.
    assert all(r.status in {"not attempted", "skipped"} for r in g.exercises), report
    if checks.require_gpu_mode():
        assert all(r.status == "not attempted" for r in g.exercises), report
