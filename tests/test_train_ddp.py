"""launch/train_ddp.py, launch/multinode_local.sh and benchmarks/ddp_scaling.py, run for real with torchrun:
CPU ranks (gloo) here, GPU ranks (NCCL) in the tests marked gpu/multigpu. A torchrun start costs seconds on a
small CPU, so each launch checks several features at once."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "train_ddp.py"
MULTINODE = ROOT / "launch" / "multinode_local.sh"
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
SMALL = ["--train-size", "1024", "--eval-size", "101", "--batch-size", "64"]  # 8 batches per rank per epoch
GPUS = torch.cuda.device_count()


def run(cmd: list[str], timeout: float = 240, **env: str) -> tuple[int | None, str]:
    """Run a command from the repository root; (exit code, or None if stopped at the timeout; output).
    Whatever it started is stopped at the end (torchrun's workers live in sessions of their own)."""
    proc = subprocess.Popen(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **env),
                            stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
        return proc.returncode, out
    except subprocess.TimeoutExpired:
        family = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGTERM)  # torchrun stops its workers; multinode_local.sh stops its agents
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(10)
        for p in family:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        proc.kill()
        out, _ = proc.communicate()
        return None, out


def torchrun(*args: str, nproc: int = 2, cpu: bool = True, **env: str) -> tuple[int | None, str]:
    return run(TORCHRUN + ["--standalone", f"--nproc-per-node={nproc}", str(SCRIPT), *args]
               + (["--cpu"] if cpu else []), **env)


def result(out: str) -> dict:
    lines = [ln.split("RESULT ", 1)[1] for ln in out.splitlines() if "RESULT {" in ln]
    assert lines, f"no RESULT line:\n{out[-4000:]}"
    return json.loads(lines[-1])


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """Two epochs on two CPU ranks with accumulation, fp16 compression, uneven inputs under Join, and a
    checkpoint; rank 1 has one batch fewer (--uneven 1)."""
    ckpt = tmp_path_factory.mktemp("ddp") / "ck.pt"
    code, out = torchrun("--epochs", "2", "--accum", "2", "--comm-hook", "fp16", "--uneven", "1",
                         "--checkpoint", str(ckpt), *SMALL)
    assert code == 0, out
    return ckpt, out, result(out)


def test_one_launch_trains_with_accumulation_compression_and_join(trained):
    _, out, res = trained
    assert res["world_size"] == 2 and res["backend"] == "gloo"
    for rank in (0, 1):
        assert f"[rank {rank}] RANK={rank} LOCAL_RANK={rank} GROUP_RANK=0 WORLD_SIZE=2 device=cpu" in out
    e0, e1 = res["epochs"]
    assert e0["steps"] == e1["steps"] == 4  # rank 0: 8 micro-batches, 2 per optimizer step
    # fp16 hook: half the fp32 gradient bytes per optimizer step, and one all-reduce per step (not per micro-batch)
    assert e0["bytes_per_step"] == e1["bytes_per_step"] == res["grad_bytes"] / 2
    assert e1["loss"] < e0["loss"]
    assert e0["first_indices"] != e1["first_indices"]  # set_epoch: a new shuffle


def test_evaluation_counts_each_sample_once_despite_padding(trained):
    for e in trained[2]["epochs"]:
        assert e["counted"] == 101 and e["padded_counted"] == 102  # 101 samples over 2 ranks: one repeat
        assert 0.0 <= e["acc"] <= 1.0


def test_checkpoint_holds_the_inner_module_optimizer_and_epoch(trained):
    ckpt = trained[0]
    state = torch.load(ckpt, map_location="cpu", weights_only=True)
    assert sorted(state) == ["epoch", "model", "optimizer"] and state["epoch"] == 1
    assert not any(k.startswith("module.") for k in state["model"])
    assert state["optimizer"]["state"] and all("momentum_buffer" in s for s in state["optimizer"]["state"].values())
    assert not Path(str(ckpt) + ".tmp").exists()


