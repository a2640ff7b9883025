"""Lesson 04 (async memcpy): the prefetcher check against the solution and wrong answers; bench and copies."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pytest
import torch

from course_utils import bench, checks, copies, reference
from course_utils.checks import copies as check04
from course_utils.timeline import Timeline
from tests.test_lesson03_events import solution_source

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "04_async_memcpy.ipynb"
WRONG = ROOT / "tests" / "wrong_answers" / "04_async_memcpy"
EX = "ex04_prefetcher"


def load(src: str, name: str):
    ns = {"torch": torch}
    exec(compile(src, name, "exec"), ns)
    return ns["prefetch"]


def solution():
    return load(solution_source(NOTEBOOK, EX), "solution")


def wrong(stem: str):
    path = WRONG / f"{stem}.py"
    return load(solution_source(NOTEBOOK, EX, path.read_text()), path.name)


def wrong_answers() -> list[Path]:
    return sorted(WRONG.glob(f"{EX}*.py"))


def test_solution_passes_the_cpu_part(capsys, monkeypatch):
    monkeypatch.setattr(checks, "gpu_available", lambda: False)
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    check04.check_prefetcher(solution())
    out = capsys.readouterr().out
    assert "correct and reading ahead" in out and checks.SKIP_MARKER in out


def test_single_buffer_fails_on_cpu():
    with pytest.raises(checks.CheckFailed, match="wrong results"):
        check04.check_prefetcher(wrong(EX))


def test_no_read_ahead_fails_on_cpu():
    def no_prefetch(batches, device, tl):  # plausible: copy each batch when it is asked for
        for i, b in enumerate(batches):
            with tl.span(f"h2d {i}", kind="h2d"):
                yield b.to(device, non_blocking=True)

    with pytest.raises(checks.CheckFailed, match="taken ahead"):
        check04.check_prefetcher(no_prefetch)


def test_judge_requires_overlap_when_measured():
    b = [torch.ones(3)] * 3
    e = [x * 2 + 1 for x in b]
    check04.judge_prefetcher(3, e, e, [2, 3, 3], True, hidden=0.9)
    with pytest.raises(checks.CheckFailed, match="hidden under compute"):
        check04.judge_prefetcher(3, e, e, [2, 3, 3], True, hidden=0.1)
    with pytest.raises(checks.CheckFailed, match="batches out"):
        check04.judge_prefetcher(3, e[:2], e[:2], [2, 3], True)


def test_cpu_run_fails_when_gpu_required(monkeypatch):
    monkeypatch.setattr(checks, "gpu_available", lambda: False)
    monkeypatch.setenv("COURSE_REQUIRE_GPU", "1")
    with pytest.raises(checks.CheckFailed, match="needs a GPU"):
        check04.check_prefetcher(solution())


def test_measure_reports_bytes_over_time():
    src, dst = torch.ones(1 << 20, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8)
    r = bench.measure("h2h", 1 << 20, lambda: dst.copy_(src), cuda=False, budget_ms=5)
    assert r.algbw_gbps == pytest.approx((1 << 20) / (r.time_ms * 1e6))
    assert r.iters >= 3 and bench.BenchResult.from_dict(r.to_dict()) == r
    table = bench.format_table([r])
    assert "algbw (GB/s)" in table and "1 MiB" in table


def test_plot_draws_series_and_limit():
    rs = [bench.BenchResult("h2d pinned", 1 << k, 0.1, (1 << k) / 1e5) for k in (10, 20)]
    fig = bench.plot_bandwidth(rs, limits={"PCIe Gen5 x16 limit": 63.0}, title="t")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert labels == ["h2d pinned", "PCIe Gen5 x16 limit: 63 GB/s"]
    assert "GB/s" in fig.axes[0].get_ylabel()


def test_sweep_measures_what_this_machine_has():
    data = copies.sweep_data([1 << 12, 1 << 16])
    ops = {r["op"] for r in data["results"]}
    if torch.cuda.is_available():
        assert {"h2d pinned", "h2d pageable", "d2h pinned", "d2h pageable", "d2d"} == ops
    else:
        assert ops == {"h2h pageable"} and data["limit_gbps"] is None
    copies.plot_sweep(data)


def test_reference_recording_has_provenance_and_every_part():
    rec = reference.load("04_copies")
    assert rec.provenance.get("gpu") and rec.provenance.get("date")
    assert {"sweep", "nonblocking", "pin_cost", "serial_spans", "overlap_spans"} <= set(rec.data)
    ops = {r["op"] for r in rec.data["sweep"]["results"]}
    assert {"h2d pinned", "h2d pageable", "d2h pinned", "d2h pageable", "d2d"} <= ops
    copies.plot_sweep(rec.data["sweep"])
    assert Timeline.from_spans(rec.data["overlap_spans"]).stats().copy_compute_overlap > \
        Timeline.from_spans(rec.data["serial_spans"]).stats().copy_compute_overlap


@pytest.mark.gpu
def test_check_passes_the_solution_on_gpu():
    check04.check_prefetcher(solution())


@pytest.mark.gpu
@pytest.mark.parametrize("path", wrong_answers(), ids=lambda p: p.stem)
def test_check_fails_wrong_answers_on_gpu(path):
    with pytest.raises(checks.CheckFailed):
        check04.check_prefetcher(wrong(path.stem))


@pytest.mark.gpu
def test_pinned_beats_pageable_and_nonblocking_pageable_holds_the_host():
    rs = {r.op: r for r in copies.copy_sweep([64 << 20], ops=("h2d",))}
    assert rs["h2d pinned"].algbw_gbps > rs["h2d pageable"].algbw_gbps
    nb = copies.nonblocking_host_time(64 << 20)
    assert nb["pinned"]["returned_ms"] < 0.5 * nb["pageable"]["returned_ms"]


def test_late_copy_detector_recognises_host_to_gpu_copies_only():
    from course_utils.checks.copies import _copies_to_cuda

    T, x = torch.Tensor, torch.ones(3)
    assert _copies_to_cuda(T.to, (x, "cuda"), {})
    assert _copies_to_cuda(T.to, (x,), {"device": torch.device("cuda", 0), "non_blocking": True})
    assert _copies_to_cuda(T.cuda, (x,), {})
    assert not _copies_to_cuda(T.to, (x, torch.float16), {})
    assert not _copies_to_cuda(T.to, (x, "cpu"), {})
    assert not _copies_to_cuda(T.add, (x, x), {})


@pytest.mark.gpu
def test_late_copy_batches_delay_the_copy_on_its_own_stream():
    from course_utils.checks.copies import late_copy_batches

    (late,) = late_copy_batches([torch.ones(1 << 20).pin_memory()], delay_ms=5.0)
    dst = torch.empty(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        start.record()
        dst.copy_(late, non_blocking=True)
        end.record()
    torch.cuda.synchronize()
    assert type(dst) is torch.Tensor  # results stay plain tensors
    assert start.elapsed_time(end) >= 4.0  # the 5 ms sleep went onto the copy's stream first
    assert torch.equal(dst.cpu(), torch.ones(1 << 20))
