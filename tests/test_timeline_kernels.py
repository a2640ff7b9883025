"""Kernels mode and torch.profiler traces on the CPU: the classification of a synthetic GPU trace laid out
exactly as kineto writes it, of a real CPU trace with a gloo collective, and CPU-only captures
(kernels mode on a machine without CUDA records CPU ops: gloo collectives become communication).

The GPU trace's layout follows libkineto's ChromeTraceLogger (output_json.cpp: X events with pid = device,
tid = stream for GPU activity, pid/tid = process/thread for CPU events, `ts` in µs from
baseTimeNanoseconds) and CuptiActivity.h (kernel args "device", "stream", "correlation", ...; memcpy
names "Memcpy HtoD (Pinned -> Device)"; PtoP copies carry fromDevice/inDevice/toDevice instead of device;
GPU user annotations carry only "External id").

Every test here runs on any machine, a GPU box included: the captures ask for the CPU explicitly
(Timeline(device="cpu", ...)), so they neither depend on nor disturb a GPU. The GPU paths are in
test_timeline_gpu.py.
"""

from __future__ import annotations

import tempfile
import time

import matplotlib

matplotlib.use("Agg")

import pytest  # noqa: E402
import torch  # noqa: E402

from course_utils.timeline import RANGE, Span, Timeline, from_profiler  # noqa: E402
from course_utils.timeline.profiler_trace import ANCHOR, COMM_OP, PROBE, memcpy_kind, spans_from_trace  # noqa: E402
from course_utils.timeline.stats import timeline_stats  # noqa: E402
from tests.timeline_helpers import close_figures  # noqa: E402,F401  (close_figures: autouse)

PID = 4242  # the process; its main thread has tid == pid on Linux


# ------------------------------------------------------------------ a GPU trace as kineto writes it
def cpu(cat, name, ts, dur, ext, tid=PID, **extra):
    return {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur,
            "args": {"External id": ext, "Record function id": 0, "Ev Idx": ext, **extra}}


def launch(name, ts, corr, cat="cuda_runtime", tid=PID):
    return {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": 3.5,
            "args": {"External id": corr, "cbid": 211, "correlation": corr}}


def kernel(name, ts, dur, stream, corr, device=0):
    return {"ph": "X", "cat": "kernel", "name": name, "pid": device, "tid": stream, "ts": ts, "dur": dur,
            "args": {"External id": corr, "queued": 0, "device": device, "context": 1, "stream": stream,
                     "correlation": corr, "registers per thread": 96, "shared memory": 0, "blocks per SM": 1.0,
                     "warps per SM": 4.0, "grid": [132, 1, 1], "block": [128, 1, 1],
                     "est. achieved occupancy %": 6}}


def memcpy(name, ts, dur, stream, corr, peer=False):
    args = ({"fromDevice": 0, "inDevice": 0, "toDevice": 1, "fromContext": 1, "inContext": 1, "toContext": 2}
            if peer else {"device": 0, "context": 1})
    return {"ph": "X", "cat": "gpu_memcpy", "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur,
            "args": {"External id": corr, **args, "stream": stream, "correlation": corr, "bytes": 1 << 20,
                     "memory bandwidth (GB/s)": 20.0}}


GEMM = "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64_execute_kernel__5x_cublas"
ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, "
       "at::detail::Array<char*, 3> >(int, at::native::CUDAFunctor_add<float>, at::detail::Array<char*, 3>)")
NCCL = "ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)"
SPIN = "void at::cuda::(anonymous namespace)::spin_kernel(long)"


