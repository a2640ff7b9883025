"""course_utils.bench: nccl-tests' definitions, buffer sizes, the collective sweep on gloo ranks, the alpha-beta
fit, link limits, the table and the plot. GPU: bench's busbw against a raw timing loop in the same run
(benchmarks/collectives_bench.py), on two GPUs or more."""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

from course_utils import bench, launch
from course_utils.hardware import GPUInfo, Machine, Topology

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------------------ definitions

# busbw / algbw as nccl-tests' src/<op>.cu compute it (AllReduceGetBw, AllGatherGetBw, ...), written out by hand.
NCCL_TESTS = {
    "all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "gather": lambda n: (n - 1) / n,
    "scatter": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0, "reduce": lambda n: 1.0,
}


@pytest.mark.parametrize("n", [1, 2, 3, 4, 5, 8, 16])
def test_bus_factor_is_nccl_tests(n):
    assert set(bench.COLLECTIVES) == set(NCCL_TESTS)
    for op, factor in NCCL_TESTS.items():
        assert bench.bus_factor(op, n) == pytest.approx(factor(n), rel=1e-12), op
    assert bench.bus_factor("all_reduce", 2) == 1.0 and bench.bus_factor("all_reduce", 8) == 1.75


def test_bus_factor_refuses_unknown_ops_and_world_sizes():
    with pytest.raises(ValueError, match="unknown collective 'allreduce'"):
        bench.bus_factor("allreduce", 4)
    with pytest.raises(ValueError, match="world_size"):
        bench.bus_factor("all_reduce", 0)


