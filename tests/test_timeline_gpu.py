"""course_utils.timeline on a GPU: CUDA-event spans show real concurrency, never synchronise while
recording, line up with host spans and with torch.profiler's CUPTI timings.

Kernels of known length are torch.cuda._sleep(cycles), calibrated once against CUDA events. Set
TIMELINE_PNG_DIR to also save the pictures these tests draw.
"""

from __future__ import annotations

import os
import time

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from course_utils.timeline import Timeline, from_profiler  # noqa: E402

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def cycles_per_ms():
    torch.cuda._sleep(1000)  # load the kernel
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    b.synchronize()
    return 20_000_000 / a.elapsed_time(b)


def sleep_ms(ms: float, cycles_per_ms: float) -> None:
    torch.cuda._sleep(int(ms * cycles_per_ms))


def _save(fig, name):
    d = os.environ.get("TIMELINE_PNG_DIR")
    if d:
        fig.savefig(os.path.join(d, name), dpi=110, bbox_inches="tight")
    plt.close(fig)


def _overlap(a, b) -> float:
    return max(0.0, min(a.end_ms, b.end_ms) - max(a.start_ms, b.start_ms))


def test_sleeps_on_two_side_streams_overlap_and_on_one_stream_follow(cycles_per_ms):
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    tl = Timeline()
    assert tl.uses_cuda
    tl.name_stream(s1, "side stream 1")
    tl.name_stream(s2, "side stream 2")
    torch.cuda.synchronize()
    with tl.span("A: sleep 10 ms", stream=s1):
        sleep_ms(10, cycles_per_ms)
    with tl.span("B: sleep 10 ms", stream=s2):
        sleep_ms(10, cycles_per_ms)
    s2.wait_stream(s1)
    s1.wait_stream(s2)  # C starts after both A and B
    with tl.span("C: sleep 10 ms", stream=s1):
        sleep_ms(10, cycles_per_ms)
    with tl.span("D: sleep 10 ms", stream=s1):
        sleep_ms(10, cycles_per_ms)
    sp = {s.name[0]: s for s in tl.spans()}
    a, b, c, d = sp["A"], sp["B"], sp["C"], sp["D"]
    assert (a.stream, b.stream, c.stream) == ("side stream 1", "side stream 2", "side stream 1")
    assert _overlap(a, b) > 0.8 * a.duration_ms  # two streams: drawn overlapping
    assert _overlap(c, d) == 0 and d.start_ms >= c.end_ms  # one stream: one after the other
    durations = [s.duration_ms for s in (a, b, c, d)]
    print(f"\n[streams] A B C D ms: {[round(x, 3) for x in durations]}, A/B overlap {_overlap(a, b):.3f} ms")
    assert max(durations) / min(durations) < 1.05, durations  # same kernel, same length within 5%
    assert c.start_ms >= max(a.end_ms, b.end_ms) - 0.05
    _save(tl.plot(title="two side streams, then one"), "timeline_streams.png")


