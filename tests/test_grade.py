"""Grading a class of fixture submissions with one command: masters full marks, student versions zero,
one solved exercise scores exactly its points, wrong answers fail, tampered checks earn nothing.

The fixture lesson (tests/fixtures/grading/99_fixture.ipynb) has three exercises; ex99_gpu needs CUDA, so on a
CPU-only machine it is "skipped" (0 points, not passed); on a GPU machine it must pass, and under
COURSE_REQUIRE_GPU=1 without a GPU it fails.
"""

from __future__ import annotations

import csv
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from course_utils import checks, release

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
MASTER = FIXTURES / "grading" / "99_fixture.ipynb"
IDS = ["ex99_add", "ex99_mean", "ex99_gpu"]
POINTS = {"ex99_add": 2, "ex99_mean": 3, "ex99_gpu": 1}


def gpu_outcome(right: bool) -> str:
    """What the GPU-only exercise reports here: needs CUDA to pass, fails if a GPU is required and absent."""
    if checks.gpu_available():
        return "passed" if right else "failed"
    return "failed" if checks.require_gpu_mode() else "skipped"


def wrong_answers(stem: str) -> dict[str, str]:
    return {p.stem: p.read_text() for p in sorted((FIXTURES / "wrong_answers" / stem).glob("*.py"))}


def _write(nb, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(release.dumps(nb))


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Five submissions graded by one command (-j 2); returns (statuses, messages, scores, totals, seconds)."""
    base = tmp_path_factory.mktemp("class")
    m = nbformat.read(MASTER, as_version=4)
    wrong = release.substitute(m, wrong_answers(MASTER.stem), "fixture")  # markers go with the solutions
    tampered = release.student_version(m, "fixture")
    tampered.cells[3].source = tampered.cells[3].source.replace("raise NotImplementedError()", "return 0")
    tampered.cells[4].source = "pass"  # the ex99_add check, edited
    tampered.cells[7].source = "values = [1, 2, 3]"
    tampered.cells[8].source = "mean = 2.0\nprint(mean)"
    del tampered.cells[9]  # the ex99_mean check, deleted
    subs = {
        "master": m,
        "student": release.student_version(m, "fixture"),
        "one": release.student_version(m, "fixture", completed={"ex99_mean"}),
        "wrong": wrong,
        "tampered": tampered,
    }
    for who, nb in subs.items():
        _write(nb, base / "class" / who / f"{who}_99_fixture.ipynb")
    cmd = [sys.executable, "-m", "course_utils.grade", "class", "--master-dir", str(MASTER.parent), "-j", "2",
           "--csv", "scores.csv", "--junit", "grades.xml", "--timeout", "120", "--cell-timeout", "60"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=base, capture_output=True, text=True, timeout=300)
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    statuses, messages = {}, {}
    for suite in ET.parse(base / "grades.xml").getroot().findall("testsuite"):
        who = Path(suite.get("name")).parent.name
        for case in suite.findall("testcase"):
            failure, skipped = case.find("failure"), case.find("skipped")
            status = failure.get("type") if failure is not None else ("skipped" if skipped is not None else "passed")
            statuses[who, case.get("name")] = status
            messages[who, case.get("name")] = failure.get("message") if failure is not None else ""
    rows = {Path(r["submission"]).parent.name: r for r in csv.DictReader((base / "scores.csv").open())}
    return statuses, messages, rows, proc.stdout, seconds


def test_one_command_grades_the_class(graded):
    statuses, _, rows, out, seconds = graded
    assert sorted(rows) == ["master", "one", "student", "tampered", "wrong"]
    assert list(next(iter(rows.values())))[2:5] == IDS
    assert "5 submissions graded" in out and "total" in out
    assert seconds < 200


def test_master_scores_full_marks(graded):
    statuses, _, rows, _, _ = graded
    assert [statuses["master", i] for i in IDS] == ["passed", "passed", gpu_outcome(right=True)]
    expected = sum(POINTS[i] for i in IDS if statuses["master", i] == "passed")
    assert float(rows["master"]["total"]) == expected
    assert float(rows["master"]["max"]) == 6


def test_released_student_version_scores_zero_not_attempted(graded):
    statuses, _, rows, _, _ = graded
    assert [statuses["student", i] for i in IDS] == ["not attempted"] * 3
    assert float(rows["student"]["total"]) == 0


def test_one_solved_exercise_scores_exactly_its_points(graded):
    statuses, _, rows, _, _ = graded
    assert [statuses["one", i] for i in IDS] == ["not attempted", "passed", "not attempted"]
    assert float(rows["one"]["total"]) == POINTS["ex99_mean"]
    assert [rows["one"][i] for i in IDS] == ["0", "3", "0"]


def test_wrong_answers_fail_with_the_checks_message(graded):
    statuses, messages, rows, _, _ = graded
    assert [statuses["wrong", i] for i in IDS] == ["failed", "failed", gpu_outcome(right=False)]
    assert messages["wrong", "ex99_add"] == "ex99_add: expected add(2, 3) == 5, saw -1"
    assert "expected values [1, 2, 3, 4], saw [1, 2, 3]" in messages["wrong", "ex99_mean"]
    assert float(rows["wrong"]["total"]) == 0


def test_edited_or_deleted_checks_earn_nothing(graded):
    statuses, messages, rows, _, _ = graded
    assert statuses["tampered", "ex99_add"] == "failed"  # its `pass` was replaced by the master's check
    assert "saw 0" in messages["tampered", "ex99_add"]
    assert statuses["tampered", "ex99_mean"] == "failed"  # its deleted check was put back
    assert float(rows["tampered"]["total"]) == 0