def test_two_nodes_resume_the_checkpoint(trained):
    """multinode_local.sh: two agents, c10d rendezvous on localhost, one worker each; resumes at epoch 2."""
    ckpt = trained[0]
    code, out = run(["bash", str(MULTINODE), "--cpu", "--epochs", "1", "--checkpoint", str(ckpt), "--resume", *SMALL],
                    PYTHON=sys.executable, NPROC_PER_NODE="1")
    assert code == 0, out
    for rank in (0, 1):  # each node's only worker: LOCAL_RANK 0; the rendezvous numbered the nodes
        assert f"[node{rank}] [rank {rank}] RANK={rank} LOCAL_RANK=0 GROUP_RANK={rank} WORLD_SIZE=2" in out, out
    res = result(out)
    assert res["resumed_at_epoch"] == 2 and [e["epoch"] for e in res["epochs"]] == [2]
    assert torch.load(ckpt, map_location="cpu", weights_only=True)["epoch"] == 2


def test_no_set_epoch_repeats_the_order_and_powersgd_sends_less():
    code, out = torchrun("--epochs", "2", "--no-set-epoch", "--comm-hook", "powersgd", "--powersgd-start", "2",
                         "--powersgd-rank", "1", *SMALL, CUDA_VISIBLE_DEVICES="")  # PowerSGD on CPU: no GPU visible
    assert code == 0, out
    e0, e1 = result(out)["epochs"]
    assert e0["first_indices"] == e1["first_indices"]  # the bug: the same order every epoch
    grad_bytes = result(out)["grad_bytes"]
    assert e1["bytes_per_step"] < grad_bytes / 4  # P and Q (plus the biases), all steps compressed by epoch 1


@pytest.mark.gpu
def test_powersgd_on_the_cpu_where_gpus_are_visible_says_how_to_run_it():
    code, out = torchrun("--epochs", "1", "--comm-hook", "powersgd", *SMALL)
    assert code not in (0, None), out
    assert "CUDA_VISIBLE_DEVICES=" in out and "drop --cpu" in out, out


def test_unused_layer_fails_naming_it_with_debug_info_and_trains_when_asked_to_find_it():
    code, out = torchrun("--epochs", "1", "--unused-layer", *SMALL, TORCH_DISTRIBUTED_DEBUG="INFO")
    assert code not in (0, None), out
    assert "Parameters which did not receive grad for rank 0: aux.bias, aux.weight" in out, out
    code, out = torchrun("--epochs", "1", "--unused-layer", "--find-unused-parameters", *SMALL)
    assert code == 0 and result(out)["epochs"][0]["steps"] == 8, out


def test_uneven_inputs_without_join_hang_until_the_timeout():
    t0 = time.monotonic()
    code, out = torchrun("--epochs", "1", "--uneven", "2", "--no-join", "--timeout", "4", *SMALL)
    assert code not in (0, None), out  # the collective timed out (not a hang until our own timeout)
    assert "Timed out" in out or "timed out" in out, out
    assert time.monotonic() - t0 < 120


def test_one_process_without_torchrun_and_the_bench_mode():
    code, out = run([sys.executable, str(SCRIPT), "--cpu", "--bench", "16,32", "--bench-steps", "3"])
    assert code == 0, out
    res = result(out)
    assert res["world_size"] == 1 and set(res["bench_ms"]) == {"16", "32"}
    assert all(v > 0 for v in res["bench_ms"].values())


def test_gpu_only_options_refuse_the_cpu_with_a_clear_message():
    code, out = run([sys.executable, str(SCRIPT), "--cpu", "--sync-bn"])
    assert code != 0 and "--sync-bn needs GPUs" in out, out
    code, out = run([sys.executable, str(SCRIPT), "--cpu", "--comm-hook", "bf16"])
    assert code != 0 and "use --comm-hook fp16" in out, out


def test_multinode_returns_a_failure():
    """The workers fail at once (a flag the CPU cannot do): the script ends with a failing status."""
    code, out = run(["bash", str(MULTINODE), "--cpu", "--sync-bn"], timeout=120, PYTHON=sys.executable,
                    JOIN_TIMEOUT="20")
    assert code not in (0, None), out
    assert "--sync-bn needs GPUs" in out


