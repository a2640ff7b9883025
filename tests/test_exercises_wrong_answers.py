"""Real lessons: every exercise has a wrong answer, and the grader fails each one.

tests/wrong_answers/<notebook stem>/<exercise id>.py replaces the exercise's solution block (markers included;
`### NEXT SOLUTION` lines split it over several blocks); variants are named <exercise id>__<what>.py. The main
wrong answers of a notebook go into one submission; each variant into a submission of its own (its other
exercises left unsolved, so only the variant is probed; only the variants aimed at the grading itself, as each
lesson's own tests run every variant, see LESSON_TESTS); the grader
(course_utils.grading) grades them all in one pass per notebook. On a CPU-only machine a GPU exercise may skip
(0 points) instead of failing; under COURSE_REQUIRE_GPU=1 it must fail. Exercises are discovered in
notebooks/*.ipynb when the tests run.
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


# Every lesson's own test file (tests/lessons/test_<stem>.py) runs every one of its wrong-answer files through the
# notebook's check and asserts its verdict and message (parametrized over the folder, so no file is left out).
# Through the grader, a lesson's main wrong answers go together (all_wrong) with only the variants aimed at the
# grading itself; grading its other variants here again cost about a minute of CI per lesson (and, for 01-04, GPU
# time on a GPU machine, where their timing checks run one at a time).
LESSON_TESTS = ROOT / "tests" / "lessons"


# Aimed at the grading itself, or (the last two) at a measurement the grader's probe takes afresh.
GRADING_VARIANTS = ("equal_to_anything", "always_equal", "reads_the_check", "uses_the_check", "hangs", "uses_bench",
                    "changes_workload_class", "fake_copy_spans")


def through_the_grader(variant: str) -> bool:
    """Whether the variant file `variant` (<exercise id>__<what>) is graded here."""
    return variant.split("__")[-1].endswith(GRADING_VARIANTS)


@pytest.mark.parametrize("master", PARAMS, **IDS)
def test_each_lesson_runs_every_one_of_its_wrong_answers(master):
    test_file = LESSON_TESTS / f"test_{master.stem}.py"
    assert test_file.is_file(), f"lesson {master.stem} has no tests: write {test_file.relative_to(ROOT)}"
    text = test_file.read_text()
    assert master.stem in text, f"{test_file.name} is not lesson {master.stem}'s test"
    assert "WRONG.glob(" in text, f"{test_file.name} does not run every file of tests/wrong_answers/{master.stem}/"


@pytest.fixture(scope="module")
def grader():
    with grading.Grader(grading.Options(jobs=2)) as g:
        yield g


@pytest.mark.slow
@pytest.mark.parametrize("master", PARAMS, **IDS)
def test_wrong_answers_fail_their_checks(grader, master, tmp_path):
    nb = nbformat.read(master, as_version=4)
    files = sorted((WRONG / master.stem).glob("*.py"))
    main = {f.stem: f.read_text() for f in files if "__" not in f.stem}
    if not main:
        pytest.fail(f"no wrong answers for {master.name}")
    subs = {"all_wrong": main} | {f.stem: {f.stem.split("__")[0]: f.read_text()} for f in files
                                  if "__" in f.stem and through_the_grader(f.stem)}
    stubs = {ex.grade_id: release.STUB for ex in _exercises(master)}  # a variant's other exercises: not attempted
    items = []
    for name, answers in subs.items():
        path = tmp_path / name / master.name
        path.parent.mkdir()
        path.write_text(release.dumps(release.substitute(nb, {**stubs, **answers}, str(master))))
        items.append((path, master))
    allowed = {"failed"} if checks.require_gpu_mode() else {"failed", "skipped"}
    problems = []
    for (path, _), g in zip(items, grader.grade_all(items), strict=True):
        answers = subs[path.parent.name]
        for r in g.exercises:
            if r.grade_id not in answers:
                continue
            if "no check registered" in r.message:
                problems.append(f"{r.grade_id}: no check registered (register an Exercise in its checks module)")
            elif r.status not in allowed:
                problems.append(f"{path.parent.name}: {r.grade_id} {r.status}\n{grade.format_table(g)}")
            elif r.status == "failed" and not r.message:
                problems.append(f"{path.parent.name}: {r.grade_id} failed without a message")
        if path.parent.name == "all_wrong" and g.total != 0:
            problems.append(f"every answer wrong, yet {g.total:g} points\n{grade.format_table(g)}")
    assert not problems, "\n".join(problems)
