"""course_utils.launch.run on the CPU (gloo): arguments, results, torchrun's environment, failures,
timeouts (with the stuck ranks' stacks), Ctrl-C, parent death and cleanup. Pool and the magics are in
test_launch_pool.py, the torchrun CLI in test_launch_cli.py, wire and pickling in test_launch_transport.py,
GPU paths in test_launch_gpu.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

from course_utils import launch
from course_utils.launch import WorkerError, WorkerTimeout, errors, group, options
from tests.launch_helpers import (
    ALL_REDUCE,
    FAILS_ON_RANK_1,
    ROOT,
    assert_clean,
    assert_cuda_untouched,
    assert_gone,
    cell_function,
    children,
    snapshot,
    tcpstore_warmed,  # noqa: F401  (an autouse fixture)
)

pytestmark = pytest.mark.ranks

# ---- bad input: a clear error before any process starts ---------------------------------------------


@pytest.mark.parametrize("kwargs, error, words", [
    ({"nproc": 0}, ValueError, "nproc must be a positive integer"),
    ({"nproc": 1.5}, ValueError, "nproc must be a positive integer"),
    ({"nproc": True}, ValueError, "nproc must be a positive integer"),
    ({"backend": "mpi"}, ValueError, "unknown backend 'mpi'"),
    ({"timeout": 0}, ValueError, "timeout must be a positive number"),
    ({"gpus": "yes"}, ValueError, "gpus must be True, False or None"),
])
def test_bad_arguments_fail_before_any_process(kwargs, error, words):
    with pytest.raises(error, match=words):
        launch.run(ALL_REDUCE, **kwargs)
    assert children(psutil.Process()) == []


def test_nccl_without_enough_gpus_is_a_clear_error():
    too_many = torch.cuda.device_count() + 1
    with pytest.raises(ValueError, match="needs one CUDA GPU per rank"):
        launch.run(ALL_REDUCE, nproc=too_many, backend="nccl")
    with pytest.raises(ValueError, match="NCCL ranks need their GPUs"):
        options.pick_gpus(False, "nccl")
    assert children(psutil.Process()) == []


def test_uncallable_and_unpicklable_arguments_are_named():
    with pytest.raises(TypeError, match="fn must be callable"):
        launch.run(42)
    with pytest.raises(TypeError, match="argument 1 cannot be sent to the workers"):
        launch.run(ALL_REDUCE, 1.0, threading.Lock())
    with pytest.raises(TypeError, match="keyword argument 'lock' cannot be sent"):
        launch.run(ALL_REDUCE, lock=threading.Lock())
    with pytest.raises(SyntaxError):
        launch.run_code("def broken(:\n    pass")
    with pytest.raises(ValueError, match="between 0 and 1"):
        launch.run_code("pass", nproc=2, ranks=[2])
    assert children(psutil.Process()) == []


def test_auto_backend_on_cpu_is_gloo_and_says_so_once(capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.setattr(options, "_said", set())
    assert launch.pick_backend("auto", 2) == "gloo"
    assert launch.pick_backend("auto", 4) == "gloo"
    assert capsys.readouterr().out.count("gloo") == 1
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    if dist.is_nccl_available():
        assert launch.pick_backend("auto", 2) == "nccl"
    assert launch.pick_backend("auto", 3) == "gloo"  # one GPU per rank, or the CPU
    assert "3 ranks but 2 GPUs" in capsys.readouterr().out


def test_only_nccl_ranks_see_gpus_unless_asked():
    assert options.pick_gpus(None, "nccl") is True
    assert options.pick_gpus(None, "gloo") is False
    assert options.pick_gpus(True, "gloo") is True


# ---- a normal run -------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_run_returns_every_rank_with_torchrun_environment(capsys):
    before = snapshot()
    results = launch.run(ALL_REDUCE, 2.0, nproc=2, backend="gloo")
    assert sorted(results) == [0, 1]
    for rank, r in results.items():
        assert torch.equal(r["tensor"], torch.full((3,), 6.0))  # (1 + 2) * 2.0 on every rank
        env = r["env"]
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == env["ROLE_WORLD_SIZE"] == "2"
        assert env["GROUP_RANK"] == "0" and env["GROUP_WORLD_SIZE"] == "1" and env["ROLE_NAME"] == "default"
        assert env["MASTER_ADDR"] == "127.0.0.1" and 0 < int(env["MASTER_PORT"]) < 65536
        assert env["TORCHELASTIC_USE_AGENT_STORE"] == "True" and env["TORCHELASTIC_RESTART_COUNT"] == "0"
        assert env["CUDA_VISIBLE_DEVICES"] == ""  # gloo ranks see no GPU unless asked
        assert r["backend"] == "gloo"
        assert r["pgid"] == r["pid"]  # its own process group: killpg reaches all it starts
    assert results[0]["env"]["MASTER_PORT"] == results[1]["env"]["MASTER_PORT"]
    out = capsys.readouterr().out
    assert "[rank 0] sum is 6" in out and "[rank 1] sum is 6" in out
    # The notebook's process never initialises CUDA or a process group because of the launcher.
    assert_cuda_untouched(before)
    assert not dist.is_initialized()
    assert_clean(before)


@pytest.mark.timeout(60)
def test_gloo_ranks_may_see_the_gpus_when_asked(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    results = launch.run(ALL_REDUCE, nproc=1, backend="gloo", gpus=True)
    assert results[0]["env"]["CUDA_VISIBLE_DEVICES"] == "0"  # left as the notebook has it


@pytest.mark.timeout(60)
def test_two_launches_at_once_do_not_collide():
    results, errors = {}, []

    def launch_one(key):
        try:
            results[key] = launch.run(ALL_REDUCE, nproc=2, backend="gloo")
        except Exception as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=launch_one, args=(k,)) for k in "ab"]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    ports = {k: r[0]["env"]["MASTER_PORT"] for k, r in results.items()}
    assert ports["a"] != ports["b"]
    assert all(torch.equal(r[i]["tensor"], torch.full((3,), 3.0)) for r in results.values() for i in (0, 1))


# ---- failures ----------------------------------------------------------------------------------------


@pytest.mark.timeout(60)
def test_a_crash_stops_the_others_and_reports_the_first_traceback():
    before = snapshot()
    with pytest.raises(WorkerError) as info:
        launch.run(FAILS_ON_RANK_1, nproc=3, backend="gloo", timeout=50)  # ends long before the timeout
    err = info.value
    assert err.rank == 1
    assert isinstance(err.exception, ValueError) and str(err.exception) == "rank 1 has bad data"
    assert "fails_on_rank_1" in err.traceback and 'raise ValueError("rank 1 has bad data")' in err.traceback
    assert sorted(err.others) == [0, 2]
    assert "rank 1 failed first: ValueError: rank 1 has bad data" in str(err)
    # The others' errors are consequences, and say so in one line (not gloo's "... GLHF!" paragraph).
    for rank in (0, 2):
        assert err.others[rank].startswith(("stopped waiting", "was still running")), err.others[rank]
    assert "GLHF" not in str(err) and "typically caused" not in str(err)
    assert_clean(before)


def test_the_first_failure_is_the_cause_not_a_lost_connection_stamped_earlier():
    """A timed-out gloo rank closes its connections; on a busy machine the other rank can catch "Connection closed
    by peer ... GLHF!" and stamp it before the timed-out rank stamps its own error."""
    closed = {"type": "RuntimeError", "time": 10.0,
              "message": "[pair.cc:553] Connection closed by peer [127.0.0.1]:2481. This is typically caused by a "
                         "remote worker crashing. Check the logs of the remote worker before reporting an error. GLHF!"}
    timed_out = {"type": "RuntimeError", "time": 10.2, "message": "[pair.cc:446] Timed out waiting 2000ms for recv"}
    silent = {"type": "WorkerExited", "silent": True, "time": 0.0, "message": "rank 2 exited with code 3"}
    assert errors.first_failure({0: closed, 1: timed_out}) == 1
    assert errors.first_failure({0: closed, 1: timed_out, 2: silent}) == 2
    assert errors.first_failure({0: closed, 1: dict(closed, time=9.0)}) == 1  # only lost connections: the earliest
    assert errors.first_failure({0: timed_out, 1: dict(timed_out, time=9.0)}) == 1
    assert errors.describe_other(closed, 1).startswith("stopped waiting: its connection closed when rank 1 failed")