def gpu_trace(with_launches: bool = True) -> dict:
    ev = [
        {"ph": "M", "name": "process_name", "ts": 0, "pid": PID, "tid": 0, "args": {"name": "python"}},
        cpu("user_annotation", "step", 100, 100, 1),
        cpu("cpu_op", "aten::mm", 110, 6, 2), launch("cudaLaunchKernel", 112, 11), kernel(GEMM, 120, 50, 7, 11),
        cpu("cpu_op", "aten::add_", 130, 3, 3), launch("cudaLaunchKernel", 131, 12), kernel(ADD, 140, 10, 20, 12),
        cpu("user_annotation", "inner", 150, 20, 4),
        launch("cudaMemcpyAsync", 152, 13), memcpy("Memcpy HtoD (Pinned -> Device)", 160, 30, 21, 13),
        launch("cudaMemsetAsync", 160, 16),
        {"ph": "X", "cat": "gpu_memset", "name": "Memset (Device)", "pid": 0, "tid": 7, "ts": 172, "dur": 1,
         "args": {"External id": 16, "device": 0, "context": 1, "stream": 7, "correlation": 16, "bytes": 64}},
        launch("cudaMemcpyAsync", 180, 14), memcpy("Memcpy DtoH (Device -> Pinned)", 200, 5, 21, 14),
        launch("cudaMemcpyPeerAsync", 185, 15), memcpy("Memcpy PtoP (Device -> Device)", 206, 4, 22, 15, peer=True),
        # a collective: PyTorch's wrapper op, NCCL's range, the kernel on NCCL's own stream
        cpu("cpu_op", "record_param_comms", 210, 10, 5),
        cpu("user_annotation", "nccl:all_reduce", 211, 8, 6),
        launch("cudaLaunchKernelExC", 212, 17), kernel(NCCL, 215, 80, 40, 17),
        # a kernel on a second GPU of this process
        launch("cudaLaunchKernel", 220, 18), kernel(ADD, 230, 10, 7, 18, device=1),
        # things that are not work: a sync record, kineto's GPU-side copy of "step", the profiler's own span
        {"ph": "X", "cat": "cuda_sync", "name": "Stream Sync", "pid": 0, "tid": 7, "ts": 300, "dur": 5,
         "args": {"External id": 19, "cuda_sync_kind": "Stream Sync", "stream": 7, "correlation": 19, "device": 0,
                  "context": 1}},
        {"ph": "X", "cat": "gpu_user_annotation", "name": "step", "pid": 0, "tid": 7, "ts": 119.999, "dur": 53.002,
         "args": {"External id": 1}},
        {"ph": "X", "cat": "Trace", "ts": 90, "dur": 300, "pid": "Spans", "tid": "PyTorch Profiler",
         "name": "PyTorch Profiler (0)", "args": {"Op count": 0}},
    ]
    if not with_launches:
        ev = [e for e in ev if e.get("cat") not in ("cuda_runtime", "cuda_driver")]
    return {"schemaVersion": 1, "deviceProperties": [], "distributedInfo": {"rank": 3},
            "displayTimeUnit": "ms", "baseTimeNanoseconds": 1_790_857_026_000_000_000, "traceEvents": ev}


def by(spans, name, kind=None):
    return [s for s in spans if s.name == name and (kind is None or s.kind == kind)]


def test_gpu_work_lands_on_its_stream_with_its_kind():
    spans = from_profiler(gpu_trace(), host_ops=False)
    work = {(s.name, s.stream): s.kind for s in spans if s.kind != RANGE}
    assert work == {
        (GEMM, "stream 7"): "compute", (ADD, "stream 20"): "compute",
        ("Memcpy HtoD (Pinned -> Device)", "stream 21"): "h2d", ("Memcpy DtoH (Device -> Pinned)", "stream 21"): "d2h",
        ("Memcpy PtoP (Device -> Device)", "stream 22"): "d2d", ("Memset (Device)", "stream 7"): "compute",
        (NCCL, "comm"): "comm",  # NCCL's own stream is the communication row
        (ADD, "cuda:1 stream 7"): "compute",  # another GPU of this process: named by device
    }
    assert all(s.rank == 3 for s in spans)  # from the trace's distributedInfo
    gemm = by(spans, GEMM)[0]
    assert (gemm.start_ms, gemm.end_ms) == (0.120, 0.170)  # ts / 1000: ms from the trace's base time
    assert not by(spans, "Stream Sync") and not by(spans, "PyTorch Profiler (0)")


def test_named_ranges_cover_the_work_they_launched_on_each_row_nested_ones_too():
    spans = from_profiler(gpu_trace(), host_ops=False)
    step = {s.stream: (s.start_ms, s.end_ms) for s in by(spans, "step")}
    inner = {s.stream: (s.start_ms, s.end_ms) for s in by(spans, "inner")}
    assert all(s.kind == RANGE for s in by(spans, "step") + by(spans, "inner"))
    # "step" launched the gemm and the memset (stream 7), the add (20), both copies (21) and the peer copy (22)
    assert step == {"stream 7": (0.120, 0.173), "stream 20": (0.140, 0.150), "stream 21": (0.160, 0.205),
                    "stream 22": (0.206, 0.210)}
    # "inner" is nested in "step": kineto's gpu_user_annotation would miss "step"'s share of it; ours does not
    assert inner == {"stream 21": (0.160, 0.190), "stream 7": (0.172, 0.173)}
    assert not by(spans, "nccl:all_reduce")  # a collective's own range is not a user's named range


