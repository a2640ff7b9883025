"""`pytest --nbmake` on a student notebook passes exactly when every exercise passes (or is skipped for want
of a GPU): an unsolved exercise raises NotImplementedError, a wrong one makes its check raise CheckFailed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from course_utils import checks, release

pytestmark = pytest.mark.grading

FIXTURES = Path(__file__).parent / "fixtures"
MASTER = FIXTURES / "grading" / "99_fixture.ipynb"
IDS = ["ex99_add", "ex99_mean", "ex99_gpu", "ex99_scale"]


def test_nbmake_passes_exactly_when_every_exercise_does(tmp_path):
    m = nbformat.read(MASTER, as_version=4)
    wrong_add = (FIXTURES / "wrong_answers" / MASTER.stem / "ex99_add.py").read_text()
    notebooks = {
        "completed": release.student_version(m, "fixture", completed=IDS),
        "unsolved": release.student_version(m, "fixture"),
        "one_missing": release.student_version(m, "fixture", completed=IDS[1:]),
        "one_wrong": release.substitute(m, {"ex99_add": wrong_add}, "fixture"),
    }
    for name, nb in notebooks.items():
        (tmp_path / f"{name}.ipynb").write_text(release.dumps(nb))
    shutil.copy(MASTER.parent / "fixture_checks.py", tmp_path)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--nbmake", "--nbmake-timeout=120",
           "--junitxml=report.xml", *[f"{name}.ipynb" for name in notebooks]]
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}  # the outer run's options stay out
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    report = ET.parse(tmp_path / "report.xml").getroot()
    outcome = {}
    for case in report.iter("testcase"):
        name = Path(case.get("file") or case.get("classname") or case.get("name")).stem
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome[name.split(".")[0]] = "failed" if failed else "passed"
    # On a CPU-only machine the GPU exercise skips, which nbmake counts as passing; under COURSE_REQUIRE_GPU=1
    # it must run for real, so a CPU-only machine then fails the completed notebook too.
    completed = "failed" if checks.require_gpu_mode() and not checks.gpu_available() else "passed"
    assert outcome == {"completed": completed, "unsolved": "failed", "one_missing": "failed",
                       "one_wrong": "failed"}, proc.stdout[-3000:]
    assert proc.returncode == (0 if all(v == "passed" for v in outcome.values()) else 1)
    assert "NotImplementedError" in proc.stdout and "CheckFailed" in proc.stdout