def test_collective_counts_size_buffers_as_nccl_tests():
    mib = 1 << 20
    assert bench.collective_counts("all_reduce", mib, 4) == (mib // 4, mib // 4, mib)
    assert bench.collective_counts("broadcast", 1000, 3) == (250, 250, 1000)
    shard = mib // 4 // 4
    assert bench.collective_counts("all_gather", mib, 4) == (shard, 4 * shard, mib)  # S = the output, n shards
    assert bench.collective_counts("gather", mib, 4) == (shard, 4 * shard, mib)
    assert bench.collective_counts("reduce_scatter", mib, 4) == (4 * shard, shard, mib)  # S = the input
    assert bench.collective_counts("scatter", mib, 4) == (4 * shard, shard, mib)
    assert bench.collective_counts("all_to_all", mib, 4) == (4 * shard, 4 * shard, mib)
    # shards are a multiple of 16 bytes (4 floats), as nccl-tests aligns them, and at least one element
    ins, outs, size = bench.collective_counts("all_gather", 1000, 3)
    assert ins == 80 and outs == 240 and size == 960
    assert bench.collective_counts("all_gather", 8, 4) == (1, 4, 16)


def test_size_range():
    assert bench.size_range(1024, 1 << 20, 4) == [1 << 10, 1 << 12, 1 << 14, 1 << 16, 1 << 18, 1 << 20]
    assert bench.size_range(8, 8) == [8]
    with pytest.raises(ValueError):
        bench.size_range(16, 8)


def test_bench_result_reads_old_copy_results_and_round_trips():
    old = {"op": "h2d pinned", "size_bytes": 1024, "time_ms": 0.01, "algbw_gbps": 0.1, "busbw_gbps": None,
           "iters": 3}  # lesson 04's recordings hold these keys only
    r = bench.BenchResult.from_dict(old)
    assert r.mode is None and r.world_size is None
    assert bench.BenchResult.from_dict(r.to_dict()) == r


def test_measure_still_times_copies():
    x = torch.zeros(1 << 16)
    r = bench.measure("h2h", x.numel() * 4, lambda: x.clone(), cuda=False, budget_ms=2)
    assert r.iters >= 3 and r.time_ms > 0 and r.algbw_gbps == pytest.approx(r.size_bytes / (r.time_ms * 1e6))
    assert "h2h" in bench.format_table([r]) and "busbw" not in bench.format_table([r])  # no bus factor for a copy
    both = bench.format_table([r, bench.BenchResult(**{**r.__dict__, "op": "all_reduce", "busbw_gbps": 1.0})])
    assert "busbw" in both and both.splitlines()[1].rstrip().endswith("-")  # the copy's cell, where others have one


# ------------------------------------------------------------------------------------------ on gloo ranks


def _run_every_collective():
    """Each collective once on known data, through bench.collective_call: what every rank got."""
    import torch.distributed as dist

    out = {}
    n, rank = dist.get_world_size(), dist.get_rank()
    for op in bench.COLLECTIVES:
        call, inp, res, size = bench.collective_call(op, 16 * n, dtype=torch.float32)
        if inp.numel():
            inp.copy_(torch.arange(inp.numel(), dtype=torch.float32) + 100 * (rank + 1))
        work = call(True)
        if work is not None:
            work.wait()
        out[op] = (res.clone(), size)
    return out


@pytest.fixture(scope="module")
def pool():
    with launch.Pool(2, backend="gloo") as p:
        yield p


def test_collective_call_does_what_its_name_says(pool):
    got = pool.run(_run_every_collective)
    a = torch.arange(8, dtype=torch.float32)  # every buffer holds 8 floats per rank (16 * n bytes on n = 2)
    r0, r1 = a + 100, a + 200
    assert torch.equal(got[0]["all_reduce"][0], r0 + r1) and torch.equal(got[1]["all_reduce"][0], r0 + r1)
    assert torch.equal(got[1]["broadcast"][0], r0)
    assert torch.equal(got[0]["reduce"][0], r0 + r1)
    shard0, shard1 = torch.arange(4, dtype=torch.float32) + 100, torch.arange(4, dtype=torch.float32) + 200
    assert torch.equal(got[1]["all_gather"][0], torch.cat([shard0, shard1]))
    assert torch.equal(got[0]["gather"][0], torch.cat([shard0, shard1]))
    assert torch.equal(got[1]["reduce_scatter"][0], (r0 + r1)[4:])
    assert torch.equal(got[1]["scatter"][0], r0[4:])
    assert torch.equal(got[0]["all_to_all"][0], torch.cat([r0[:4], r1[:4]]))
    assert all(size == 32 for _, size in got[0].values())


def test_sweep_on_gloo_ranks(pool):
    sizes = [1024, 16384]
    res = pool.run(bench.sweep, bench.COLLECTIVES, sizes, modes=bench.MODES, warmup=1, iters=3)
    r0, r1 = res[0], res[1]
    assert len(r0) == len(bench.COLLECTIVES) * len(sizes) * 2
    assert [r.time_ms for r in r0] == [r.time_ms for r in r1]  # the average over ranks: one number everywhere
    for r in r0:
        assert r.world_size == 2 and r.backend == "gloo" and r.iters == 3 and r.mode in bench.MODES
        assert r.size_bytes in sizes and r.time_ms > 0
        assert r.algbw_gbps == pytest.approx(r.size_bytes / (r.time_ms * 1e-3) / 1e9)
        assert r.busbw_gbps == pytest.approx(r.algbw_gbps * NCCL_TESTS[r.op](2))
        assert max(r.input_bytes, r.output_bytes) == r.size_bytes  # S is the bigger of the tensors
        if r.op in ("all_gather", "gather"):
            assert r.input_bytes * 2 == r.output_bytes
        if r.op in ("reduce_scatter", "scatter"):
            assert r.output_bytes * 2 == r.input_bytes
        assert r.count == r.size_bytes // 4 // (2 if r.op in bench.SHARDED else 1)
    table = bench.format_nccl_table(r0)
    for words in ("size", "count", "type", "redop", "root", "time", "algbw", "busbw", "(elements)", "back-to-back",
                  "blocking", "# Avg bus bandwidth", "# all_to_all: 2 ranks, gloo"):
        assert words in table, words


def test_measure_collective_refuses_bad_arguments(pool):
    with pytest.raises(launch.WorkerError, match="mode must be one of"):
        pool.run(bench.measure_collective, "all_reduce", 1024, "pipelined")


# ------------------------------------------------------------------------------------------ alpha-beta


def synthetic(alpha_us=25.0, beta_gbps=40.0, op="all_reduce", n=4, noise=None, sizes=None):
    out = []
    for i, s in enumerate(sizes or bench.size_range(1024, 1 << 28, 4)):
        t_us = alpha_us + s / (beta_gbps * 1e3)
        if noise:
            t_us *= 1 + noise * (1 if i % 2 else -1)
        algbw = s / (t_us * 1e-6) / 1e9
        out.append(bench.BenchResult(op, s, t_us / 1e3, algbw, algbw * bench.bus_factor(op, n), 20, "back_to_back",
                                     n))
    return out


def test_fit_recovers_alpha_and_beta():
    fit = bench.fit_alpha_beta(synthetic())
    assert fit.alpha_us == pytest.approx(25.0, rel=1e-6) and fit.beta_gbps == pytest.approx(40.0, rel=1e-6)
    assert fit.bus_gbps == pytest.approx(40.0 * 1.5) and fit.world_size == 4 and fit.op == "all_reduce"
    assert fit.time_us(1 << 20) == pytest.approx(25.0 + (1 << 20) / 40e3)
    assert bench.AlphaBeta.from_dict(fit.to_dict()) == fit
    noisy = bench.fit_alpha_beta([r.to_dict() for r in synthetic(noise=0.05)])  # dicts, as recorded
    assert noisy.alpha_us == pytest.approx(25.0, rel=0.15) and noisy.beta_gbps == pytest.approx(40.0, rel=0.15)


def test_fit_keeps_alpha_non_negative_and_says_what_is_missing():
    fit = bench.fit_alpha_beta(synthetic(alpha_us=0.0, noise=0.2, sizes=[1 << 20, 1 << 22, 1 << 24]))
    assert fit.alpha_us >= 0 and fit.beta_gbps > 0
    mixed = synthetic() + synthetic(op="broadcast")
    with pytest.raises(ValueError, match="several ops"):
        bench.fit_alpha_beta(mixed)
    assert bench.fit_alpha_beta(mixed, op="broadcast").op == "broadcast"
    with pytest.raises(ValueError, match="two sizes"):
        bench.fit_alpha_beta(synthetic(sizes=[1024]))
    assert bench.fit_alpha_beta([
        bench.BenchResult(**{**r.to_dict(), "op": "ring by hand"}) for r in synthetic()]).bus_gbps is None
    flat = [bench.BenchResult("all_reduce", s, 1.0, 1.0, 1.0, 20, "back_to_back", 2) for s in (1024, 4096)]
    with pytest.raises(ValueError, match="do not grow"):
        bench.fit_alpha_beta(flat)


# ------------------------------------------------------------------------------------------ link limits


def machine(n=2, links="NV18", cc="9.0", gen=5, width=16):
    gpus = [GPUInfo(index=i, name="H200", compute_capability=cc, pcie_gen=gen, pcie_width=width) for i in range(n)]
    topo = Topology(gpus=[f"GPU{i}" for i in range(n)],
                    links=[["X" if i == j else links for j in range(n)] for i in range(n)])
    return Machine(gpus=gpus, topology=topo, peer_access=None, cpu_cores=16, cpu_cores_usable=16, python="3.12",
                   torch="2.11", cuda="13.0", nccl="2.28", driver="580", backend="nccl", backend_reason="")


def test_link_limits():
    assert bench.link_limits(machine(), 2) == {"NVLink x18, one direction": 450.0}
    assert bench.link_limits(machine(n=4, links="NV12", cc="8.0"), 4) == {"NVLink x12, one direction": 300.0}
    pcie = bench.link_limits(machine(links="SYS"), 2)
    assert list(pcie) == ["PCIe gen5 x16, one direction"] and pcie["PCIe gen5 x16, one direction"] == pytest.approx(
        63.0)
    assert bench.link_limits(machine(), 4) == {}  # more ranks than GPUs
    assert bench.link_limits(machine(cc="7.5"), 2) == {}  # an NVLink this table does not know
    assert bench.link_limits(machine(n=0), 2) == {}


# ------------------------------------------------------------------------------------------ drawing


def test_plot_bandwidth_draws_one_line_per_op_and_mode_and_the_limits():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = synthetic() + [bench.BenchResult(**{**r.to_dict(), "mode": "blocking"}) for r in synthetic()]
    fig = bench.plot_bandwidth(results, limits={"NVLink x18, one direction": 450.0}, y="busbw")
    ax = fig.axes[0]
    assert len(ax.lines) == 3 and "busbw" in ax.get_ylabel()
    assert max(ax.lines[0].get_ydata()) == pytest.approx(max(r.busbw_gbps for r in synthetic()))
    assert ax.lines[0].get_color() == ax.lines[1].get_color()  # one colour per op, the mode by line style
    plt.close(fig)
    with pytest.raises(ValueError, match="algbw"):
        bench.plot_bandwidth(results, y="time")


# ------------------------------------------------------------------------------------------ GPU


def _collectives_bench():
    spec = importlib.util.spec_from_file_location("collectives_bench", ROOT / "benchmarks" / "collectives_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.gpu
@pytest.mark.multigpu
def test_busbw_matches_a_raw_timing_loop_on_nccl():
    """bench's all_reduce and all_gather busbw within 5% of the plainest timing loop, at 256 MiB (best of 3)."""
    cb = _collectives_bench()
    rows = cb.compare(nproc=2, ops=["all_reduce", "all_gather"], sizes=[256 << 20], repeats=3)
    for row in rows:
        print(f"\n{row['op']} {bench.human_bytes(row['size'])}: bench {row['bench_busbw']:.1f} GB/s, raw loop "
              f"{row['raw_busbw']:.1f} GB/s, ratio {row['ratio']:.3f}")
        assert math.isfinite(row["ratio"]) and abs(row["ratio"] - 1) <= 0.05, row
