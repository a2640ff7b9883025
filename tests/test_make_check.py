"""`make check`: a student checks their own lessons as the grader scores them, with a table and an exit code.

Shown on the fixture lesson (tests/fixtures/grading/99_fixture.ipynb) in a workspace of its own: solved, unsolved
and wrong versions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from course_utils import release

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "grading"
MASTER = FIXTURE / "99_fixture.ipynb"
WRONG = {"ex99_add": "    return a - b\n"}


def make_check(workspace: Path, nb, master_dir: Path = FIXTURE) -> subprocess.CompletedProcess:
    (workspace / "notebooks").mkdir(parents=True)
    (workspace / "notebooks" / MASTER.name).write_text(release.dumps(nb))
    env = {**os.environ, "COURSE_CHECKS_MODULES": str(FIXTURE / "fixture_checks.py"), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("COURSE_REQUIRE_GPU", None)
    return subprocess.run(["make", "-s", "check", "NB=99_fixture", f"LAB_WORKSPACE={workspace}",
                           f"MASTER_DIR={master_dir}", f"PY={sys.executable}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("version", ["solved", "unsolved", "wrong"])
def test_make_check_reports_each_exercise_and_fails_unless_all_pass(version, tmp_path):
    master = nbformat.read(MASTER, as_version=4)
    nb = {"solved": master, "unsolved": release.student_version(master, "fixture"),
          "wrong": release.substitute(master, WRONG, "fixture")}[version]
    run = make_check(tmp_path / "ws", nb)
    out = run.stdout
    assert "\x1b" not in out + run.stderr  # a plain table, no colour codes
    for gid in ("ex99_add", "ex99_mean", "ex99_gpu", "ex99_scale"):
        assert gid in out, out
    if version == "solved":
        assert run.returncode == 0, out + run.stderr
        assert "not attempted" not in out and "failed" not in out
        assert "skipped" in out  # the GPU exercise, on a machine without one
    elif version == "unsolved":
        assert run.returncode != 0, out + run.stderr  # (make passes on the command's 1 as its own 2)
        assert "not attempted" in out and "raise NotImplementedError()" in out
    else:
        assert run.returncode != 0, out + run.stderr  # (make passes on the command's 1 as its own 2)
        assert "failed" in out and "ex99_add" in out


def test_the_masters_without_their_solutions_score_as_the_masters_do(tmp_path):
    """Hub students cannot read the masters: their `make check` scores against release.unsolved_master copies."""
    master = nbformat.read(MASTER, as_version=4)
    unsolved = tmp_path / "grading"
    unsolved.mkdir()
    (unsolved / MASTER.name).write_text(release.dumps(release.unsolved_master(master, "fixture")))
    solved = make_check(tmp_path / "solved", master, unsolved)
    assert solved.returncode == 0 and "failed" not in solved.stdout, solved.stdout + solved.stderr
    wrong = make_check(tmp_path / "wrong", release.substitute(master, WRONG, "fixture"), unsolved)
    assert wrong.returncode != 0 and "failed" in wrong.stdout, wrong.stdout + wrong.stderr