def test_pinned_h2d_copy_on_a_side_stream_overlaps_a_matmul():
    x = torch.randn(8192, 8192, device="cuda")
    host = torch.empty(64 * 2**20 // 4, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    compute_s, copy_s = torch.cuda.Stream(), torch.cuda.Stream()
    y = x @ x  # warm up cuBLAS and the copy path
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    tl = Timeline()
    tl.name_stream(compute_s, "compute")
    tl.name_stream(copy_s, "copy")
    with tl.span("matmul 8192²", kind="compute", stream=compute_s):
        y = x @ x
    with tl.span("H2D 64 MiB pinned", kind="h2d", stream=copy_s):
        dev.copy_(host, non_blocking=True)
    mm, h2d = tl.spans()
    assert mm.stream == "compute" and h2d.stream == "copy"
    print(f"\n[copy] matmul {mm.duration_ms:.3f} ms, h2d {h2d.duration_ms:.3f} ms, "
          f"copy/compute overlap {tl.stats().copy_compute_overlap:.3f}")
    assert h2d.duration_ms < mm.duration_ms  # the setting this test is built for
    assert _overlap(mm, h2d) > 0.9 * h2d.duration_ms
    assert tl.stats().copy_compute_overlap > 0.9
    del y
    _save(tl.plot(title="pinned H2D copy under a matmul"), "timeline_copy_overlap.png")


def test_recording_never_synchronises_and_the_host_runs_ahead(cycles_per_ms):
    s = torch.cuda.Stream()
    tl = Timeline()
    x = torch.ones(4, device="cuda")
    with tl.span("warm-up", stream=s):  # first-use costs (events, stream label) stay out of the timing
        x.add_(1)
    tl.mark("warm-up done", stream=s)
    tl.spans()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any synchronising call in here raises
    try:
        t0 = time.perf_counter()
        for i in range(5):
            with tl.span(f"sleep {i}", stream=s):
                sleep_ms(20, cycles_per_ms)
                x.add_(1)
            tl.mark(f"after {i}", stream=s)
        with tl.span("host bookkeeping", kind="host"):
            pass
        host_ms = (time.perf_counter() - t0) * 1e3
        still_busy = not s.query()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    print(f"\n[no sync] host {host_ms:.3f} ms while recording; GPU still busy after: {still_busy}")
    assert still_busy  # the host got here while the GPU had most of the 100 ms still to run
    spans = [sp for sp in tl.spans() if sp.kind == "compute" and sp.name != "warm-up"]
    gpu_ms = spans[-1].end_ms - spans[0].start_ms
    print(f"[no sync] GPU work {gpu_ms:.3f} ms")
    assert gpu_ms > 90
    assert host_ms < 0.1 * gpu_ms, (host_ms, gpu_ms)


def test_sync_debug_mode_would_catch_a_sync():
    """Control for the test above: the guard really raises on a synchronising call."""
    x = torch.ones(4, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):
            x.sum().item()
    finally:
        torch.cuda.set_sync_debug_mode(0)


def test_spans_waits_once_for_unfinished_work(cycles_per_ms):
    s = torch.cuda.Stream()
    tl = Timeline()
    torch.cuda.synchronize()
    with tl.span("50 ms", stream=s):
        sleep_ms(50, cycles_per_ms)
    assert not s.query()  # unfinished when we ask
    (span,) = tl.spans()
    assert s.query()
    assert span.duration_ms == pytest.approx(50, rel=0.2)  # calibrated cycles; clocks may drift a little
    assert tl.spans() == [span]  # resolved once, kept


def test_host_spans_share_the_time_axis_with_cuda_spans(cycles_per_ms):
    s = torch.cuda.Stream()
    tl = Timeline()
    torch.cuda.synchronize()
    with tl.span("kernel 30 ms", stream=s):
        with tl.span("launch", kind="host"):
            sleep_ms(30, cycles_per_ms)
    with tl.span("s.synchronize()", kind="host"):
        s.synchronize()
    sp = {x.name: x for x in tl.spans()}
    kernel, launch, wait = sp["kernel 30 ms"], sp["launch"], sp["s.synchronize()"]
    print(f"\n[anchor] kernel {kernel.start_ms:.3f}-{kernel.end_ms:.3f}, launch {launch.start_ms:.3f}-"
          f"{launch.end_ms:.3f}, wait ends {wait.end_ms:.3f} ms; anchor ± {tl.anchor_uncertainty_ms * 1e3:.1f} µs")
    slack = 0.5 + tl.anchor_uncertainty_ms  # launch latency plus the anchor's uncertainty
    assert kernel.start_ms == pytest.approx(launch.start_ms, abs=slack)  # idle GPU starts at once
    assert kernel.end_ms == pytest.approx(wait.end_ms, abs=slack)  # the host wakes when the kernel ends
    assert launch.end_ms < kernel.start_ms + 1 < kernel.end_ms - 25  # the host ran ahead
    assert tl.anchor_uncertainty_ms < 0.5
    _save(tl.plot(title="host runs ahead, then waits"), "timeline_host_and_device.png")


def test_event_timings_agree_with_the_profilers(cycles_per_ms):
    from torch.profiler import ProfilerActivity, profile

    s = torch.cuda.Stream()
    host = torch.empty(16 * 2**20 // 4, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    torch.cuda.synchronize()
    tl = Timeline()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with tl.span("sleep 10 ms", stream=s):
            sleep_ms(10, cycles_per_ms)
        with tl.span("h2d", kind="h2d", stream=s):
            dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()
    ours = {x.name: x for x in tl.spans()}
    theirs = from_profiler(prof, host_ops=False)
    kernels = [x for x in theirs if x.kind == "compute"]  # the spin kernel behind torch.cuda._sleep
    copies = [x for x in theirs if x.kind == "h2d"]
    assert len(kernels) == 1 and len(copies) == 1, [(x.name, x.kind) for x in theirs]
    assert kernels[0].stream.startswith("stream ") and kernels[0].stream == copies[0].stream
    print(f"\n[profiler] sleep: events {ours['sleep 10 ms'].duration_ms:.4f} ms, CUPTI {kernels[0].duration_ms:.4f}; "
          f"h2d: events {ours['h2d'].duration_ms:.4f}, CUPTI {copies[0].duration_ms:.4f}")
    assert ours["sleep 10 ms"].duration_ms == pytest.approx(kernels[0].duration_ms, rel=0.05)
    assert ours["h2d"].duration_ms == pytest.approx(copies[0].duration_ms, rel=0.25, abs=0.05)


def test_a_label_is_not_a_stream_on_a_gpu():
    tl = Timeline()
    with pytest.raises(TypeError, match="name_stream"):
        tl.span("x", kind="compute", stream="copy")
    with tl.span("fine", kind="host", stream="copy"):
        pass
    assert tl.spans()[0].stream == "copy"


@pytest.mark.multigpu
def test_a_stream_on_another_device_is_refused():
    tl = Timeline(device=0)
    other = torch.cuda.Stream(device=1)
    with pytest.raises(ValueError, match="cuda:1.*cuda:0"):
        tl.span("x", stream=other)
    Timeline(device=1).span("ok", stream=other).__exit__(None, None, None)


def _nccl_gather_worker():
    """Rank 1 computes for a while before the all_reduce; rank 0 goes straight in and must wait for it."""
    import torch.distributed as dist

    from course_utils.timeline import Timeline

    x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    grad = torch.ones(1 << 20, device="cuda")
    x @ x  # warm-up: cuBLAS handle, NCCL communicator
    dist.all_reduce(grad)
    torch.cuda.synchronize()
    dist.barrier()
    tl = Timeline()
    if dist.get_rank() == 1:
        with tl.span("matmuls", kind="compute"):
            for _ in range(100):
                x @ x
    with tl.span("all_reduce", kind="comm"):
        dist.all_reduce(grad)
    merged = tl.gather()
    return [s.to_dict() for s in merged.spans()], merged.skew_ms


@pytest.mark.multigpu
@pytest.mark.timeout(180)
def test_gather_through_launch_on_nccl_puts_two_gpus_on_one_axis():
    from course_utils import launch
    from course_utils.timeline import Span

    out = launch.run(_nccl_gather_worker, nproc=2, backend="nccl", timeout=150)
    (spans0, skew), (spans1, _) = out[0], out[1]
    assert spans0 == spans1  # every rank gets the same merged timeline
    spans = [Span.from_dict(d) for d in spans0]
    assert {s.rank for s in spans} == {0, 1}
    mm = next(s for s in spans if s.name == "matmuls")
    ar = {s.rank: s for s in spans if s.name == "all_reduce"}
    assert mm.rank == 1 and mm.duration_ms > 1.0
    # Rank 0's all_reduce starts before rank 1's matmuls end and cannot end before rank 1 joins: its bar
    # covers rank 1's compute on the common axis, within the clocks' stated skew (plus a small margin).
    margin = (skew or 0.0) + 0.5
    assert ar[0].start_ms < mm.end_ms
    assert ar[0].end_ms >= mm.end_ms - margin
    assert abs(ar[0].end_ms - ar[1].end_ms) < 0.5 * mm.duration_ms