def test_ranges_are_never_work_in_the_stats():
    spans = from_profiler(gpu_trace(), host_ops=False)
    st = timeline_stats(spans)
    without = timeline_stats([s for s in spans if s.kind != RANGE])
    assert st.rows["stream 7"].busy_ms == pytest.approx(0.051)  # gemm 50 µs + memset 1 µs, not the range's 53
    assert st.rows == without.rows and st.comm_compute_overlap == without.comm_compute_overlap
    # HTA's ratio, by hand: comm [215, 295] µs; compute under it: the cuda:1 kernel [230, 240] (same rank)
    assert st.comm_compute_overlap == pytest.approx(10 / 80)


def test_without_launch_events_kinetos_gpu_ranges_are_used():
    spans = from_profiler(gpu_trace(with_launches=False), host_ops=False)
    step = by(spans, "step")
    assert [(s.kind, s.stream) for s in step] == [(RANGE, "stream 7")]
    assert step[0].start_ms == pytest.approx(0.119999)


def test_host_ops_with_gpu_work_are_launches_not_communication():
    spans = from_profiler(gpu_trace(), host_ops=True)
    host = [(s.name, s.kind, s.stream) for s in spans if s.stream == "host"]
    # top-level CPU ops of the main thread; the collective's wrapper is host work here (NCCL's kernel is the comm)
    assert host == [("aten::mm", "host", "host"), ("aten::add_", "host", "host"),
                    ("record_param_comms", "host", "host")]


DTOD = "Memcpy DtoD (Device -> Device)"


@pytest.mark.parametrize("probe", ["copy", "kernel"])
def test_probes_name_streams_and_are_dropped(probe):
    """Kernels mode's probe is a 1-byte copy (a kernel's first launch can wait for the GPU); both kinds work."""
    trace = gpu_trace()
    work = (launch("cudaMemcpyAsync", 51, 20), memcpy(DTOD, 55, 1, 20, 20)) if probe == "copy" else \
        (launch("cudaLaunchKernel", 51, 20), kernel(SPIN, 55, 1, 20, 20))
    trace["traceEvents"] += [cpu("user_annotation", PROBE + "side 1", 50, 5, 7), *work,
                             # another timeline's probe (nested captures): its copy on stream 7 is not work either
                             cpu("user_annotation", PROBE + "not ours", 60, 5, 8),
                             launch("cudaMemcpyAsync", 61, 21), memcpy(DTOD, 62, 1, 7, 21)]
    spans = spans_from_trace(trace, stream_names=["side 1"])
    rows = {s.stream for s in spans}
    assert "side 1" in rows and "stream 20" not in rows and "not ours" not in rows and "stream 7" in rows
    assert [s.name for s in spans if s.name in (SPIN, DTOD)] == []  # the probes' work is not the user's work
    assert not [s for s in spans if s.name.startswith(PROBE)]


def test_window_keeps_work_launched_inside_it():
    spans = spans_from_trace(gpu_trace(), host_ops=False, window=(0.105, 0.135))
    assert {s.name for s in spans if s.kind != RANGE} == {GEMM, ADD}  # launched at 112 and 131 µs


def test_memcpy_directions_and_comm_names():
    assert [memcpy_kind(n) for n in ("Memcpy HtoD (Pageable -> Device)", "Memcpy DtoH (Device -> Pinned)",
                                     "Memcpy DtoD (Device -> Device)", "Memcpy PtoP (Device -> Device)")] == \
        ["h2d", "d2h", "d2d", "d2d"]
    comm = ["gloo:all_reduce", "nccl:all_reduce", "c10d::allreduce_", "c10d::broadcast_", "record_param_comms",
            "_c10d_functional::all_reduce"]
    not_comm = ["aten::broadcast_tensors", "aten::all", "my all_reduce range", "aten::_reduce_scatter_base?"]
    assert all(COMM_OP.match(n) for n in comm) and not any(COMM_OP.match(n) for n in not_comm)


