"""course_utils.launch on GPUs (marked gpu/multigpu: skipped on CPU machines, run by `make test-gpu`):
NCCL ranks each on their own GPU, nothing the notebook receives initialises CUDA there (checked in fresh
interpreters), gloo ranks that see no GPU unless asked, and a call that closes over a CUDA tensor refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import psutil
import pytest
import torch
import torch.distributed as dist

from course_utils import launch
from course_utils.launch import Pool, WorkerError
from tests.launch_helpers import (
    ROOT,
    assert_gone,
    cell_function,
    children,
    cuda_initialised,
    tcpstore_warmed,  # noqa: F401  (an autouse fixture)
)

pytestmark = pytest.mark.ranks

CUDA_ALL_REDUCE = cell_function("""
    import os
    import torch
    import torch.distributed as dist

    def cuda_all_reduce(scale=1.0):
        device = torch.device("cuda", torch.cuda.current_device())
        t = torch.full((1024,), float(dist.get_rank() + 1), device=device) * scale
        dist.all_reduce(t)
        torch.cuda.synchronize()
        print(f"rank {dist.get_rank()} on {device}: sum {t[0].item():g}")
        return {"tensor": t, "device": str(device), "local_rank": int(os.environ["LOCAL_RANK"]),
                "backend": dist.get_backend(), "visible": torch.cuda.device_count()}
""", "cuda_all_reduce")


@pytest.fixture(autouse=True)
def cuda_before():
    """This worker's CUDA state before each test (a test run earlier in the same worker may have initialised
    it; the fresh-interpreter tests below prove the launcher never does)."""
    CUDA_BEFORE[:] = [cuda_initialised()]
    yield
    CUDA_BEFORE.clear()


CUDA_BEFORE: list[bool] = []


def assert_notebook_untouched():
    assert cuda_initialised() == CUDA_BEFORE[0], "the launcher initialised CUDA in the notebook's process"
    assert not dist.is_initialized()
    assert children(psutil.Process()) == []


def run_fresh(script: str) -> str:
    """Run a script in a fresh interpreter (whose CUDA state nothing else touched); return its output."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT), timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@pytest.mark.gpu
@pytest.mark.timeout(120)
def test_cuda_results_come_back_on_the_cpu():
    results = launch.run(CUDA_ALL_REDUCE, nproc=1, backend="nccl")
    assert results[0]["device"] == "cuda:0" and results[0]["backend"] == "nccl"
    assert results[0]["tensor"].device.type == "cpu" and torch.equal(results[0]["tensor"], torch.ones(1024))
    assert_notebook_untouched()


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_nothing_the_parent_unpickles_initialises_cuda():
    """A CUDA tensor as a result, inside an exception, and pickled by torch itself (the unpickler's own
    guarantee, without the worker's move to the CPU): the notebook's process never initialises CUDA."""
    out = run_fresh("""
        import pickle, subprocess, sys
        import torch
        from course_utils import launch
        from course_utils.launch.pickling import loads_pickle_on_cpu

        def returns_cuda():
            return {"t": torch.arange(4.0, device="cuda"), "p": torch.nn.Parameter(torch.ones(2, device="cuda"))}

        def raises_cuda():
            raise ValueError(torch.arange(3.0, device="cuda"))

        r = launch.run(returns_cuda, nproc=1, backend="nccl")[0]
        assert r["t"].device.type == "cpu" and r["t"].tolist() == [0.0, 1.0, 2.0, 3.0]
        assert isinstance(r["p"], torch.nn.Parameter) and r["p"].device.type == "cpu"
        try:
            launch.run(raises_cuda, nproc=1, backend="nccl")
        except launch.WorkerError as err:
            assert isinstance(err.exception, ValueError), err
            assert err.exception.args[0].device.type == "cpu" and err.exception.args[0].tolist() == [0.0, 1.0, 2.0]
        else:
            raise AssertionError("no WorkerError")
        raw = subprocess.run([sys.executable, "-c", "import pickle, sys, torch; "
                              "sys.stdout.buffer.write(pickle.dumps(ValueError(torch.ones(2, device='cuda'))))"],
                             capture_output=True, check=True).stdout
        back = loads_pickle_on_cpu(raw)
        assert back.args[0].device.type == "cpu" and back.args[0].tolist() == [1.0, 1.0]
        print("cuda initialised in the parent:", torch.cuda.is_initialized())
    """)
    assert "cuda initialised in the parent: False" in out


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_a_function_closing_over_a_cuda_tensor_is_refused_clearly():
    out = run_fresh("""
        import torch
        from course_utils import launch

        weights = torch.ones(3, device="cuda")

        def uses_weights():
            return weights.sum()

        try:
            launch.run(uses_weights, nproc=1)
        except TypeError as err:
            print("refused:", err)
        try:
            launch.run(print, weights, nproc=1)
        except TypeError as err:
            print("refused:", err)
    """)
    assert "refused: fn uses a tensor on cuda:0, which cannot be sent to the ranks" in out
    assert "refused: argument 0 holds a tensor on cuda:0" in out


