"""Lesson 02 (CUDA streams): measurement helpers, the stream-split check against right and wrong runs,
the reference recording, and the notebook's exercise cells with the solution and the wrong answer."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest
import torch

from course_utils import checks, reference
from course_utils import streams as st
from course_utils.checks.streams import check_stream_split
from course_utils.timeline import Timeline
from tests.exercise_cells import exercise_cells, run_cells

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "02_cuda_streams.ipynb"
EX = "ex02_stream_split"
HAS_CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------------------ runs of the workload


def one_side_stream(workload):  # everything on one side stream: no overlap
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main)
    with torch.cuda.stream(side):
        for chain in workload.chains:
            for step in chain:
                step()
    main.wait_stream(side)


def syncs_between_launches(workload):  # two streams, but the host waits after every launch
    streams = [torch.cuda.Stream() for _ in workload.chains]
    for stream, chain in zip(streams, workload.chains, strict=True):
        with torch.cuda.stream(stream):
            for step in chain:
                step()
                torch.cuda.synchronize()


def forgets_wait_stream(workload):  # fast, but the current stream does not wait for the chains
    streams = [torch.cuda.Stream() for _ in workload.chains]
    for stream, chain in zip(streams, workload.chains, strict=True):
        with torch.cuda.stream(stream):
            for step in chain:
                step()


# ------------------------------------------------------------------------------ the check


def test_without_a_gpu_the_check_skips_or_fails_under_require_gpu(monkeypatch, capsys):
    """Pretend there is no GPU (so this runs on GPU machines too): skip normally, fail under COURSE_REQUIRE_GPU=1."""
    monkeypatch.setattr(checks, "gpu_available", lambda: False)
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    check_stream_split(st.split_chains_reference)
    assert checks.SKIP_MARKER in capsys.readouterr().out
    monkeypatch.setenv("COURSE_REQUIRE_GPU", "1")
    with pytest.raises(checks.CheckFailed, match="needs a GPU"):
        check_stream_split(st.split_chains_reference)


@pytest.mark.gpu
def test_check_passes_the_reference_split(capsys):
    check_stream_split(st.split_chains_reference)
    assert checks.PASS_MARKER in capsys.readouterr().out


@pytest.mark.gpu
@pytest.mark.parametrize("run, message", [(st.run_on_one_stream, "speed-up"), (one_side_stream, "speed-up"),
                                          (syncs_between_launches, "speed-up"), (forgets_wait_stream, "counts")])
def test_check_fails_wrong_runs(run, message):
    with pytest.raises(checks.CheckFailed, match=message):
        check_stream_split(run)


# ------------------------------------------------------------------------------ helpers


def test_makespan_counts_compute_spans_only():
    spans = [{"name": "a", "kind": "compute", "start_ms": 1.0, "end_ms": 4.0},
             {"name": "b", "kind": "compute", "start_ms": 2.0, "end_ms": 6.5},
             {"name": "h", "kind": "host", "start_ms": 0.0, "end_ms": 9.0}]
    assert st.makespan_ms(spans) == pytest.approx(5.5)
    assert st.makespan_ms(spans, kind="host") == pytest.approx(9.0)
    with pytest.raises(ValueError, match="no 'comm' spans"):
        st.makespan_ms(spans, kind="comm")


def test_host_cost_per_op_is_measured_on_cpu():
    us = st.host_cost_per_op_us("cpu", n=200)
    assert 0 < us < 10_000


@pytest.mark.gpu
def test_sleep_kernels_overlap_on_side_streams():
    one, two = st.sleep_on_streams(4, 4.0, 1), st.sleep_on_streams(4, 4.0, 2)
    assert one["makespan_ms"] == pytest.approx(16.0, rel=0.25)
    assert one["makespan_ms"] / two["makespan_ms"] > 1.6


@pytest.mark.gpu
def test_streams_do_not_help_full_or_launch_bound_work():
    # 8192: each matmul fills the GPU for ~1.5 ms on an H100. (At 4096 a partly empty last wave of thread
    # blocks left room, and 2 streams measured 1.3x faster on an H100: not a "fills the GPU" case.)
    mm1, mm2 = st.matmul_on_streams(8192, 4, 1), st.matmul_on_streams(8192, 4, 2)
    assert mm1["makespan_ms"] / mm2["makespan_ms"] < 1.2
    t1, t2 = st.tiny_ops_on_streams(2, 200, 1), st.tiny_ops_on_streams(2, 200, 2)
    # Where the loop is launch-bound, a second stream buys nothing. (A host that launches faster than the
    # GPU runs tiny kernels makes the loop GPU-bound: seen on a 2xH200 host, where 2 streams were 1.8x.)
    if st.launch_bound(t1):
        assert t1["makespan_ms"] / t2["makespan_ms"] < 1.3


def test_launch_bound_verdict():
    assert st.launch_bound({"makespan_ms": 8.2, "host_launch_ms": 8.0})
    assert not st.launch_bound({"makespan_ms": 0.74, "host_launch_ms": 0.40})


@pytest.mark.gpu
def test_legacy_default_stream_serialises_with_a_blocking_stream_only():
    pairs = st.default_stream_pairs(4.0)
    assert pairs["two side streams"]["makespan_ms"] < 0.75 * pairs["two side streams"]["serial_ms"]
    blocking = pairs["default + blocking stream"]
    assert blocking["makespan_ms"] > 0.9 * blocking["serial_ms"]


@pytest.mark.gpu
def test_handoff_orders_the_consumer_after_the_producer():
    out = st.handoff(4.0)
    assert out["y_ok"]
    spans = {s["name"]: s for s in out["spans"]}
    assert spans["consume: y = x * 2"]["start_ms"] >= spans["produce: sleep, then fill x"]["end_ms"] - 0.05


# ------------------------------------------------------------------------------ the recording


def test_reference_recording_is_complete_and_plots():
    if "02_streams" not in reference.available():
        pytest.skip("no reference recording 02_streams yet: make it on a GPU with "
                    "python benchmarks/record_references.py 02_streams")
    rec = reference.load("02_streams")
    assert rec.provenance.get("gpu") and rec.provenance.get("torch") and rec.provenance.get("date")
    for key in ("cycles_per_ms", "sleep", "default_stream", "handoff", "matmul", "tiny", "host_us_per_op", "exercise"):
        assert key in rec.data, key
    assert set(rec.data["default_stream"]) == {"two side streams", "default + side stream", "default + blocking stream"}
    import matplotlib.pyplot as plt

    figs = [Timeline.from_spans(r["spans"]).plot(title="t") for r in rec.data["sleep"].values()]
    figs.append(st.plot_makespans(rec.data["sleep"]))
    for fig in figs:
        plt.close(fig)


def test_recording_is_registered():
    assert st.RECORDINGS == {"02_streams": st.record_lesson02}


# ------------------------------------------------------------------------------ the notebook's exercise


@pytest.fixture(scope="module")
def notebook() -> dict:
    return json.loads(NOTEBOOK.read_text())


def test_notebook_exercise_metadata(notebook):
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    meta = {c["metadata"]["nbgrader"]["grade_id"]: c["metadata"]["nbgrader"]
            for c in cells if "nbgrader" in c["metadata"]}
    assert meta[EX]["grade"] is True and meta[EX]["points"] > 0 and meta[EX]["locked"] is True
    assert meta[f"{EX}_solution"]["solution"] is True
    assert any("parameters" in c["metadata"].get("tags", []) for c in cells)


def test_notebook_exercise_with_solution(notebook, monkeypatch):
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    text, error = run_cells(exercise_cells(notebook, EX, None))
    assert error is None, text
    assert (checks.PASS_MARKER if HAS_CUDA else checks.SKIP_MARKER) in text


def test_notebook_exercise_with_wrong_answer(notebook, monkeypatch):
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    wrong = (ROOT / "tests" / "wrong_answers" / NOTEBOOK.stem / f"{EX}.py").read_text()
    text, error = run_cells(exercise_cells(notebook, EX, wrong))
    if HAS_CUDA:
        assert error == "CheckFailed", text
        assert "speed-up" in text
    else:
        assert error is None and checks.SKIP_MARKER in text, text


def test_makespan_plot_draws_bars():
    import matplotlib.pyplot as plt

    fig = st.plot_makespans({"one": {"makespan_ms": 4.0}, "two": {"makespan_ms": 2.0}})
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert any("x2.00" in t for t in texts)
    plt.close(fig)
