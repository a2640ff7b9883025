"""A notebook whose Jupyter kernel dies before running a cell is started again (tests/conftest.py), with a
warning; one that dies every time, or dies in a cell, still fails."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from tests.test_gpu_mode import nested_env

ROOT = Path(__file__).resolve().parents[1]

# The kernel a kernelspec starts: it exits at once for its first `deaths` starts (counted in a file), like a
# kernel whose port was taken, and is an ordinary ipykernel after that.
FLAKY_KERNEL = """
import os, sys
count = os.path.join(os.path.dirname(os.path.abspath(__file__)), "starts")
n = int(open(count).read()) if os.path.exists(count) else 0
open(count, "w").write(str(n + 1))
if n < int(os.environ["DEATHS"]):
    os._exit(1)
from ipykernel import kernelapp
kernelapp.launch_new_instance()
"""


def _run(tmp_path: Path, deaths: int, cell: str = "print(6 * 7)") -> tuple[subprocess.CompletedProcess, int]:
    spec = tmp_path / "jupyter" / "kernels" / "flaky"
    spec.mkdir(parents=True)
    (spec / "flaky.py").write_text(FLAKY_KERNEL)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, str(spec / "flaky.py"), "-f", "{connection_file}"],
        "display_name": "flaky", "language": "python"}))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
    nb.metadata["kernelspec"] = {"name": "flaky", "display_name": "flaky", "language": "python"}
    nbformat.write(nb, tmp_path / "flaky.ipynb")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "tests.conftest", "--nbmake",
         "-n", "0", "--rootdir", str(tmp_path), str(tmp_path / "flaky.ipynb")],
        cwd=ROOT, env=nested_env(JUPYTER_PATH=str(tmp_path / "jupyter"), DEATHS=str(deaths)),
        capture_output=True, text=True, timeout=180)
    starts = int((spec / "starts").read_text()) if (spec / "starts").exists() else 0
    return res, starts


def test_a_kernel_that_died_before_its_first_cell_is_started_again_with_a_warning(tmp_path):
    res, starts = _run(tmp_path, deaths=1)
    out = res.stdout + res.stderr
    assert res.returncode == 0, out[-3000:]
    assert starts == 2
    assert "flaky.ipynb: the Jupyter kernel died before it ran a cell" in out, out[-3000:]


def test_a_kernel_that_dies_at_every_start_fails_the_notebook(tmp_path):
    res, starts = _run(tmp_path, deaths=99)
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "1 failed" in out, out[-3000:]
    assert starts == 3
    assert "Kernel died before replying to kernel_info" in out


def test_a_kernel_that_dies_in_a_cell_is_not_started_again(tmp_path):
    res, starts = _run(tmp_path, deaths=0, cell="import os; os._exit(1)")
    out = res.stdout + res.stderr
    assert res.returncode == 1 and "1 failed" in out, out[-3000:]
    assert starts == 1


def test_only_a_kernel_that_died_before_its_first_cell_is_started_again():
    import warnings

    from tests.conftest import KERNEL_START_FAILED, retrying_kernel_start

    def failing(*errors):
        calls = []

        def run():
            calls.append(1)
            if len(calls) <= len(errors):
                raise errors[len(calls) - 1]
            return "ran"
        return run, calls

    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        run, calls = failing(RuntimeError(KERNEL_START_FAILED), RuntimeError(KERNEL_START_FAILED))
        assert retrying_kernel_start(run, "nb")() == "ran" and len(calls) == 3
    assert [str(w.message).split(";")[0] for w in said] == ["nb: the Jupyter kernel died before it ran a cell "
                                                            f"({KERNEL_START_FAILED})"] * 2
    for other in (RuntimeError("Kernel didn't respond in 60 seconds"), ValueError(KERNEL_START_FAILED)):
        run, calls = failing(other)
        with pytest.raises(type(other)):
            retrying_kernel_start(run, "nb")()
        assert len(calls) == 1
    run, calls = failing(*[RuntimeError(KERNEL_START_FAILED)] * 3)
    with pytest.warns(UserWarning), pytest.raises(RuntimeError, match=KERNEL_START_FAILED):
        retrying_kernel_start(run, "nb")()
    assert len(calls) == 3