# ------------------------------------------------------------------ a real CPU trace
def _gloo_profile(path):
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile, record_function

    x = torch.randn(128, 128)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                with record_function("my step"):
                    y = x @ x
                    work = dist.all_reduce(y, async_op=True)
                    torch.broadcast_tensors(x, y)
                    work.wait()
        finally:
            dist.destroy_process_group()
    prof.export_chrome_trace(str(path))


def test_a_real_cpu_trace_with_gloo(tmp_path):
    path = tmp_path / "trace.json"
    _gloo_profile(path)
    spans = from_profiler(str(path))
    kinds = {(s.name, s.stream): s.kind for s in spans}
    # no GPU here: the CPU ops are the computation (top-level ones only)
    assert kinds[("aten::matmul", "host")] == "compute" and not by(spans, "aten::mm")
    assert kinds[("aten::broadcast_tensors", "host")] == "compute"  # not communication
    assert kinds[("c10d::allreduce_", "host")] == "comm"  # the call on the main thread
    assert kinds[("gloo:all_reduce", "comm")] == "comm"  # gloo's work on its own thread: the comm row
    assert [(s.kind, s.stream) for s in by(spans, "my step")] == [(RANGE, "host")]
    # host_ops=False drops the CPU ops; the user's named range stays, over its host time
    assert [(s.name, s.kind, s.stream) for s in from_profiler(str(path), host_ops=False)] == \
        [("my step", RANGE, "host")]


def test_from_profiler_takes_a_profile_object_once():
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(8).add_(1)
    assert "aten::add_" in [s.name for s in from_profiler(prof)]
    with pytest.raises(RuntimeError, match="already exported"):
        from_profiler(prof)
    with pytest.raises(TypeError, match="trace path"):
        from_profiler(42)


# ------------------------------------------------------------------ kernels mode without CUDA
def test_a_capture_hides_the_profilers_warning_about_cycles_only(monkeypatch):
    """torch 2.11 (the GPU machines) warns "Profiler clears events at the end of each cycle" when a capture
    starts; a capture is one cycle of a fresh profile object, so a learner must not see it. Other warnings pass."""
    import warnings

    from torch.profiler import profile

    start = profile.start

    def warning_start(self):
        warnings.warn("Warning: Profiler clears events at the end of each cycle. ...", UserWarning, stacklevel=2)
        warnings.warn("something else the profiler says", UserWarning, stacklevel=2)
        start(self)

    monkeypatch.setattr(profile, "start", warning_start)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        tl = Timeline(device="cpu", mode="kernels")  # the profiler's CPU ops, also on a GPU machine
        with tl.capture():
            torch.ones(4).sum()
    assert [str(w.message) for w in seen] == ["something else the profiler says"]
    assert tl.spans()


def test_kernels_mode_on_a_cpu_records_ops_ranges_and_gloo_on_the_host_clock():
    import torch.distributed as dist

    x = torch.randn(128, 128)
    with tempfile.TemporaryDirectory() as d:
        dist.init_process_group("gloo", init_method=f"file://{d}/store", rank=0, world_size=1)
        try:
            tl = Timeline(device="cpu", mode="kernels")  # the profiler's CPU ops, also on a GPU machine
            assert tl.mode == "kernels" and not tl.uses_cuda
            before = time.perf_counter_ns()
            with tl.capture() as same:
                assert same is tl
                with tl.span("step"):
                    y = x @ x
                    dist.all_reduce(y)
                    torch.broadcast_tensors(x, y)
                with tl.span("sleep 5 ms", kind="host"):
                    time.sleep(0.005)
            after = time.perf_counter_ns()
        finally:
            dist.destroy_process_group()
    spans = tl.spans()
    step, = by(spans, "step")
    sleep, = by(spans, "sleep 5 ms")
    assert (step.kind, step.stream, sleep.kind) == (RANGE, "host", "host")
    assert by(spans, "aten::broadcast_tensors", "compute") and by(spans, "gloo:all_reduce", "comm")
    # every time is on the timeline's host clock: inside the capture, in the order the code ran
    lo, hi = (before - tl.origin_ns) / 1e6, (after - tl.origin_ns) / 1e6
    assert all(lo <= s.start_ms <= s.end_ms <= hi for s in spans)
    assert step.end_ms <= sleep.start_ms
    assert not [s for s in spans if s.name.startswith(ANCHOR)]  # the clock anchors are not the user's ranges
    matmul, = by(spans, "aten::matmul")
    assert step.start_ms <= matmul.start_ms <= matmul.end_ms <= step.end_ms
    assert tl.clock_uncertainty_ms < 0.5
    st = tl.stats()
    assert st.rows["host"].busy_ms < (sleep.end_ms - step.start_ms)  # the range is not work
    assert Timeline.from_spans(spans, mode="kernels").plot() is not None


