"""A notebook whose Jupyter kernel dies before running a cell is started again (tests/conftest.py), with a
warning; one that dies at every start, or dies in a cell, still fails."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from tests.conftest import KERNEL_START_FAILED, retrying_kernel_start
from tests.test_gpu_mode import nested_env

ROOT = Path(__file__).resolve().parents[1]

# The kernel a kernelspec starts: it exits at once for its first `deaths` starts (counted in a file), like a
# kernel whose port was taken, and is an ordinary ipykernel after that.
FLAKY_KERNEL = """
import os, sys
here = os.path.dirname(os.path.abspath(__file__))
count = os.path.join(here, "starts")
n = int(open(count).read()) if os.path.exists(count) else 0
open(count, "w").write(str(n + 1))
if n < int(open(os.path.join(here, "deaths")).read()):
    os._exit(1)
from ipykernel import kernelapp
kernelapp.launch_new_instance()
"""

# notebook -> (kernel deaths before it runs, its cell)
CASES = {"dies_once": (1, "print(6 * 7)"), "dies_always": (99, "print(6 * 7)"),
         "dies_in_a_cell": (0, "import os; os._exit(1)")}


@pytest.fixture(scope="module")
def nested(tmp_path_factory) -> tuple[str, dict[str, str], dict[str, int]]:
    """One nested nbmake run over a notebook per case, each with a kernelspec of its own: its output, each
    notebook's outcome and how often each kernel was started."""
    tmp = tmp_path_factory.mktemp("kernel_start")
    for name, (deaths, cell) in CASES.items():
        spec = tmp / "jupyter" / "kernels" / name
        spec.mkdir(parents=True)
        (spec / "kernel.py").write_text(FLAKY_KERNEL)
        (spec / "deaths").write_text(str(deaths))
        (spec / "kernel.json").write_text(json.dumps({
            "argv": [sys.executable, str(spec / "kernel.py"), "-f", "{connection_file}"],
            "display_name": name, "language": "python"}))
        nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(cell)])
        nb.metadata["kernelspec"] = {"name": name, "display_name": name, "language": "python"}
        nbformat.write(nb, tmp / f"{name}.ipynb")
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "tests.conftest", "--nbmake", "-n", "0",
         "--rootdir", str(tmp), f"--junitxml={tmp / 'junit.xml'}", *sorted(str(p) for p in tmp.glob("*.ipynb"))],
        cwd=ROOT, env=nested_env(JUPYTER_PATH=str(tmp / "jupyter")), capture_output=True, text=True, timeout=240)
    out = res.stdout + res.stderr
    outcome = {}
    for case in ET.parse(tmp / "junit.xml").getroot().iter("testcase"):
        failed = case.find("failure") is not None or case.find("error") is not None
        outcome[case.get("name").removesuffix(".ipynb")] = "failed" if failed else "passed"
    starts = {name: int((tmp / "jupyter" / "kernels" / name / "starts").read_text()) for name in CASES}
    return out, outcome, starts


def test_a_kernel_that_died_before_its_first_cell_is_started_again_with_a_warning(nested):
    out, outcome, starts = nested
    assert outcome["dies_once"] == "passed" and starts["dies_once"] == 2, out[-3000:]
    assert "dies_once.ipynb: the Jupyter kernel died before it ran a cell" in out, out[-3000:]


def test_a_kernel_that_dies_at_every_start_fails_the_notebook(nested):
    out, outcome, starts = nested
    assert outcome["dies_always"] == "failed" and starts["dies_always"] == 3, out[-3000:]
    assert KERNEL_START_FAILED in out


def test_a_kernel_that_dies_in_a_cell_is_not_started_again(nested):
    out, outcome, starts = nested
    assert outcome["dies_in_a_cell"] == "failed" and starts["dies_in_a_cell"] == 1, out[-3000:]


def test_only_a_kernel_that_died_before_its_first_cell_is_started_again():
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
