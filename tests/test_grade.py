"""Grading a class with one command (-j 4): exactly the honest submissions get their points.

The fixture lesson (tests/fixtures/grading/99_fixture.ipynb, checks in fixture_checks.py) has four exercises:
ex99_add, ex99_mean (two solution cells), ex99_gpu (needs CUDA: "skipped" on a CPU-only machine, a failure
under COURSE_REQUIRE_GPU=1) and ex99_scale (needs CUDA, with a CPU part: on CPU "skipped" once the CPU part
passes, "failed" if it does not).
"""

from __future__ import annotations

import csv
import os
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
CHECKS_MODULE = FIXTURES / "grading" / "fixture_checks.py"
IDS = ["ex99_add", "ex99_mean", "ex99_gpu", "ex99_scale"]
POINTS = {"ex99_add": 2, "ex99_mean": 3, "ex99_gpu": 1, "ex99_scale": 2}
sys.path.insert(0, str(FIXTURES / "grading"))
import attacks  # noqa: E402  (tests/fixtures/grading/attacks.py)

pytestmark = pytest.mark.grading

sys.path.remove(str(FIXTURES / "grading"))


def right(gid: str) -> str:
    """What a right answer to `gid` reports here."""
    if gid in ("ex99_add", "ex99_mean") or checks.gpu_available():
        return "passed"
    return "failed" if checks.require_gpu_mode() else "skipped"


def wrong_answers(stem: str) -> dict[str, str]:
    files = sorted((FIXTURES / "wrong_answers" / stem).glob("*.py"))
    return {p.stem: p.read_text() for p in files if "__" not in p.stem}


OWN = {  # right answers written differently from the master's
    "ex99_add": "total = 0\nfor v in (a, b):\n    total += v\nreturn total",
    "ex99_mean": "out = 0\nfor v in xs:\n    out = out + v\nreturn out\n"
                 "### NEXT SOLUTION\nreturn float(total(xs)) / len(xs)",
    "ex99_gpu": 'x = torch.tensor([0.0, 2.0, 4.0, 6.0]).to("cuda") if torch.cuda.is_available() else None',
    "ex99_scale": 'return (t * k).to("cuda" if torch.cuda.is_available() else "cpu")',
}


def extra_cells(m):
    """Wrong regions, and the right answers (plus pass lines) outside them: in set-up, check and added cells."""
    nb = release.substitute(m, {gid: ("return 0" if gid != "ex99_gpu" else "x = None") for gid in IDS}, "fixture")
    nb.cells[1].source += "\nadd = lambda a, b: a + b\nmean = lambda xs: sum(xs) / len(xs)"
    for cell in nb.cells:
        if release.is_check_cell(cell):
            cell.source = f"print('passed: {release.nbgrader_meta(cell)['grade_id']}')"
    nb.cells.insert(4, nbformat.v4.new_code_cell("def add(a, b):\n    return a + b"))
    return nb


def attack(m, body: str):
    flags = {"ex99_add": [True], "ex99_mean": [True, True], "ex99_gpu": [False], "ex99_scale": [True]}
    entries = {"ex99_add": "add", "ex99_mean": "mean", "ex99_gpu": "x", "ex99_scale": "scale"}
    from course_utils.grading import assemble

    return release.substitute(m, attacks.attack_answers(assemble.parse_master(m, MASTER), flags, entries, body, {}),
                              "fixture")


def _write(nb, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(release.dumps(nb))


def _grade(base: Path, folder: str, *args: str, env: dict | None = None):
    cmd = [sys.executable, "-m", "course_utils.grade", folder, "--master-dir", str(MASTER.parent),
           "--csv", f"{folder}.csv", "--junit", f"{folder}.xml", "--timeout", "120", "--cell-timeout", "60", *args]
    environment = {k: v for k, v in os.environ.items() if k != "COURSE_CHECKS_MODULES"}
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=base, capture_output=True, text=True, timeout=300,
                          env={**environment, **(env or {})})
    seconds = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout + proc.stderr
    statuses, messages = {}, {}
    for suite in ET.parse(base / f"{folder}.xml").getroot().findall("testsuite"):
        who = Path(suite.get("name")).parent.name
        for case in suite.findall("testcase"):
            failure, skipped = case.find("failure"), case.find("skipped")
            status = failure.get("type") if failure is not None else ("skipped" if skipped is not None else "passed")
            statuses[who, case.get("name")] = status
            messages[who, case.get("name")] = failure.get("message") if failure is not None else ""
    rows = {Path(r["submission"]).parent.name: r for r in csv.DictReader((base / f"{folder}.csv").open())}
    return statuses, messages, rows, proc.stdout, seconds