def test_kernels_mode_needs_a_capture_and_reports_misuse():
    tl = Timeline(device="cpu", mode="kernels")
    with pytest.raises(RuntimeError, match="inside `with tl.capture"):
        tl.span("outside")
    with tl.capture():
        with tl.span("x"):
            pass
        with pytest.raises(RuntimeError, match="after the block"):
            tl.spans()
    assert [s.name for s in tl.spans()] == ["x"]
    with pytest.raises(ValueError, match="mode must be"):
        Timeline(device="cpu", mode="cupti")


def test_captures_nest_across_timelines_and_refuse_a_foreign_profiler():
    from torch.profiler import ProfilerActivity, profile

    outer, inner = Timeline(device="cpu", mode="kernels"), Timeline(device="cpu", mode="kernels")
    with outer.capture():
        with outer.span("outer range"):
            torch.ones(4).add_(1)
        with inner.capture():  # e.g. a check recording around code that records its own timeline
            with inner.span("inner range"):
                torch.ones(4).mul_(2)
        with pytest.raises(RuntimeError, match="inside another timeline's capture"):
            inner.spans()
    assert [(s.name, s.stream) for s in by(outer.spans(), "outer range") + by(outer.spans(), "inner range")] == \
        [("outer range", "host"), ("inner range", "host")]
    assert [s.name for s in inner.spans() if s.kind == RANGE] == ["inner range"]  # only its own window
    with profile(activities=[ProfilerActivity.CPU]):
        with pytest.raises(RuntimeError, match="another torch.profiler"):
            with Timeline(device="cpu", mode="kernels").capture():
                pass


def test_ranges_that_launched_no_gpu_work_are_drawn_on_their_host_row():
    """On a GPU (host_ops off, launches in the trace) the outer timeline of nested captures once dropped the
    inner timeline's range because it launched no kernel. A range the user opened is drawn: over the work
    it launched on each GPU row, else over its host time on its thread's row; its own ranges likewise."""
    from course_utils.timeline.profiler_trace import OwnRange

    trace = gpu_trace()
    other = PID + 1  # another thread of the process, e.g. a backward or a data-loading thread
    trace["traceEvents"] += [cpu("user_annotation", "inner timeline's span", 400, 30, 30),
                             cpu("cpu_op", "aten::mul_", 405, 5, 31),  # CPU work only
                             cpu("user_annotation", "on another thread", 410, 10, 32, tid=other),
                             cpu("user_annotation", "my span", 440.2, 9.5, 33)]  # the first of this timeline's
    own = [OwnRange("my span", "loader", 0.440), OwnRange("my span", None, 0.470)]
    own[0].t1_ms, own[1].t1_ms = 0.450, 0.480
    spans = spans_from_trace(trace, host_ops=False, own=own, main_tid=PID)
    added = ("inner timeline's span", "on another thread", "my span")
    got = sorted((s.name, s.kind, s.stream, s.start_ms, s.end_ms) for s in spans if s.name in added)
    assert got == [("inner timeline's span", RANGE, "host", 0.400, 0.430),
                   ("my span", RANGE, "host", 0.470, 0.480),  # no record_function in the trace: its host times
                   ("my span", RANGE, "loader", pytest.approx(0.4402), pytest.approx(0.4497)),  # the trace's times
                   ("on another thread", RANGE, f"host thread {other}", 0.410, 0.420)]
    assert not by(spans, "aten::mul_")  # host_ops=False: CPU ops are not drawn
    st = timeline_stats(spans)
    assert "host" not in st.rows and st.rows == timeline_stats([s for s in spans if s.kind != RANGE]).rows
    # without launch events kineto's GPU-side copy draws a range on its GPU row; no second copy on the host
    no_launch = spans_from_trace(gpu_trace(with_launches=False), host_ops=False)
    assert [s.stream for s in by(no_launch, "step")] == ["stream 7"]
    assert [s.stream for s in by(no_launch, "inner")] == ["host"]  # no GPU-side copy of it in that trace