@pytest.mark.timeout(60)
def test_a_rank_that_dies_silently_is_named():
    dies = cell_function("""
        import os
        import torch.distributed as dist

        def dies():
            print("about to vanish")
            if dist.get_rank() == 0:
                os._exit(3)
            dist.barrier()
    """, "dies")
    before = snapshot()
    with pytest.raises(WorkerError, match="rank 0 exited with code 3") as info:
        launch.run(dies, nproc=2, backend="gloo")
    assert info.value.rank == 0 and "about to vanish" in info.value.traceback
    assert_clean(before)


STUCK = cell_function("""
    import time
    import torch.distributed as dist

    def stuck():
        print("rank", dist.get_rank(), "going in", flush=True)
        if dist.get_rank() == 0:
            dist.barrier()  # waits for rank 1, which is asleep
        else:
            time.sleep(300)
""", "stuck")


@pytest.mark.timeout(60)
def test_a_hang_ends_at_the_timeout_with_each_ranks_stack_and_every_process_gone():
    before = snapshot()
    start = time.monotonic()
    with pytest.raises(WorkerTimeout) as info:  # 15 s: ranks start in a few seconds even on a busy 2-core box
        launch.run(STUCK, nproc=2, backend="gloo", timeout=15)
    assert time.monotonic() - start < 15 + group.STACK_WAIT + group.EXIT_WAIT
    err = info.value
    assert err.running == [0, 1] and err.sending == [] and isinstance(err, TimeoutError)
    # where each rank was, as a traceback: the cell's line, with its source, and what it called
    assert 'File "<cell stuck>", line 8, in stuck' in err.stacks[0] and "dist.barrier()" in err.stacks[0]
    assert "in barrier" in err.stacks[0]
    assert 'File "<cell stuck>", line 10, in stuck' in err.stacks[1] and "time.sleep(300)" in err.stacks[1]
    assert "watchdog" not in str(err) and "worker.py" not in str(err)  # the launcher's own frames are left out
    assert "where rank 0 was" in str(err) and "mismatched collectives" in str(err)
    assert err.last_output == {0: "rank 0 going in", 1: "rank 1 going in"}
    assert_clean(before)


