"""course_utils.launch.Pool and the %%torchrun / %%ranks magics on the CPU (gloo)."""

from __future__ import annotations

import gc

import pytest
import torch

from course_utils import launch
from course_utils.launch import LaunchError, Pool, WorkerError, WorkerTimeout
from tests.launch_helpers import (
    ALL_REDUCE,
    FAILS_ON_RANK_1,
    assert_clean,
    assert_gone,
    snapshot,
    tcpstore_warmed,  # noqa: F401  (an autouse fixture)
)

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(60)
def test_pool_keeps_ranks_and_their_state_alive(capsys):
    before = snapshot()
    with Pool(2, backend="gloo") as pool:
        pids = pool.pids
        for scale in (1.0, 2.0):
            results = pool.run(ALL_REDUCE, scale)
            assert [torch.equal(r["tensor"], torch.full((3,), 3.0 * scale)) for r in results.values()] == [True] * 2
            assert [r["pid"] for r in results.values()] == pids  # the same processes every time
        assert pool.exec("x = dist.get_rank() * 10") == {0: None, 1: None}
        assert pool.exec("x + 1") == {0: 1, 1: 11}  # variables persist per rank
        assert launch.current_pool() is pool
        with pytest.raises(WorkerError, match="NameError") as info:  # every rank fails alike: still in step
            pool.exec("undefined_name")
        assert "<ranks cell>" in info.value.traceback
        assert not pool.closed and pool.exec("x") == {0: 0, 1: 10}
        pool.exec("print('only rank 1 shows')", ranks=[1])
    assert pool.closed and launch.current_pool() is None
    out = capsys.readouterr().out
    assert "[rank 1] only rank 1 shows" in out and "[rank 0] only rank 1 shows" not in out
    assert_gone(pids)
    assert_clean(before)
    with pytest.raises(LaunchError, match="closed"):
        pool.run(ALL_REDUCE)


@pytest.mark.timeout(90)
def test_pool_shuts_down_when_ranks_fall_out_of_step():
    before = snapshot()
    pool = Pool(3, backend="gloo")
    pids = pool.pids
    with pytest.raises(WorkerError, match="has been shut down") as info:
        pool.run(FAILS_ON_RANK_1)
    assert info.value.rank == 1 and pool.closed
    assert_gone(pids)
    pool = Pool(2, backend="gloo")
    pids = pool.pids
    # rank 0 waits in a collective that rank 1 never joins: a hang, ended by the call's timeout
    with pytest.raises(WorkerTimeout) as info:
        pool.exec("print('waiting for rank 1')\nif dist.get_rank() == 0:\n    dist.barrier()", timeout=3)
    assert info.value.running == [0]
    assert info.value.last_output[0] == "waiting for rank 1"
    assert '"<ranks cell>", line 3' in info.value.stacks[0] and "dist.barrier()" in info.value.stacks[0]
    assert pool.closed
    assert_gone(pids)
    assert_clean(before)


@pytest.mark.timeout(60)
def test_a_pool_dropped_without_closing_ends_its_workers_and_prints_nothing(capfd):
    pool = Pool(2, backend="gloo")
    pids = pool.pids
    pool.exec("print('a line that is printed now', flush=True)")
    pool.exec("import sys; sys.stdout.write('no newline yet')")  # held back until the line ends
    capfd.readouterr()
    launch.pool._current = None  # as if another pool had been started since
    del pool
    gc.collect()
    assert_gone(pids)
    captured = capfd.readouterr()
    assert captured.out == "" and captured.err == ""  # the garbage collector must not print into some cell


# ---- magics -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "course_utils")
    return ip


@pytest.mark.timeout(60)
def test_torchrun_magic_runs_the_cell_on_n_ranks(shell, capsys):
    before = snapshot()
    cell = "import os\nprint('I am', os.environ['RANK'], 'of', dist.get_world_size())\ndist.get_rank() ** 2\n"
    assert shell.run_cell_magic("torchrun", "-n 3 --backend gloo --ranks 0,2", cell) == {0: 0, 1: 1, 2: 4}
    out = capsys.readouterr().out
    assert "[rank 0] I am 0 of 3" in out and "[rank 2] I am 2 of 3" in out and "I am 1" not in out
    with pytest.raises(WorkerError, match="ZeroDivisionError"):
        shell.run_cell_magic("torchrun", "-n 2 --backend gloo", "x = 1\n1 / (dist.get_rank() - 1)")
    assert_clean(before)


@pytest.mark.timeout(90)
def test_ranks_magic_keeps_variables_and_honours_or_refuses_its_options(shell, capsys):
    before = snapshot()
    shell.run_line_magic("ranks", "--close")
    shell.run_cell_magic("ranks", "-n 2 --backend gloo", "t = torch.ones(2) * (dist.get_rank() + 1)")
    assert "started Pool(nproc=2" in capsys.readouterr().out
    result = shell.run_cell_magic("ranks", "", "dist.all_reduce(t)\nt")
    assert all(torch.equal(v, torch.full((2,), 3.0)) for v in result.values())
    pool = launch.current_pool()
    pids = pool.pids
    # An option the open pool does not have is an error, not silently ignored; the pool and its variables stay.
    with pytest.raises(ValueError, match=r"does not match --backend nccl \(it runs gloo\).*%ranks --close"):
        shell.run_cell_magic("ranks", "--backend nccl", "t")
    with pytest.raises(ValueError, match="does not match --gpus"):
        shell.run_cell_magic("ranks", "--gpus", "t")
    assert launch.current_pool() is pool and shell.run_cell_magic("ranks", "--backend gloo", "t")[1][0] == 3.0
    # --timeout applies to the cell on the open pool
    with pytest.raises(WorkerTimeout, match="after the 2 s timeout"):
        shell.run_cell_magic("ranks", "--timeout 2", "import time\ntime.sleep(30)")
    assert pool.closed and launch.current_pool() is None
    assert_gone(pids)
    shell.run_line_magic("ranks", "--close")
    assert "no pool is open" in capsys.readouterr().out
    assert_clean(before)