def test_capture_is_a_no_op_in_host_mode():
    tl = Timeline(device="cpu")  # the host clock, on any machine
    assert tl.mode == "host" and Timeline(device="cpu", mode="events").mode == "host"
    with tl.capture():
        with tl.span("a"):
            pass
    assert [s.name for s in tl.spans()] == ["a"]
    # mode=None picks kernels where the profiler sees CUDA kernels (without initialising CUDA here), else
    # events on a GPU, else host
    from torch.profiler import ProfilerActivity, supported_activities

    best = "host" if not torch.cuda.is_available() else \
        "kernels" if ProfilerActivity.CUDA in supported_activities() else "events"
    assert Timeline().mode == best


def test_the_mode_is_fixed_when_the_timeline_is_made():
    """Using a timeline outside a capture never changes its mode; what its mode cannot serve raises,
    saying what was wrong and what to do."""
    tl = Timeline(device="cpu", mode="kernels")
    with pytest.raises(RuntimeError) as err:
        tl.span("outside")
    msg = str(err.value)
    assert "'outside' is outside `with tl.capture():`" in msg and "mode='kernels'" in msg
    assert "put the work inside `with tl.capture():`" in msg and "Timeline(mode='host')" in msg
    tl.mark("an instant")  # marks and host spans are host-clock records in every mode: no capture needed
    with tl.span("loading", kind="host"):
        pass
    assert tl.mode == "kernels"
    with pytest.raises(AttributeError):
        tl.mode = "events"  # read-only
    with tl.capture():
        with tl.span("inside"):
            torch.ones(4).add_(1)
    assert tl.mode == "kernels"
    assert {"an instant", "loading", "inside"} <= {s.name for s in tl.spans()}
    auto = Timeline()
    with auto.capture():  # right in every mode: a no-op outside kernels mode
        with auto.span("a"):
            torch.ones(4).add_(1)
    mode = auto.mode
    if mode != "kernels":  # host or events mode: spans outside a capture are fine, and change nothing
        with auto.span("b"):
            pass
        assert {"a", "b"} <= {s.name for s in auto.spans()}
    assert auto.mode == mode


def _gloo_kernels_worker():
    import time as _t

    import torch.distributed as dist

    from course_utils.timeline import Timeline

    # kernels mode on the CPU: the profiler's CPU ops, gloo's collectives as communication. Stated, not left to
    # the machine: on a GPU box a CUDA timeline would draw GPU work only (and the launcher hides GPUs from
    # gloo ranks anyway).
    tl = Timeline(device="cpu", mode="kernels")
    assert not tl.uses_cuda
    dist.barrier()
    with tl.capture():
        if dist.get_rank() == 1:
            with tl.span("late start", kind="host"):
                _t.sleep(0.05)  # rank 1 joins the collective 50 ms after rank 0
        with tl.span("all_reduce"):
            dist.all_reduce(torch.ones(1 << 16))
    merged = tl.gather()
    return [s.to_dict() for s in merged.spans()], merged.skew_ms, merged.skew_note, merged.mode


@pytest.mark.timeout(180)
def test_kernels_mode_gather_through_launch_on_gloo_shares_the_host_clock():
    from course_utils import launch

    out = launch.run(_gloo_kernels_worker, nproc=2, backend="gloo", timeout=150)
    (spans0, skew, note, mode), (spans1, *_) = out[0], out[1]
    assert spans0 == spans1 and mode == "kernels" and note == "one host clock"
    spans = [Span.from_dict(d) for d in spans0]
    late = next(s for s in spans if s.name == "late start")
    comm = {r: [s for s in spans if s.rank == r and s.kind == "comm"] for r in (0, 1)}
    assert comm[0] and comm[1]
    # rank 0's collective cannot finish before rank 1 has started its own
    last_start = min(s.start_ms for s in comm[1])
    assert max(s.end_ms for s in comm[0]) >= last_start - skew
    assert max(s.end_ms for s in comm[0]) >= late.end_ms - skew
    assert skew < 0.5
