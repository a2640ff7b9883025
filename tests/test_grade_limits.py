"""Submissions that misbehave are cut off and still scored; the grader never hangs and leaves nothing running.

Two levels: the grader (probes with time limits, the feedback run with its limits), and the notebook runner of
the feedback run itself (tiny notebooks without torch, so each kernel is cheap).
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import nbformat
import pytest

from course_utils import release
from course_utils.grading import grade as grading
from course_utils.grading.notebook import run_notebook
from tests.launch_helpers import processes_with

pytestmark = pytest.mark.grading

FIXTURES = Path(__file__).parent / "fixtures"
MASTER = FIXTURES / "grading" / "99_fixture.ipynb"
CHECKS_MODULE = str(FIXTURES / "grading" / "fixture_checks.py")
CELL_TIMEOUT = 3


def _cell(source):
    return nbformat.v4.new_code_cell(source)


def _nb(*sources):
    nb = nbformat.v4.new_notebook(cells=[_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


# ---------------------------------------------------------------------------------------------- the grader


@pytest.fixture(scope="module")
def grader():
    options = grading.Options(cell_timeout=CELL_TIMEOUT, timeout=60, checks_modules=(CHECKS_MODULE,),
                              max_cell_output=200_000)
    with grading.Grader(options) as g:
        yield g


def _submit(tmp_path: Path, name: str, add_region: str) -> Path:
    m = nbformat.read(MASTER, as_version=4)
    nb = release.substitute(m, {"ex99_add": add_region}, "fixture")
    path = tmp_path / name / "99_fixture.ipynb"
    path.parent.mkdir(parents=True)
    path.write_text(release.dumps(nb))
    return path


def test_infinite_loop_is_cut_off_and_the_rest_still_graded(grader, tmp_path, monkeypatch):
    from course_utils import gpu_lock

    waited = []  # seconds spent waiting for the GPU locks (held by GPU tests running beside this one)

    def timed_take(ids, what=""):
        t = time.monotonic()
        try:
            return take(ids, what)
        finally:
            waited.append(time.monotonic() - t)

    take = gpu_lock.take
    monkeypatch.setattr(gpu_lock, "take", timed_take)
    path = _submit(tmp_path, "loop", "while True:\n    pass")
    t0 = time.monotonic()
    g = grader.grade(path, MASTER)
    got = g.by_id()
    assert got["ex99_add"].status == "failed" and f"time limit of {CELL_TIMEOUT} s" in got["ex99_add"].message
    # every other exercise earns its points: 3 on a CPU machine (ex99_gpu is skipped there), more on a GPU box
    assert got["ex99_mean"].status == "passed" and g.total == g.max_points - got["ex99_add"].points - g.skipped_points
    assert g.total >= 3
    # cut off at CELL_TIMEOUT, not left to run until the submission's limit (600 s); the rest is probes starting
    # and running, which took 30 s on a loaded 2-core machine
    assert time.monotonic() - t0 - sum(waited) < CELL_TIMEOUT + 90, waited


def test_exit_with_the_pass_line_is_scored_as_failed_and_the_rest_still_graded(grader, tmp_path):
    path = _submit(tmp_path, "exit", "import os\nprint('passed: ex99_add')\nos._exit(0)")
    got = grader.grade(path, MASTER).by_id()
    assert got["ex99_add"].status == "failed" and "ended without a result (exit code 0)" in got["ex99_add"].message
    assert got["ex99_mean"].status == "passed"


def test_the_submission_time_limit_stops_its_probes(tmp_path):
    path = _submit(tmp_path, "slow", "import time\ntime.sleep(3)\nreturn a + b")
    options = grading.Options(cell_timeout=10, timeout=2, checks_modules=(CHECKS_MODULE,))
    with grading.Grader(options) as g:
        got = g.grade(path, MASTER)
    statuses = [r.status for r in got.exercises]
    assert statuses[0] == "failed" and "time limit of 2 s" in got.exercises[0].message
    assert any("the submission's time limit of 2 s was used up" in r.message for r in got.exercises[1:]), statuses
    assert got.total == 0 and "time limit" in got.stopped


def test_feedback_run_is_capped_and_written(tmp_path):
    flood = "import sys\nfor _ in range(100):\n    sys.stdout.write('x' * 1_000_000)\nreturn a + b"
    path = _submit(tmp_path, "flood", flood)
    executed = tmp_path / "executed"
    options = grading.Options(cell_timeout=60, timeout=120, checks_modules=(CHECKS_MODULE,),
                              max_cell_output=200_000, executed_dir=executed)
    t0 = time.monotonic()
    with grading.Grader(options) as g:
        got = g.grade(path, MASTER)
    assert got.by_id()["ex99_add"].status == "passed"  # the probe's output goes nowhere; the answer is right
    (kept,) = executed.iterdir()
    text = kept.read_text()
    assert len(text) < 1_000_000  # 100 MB went by in the check cell's call of add; a fifth of a MB was kept
    outputs = [o for c in json.loads(text)["cells"] for o in c.get("outputs", [])]
    assert any("output cut here" in "".join(o.get("text", "")) for o in outputs)
    assert time.monotonic() - t0 < 90


# ---------------------------------------------------------------------------------------------- the notebook runner


def test_runner_loop_is_interrupted_and_later_cells_run():
    run = run_notebook(_nb("while True:\n    pass", "print('after')"), cell_timeout=CELL_TIMEOUT, timeout=30)
    assert run.cells[0].status == "timeout" and "time limit" in run.cells[0].evalue
    assert run.cells[1].status == "ok" and run.cells[1].stdout == "after\n"


def test_runner_kernel_exit_ends_the_run():
    run = run_notebook(_nb("import os\nos._exit(0)", "print('never')"), cell_timeout=10, timeout=30)
    assert run.cells[0].ename == "DeadKernelError" and run.cells[1].status == "not run"
    assert "kernel died" in run.stopped


def test_runner_kills_a_kernel_that_ignores_interrupts():
    stubborn = "import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass"
    t0 = time.monotonic()
    run = run_notebook(_nb(stubborn, "print('never')"), cell_timeout=CELL_TIMEOUT, timeout=30)
    assert "ignored the interrupt" in run.stopped and run.cells[1].status == "not run"
    assert time.monotonic() - t0 < CELL_TIMEOUT + 25


def test_runner_notebook_time_limit():
    run = run_notebook(_nb("import time\ntime.sleep(20)", "print('never')"), cell_timeout=20, timeout=4)
    assert "the notebook time limit of 4 s was reached" in run.stopped
    assert run.cells[1].status == "not run"


def test_runner_sandbox_is_throwaway_and_fenced(tmp_path):
    outside = tmp_path / "outside.txt"
    code = (f"import os\nprint(os.getcwd()); print(os.environ['HOME']); print(get_ipython().profile_dir.location)\n"
            f"try:\n    open({str(outside)!r}, 'w').write('x'); print('written')\nexcept OSError:\n"
            "    print('denied')")
    run = run_notebook(_nb(code), cell_timeout=20, timeout=30)
    cwd, home, profile, verdict = run.cells[0].stdout.split("\n")[:4]
    root = Path(cwd).parent
    assert root.name.startswith("course-notebook-") and home == str(root / "home")
    assert profile.startswith(str(root / "ipython"))
    assert not root.exists()
    assert verdict == "denied" and not outside.exists()


def test_runner_kills_processes_started_by_the_notebook():
    """A child and a setsid'd orphan of the kernel (it once outlived the whole run, as the student's uid) end
    with the kernel's sandbox."""
    marker = f"left-behind-{uuid.uuid4().hex}"
    start = ("import os, subprocess, sys, time\n"
             f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)  # {marker}'])\n"
             "if os.fork() == 0:\n    os.setsid()\n"
             f"    os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(301)  # {marker}'])\n"
             "time.sleep(1)\nprint('started')")
    run = run_notebook(_nb(start, "import os\nos._exit(3)"), cell_timeout=10, timeout=20)
    assert run.cells[0].stdout == "started\n", run.cells[0]
    assert run.stopped == "the kernel died in cell 1"
    assert processes_with(marker) == []


def test_runner_sees_nothing_of_ours(tmp_path):
    secret = tmp_path / "99_master.ipynb"
    secret.write_text("the solution")
    code = (f"import os\nprint(os.path.exists({str(secret)!r}), "
            "sorted(int(p) for p in os.listdir('/proc') if p.isdigit())[:1])")
    run = run_notebook(_nb(code), cell_timeout=20, timeout=30)
    assert run.cells[0].stdout == "False [1]\n", run.cells[0]
