"""The grader's parts that need no kernel: putting the master's checks back, scoring rules, reports."""

from __future__ import annotations

import csv
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from course_utils import grade, release
from course_utils._notebook_exec import CellRun, NotebookRun

MASTER = Path(__file__).parent / "fixtures" / "grading" / "99_fixture.ipynb"


def master():
    return nbformat.read(MASTER, as_version=4)


def check_positions(nb, roles):
    return {gid: i for i, (role, gid) in roles.items() if role == "check"}


def test_checks_come_from_the_master_even_when_edited_or_deleted():
    m = master()
    sub = release.student_version(m, "fixture")
    sub.cells[4].source = "pass  # edited check"  # keeps its metadata
    del sub.cells[9]  # the ex99_mean check
    sub.cells.insert(9, nbformat.v4.new_code_cell("scratch = 1  # a cell the student added"))
    sub.cells[12].metadata = {}  # the gpu check, metadata stripped: still recognised by its cell id
    sub.cells[12].source = "pass"
    nb, exercises, roles = grade.assemble(sub, m, "fixture")
    where = check_positions(nb, roles)
    for ex in exercises:
        assert nb.cells[where[ex.grade_id]].source == m.cells[ex.check_index].source
    assert "pass  # edited check" not in [c.source for c in nb.cells]
    assert sum(c.source == "pass" for c in nb.cells) == 0
    # ex99_mean's check goes after the student's added cell and before the next master cell.
    ids = [c.get("id") for c in nb.cells]
    mean = where["ex99_mean"]
    assert nb.cells[mean - 1].source.startswith("scratch = 1")
    assert ids[mean + 1] == "ex-gpu-prompt"
    assert [gid for _, gid in sorted((i, g) for g, i in where.items())] == ["ex99_add", "ex99_mean", "ex99_gpu"]
    solutions = sorted(i for i, (role, gid) in roles.items() if role == "solution" and gid == "ex99_mean")
    assert [ids[i] for i in solutions] == ["ex-mean-solution-1", "ex-mean-solution-2"]


def test_checks_of_a_submission_with_no_matching_cells_go_to_the_end():
    m = master()
    sub = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('something else entirely')")])
    sub.metadata["kernelspec"] = {"name": "some-env", "display_name": "x", "language": "python"}
    nb, _, roles = grade.assemble(sub, m, "fixture")
    assert [c.source for c in nb.cells[1:]] == ["fc.check_add(add)", "fc.check_mean(values, mean)",
                                                "fc.check_gpu_double(x)"]
    assert nb.metadata["kernelspec"]["name"] == "python3"  # the master's kernel, not the student's


def _run(cells: dict[int, CellRun], stopped: str = "") -> NotebookRun:
    return NotebookRun(cells=cells, stopped=stopped)


EX = [release.Exercise("ex_a", 2, 1, [0])]
ROLES = {0: ("solution", "ex_a"), 1: ("check", "ex_a")}


@pytest.mark.parametrize(
    "solution, check, stopped, status, message",
    [
        (CellRun(0, "ok"), CellRun(1, "ok", stdout="passed: ex_a\n"), "", "passed", ""),
        (CellRun(0, "ok"), CellRun(1, "ok", stdout=""), "", "passed", ""),
        (CellRun(0, "ok"), CellRun(1, "ok", stdout="skipped: needs a GPU (ex_a ...)\n"), "", "skipped", "needs a GPU"),
        (CellRun(0, "ok"), CellRun(1, "error", "CheckFailed", "ex_a: expected 5, saw 4"), "", "failed",
         "ex_a: expected 5, saw 4"),
        (CellRun(0, "error", "ZeroDivisionError", "division by zero"), CellRun(1, "error", "NameError", "name 'y'"),
         "", "failed", "NameError: name 'y' (a solution cell raised ZeroDivisionError: division by zero)"),
        (CellRun(0, "error", "NotImplementedError", ""), CellRun(1, "error", "NameError", "x"), "", "not attempted",
         "still raises NotImplementedError"),
        (CellRun(0, "error", "NotImplementedError", ""), CellRun(1, "ok", stdout="passed: ex_a"), "", "not attempted",
         "still raises NotImplementedError"),
        (CellRun(0, "ok"), CellRun(1, "error", "NotImplementedError", ""), "", "not attempted", "NotImplementedError"),
        (CellRun(0, "timeout", "CellTimeoutError", "cell 0 ran past"), CellRun(1, "error", "NameError", "f"), "",
         "failed", "CellTimeoutError: cell 0 ran past"),
        (CellRun(0, "error", "DeadKernelError", "the kernel died"), CellRun(1, "not run"), "the kernel died in cell 0",
         "failed", "the check did not run: the kernel died in cell 0"),
    ],
    ids=["pass", "pass-silent", "skip", "checkfailed", "other-error", "nie-solution", "nie-solution-but-check-ok",
         "nie-in-check", "timeout", "kernel-died"],
)
def test_scoring_rules(solution, check, stopped, status, message):
    (result,) = grade.score(EX, ROLES, _run({0: solution, 1: check}, stopped))
    assert result.status == status
    assert message in result.message
    assert result.score == (2 if status == "passed" else 0)


