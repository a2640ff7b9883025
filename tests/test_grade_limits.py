"""Submissions that misbehave are cut off and still scored; the grader never hangs and leaves nothing running.

A tiny master (no torch import, so each kernel is cheap) with two exercises; the first one misbehaves in each
submission, the second is solved, so we also see that grading goes on after the bad cell when it can.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import nbformat
import pytest

from course_utils import grade, release
from course_utils._notebook_exec import run_notebook

CELL_TIMEOUT = 3


def _cell(source, meta=None):
    cell = nbformat.v4.new_code_cell(source)
    if meta:
        cell.metadata["nbgrader"] = meta
    return cell


def _master() -> nbformat.NotebookNode:
    def sol(gid):
        return {"solution": True, "grade": False, "locked": False, "grade_id": f"{gid}_solution", "schema_version": 3}

    def chk(gid):
        return {"grade": True, "solution": False, "locked": True, "grade_id": gid, "points": 1, "schema_version": 3}

    cells = [
        _cell("from course_utils import checks"),
        _cell("### BEGIN SOLUTION\nfirst = 42\n### END SOLUTION", sol("ex98_first")),
        _cell('checks.expect(first == 42, "ex98_first", "42", first)\nchecks.passed("ex98_first")', chk("ex98_first")),
        _cell("### BEGIN SOLUTION\nsecond = 7\n### END SOLUTION", sol("ex98_second")),
        _cell('checks.expect(second == 7, "ex98_second", "7", second)', chk("ex98_second")),
    ]
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


@pytest.fixture(scope="module")
def master_path(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("limits") / "98_limits.ipynb"
    path.write_text(release.dumps(_master()))
    return path


def _grade(master_path: Path, first: str, **limits) -> tuple[grade.Grade, float]:
    sub = release.substitute(_master(), {"ex98_first": first})
    path = master_path.parent / "submissions" / f"{len(first)}_98_limits.ipynb"
    path.parent.mkdir(exist_ok=True)
    path.write_text(release.dumps(sub))
    options = {"cell_timeout": CELL_TIMEOUT, "timeout": 30, **limits}
    t0 = time.monotonic()
    g = grade.grade_notebook(path, master_path, executed_dir=master_path.parent / "executed", **options)
    return g, time.monotonic() - t0


def test_infinite_loop_is_cut_off_and_the_rest_still_graded(master_path):
    g, seconds = _grade(master_path, "while True:\n    pass")
    first, second = g.exercises
    assert first.status == "failed" and "time limit of 3 s" in first.message
    assert second.status == "passed" and g.total == 1
    assert seconds < CELL_TIMEOUT + 20


def test_kernel_exit_is_scored_and_ends_the_run(master_path):
    g, seconds = _grade(master_path, "import os\nos._exit(0)")
    assert [r.status for r in g.exercises] == ["failed", "failed"]
    assert "kernel died" in g.stopped
    assert "did not run: the kernel died" in g.exercises[1].message
    assert seconds < 30


def test_a_kernel_that_ignores_interrupts_is_killed(master_path):
    stubborn = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass"
    g, seconds = _grade(master_path, stubborn)
    assert [r.status for r in g.exercises] == ["failed", "failed"]
    assert "ignored the interrupt" in g.stopped
    assert seconds < CELL_TIMEOUT + 25


def test_notebook_time_limit(master_path):
    g, seconds = _grade(master_path, "import time\ntime.sleep(20)\nfirst = 42", timeout=4, cell_timeout=20)
    assert [r.status for r in g.exercises] == ["failed", "failed"]
    assert "the notebook time limit of 4 s was reached" in g.stopped
    assert "did not run" in g.exercises[1].message
    assert seconds < 20


def test_100_mb_of_output_is_capped(master_path):
    flood = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)\nfirst = 42"
    g, seconds = _grade(master_path, flood, max_cell_output=200_000)
    assert [r.status for r in g.exercises] == ["passed", "passed"]
    executed = master_path.parent / "executed"
    (kept,) = [p for p in executed.iterdir() if p.name.endswith(f"__{len(flood)}_98_limits.ipynb")]
    text = kept.read_text()
    assert len(text) < 1_000_000  # 100 MB went by; a fifth of a MB was kept
    outputs = [o for c in json.loads(text)["cells"] for o in c.get("outputs", [])]
    assert any("output cut here" in "".join(o.get("text", "")) for o in outputs)
    assert seconds < 60


def test_processes_started_by_the_notebook_are_killed(tmp_path):
    psutil = pytest.importorskip("psutil")
    nb = nbformat.v4.new_notebook(cells=[
        _cell("import subprocess\nchild = subprocess.Popen(['sleep', '300'])\nprint(child.pid)"),
        _cell("import os\nos._exit(3)"),
    ])
    run = run_notebook(nb, cwd=tmp_path, cell_timeout=10, timeout=20)
    pid = int(run.cells[0].stdout)
    time.sleep(0.5)
    alive = psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    assert not alive, f"process {pid} started by the notebook is still running"
    assert run.stopped == "the kernel died in cell 1"