HONEST = ["master", "completed", "own"]
ATTACKING = ["shadow", "extra_cells", "equal_to_anything"]


@pytest.fixture(scope="module")
def graded(tmp_path_factory):
    """Three honest, three attacking, one unsolved, one half-solved, one wrong submission; one command, -j 4."""
    base = tmp_path_factory.mktemp("class")
    m = nbformat.read(MASTER, as_version=4)
    subs = {
        "master": m,
        "completed": release.student_version(m, "fixture", completed=IDS),
        "own": release.substitute(m, OWN, "fixture"),
        "shadow": attack(m, attacks.ATTACKS["shadow_check"]),
        "extra_cells": extra_cells(m),
        "equal_to_anything": attack(m, attacks.ATTACKS["equal_to_anything"]),
        "unsolved": release.student_version(m, "fixture"),
        "one": release.student_version(m, "fixture", completed={"ex99_mean"}),
        "wrong": release.substitute(m, wrong_answers(MASTER.stem), "fixture"),
    }
    for who, nb in subs.items():
        _write(nb, base / "class" / who / f"{who}_99_fixture.ipynb")
    return _grade(base, "class", "-j", "4", "--checks-module", str(CHECKS_MODULE))


def test_one_command_grades_the_class(graded):
    _, _, rows, out, seconds = graded
    assert sorted(rows) == sorted(HONEST + ATTACKING + ["unsolved", "one", "wrong"])
    assert list(next(iter(rows.values())))[3:7] == IDS
    assert all(row["student"] == who for who, row in rows.items())  # one folder per student
    assert "9 submissions graded" in out and "total" in out
    # No submission ran into its own time limit (--timeout 120). A bound on the class's wall time would fail on a
    # loaded machine, and says nothing about correctness.
    assert "time limit" not in out, out


@pytest.mark.parametrize("who", HONEST)
def test_honest_submissions_get_their_points(graded, who):
    statuses, _, rows, out, _ = graded
    assert [statuses[who, i] for i in IDS] == [right(i) for i in IDS], out
    assert float(rows[who]["total"]) == sum(POINTS[i] for i in IDS if right(i) == "passed")
    assert float(rows[who]["max"]) == 8


@pytest.mark.parametrize("who", ATTACKING + ["unsolved", "wrong"])
def test_the_others_get_nothing(graded, who):
    statuses, _, rows, out, _ = graded
    assert float(rows[who]["total"]) == 0, out
    assert all(statuses[who, i] != "passed" for i in IDS)


def test_unsolved_is_not_attempted_and_one_solved_scores_exactly_its_points(graded):
    statuses, _, rows, _, _ = graded
    assert [statuses["unsolved", i] for i in IDS] == ["not attempted"] * 4
    assert [statuses["one", i] for i in IDS] == ["not attempted", "passed", "not attempted", "not attempted"]
    assert [rows["one"][i] for i in IDS] == ["0", "3", "0", "0"]


def test_wrong_answers_fail_with_the_checks_message(graded):
    statuses, messages, _, _, _ = graded
    assert statuses["wrong", "ex99_add"] == "failed"
    assert messages["wrong", "ex99_add"] == "ex99_add: expected add(2, 3) == 5, saw -1"
    assert messages["wrong", "ex99_mean"].startswith("ex99_mean: expected mean([1, 2, 3, 4]) == 2.5, saw 2.25")
    assert statuses["wrong", "ex99_scale"] == "failed"  # its CPU part already fails
    assert statuses["wrong", "ex99_gpu"] == ("failed" if checks.gpu_available() else right("ex99_gpu"))


def test_cells_outside_the_regions_do_not_run(graded):
    statuses, messages, _, _, _ = graded
    assert statuses["extra_cells", "ex99_add"] == "failed" and "saw 0" in messages["extra_cells", "ex99_add"]


def test_checks_modules_come_from_the_option_or_the_environment(tmp_path):
    m = nbformat.read(MASTER, as_version=4)
    _write(m, tmp_path / "one" / "master" / "99_fixture.ipynb")
    statuses, messages, _, out, _ = _grade(tmp_path, "one")  # the fixture's checks are nowhere to be found
    assert statuses["master", "ex99_add"] == "failed"
    assert "no check registered for exercise 'ex99_add'" in messages["master", "ex99_add"]
    statuses, _, _, out, _ = _grade(tmp_path, "one", env={"COURSE_CHECKS_MODULES": str(CHECKS_MODULE)})
    assert statuses["master", "ex99_add"] == "passed", out