def test_find_master_by_name(tmp_path):
    for name in ("02_cuda_streams.ipynb", "03_cuda_events.ipynb", "03_cuda_events_extra.ipynb"):
        (tmp_path / name).write_text("{}")
    sub = Path("alice") / "02_cuda_streams.ipynb"
    assert grade.find_master(sub, tmp_path).name == "02_cuda_streams.ipynb"
    assert grade.find_master(Path("bob_02_cuda_streams (1).ipynb"), tmp_path).name == "02_cuda_streams.ipynb"
    assert grade.find_master(Path("x_03_cuda_events_extra.ipynb"), tmp_path).name == "03_cuda_events_extra.ipynb"
    with pytest.raises(grade.GradeError, match="cannot tell which master"):
        grade.find_master(Path("homework.ipynb"), tmp_path)
    with pytest.raises(grade.GradeError, match="no master notebooks"):
        grade.find_master(sub, tmp_path / "empty")


def _grades():
    a = grade.Grade("s/alice.ipynb", "notebooks/99_fixture.ipynb", [
        grade.ExerciseResult("ex99_add", 2, 2, "passed"),
        grade.ExerciseResult("ex99_mean", 3, 0, "failed", "ex99_mean: expected mean 2.5, saw 2.0"),
        grade.ExerciseResult("ex99_gpu", 1, 0, "skipped", "needs a GPU"),
    ], seconds=3.0)
    b = grade.Grade("s/bob.ipynb", "notebooks/99_fixture.ipynb", [
        grade.ExerciseResult("ex99_add", 2, 0, "not attempted", "a solution cell still raises NotImplementedError"),
        grade.ExerciseResult("ex99_mean", 3, 3, "passed"),
        grade.ExerciseResult("ex99_gpu", 1, 0, "skipped", "needs a GPU"),
    ], seconds=2.0, stopped="the kernel died in cell 12")
    return [a, b]


def test_csv_has_a_row_per_submission_and_a_column_per_exercise(tmp_path):
    path = tmp_path / "scores.csv"
    grade.write_csv(_grades(), path)
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == ["submission", "master", "ex99_add", "ex99_mean", "ex99_gpu", "total", "max", "notes"]
    assert [(r["submission"], r["ex99_add"], r["ex99_mean"], r["total"], r["max"]) for r in rows] == [
        ("s/alice.ipynb", "2", "0", "2", "6"), ("s/bob.ipynb", "0", "3", "3", "6")]
    assert "ex99_gpu: skipped" in rows[0]["notes"] and "ex99_mean: failed" in rows[0]["notes"]
    assert rows[1]["notes"].startswith("the kernel died in cell 12")


def test_junit_reports_each_exercise(tmp_path):
    path = tmp_path / "grades.xml"
    grade.write_junit(_grades(), path)
    root = ET.parse(path).getroot()
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["s/alice.ipynb", "s/bob.ipynb"]
    assert (suites[0].get("tests"), suites[0].get("failures"), suites[0].get("skipped")) == ("3", "1", "1")
    cases = {c.get("name"): c for c in suites[0].findall("testcase")}
    assert cases["ex99_add"].find("failure") is None and cases["ex99_add"].find("skipped") is None
    assert cases["ex99_mean"].find("failure").get("message") == "ex99_mean: expected mean 2.5, saw 2.0"
    assert cases["ex99_gpu"].find("skipped") is not None
    bob = {c.get("name"): c for c in suites[1].findall("testcase")}
    assert bob["ex99_add"].find("failure").get("type") == "not attempted"


def test_table_shows_scores_and_total():
    text = grade.format_table(_grades()[0])
    assert "ex99_mean" in text and "0/3" in text and "expected mean 2.5" in text
    assert "total" in text and "2/6" in text and "1 points skipped" in text


def test_unreadable_submission_scores_zero_without_running(tmp_path):
    bad = tmp_path / "99_fixture.ipynb"
    bad.write_text("{ not json")
    g = grade.grade_notebook(bad, MASTER)
    assert g.total == 0 and {r.status for r in g.exercises} == {"failed"}
    assert g.stopped.startswith("cannot read the submission")


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    assert grade.main([str(tmp_path / "missing.ipynb")]) == 2
    assert "no such file" in capsys.readouterr().err
    sub = tmp_path / "homework.ipynb"
    sub.write_text("{}")
    assert grade.main([str(sub), "--master-dir", str(MASTER.parent)]) == 2
    assert "cannot tell which master" in capsys.readouterr().err
