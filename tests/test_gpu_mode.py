"""The conftest's rules, each proven with a nested pytest run: `make test-gpu` fails when a GPU test is skipped; a
process a test left running is named and ended when the session ends; a worker that cannot exit says why and ends."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import is_gpu_skip

ROOT = Path(__file__).resolve().parents[1]


def nested_env(**extra: str) -> dict[str, str]:
    """The environment for a pytest run inside a test: this run's PYTEST_ADDOPTS (a --junitxml, say) left out,
    or the inner run would write this run's report over."""
    return {**{k: v for k, v in os.environ.items() if k != "PYTEST_ADDOPTS"}, **extra}


def run_with_our_conftest(tmp_path: Path, files: dict[str, str], *args: str, **env: str) -> subprocess.CompletedProcess:
    """`pytest -q *args` in tmp_path, holding `files` ({name: source}) and this suite's conftest, nested (see
    nested_env; `env` is added to its environment)."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args, str(tmp_path)],
                          cwd=tmp_path, env=nested_env(**env), capture_output=True, text=True, timeout=120)


SAMPLE = '''
import pytest

def test_needs_gpu():
    pytest.skip("needs a GPU")

def test_optional_tool():
    pytest.skip("jupyterlab is not installed here")
'''


def test_gpu_skip_reasons():
    assert is_gpu_skip("needs a GPU") and is_gpu_skip("needs two or more GPUs") and is_gpu_skip("CUDA only")
    assert not is_gpu_skip("jupyterlab is not installed here")


@pytest.mark.parametrize("require", ["0", "1"])
def test_require_gpu_turns_gpu_skips_into_failures(tmp_path, require):
    res = run_with_our_conftest(tmp_path, {"test_sample.py": SAMPLE}, COURSE_REQUIRE_GPU=require)
    if require == "1":
        assert res.returncode == 1, res.stdout
        assert "1 failed" in res.stdout and "1 skipped" in res.stdout
    else:
        assert res.returncode == 0, res.stdout
        assert "2 skipped" in res.stdout


SCOPED = '''
import os
import pytest

@pytest.fixture(scope="module")
def built():
    with open(os.path.join(os.path.dirname(__file__), "builds.txt"), "a") as f:
        f.write(__name__ + "\\n")

@pytest.mark.parametrize("i", range(6))
def test_uses_it(built, i):
    pass
'''


def test_loadgroup_keeps_a_file_in_one_worker(tmp_path):
    """`--dist loadgroup` (the Makefile's) builds each module fixture once: one file, one worker."""
    proc = run_with_our_conftest(tmp_path, dict.fromkeys(("test_a.py", "test_b.py", "test_c.py"), SCOPED),
                                 "-n", "2", "--dist", "loadgroup")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    builds = (tmp_path / "builds.txt").read_text().split()
    assert sorted(builds) == ["test_a", "test_b", "test_c"], builds  # three, not one per worker per file


RECORDS_ITS_TURN = '''
import pathlib, pytest
{mark}
@pytest.mark.parametrize("i", range({n}))
def test_runs(i):
    with open(pathlib.Path(__file__).parent / "order.txt", "a") as f:
        f.write(pathlib.Path(__file__).stem + "\\n")
'''


def test_loadgroup_hands_out_the_longest_files_first(tmp_path):
    """A file marked slow as a whole goes first, then the rest by number of tests (xdist's own order would run
    the one-test slow file last, alone at the end of the run)."""
    slow = "pytestmark = pytest.mark.slow"
    files = {f"{name}.py": RECORDS_ITS_TURN.format(mark=mark, n=n)
             for name, mark, n in (("test_a", "", 2), ("test_b", "", 4), ("test_z", slow, 1))}
    proc = run_with_our_conftest(tmp_path, files, "-n", "1", "--dist", "loadgroup",
                                 "-W", "ignore::pytest.PytestUnknownMarkWarning")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    order = (tmp_path / "order.txt").read_text().split()
    assert order == ["test_z"] + ["test_b"] * 4 + ["test_a"] * 2, order


LEAVES_A_THREAD = '''
import threading, time

def test_leaves_a_thread_running():
    threading.Thread(target=time.sleep, args=(3600,), name="left-behind").start()  # not a daemon: blocks exit
'''


def test_a_worker_that_cannot_exit_reports_its_threads_and_ends(tmp_path):
    res = run_with_our_conftest(tmp_path, {"test_sample.py": LEAVES_A_THREAD}, "-n", "1",
                                COURSE_WORKER_EXIT_GRACE_S="2")
    out = res.stdout + res.stderr
    assert "still alive 2 s after its session ended" in out and "left-behind" in out, out[-3000:]
    assert "1 passed" in out


ONE_SLOW_TEST = '''
import threading, time

def test_quick():  # a daemon thread, as IPython's history-saving thread: it cannot keep the worker alive
    threading.Thread(target=time.sleep, args=(3600,), name="IPythonHistorySavingThread", daemon=True).start()

def test_slow():
    time.sleep(8)
'''


def test_a_worker_that_ran_out_of_work_waits_quietly_for_the_others(tmp_path):
    """xdist keeps every worker until the whole run ends: one with nothing left to do is not a stray and must not
    be reported or killed (on a GPU box notebooks take turns on the GPU, so workers idle for minutes; a worker may
    also still hold IPython's daemon history thread)."""
    res = run_with_our_conftest(tmp_path, {"test_sample.py": ONE_SLOW_TEST}, "-n", "2",
                                COURSE_WORKER_EXIT_GRACE_S="2")
    out = res.stdout + res.stderr
    assert res.returncode == 0 and "2 passed" in out and "still alive" not in out, out[-3000:]


LEAVES_AN_ORPHAN = '''
import subprocess, sys

def test_leaves_an_orphan():  # a grandchild that outlives its parent is reparented: no longer anyone's child here
    subprocess.run([sys.executable, "-c", "import subprocess, sys; "
                    "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)  # orphan'])"])
'''


def test_a_process_left_running_is_named_and_ended(tmp_path):
    import psutil

    res = run_with_our_conftest(tmp_path, {"test_sample.py": LEAVES_AN_ORPHAN}, "-n", "1")
    out = res.stdout + res.stderr
    assert "processes left running by the tests, now killed" in out and "# orphan" in out, out[-3000:]
    left = [p for p in psutil.process_iter(["cmdline"])
            if "time.sleep(600)  # orphan" in " ".join(p.info["cmdline"] or [])]
    assert not left


def test_files_that_hold_the_gpus_throughout_share_one_worker_on_a_gpu_box():
    from tests.conftest import _mostly_on_the_gpu

    mostly = {p.name for p in (ROOT / "tests").glob("**/test_*.py") if _mostly_on_the_gpu(p)}
    assert {"test_01_host_and_device.py", "test_04_async_memcpy.py", "test_timeline_gpu.py", "test_launch_gpu.py",
            "test_grade_gpu.py"} <= mostly
    assert not mostly & {"test_05_ranks_and_point_to_point.py", "test_grade_attacks.py", "test_launch.py",
                         "test_count_syncs.py"}
    assert _mostly_on_the_gpu(ROOT / "notebooks" / "05_ranks_and_point_to_point.ipynb")


def test_each_notebook_left_to_a_test_is_executed_live_by_that_test_on_the_gpus_it_says():
    import ast

    from tests.conftest import executing_test

    found = {}
    for notebook in sorted((ROOT / "notebooks").glob("*.ipynb")):
        nodeid, needs = executing_test(notebook.name)
        if nodeid is None:
            continue
        found[notebook.stem] = needs
        path, func = nodeid.split("::")
        fn = next(n for n in ast.parse((ROOT / path).read_text()).body
                  if isinstance(n, ast.FunctionDef) and n.name == func)
        marks = {ast.unparse(d) for d in fn.decorator_list}
        assert ("pytest.mark.multigpu" in marks) == (needs == 2)
        assert "pytest.mark.gpu" in marks or "pytest.mark.multigpu" in marks, f"{nodeid} is not marked for GPUs"
        assert "execute_notebook(NOTEBOOK" in ast.unparse(fn), f"{nodeid} does not execute a notebook"
        source = (ROOT / path).read_text()  # the notebook it executes is the module's NOTEBOOK
        assert f'"notebooks" / "{notebook.name}"' in source, f"{path} does not name {notebook.name}"
    assert found == {"02_cuda_streams": 1, "06_collectives": 2, "07_ring_allreduce": 2, "08_overlap_and_bucketing": 2}


@pytest.mark.parametrize(("require", "gpus", "left"), [(True, 2, 4), (True, 1, 1), (True, 0, 0), (False, 2, 0)])
def test_nbmake_leaves_a_notebook_to_its_test_only_under_make_test_gpu_with_enough_gpus(monkeypatch, require, gpus,
                                                                                        left):
    from types import SimpleNamespace

    from tests import conftest

    monkeypatch.setattr(conftest, "REQUIRE_GPU", require)
    items = [SimpleNamespace(path=p) for p in sorted((ROOT / "notebooks").glob("*.ipynb"))]
    items.append(SimpleNamespace(path=ROOT / "tests" / "lessons" / "test_08_overlap_and_bucketing.py"))
    assert sum(bool(conftest.executed_by_a_test(i, gpus)) for i in items) == left


NOTEBOOK_SEES_THE_CONFTEST = {
    "cells": [{"cell_type": "code", "execution_count": None, "id": "0", "metadata": {}, "outputs": [],
               "source": "import os\nassert os.environ.get('COURSE_TEST_SESSION'), 'no conftest in this run'"}],
    "metadata": {"kernelspec": {"display_name": "Python 3", "language": "python", "name": "python3"}},
    "nbformat": 4, "nbformat_minor": 5}


def test_a_notebook_only_run_loads_the_conftest_as_make_runs_it(tmp_path):
    """pytest loads tests/conftest.py only for what it collects under tests/; `make notebooks` and the GPU notebook
    parts pass it with -p, so notebooks get the GPU locks and the stray check too (the session mark shows it)."""
    import json
    import re

    nb = tmp_path / "sees_conftest.ipynb"
    nb.write_text(json.dumps(NOTEBOOK_SEES_THE_CONFTEST))
    make = (ROOT / "Makefile").read_text()
    flags = re.search(r"^NB_PYTEST\s*:=\s*(.+)$", make, re.M).group(1).split()
    assert flags == ["-p", "tests.conftest", "--nbmake"]
    assert make.count("$(NB_PYTEST)") == 3 and "--nbmake notebooks" not in make.replace("tests --nbmake notebooks", "")
    env = {k: v for k, v in nested_env().items() if k != "COURSE_TEST_SESSION"}
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *flags, str(nb)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "1 passed" in res.stdout, res.stdout[-3000:]
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--nbmake", str(nb)],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 1 and "no conftest in this run" in res.stdout, res.stdout[-3000:]


PRINT_MARKS = r"""
def pytest_collection_finish(session):
    with open(__import__("os").environ["MARKS_OUT"], "w") as f:
        for item in session.items:
            f.write(item.nodeid + "\t" + " ".join(sorted({m.name for m in item.iter_markers()})) + "\n")
"""


def test_the_gpu_test_parts_hold_every_test_once(tmp_path):
    """make test-gpu-tests runs its parts (each meant to fit one 10-minute command), selected by marker: every test
    in exactly one part, and every lesson's tests in a lesson part."""
    import shutil

    from _pytest.mark.expression import Expression

    if shutil.which("make") is None:
        pytest.skip("make is not installed")
    dry = subprocess.run(["make", "-n", "test-gpu-tests", "PY=python3"], cwd=ROOT, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    parts = [re.search(r' tests -m "([^"]+)"$', line).group(1) for line in dry if "pytest" in line]
    (tmp_path / "print_marks.py").write_text(PRINT_MARKS)
    out = tmp_path / "marks.tsv"
    env = nested_env()
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), str(ROOT), env.get("PYTHONPATH")) if p)
    res = subprocess.run([sys.executable, "-m", "pytest", "-q", "--collect-only", "-p", "print_marks", "-p",
                          "no:cacheprovider", "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**env, "MARKS_OUT": str(out)})
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    items = [line.split("\t") for line in out.read_text().splitlines()]
    assert len(items) > 500 and len(parts) == 5
    for nodeid, marks in items:
        names = set(marks.split())
        chosen = [p for p in parts if Expression.compile(p).evaluate(lambda m, names=names: m in names)]
        assert len(chosen) == 1, f"{nodeid} (marks {sorted(names)}) is in the parts {chosen}"
        assert nodeid.startswith("tests/lessons/") == ("lesson" in names), nodeid
