"""CPU ranks are forked by one fork server per launch (course_utils/launch/forkserver.py): they must still
look like fresh interpreters (own session, own RANK, own random seeds), report how they ended, and leave
nothing behind; a server that cannot start is a clear error. GPU ranks start fresh (test_launch_gpu.py)."""

from __future__ import annotations

import os

import pytest

from course_utils import launch
from course_utils.launch import LaunchError, WorkerError, group
from tests.launch_helpers import (  # noqa: F401  (fixtures)
    assert_clean,
    cell_function,
    snapshot,
    tcpstore_warmed,
)

pytestmark = pytest.mark.ranks

WHO = cell_function("""
    import os
    import random
    import torch

    def who():
        return {"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0), "rank": os.environ["RANK"],
                "local_rank": os.environ["LOCAL_RANK"], "seed": torch.initial_seed(), "rand": torch.rand(1).item(),
                "random": random.random(), "pipes": pipes()}

    def pipes():
        found = []
        for fd in os.listdir("/proc/self/fd"):
            try:
                target = os.readlink(f"/proc/self/fd/{fd}")
            except OSError:  # the listing's own fd, closed by now
                continue
            if target.startswith("pipe:"):
                found.append(target)
        return sorted(found)
""", "who")


@pytest.mark.timeout(120)
def test_forked_ranks_look_like_fresh_interpreters(monkeypatch):
    before = snapshot()
    monkeypatch.setattr(group, "use_fork_server", lambda gpus: False)  # as GPU ranks start
    fresh = launch.run(WHO, nproc=3, backend="gloo")
    monkeypatch.undo()
    forked = launch.run(WHO, nproc=3, backend="gloo")
    assert {r["ppid"] for r in fresh.values()} == {os.getpid()}
    parents = {r["ppid"] for r in forked.values()}
    assert len(parents) == 1 and parents != {os.getpid()}  # one server forked them all
    for seen in (fresh, forked):
        for rank, r in seen.items():
            assert r["sid"] == r["pid"]  # each leads its own session: killpg reaches all it starts
            assert r["rank"] == r["local_rank"] == str(rank)
        # a fresh interpreter seeds torch's and Python's generators from the OS: no two ranks share them
        for key in ("seed", "rand", "random"):
            assert len({r[key] for r in seen.values()}) == 3, key
    # no forked rank holds another rank's pipes or the server's: as many pipes as a fresh rank, none shared between
    # ranks (the other fds, gloo's sockets, vary with timing)
    assert [len(r["pipes"]) for r in forked.values()] == [len(r["pipes"]) for r in fresh.values()]
    for seen in (fresh, forked):
        held = [set(r["pipes"]) for r in seen.values()]  # (a rank may hold both ends of a pipe of its own)
        assert sum(map(len, held)) == len(set().union(*held))
    assert_clean(before)


@pytest.mark.timeout(60)
def test_a_rank_killed_by_a_signal_is_named_with_it():
    killed = cell_function("""
        import os
        import signal
        import torch.distributed as dist

        def killed():
            if dist.get_rank() == 1:
                os.kill(os.getpid(), signal.SIGKILL)
            dist.barrier()
    """, "killed")
    before = snapshot()
    with pytest.raises(WorkerError, match=r"rank 1 exited with code -9 \(SIGKILL\)"):
        launch.run(killed, nproc=2, backend="gloo", timeout=30)
    assert_clean(before)


@pytest.mark.timeout(60)
def test_a_fork_server_that_cannot_start_says_why(tmp_path, monkeypatch):
    fake = tmp_path / "torch"
    fake.mkdir()
    (fake / "__init__.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))  # the ranks' interpreters find this torch first
    before = snapshot()
    with pytest.raises(LaunchError, match="fork server") as info:
        launch.run(WHO, nproc=2, backend="gloo", timeout=30)
    assert "this torch is broken on purpose" in str(info.value)
    assert_clean(before)


def test_only_cpu_ranks_are_forked():
    from course_utils.launch.env import use_fork_server

    assert use_fork_server(gpus=False) and not use_fork_server(gpus=True)


@pytest.mark.timeout(60)
def test_a_fork_server_killed_under_a_pool_ends_its_ranks_and_is_reported():
    import signal

    import psutil

    before = snapshot()
    pool = launch.Pool(2, backend="gloo")
    try:
        ranks = [psutil.Process(pid) for pid in pool.pids]
        server = {r.ppid() for r in ranks}
        assert len(server) == 1
        os.kill(server.pop(), signal.SIGKILL)  # its ranks die with it (PR_SET_PDEATHSIG)
        # once the kernel has torn the server down, which can take a while for a process holding torch: a rank
        # still alive until then would answer the call below
        _, alive = psutil.wait_procs(ranks, timeout=20)
        assert not alive
        forked = [r.proc for r in pool._group.ranks]
        with pytest.raises(WorkerError, match="exited with code -9"):
            pool.run(WHO)
        assert [(p.returncode, p.poll()) for p in forked] == [(-9, -9)] * 2  # never signalled again; poll agrees
    finally:
        pool.close()
    assert_clean(before)
