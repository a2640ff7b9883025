"""Student versions: solutions out, outputs cleared, checks locked, deterministic; broken masters refused.

No kernel runs here: these are the fast structural tests (grading by execution is in test_grade*.py).
"""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest

from course_utils import release

FIXTURES = Path(__file__).parent / "fixtures"
MASTER = FIXTURES / "grading" / "99_fixture.ipynb"


def master():
    return nbformat.read(MASTER, as_version=4)


def test_fixture_master_structure():
    found = release.exercises(master(), "fixture")
    assert [(ex.grade_id, ex.points) for ex in found] == [("ex99_add", 2), ("ex99_mean", 3), ("ex99_gpu", 1),
                                                          ("ex99_scale", 2)]
    assert [len(ex.solution_indices) for ex in found] == [1, 2, 1, 1]


def test_student_version_replaces_solutions_keeps_indentation_and_locks_checks():
    nb = master()
    nb.cells[1].outputs = [nbformat.v4.new_output("stream", name="stdout", text="old output")]
    nb.cells[1].execution_count = 7
    nb.cells[1].metadata["execution"] = {"iopub.status.busy": "2026-01-01T00:00:00Z"}
    student = release.student_version(nb, "fixture")
    sources = [c.source for c in student.cells]
    text = "\n".join(sources)
    for secret in ("return a + b", "return sum(xs)", "total(xs) / len(xs)", "torch.arange", "t.to(device) * k"):
        assert secret not in text
    assert "BEGIN SOLUTION" not in text and "END SOLUTION" not in text
    add = student.cells[3].source.split("\n")
    assert add[0] == "def add(a, b):" and add[2] == "    raise NotImplementedError()"  # indented like BEGIN
    assert student.cells[8].source == "def mean(xs):\n    raise NotImplementedError()\n\n\nprint(mean([1, 2, 3, 4]))"
    assert student.cells[11].source == "import torch\n\nraise NotImplementedError()"
    for cell in student.cells:
        if cell.cell_type == "code":
            assert cell.outputs == [] and cell.execution_count is None
            assert "execution" not in cell.metadata
    for ex in release.exercises(nb, "fixture"):
        check = student.cells[ex.check_index]
        assert check.source == nb.cells[ex.check_index].source
        assert check.metadata["editable"] is False and check.metadata["deletable"] is False
        assert check.metadata["nbgrader"]["locked"] is True
    assert [c.get("id") for c in student.cells] == [c.get("id") for c in nb.cells]
    assert master().cells[3].source != student.cells[3].source  # the master is untouched
    # The grader reads the same exercises from a student version.
    got = release.exercises(student, "student", require_markers=False)
    assert [ex.grade_id for ex in got] == ["ex99_add", "ex99_mean", "ex99_gpu", "ex99_scale"]


def test_the_unsolved_master_keeps_every_cell_but_the_solutions():
    master = nbformat.read(MASTER, as_version=4)
    unsolved = release.unsolved_master(master, "fixture")
    assert [ex.grade_id for ex in release.exercises(unsolved)] == [ex.grade_id for ex in release.exercises(master)]
    for a, b in zip(master.cells, unsolved.cells, strict=True):
        if release.is_solution_cell(a):
            blocks = release.solution_blocks(b.source, "unsolved")
            lines = b.source.split("\n")
            assert blocks and all([x.strip() for x in lines[s + 1:e]] == [release.STUB] for s, e in blocks)
            assert a.source != b.source
        else:
            assert a.source == b.source


def test_completed_exercises_keep_their_solution_without_markers():
    student = release.student_version(master(), "fixture", completed={"ex99_mean"})
    assert student.cells[7].source == "def total(xs):\n    return sum(xs)"
    assert student.cells[8].source == "def mean(xs):\n    return total(xs) / len(xs)\n\n\nprint(mean([1, 2, 3, 4]))"
    assert "raise NotImplementedError()" in student.cells[3].source
    with pytest.raises(release.ReleaseError, match="no exercise"):
        release.student_version(master(), "fixture", completed={"ex99_nope"})


def test_release_command_is_deterministic_and_refuses_to_overwrite_masters(tmp_path, capsys):
    src = tmp_path / "masters"
    src.mkdir()
    (src / MASTER.name).write_bytes(MASTER.read_bytes())
    plain = nbformat.v4.new_notebook(cells=[nbformat.v4.new_markdown_cell("no exercises here")])
    nbformat.write(plain, src / "00_plain.ipynb")
    assert release.main([str(src), str(tmp_path / "a")]) == 0
    assert release.main([str(src), str(tmp_path / "b")]) == 0
    assert "99_fixture.ipynb: 4 exercises, 8 points" in capsys.readouterr().out
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == ["00_plain.ipynb", "99_fixture.ipynb"]
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    # Releasing a student version's source again (same input) gives the same bytes as the first time.
    again = release.dumps(release.student_version(master(), "fixture"))
    assert (tmp_path / "a" / MASTER.name).read_text() == again
    assert release.main([str(src), str(src)]) == 2
    assert "overwrite the master" in capsys.readouterr().err
    assert (src / MASTER.name).read_bytes() == MASTER.read_bytes()