GLOO_VIEW = cell_function("""
    import os
    import torch

    def gloo_view():
        from course_utils.timeline import Timeline

        return {"cuda": torch.cuda.is_available(), "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
                "timeline": Timeline().mode, "initialised": torch.cuda.is_initialized()}
""", "gloo_view")


@pytest.mark.gpu
@pytest.mark.timeout(180)
def test_gloo_ranks_on_a_gpu_machine_see_no_gpu_unless_asked():
    for r in launch.run(GLOO_VIEW, nproc=2, backend="gloo").values():
        assert r == {"cuda": False, "visible": "", "timeline": "host", "initialised": False}
    for r in launch.run(GLOO_VIEW, nproc=2, backend="gloo", gpus=True).values():
        assert r["cuda"] is True and r["timeline"] == "kernels"
    assert_notebook_untouched()


@pytest.mark.multigpu
@pytest.mark.timeout(120)
def test_run_auto_picks_nccl_one_gpu_per_rank():
    results = launch.run(CUDA_ALL_REDUCE, 2.0, nproc=2)  # backend="auto"
    for rank, r in results.items():
        assert r["backend"] == "nccl" and r["device"] == f"cuda:{rank}" and r["local_rank"] == rank
        assert r["tensor"].device.type == "cpu" and torch.equal(r["tensor"], torch.full((1024,), 6.0))
    assert_notebook_untouched()


@pytest.fixture(scope="module")
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "course_utils")
    return ip


@pytest.mark.multigpu
@pytest.mark.timeout(180)
def test_torchrun_magic_with_nccl(shell, capsys):
    cell = ("t = torch.ones(8, device='cuda') * (dist.get_rank() + 1)\ndist.all_reduce(t)\n"
            "print(dist.get_backend(), torch.cuda.current_device())\nt")
    values = shell.run_cell_magic("torchrun", "-n 2 --backend nccl", cell)
    assert all(torch.equal(v, torch.full((8,), 3.0)) for v in values.values())
    out = capsys.readouterr().out
    assert "[rank 0] nccl 0" in out and "[rank 1] nccl 1" in out
    shell.run_cell_magic("torchrun", "-n 2 --backend nccl --cli", cell.rsplit("\n", 1)[0])
    out = capsys.readouterr().out
    assert "[rank 0] nccl 0" in out and "[rank 1] nccl 1" in out
    assert_notebook_untouched()


@pytest.mark.multigpu
@pytest.mark.timeout(180)
def test_pool_with_nccl_round_trips_and_stops_a_stuck_collective():
    with Pool(2, backend="nccl") as pool:
        for scale in (1.0, 3.0):
            results = pool.run(CUDA_ALL_REDUCE, scale)
            assert [torch.equal(r["tensor"], torch.full((1024,), 3.0 * scale)) for r in results.values()] == [True] * 2
        pids = pool.pids
        # rank 1 fails while rank 0 waits in an NCCL all_reduce, which would otherwise wait ~10 minutes
        with pytest.raises(WorkerError, match="rank 1 failed first") as info:
            pool.exec("if dist.get_rank() == 1:\n    raise RuntimeError('no')\n"
                      "dist.all_reduce(torch.ones(1, device='cuda'))\ntorch.cuda.synchronize()")
        assert info.value.stopped == [0] and pool.closed
    assert_gone(pids)
    assert_notebook_untouched()


@pytest.mark.multigpu
@pytest.mark.timeout(180)
def test_an_nccl_hang_shows_where_each_rank_waits():
    stuck = cell_function("""
        import time
        import torch
        import torch.distributed as dist

        def nccl_stuck():
            t = torch.ones(1, device="cuda")
            # Both ranks join a first all-reduce: it creates the communicator, and creating it blocks the host
            # until every rank arrives, so without it rank 0 would wait inside dist.all_reduce, not in the
            # synchronize below.
            dist.all_reduce(t)
            torch.cuda.synchronize()
            if dist.get_rank() == 0:
                dist.all_reduce(t)  # only queued on the GPU: the host goes on
                torch.cuda.synchronize()  # rank 1 never joins: the host waits here
            else:
                time.sleep(300)
    """, "nccl_stuck")
    with pytest.raises(launch.WorkerTimeout) as info:
        launch.run(stuck, nproc=2, backend="nccl", timeout=30)
    err = info.value
    assert err.running == [0, 1] and err.starting == []
    assert "torch.cuda.synchronize()" in err.stacks[0] and "time.sleep(300)" in err.stacks[1]
    print(err)
    assert_notebook_untouched()
