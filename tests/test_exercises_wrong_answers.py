"""Real lessons: every exercise has a wrong answer, and each one fails its check.

tests/wrong_answers/<notebook stem>/<exercise id>.py replaces the exercise's solution block (markers included;
`### NEXT SOLUTION` lines split it over several blocks). Variants named <exercise id>__<what>.py are the lesson
tests' business; the one named exactly after the exercise goes into one execution per notebook with every
exercise answered wrong. Exercises are discovered in notebooks/*.ipynb when the tests run.
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from course_utils import checks, grade, release

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOKS = ROOT / "notebooks"
WRONG = ROOT / "tests" / "wrong_answers"


def _exercises(path: Path) -> list[release.Exercise]:
    return release.exercises(nbformat.read(path, as_version=4), str(path))


def _has_exercises(path: Path) -> bool:
    nb = nbformat.read(path, as_version=4)
    return any(release.nbgrader_meta(c) or "BEGIN SOLUTION" in c.source for c in nb.cells)


LESSONS = [p for p in sorted(NOTEBOOKS.glob("*.ipynb")) if _has_exercises(p)]
PARAMS = LESSONS or [pytest.param(None, marks=pytest.mark.skip(reason="no notebook in notebooks/ has exercises yet"))]
IDS = {"ids": lambda p: p.stem if p else "none"}


@pytest.mark.parametrize("master", PARAMS, **IDS)
def test_every_exercise_has_a_wrong_answer(master):
    missing = [ex.grade_id for ex in _exercises(master)
               if not (WRONG / master.stem / f"{ex.grade_id}.py").is_file()
               or not (WRONG / master.stem / f"{ex.grade_id}.py").read_text().strip()]
    assert not missing, f"write tests/wrong_answers/{master.stem}/<id>.py for {missing}"


def test_wrong_answer_files_name_existing_exercises():
    known = {p.stem: {ex.grade_id for ex in _exercises(p)} for p in NOTEBOOKS.glob("*.ipynb")}
    stale = [str(f.relative_to(ROOT)) for f in sorted(WRONG.glob("*/*.py"))
             if f.stem.split("__")[0] not in known.get(f.parent.name, set())]
    assert not stale, f"wrong answers for no exercise (renamed or removed?): {stale}"


def test_exercise_ids_are_unique_and_start_with_the_lesson_number(tmp_path):
    release.release([NOTEBOOKS], tmp_path)  # raises on a broken master or a duplicate id across the course
    bad = [f"{p.name}: {ex.grade_id}" for p in LESSONS for ex in _exercises(p)
           if not ex.grade_id.startswith(f"ex{p.stem[:2]}_")]
    assert not bad, f"exercise ids start with ex<lesson number>_: {bad}"


@pytest.mark.slow
@pytest.mark.parametrize("master", PARAMS, **IDS)
def test_wrong_answers_fail_their_checks(master, tmp_path):
    exercises = _exercises(master)
    answers = {ex.grade_id: (WRONG / master.stem / f"{ex.grade_id}.py").read_text() for ex in exercises
               if (WRONG / master.stem / f"{ex.grade_id}.py").is_file()}
    if not answers:
        pytest.fail(f"no wrong answers for {master.name}")
    nb = release.substitute(nbformat.read(master, as_version=4), answers, str(master))
    submission = tmp_path / master.name
    submission.write_text(release.dumps(nb))
    g = grade.grade_notebook(submission, master)
    report = grade.format_table(g)
    allowed = {"failed"} if checks.require_gpu_mode() else {"failed", "skipped"}
    for r in g.exercises:
        if r.grade_id in answers:
            assert r.status in allowed, report
            if r.status == "failed":
                assert r.message and "did not run" not in r.message, report
    assert g.total == 0, report