def test_scaling_table_arithmetic(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import ddp_scaling

    rows = [{"gpus": 1, "strong_batch": 512, "strong_ms": 10.0, "weak_batch": 128, "weak_ms": 4.0},
            {"gpus": 2, "strong_batch": 256, "strong_ms": 6.0, "weak_batch": 128, "weak_ms": 5.0}]
    calls = iter([{"512": 10.0, "128": 4.0}, {"256": 6.0, "128": 5.0}])
    monkeypatch.setattr(ddp_scaling, "run_bench", lambda n, batches, args: next(calls))
    monkeypatch.setattr(ddp_scaling, "gpu_name", lambda: "test")
    args = ddp_scaling.argparse.Namespace(global_batch=512, batch=128, width=8, depth=2)
    res = ddp_scaling.measure([1, 2], args)
    assert [{k: r[k] for k in rows[0]} for r in res["rows"]] == rows
    assert res["rows"][1]["strong_speedup"] == pytest.approx(10 / 6)
    assert res["rows"][1]["strong_efficiency"] == pytest.approx(10 / 6 / 2)
    assert res["rows"][1]["weak_efficiency"] == pytest.approx(4 / 5)
    assert "GPUs" in ddp_scaling.table(res)


# ------------------------------------------------------------------------------------------ on GPUs


@pytest.mark.multigpu
def test_two_gpus_nccl_with_sync_bn_bf16_and_uneven_inputs(tmp_path):
    code, out = torchrun("--epochs", "2", "--accum", "2", "--sync-bn", "--comm-hook", "bf16", "--uneven", "1",
                         "--checkpoint", str(tmp_path / "ck.pt"), *SMALL, cpu=False)
    assert code == 0, out
    for rank in (0, 1):
        assert f"[rank {rank}] RANK={rank} LOCAL_RANK={rank} GROUP_RANK=0 WORLD_SIZE=2 device=cuda:{rank} " \
               "backend=nccl" in out, out
    assert "a rank ran out of batches" in out  # SyncBatchNorm + Join: throw_on_early_termination stops everyone
    res = result(out)
    assert res["backend"] == "nccl" and all(e["bytes_per_step"] == res["grad_bytes"] / 2 for e in res["epochs"])
    state = torch.load(tmp_path / "ck.pt", map_location="cpu", weights_only=True)
    assert any("running_mean" in k for k in state["model"])
    print("\n" + "\n".join(ln for ln in out.splitlines() if "epoch" in ln))


@pytest.mark.multigpu
def test_two_nodes_one_gpu_each_over_nccl():
    code, out = run(["bash", str(MULTINODE), "--epochs", "1", *SMALL], PYTHON=sys.executable, NPROC_PER_NODE="1")
    assert code == 0, out
    for rank in (0, 1):  # each "node" sees only its own GPU: both workers on cuda:0 (LOCAL_RANK 0)
        assert f"[rank {rank}] RANK={rank} LOCAL_RANK=0 GROUP_RANK={rank} WORLD_SIZE=2 device=cuda:0 " \
               "backend=nccl" in out, out
    assert result(out)["backend"] == "nccl"


@pytest.mark.gpu
def test_scaling_benchmark_on_every_gpu_here(tmp_path):
    """benchmarks/ddp_scaling.py on 1, 2, 4, ... GPUs (as many as there are): prints the table."""
    out_json = tmp_path / "scaling.json"
    code, out = run([sys.executable, str(ROOT / "benchmarks" / "ddp_scaling.py"), "--json", str(out_json),
                     "--plot", str(tmp_path / "scaling.png")], timeout=600)
    assert code == 0, out
    rows = json.loads(out_json.read_text())["rows"]
    assert [r["gpus"] for r in rows] == [n for n in (1, 2, 4, 8, 16) if n <= GPUS]
    assert rows[0]["strong_efficiency"] == pytest.approx(1.0) and rows[0]["weak_efficiency"] == pytest.approx(1.0)
    for r in rows[1:]:
        assert 0.2 < r["strong_efficiency"] <= 1.15 and 0.2 < r["weak_efficiency"] <= 1.15, r
        assert r["strong_ms"] < rows[0]["strong_ms"]  # more GPUs, less work each: faster steps
    print("\n" + out.split("GPUs", 1)[1] if "GPUs" in out else out)
