"""Machine-wide GPU turns: a second process waits for a held GPU, dead holders free it, children of a holder
take none, a waiter is told who holds the GPU, and the grader's GPU pool holds the locks while a job has its GPUs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from course_utils import gpu_lock
from course_utils.grading import grade as grading
from course_utils.grading import grader as grader_module

FIXTURE = Path(__file__).parent / "fixtures" / "grading"


@pytest.fixture(autouse=True)
def lock_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(gpu_lock.LOCK_DIR_ENV, str(tmp_path))
    monkeypatch.delenv(gpu_lock.HELD_ENV, raising=False)
    return tmp_path


def _child_takes(ids: list[str], hold_s: float = 0.0, what: str = "") -> subprocess.Popen:
    """A process that takes `ids`, prints 'took <time>', holds them `hold_s` seconds and exits (its stderr piped)."""
    code = textwrap.dedent(f"""
        import time
        from course_utils import gpu_lock
        t = gpu_lock.take({ids!r}, {what!r})
        print("took", time.time(), flush=True)
        time.sleep({hold_s})
    """)
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=os.environ.copy())


def test_a_held_gpu_makes_another_process_wait_until_it_is_released():
    turn = gpu_lock.take(["0"])
    child = _child_takes(["0"])
    time.sleep(1.0)
    assert child.poll() is None, "the child took a GPU that this process holds"
    released = time.time()
    turn.release()
    out, _ = child.communicate(timeout=30)
    assert float(out.split()[1]) >= released


def test_who_waits_is_told_who_holds_the_gpu_and_for_how_long():
    holder = _child_takes(["0"], hold_s=600, what="lesson 02's timing cell")
    try:
        assert holder.stdout.readline().startswith("took")
        time.sleep(1.1)
        waiter = _child_takes(["0"])
        time.sleep(1.0)
        assert waiter.poll() is None
        holder.kill()
        holder.wait()
        out, err = waiter.communicate(timeout=30)
        assert out.startswith("took")
        said = re.search(r"GPU 0 is in use by (\S+) \(pid (\d+), lesson 02's timing cell\) for (\d+) s; waiting", err)
        assert said, err
        assert said[1] == gpu_lock._whoami() and int(said[2]) == holder.pid and int(said[3]) >= 1
    finally:
        holder.kill()
        holder.wait()
    gpu_lock.take(["0"]).release()  # a free GPU is taken without a word
    quiet = _child_takes(["0"])
    assert quiet.communicate(timeout=30)[1] == ""


def test_lock_files_are_open_to_every_user_whatever_the_umask(lock_dir):
    old = os.umask(0o077)
    try:
        gpu_lock.take(["0", "1"]).release()
    finally:
        os.umask(old)
    assert {p.name: p.stat().st_mode & 0o777 for p in lock_dir.iterdir()} == {"gpu-0.lock": 0o666, "gpu-1.lock": 0o666}


def test_other_gpus_are_not_waited_for():
    turn = gpu_lock.take(["0"])
    try:
        out, _ = _child_takes(["1"]).communicate(timeout=30)
        assert out.startswith("took")
    finally:
        turn.release()


def test_a_holder_that_dies_frees_its_gpus():
    holder = _child_takes(["0", "1"], hold_s=600)
    assert holder.stdout.readline().startswith("took")
    holder.kill()
    holder.wait()
    got = []
    t = threading.Thread(target=lambda: got.append(gpu_lock.take(["1", "0"])))
    t.start()
    t.join(10)
    assert got, "a killed holder's locks were not dropped"
    got[0].release()


def test_children_of_a_holder_take_no_locks_and_the_variable_is_restored():
    with gpu_lock.holding(["0"]):
        assert os.environ[gpu_lock.HELD_ENV] == "1"
        out, _ = _child_takes(["0"]).communicate(timeout=30)  # would wait for ever if it took the lock
        assert out.startswith("took")
    assert gpu_lock.HELD_ENV not in os.environ
    gpu_lock.take(["0"]).release()  # and the lock is free again


def test_the_grader_pool_holds_the_machine_wide_lock_while_a_job_has_the_gpu():
    pool = grader_module.GpuPool(("0",))
    devices = pool.take(1)
    child = _child_takes(["0"])
    time.sleep(1.0)
    assert child.poll() is None, "another process could time GPU 0 while the grader's job had it"
    pool.give(devices)
    out, _ = child.communicate(timeout=30)
    assert out.startswith("took")


def test_no_gpus_no_locks(lock_dir):
    gpu_lock.take([]).release()
    assert list(lock_dir.iterdir()) == []


def test_probes_cannot_reach_the_gpu_locks(lock_dir):
    """A probe that could open a lock file could flock it (a read is enough) and stall every grader on the machine.
    The fixture's `add` passes only if opening the lock folder's file fails inside the probe."""
    from tests.exercise_cells import grade_answers

    (lock_dir / "gpu-0.lock").write_text("")
    answer = (f"    try:\n        open({str(lock_dir / 'gpu-0.lock')!r}).close()\n        return -1\n"
              f"    except OSError:\n        return a + b\n")
    with grading.Grader(grading.Options(gpus=("0",), checks_modules=(str(FIXTURE / "fixture_checks.py"),))) as g:
        got = grade_answers(FIXTURE / "99_fixture.ipynb", {"ex99_add": answer, "ex99_mean": None}, grader=g).by_id()
    assert got["ex99_add"].status == "passed", got["ex99_add"].message


def test_a_notebook_kernel_with_the_extension_holds_its_gpus_for_each_cell(lock_dir):
    """The hub starts students' kernels with `--ext=course_utils.gpu_lock`: a cell holds the kernel's GPUs while it
    runs (another process waits), frees them after, and a cell that has to wait prints who holds them."""
    from jupyter_client.manager import start_new_kernel

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "0", gpu_lock.LOCK_DIR_ENV: str(lock_dir)}
    env.pop(gpu_lock.HELD_ENV, None)
    km, kc = start_new_kernel(extra_arguments=["--ext=course_utils.gpu_lock"], env=env)
    try:
        def run(code: str, timeout: float = 60) -> str:
            """Run `code` after whatever was sent before it; all the output until it is done."""
            out = []
            sent = kc.execute(code)
            while True:
                msg = kc.get_iopub_msg(timeout=timeout)
                if msg["msg_type"] == "stream":
                    out.append(msg["content"]["text"])
                if msg["msg_type"] == "error":
                    raise AssertionError(msg["content"]["traceback"])
                if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle" \
                        and msg["parent_header"].get("msg_id") == sent:
                    return "".join(out)

        assert run("import os; print(os.environ.get('COURSE_GPU_LOCKS_HELD'))").strip() == "1"
        kc.execute("import time; print('start', flush=True); time.sleep(3)")
        time.sleep(1.5)  # the cell is running
        t0 = time.monotonic()
        gpu_lock.take(["0"]).release()
        assert time.monotonic() - t0 > 0.5, "another process took GPU 0 while a cell of the kernel ran"
        run("pass")
        with gpu_lock.holding(["0"], "lesson 02's timing cell"):
            kc.execute("print('ran')")
            time.sleep(1.5)
        said = run("pass")
        assert "ran" in said and "GPU 0 is in use by" in said and "lesson 02's timing cell" in said, said
        t0 = time.monotonic()
        gpu_lock.take(["0"]).release()  # the idle kernel holds nothing
        assert time.monotonic() - t0 < 0.5
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