@pytest.mark.timeout(60)
def test_a_timeout_during_start_up_says_so_and_blames_no_collective():
    before = snapshot()
    with pytest.raises(WorkerTimeout) as info:
        launch.run(STUCK, nproc=2, backend="gloo", timeout=0.3)  # python and torch take longer to start
    err = info.value
    assert err.starting == [0, 1] and err.running == [] and err.sending == []
    assert "had not finished starting" in str(err) and "mismatched" not in str(err)
    assert_clean(before)


@pytest.mark.timeout(60)
def test_ctrl_c_ends_every_worker():
    sleeper = cell_function("""
        import time

        def sleeper():
            print("sleeping", flush=True)
            time.sleep(60)
    """, "sleeper")
    before = snapshot()
    me = psutil.Process()

    def interrupt_once_running():
        deadline = time.monotonic() + 30
        while len(children(me)) < 2 and time.monotonic() < deadline:  # (a fork server and a rank)
            time.sleep(0.05)
        time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        threading.Thread(target=interrupt_once_running, daemon=True).start()
        with pytest.raises(KeyboardInterrupt):
            launch.run(sleeper, nproc=2, backend="gloo", timeout=50)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert_clean(before)


PARENT_SCRIPT = """
import sys, threading, time
from course_utils.launch import Pool

def start():
    global pool
    pool = Pool(2, backend="gloo")
    print("PIDS", *pool.pids, flush=True)

if sys.argv[1] == "thread":  # no PR_SET_PDEATHSIG from a thread: the workers' watchdog must act
    t = threading.Thread(target=start)
    t.start()
    t.join()
else:
    start()
time.sleep(120)
"""


@pytest.mark.timeout(90)
@pytest.mark.parametrize("where", ["main", "thread"])
def test_workers_die_with_their_parent(where):
    parent = subprocess.Popen([sys.executable, "-c", PARENT_SCRIPT, where], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))
    try:
        line = ""
        while not line.startswith("PIDS"):
            line = parent.stdout.readline()
            assert line, "the parent script ended before starting its pool"
        pids = [int(p) for p in line.split()[1:]]
        assert all(psutil.pid_exists(p) for p in pids)
        parent.kill()  # SIGKILL: no atexit, no cleanup of its own
        parent.wait()
        assert_gone(pids)
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