def _with_cell(source: str, meta: dict | None = None, where: int = 3):
    nb = master()
    cell = nbformat.v4.new_code_cell(source)
    if meta is not None:
        cell.metadata["nbgrader"] = meta
    nb.cells.insert(where, cell)
    return nb


SOL = {"solution": True, "grade": False, "grade_id": "ex99_extra_solution"}


@pytest.mark.parametrize(
    "nb, message",
    [
        (_with_cell("### BEGIN SOLUTION\nx = 1\n", SOL), "has no '### END SOLUTION'"),
        (_with_cell("x = 1\n### END SOLUTION", SOL), "without a '### BEGIN SOLUTION'"),
        (_with_cell("### BEGIN SOLUTION\n### BEGIN SOLUTION\n### END SOLUTION", SOL), "before the"),
        (_with_cell("x = 1  ### BEGIN SOLUTION", SOL), "is not exactly"),
        (_with_cell("### BEGIN SOLUTION\nx = 1\n### END SOLUTION", None), "without nbgrader solution metadata"),
        (_with_cell("x = 1", SOL), "would be released as is"),
        (_with_cell("check()", {"grade": True, "points": 1}), "has no grade_id"),
        (_with_cell("check()", {"grade": True, "grade_id": "ex99_x"}), "needs 'points'"),
        (_with_cell("check()", {"grade": True, "grade_id": "ex99_x", "points": "2"}), "needs 'points'"),
        (_with_cell("check()", {"grade": True, "grade_id": "ex99_add", "points": 1}, where=5), "duplicate grade_id"),
        (_with_cell("check()", {"grade": True, "grade_id": "ex99_x", "points": 1}, where=5), "no solution cell"),
        (_with_cell("### BEGIN SOLUTION\n### END SOLUTION", SOL, where=17), "not followed by a check cell"),
    ],
    ids=["no-end", "no-begin", "nested", "inline-marker", "no-metadata", "no-markers", "check-no-id",
         "check-no-points", "check-bad-points", "duplicate-id", "check-without-solution", "trailing-solution"],
)
def test_broken_masters_are_clear_errors(nb, message, tmp_path, capsys):
    with pytest.raises(release.ReleaseError, match=message):
        release.student_version(nb, "broken")
    path = tmp_path / "99_broken.ipynb"
    nbformat.write(nb, path)
    assert release.main([str(path), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "99_broken.ipynb" in err and message.split("'")[0].strip() in err
    assert not (tmp_path / "out").exists()  # nothing written when a master is broken


def test_duplicate_grade_id_across_notebooks_is_an_error(tmp_path, capsys):
    for name in ("98_one.ipynb", "99_two.ipynb"):
        (tmp_path / name).write_bytes(MASTER.read_bytes())
    assert release.main([str(tmp_path), str(tmp_path / "out")]) == 2
    assert "duplicate grade_id 'ex99_add' (also in" in capsys.readouterr().err


def test_substitute_indents_answers_and_fills_several_blocks():
    nb = release.substitute(master(), {"ex99_add": "# ruff: noqa\nreturn a - b\n"}, "fixture")
    assert nb.cells[3].source.endswith("\n    # ruff: noqa\n    return a - b")
    both = "return 0\n### NEXT SOLUTION\nreturn 1\n"
    nb = release.substitute(master(), {"ex99_mean": both}, "fixture")
    assert nb.cells[7].source == "def total(xs):\n    return 0"
    assert nb.cells[8].source == "def mean(xs):\n    return 1\n\n\nprint(mean([1, 2, 3, 4]))"
    one = release.substitute(master(), {"ex99_mean": "return 0"}, "fixture")
    assert one.cells[8].source == master().cells[8].source  # blocks with no replacement keep the master's
    with pytest.raises(release.ReleaseError, match="no exercise"):
        release.substitute(master(), {"ex42_missing": "x = 1"}, "fixture")


def test_fixture_wrong_answers_name_real_exercises():
    ids = {ex.grade_id for ex in release.exercises(master(), "fixture")}
    files = {p.stem.split("__")[0] for p in (FIXTURES / "wrong_answers" / MASTER.stem).glob("*.py")}
    assert files == ids


def test_answers_written_at_the_blocks_indentation_are_not_indented_twice():
    already = "# ruff: noqa: F821\n    # a comment\n    return a - b\n"
    nb = release.substitute(master(), {"ex99_add": already}, "fixture")
    assert nb.cells[3].source.split("\n")[-3:] == ["    # ruff: noqa: F821", "    # a comment", "    return a - b"]
