"""Real lessons, graded as students hand them in, by the grader (course_utils.grading).

For every master in notebooks/ with exercises (discovered when the tests run): the master scores full marks;
a fresh student version scores zero, every exercise "not attempted"; the student version with every other
exercise solved (the 1st, 3rd, ...) scores exactly those. Right answers pass, or skip for want of a GPU (never
under COURSE_REQUIRE_GPU=1). An exercise without a registered check fails these tests with the grader's
"no check registered" message: its lesson's checks module must register an Exercise for it.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from course_utils import checks, grade, release
from course_utils.grading import grade as grading

pytestmark = pytest.mark.grading

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"


def _has_exercises(path: Path) -> bool:
    nb = nbformat.read(path, as_version=4)
    return any(release.nbgrader_meta(c) or "BEGIN SOLUTION" in c.source for c in nb.cells)


LESSONS = [p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if _has_exercises(p)]
PARAMS = LESSONS or [pytest.param(None, marks=pytest.mark.skip(reason="no notebook in notebooks/ has exercises yet"))]
IDS = {"ids": lambda p: p.stem if p else "none"}


def right_outcomes() -> set[str]:
    return {"passed"} if checks.require_gpu_mode() else {"passed", "skipped"}


@pytest.fixture(scope="module")
def grader():
    with grading.Grader(grading.Options(jobs=2)) as g:
        yield g


def _grade(grader, master: Path, nb, tmp_path: Path) -> grade.Grade:
    submission = tmp_path / master.name
    submission.write_text(release.dumps(nb))
    return grader.grade(submission, master)


def _registered_or_fail(g: grade.Grade) -> None:
    missing = [r.grade_id for r in g.exercises if "no check registered" in r.message]
    assert not missing, f"no check registered for {missing}: register an Exercise for each in its lesson's checks " \
                        f"module (course_utils/checks/<module>.py)\n{grade.format_table(g)}"


@pytest.mark.slow
@pytest.mark.parametrize("master", PARAMS, **IDS)
def test_master_scores_full_marks(grader, master, tmp_path):
    g = _grade(grader, master, nbformat.read(master, as_version=4), tmp_path)
    _registered_or_fail(g)
    report = grade.format_table(g)
    assert all(r.status in right_outcomes() for r in g.exercises), report
    assert g.total == g.max_points - g.skipped_points, report


@pytest.mark.slow
@pytest.mark.parametrize("master", PARAMS, **IDS)
def test_student_version_scores_exactly_its_solved_exercises(grader, master, tmp_path):
    nb = nbformat.read(master, as_version=4)
    exercises = release.exercises(nb, str(master))
    solved = {ex.grade_id for ex in exercises[0::2]}
    g = _grade(grader, master, release.student_version(nb, str(master), completed=solved), tmp_path)
    _registered_or_fail(g)
    got = g.by_id()
    report = grade.format_table(g)
    assert list(got) == [ex.grade_id for ex in exercises]
    for ex in exercises:
        if ex.grade_id in solved:
            assert got[ex.grade_id].status in right_outcomes(), report
        else:
            assert got[ex.grade_id].status == "not attempted", report
    assert g.total == sum(ex.points for ex in exercises if ex.grade_id in solved
                          and got[ex.grade_id].status == "passed"), report
    assert not g.stopped, report


@pytest.mark.slow
@pytest.mark.parametrize("master", PARAMS, **IDS)
def test_fresh_student_version_scores_zero(grader, master, tmp_path):
    nb = nbformat.read(master, as_version=4)
    exercises = release.exercises(nb, str(master))
    g = _grade(grader, master, release.student_version(nb, str(master)), tmp_path)
    report = grade.format_table(g)
    assert g.total == 0, report
    assert [r.grade_id for r in g.exercises] == [ex.grade_id for ex in exercises]
    assert all(r.status == "not attempted" for r in g.exercises), report
