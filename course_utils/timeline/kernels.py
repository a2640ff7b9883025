"""Kernel-accurate recording through torch.profiler (CUPTI): what really ran on the GPU, and when.

    tl = Timeline(mode="kernels")
    with tl.capture():                      # one torch.profiler run (CPU + CUDA activities)
        with tl.span("chain 0", stream=s):  # a named range (record_function), drawn over its kernels
            ...
    tl.spans()                              # kernels, copies, NCCL kernels (row "comm"), ranges

What becomes a span (`spans_from_trace`, the reading of torch.profiler's Chrome trace):
- events of category kernel, gpu_memcpy and gpu_memset, with their "device" and "stream" args (the
  layout kineto's ChromeTraceLogger writes: pid = device, tid = stream, args {"device", "stream",
  "correlation", ...}): work on row "stream <id>" of their device. A copy's direction comes from its
  name ("Memcpy HtoD (Pinned -> Device)": h2d; DtoH: d2h; DtoD and PtoP: d2d). NCCL kernels (names
  starting "ncclDevKernel" or "ncclKernel") are kind comm, and a stream that runs them is the row "comm".
- named ranges (CPU "user_annotation" events: record_function, and this timeline's own spans) become
  `range` spans on each GPU row, from the first to the last kernel launched while the range was open
  (kernel and launch are joined by their "correlation" arg). That also covers ranges nested in ranges,
  which kineto's own "gpu_user_annotation" events miss; those are used only for traces without launch
  events. Ranges are drawn over work and never counted as busy time.
- with host_ops, each thread's top-level CPU ops become spans on "host" (the recording thread) or
  "host thread <tid>". Communication ops ("gloo:...", "nccl:...", "c10d::...", "record_param_comms")
  are kind comm when the trace has no GPU work (gloo on a CPU: "gloo:*" ranges on gloo's worker threads
  go to row "comm"); with GPU work they are host-side launches and the NCCL kernels are the communication.
  `aten::broadcast_tensors` is not communication.

Clocks. kineto writes every timestamp (CPU ops and, through CUPTI's timestamp callback, GPU activity)
on one clock: `ts` is µs since `baseTimeNanoseconds`, and ts * 1000 + baseTimeNanoseconds is Unix time
(system_clock, i.e. CLOCK_REALTIME, checked on torch 2.13: libkineto/src/ApproximateClock.cpp converts
its TSC reads to system_clock; output_json.cpp subtracts a base rounded to three months). The timeline's
origin is on time.perf_counter_ns (CLOCK_MONOTONIC), which every process on a host shares. Rather than
assume how the two clocks relate, each profiler run records two *anchors*: a record_function entered
right after the profiler starts and right before it stops, with perf_counter read around each. The two
(trace time, perf time) pairs give a linear map from trace time to the timeline's clock (uncertainty:
half the time to enter a record_function, about a µs). So kernel times of ranks on one host land on
one axis with no barrier-based guess.

Measuring only here; `stats` and `plot` work on the Span list.
"""

from __future__ import annotations

import bisect
import json
import os
import re
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .spans import RANGE, Span

__all__ = ["COMM_OP", "KernelRecorder", "is_nccl_kernel", "memcpy_kind", "spans_from_trace"]

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
# CPU-side names of collectives: the backends' own ranges, c10d's ops (incl. functional collectives), and
# the op PyTorch wraps every collective in. Anchored at the start, so aten::broadcast_tensors is not one.
COMM_OP = re.compile(r"^(gloo:|nccl:|ucc:|mpi:|c10d::|_c10d_functional::|c10d_functional::|record_param_comms$)")
PROBE = "course_utils.timeline stream: "  # record_function around a tiny kernel that tells a stream's id
ANCHOR = "course_utils.timeline anchor "  # record_function that ties the trace's clock to perf_counter


def is_nccl_kernel(name: str) -> bool:
    return name.startswith(("ncclDevKernel", "ncclKernel", "nccl"))


def memcpy_kind(name: str) -> str:
    """h2d, d2h or d2d from a CUPTI memcpy name such as "Memcpy HtoD (Pinned -> Device)"."""
    n = name.lower()
    if "htod" in n:
        return "h2d"
    if "dtoh" in n:
        return "d2h"
    if "htoh" in n:
        return "host"
    return "d2d"  # DtoD, PtoP (and array copies)


def _cat(e: dict[str, Any]) -> str:
    return str(e.get("cat", "")).lower()


def _gpu_kind(e: dict[str, Any]) -> str:
    cat, name = _cat(e), str(e.get("name", ""))
    if cat == "gpu_memcpy":
        return memcpy_kind(name)
    if cat == "kernel" and is_nccl_kernel(name):
        return "comm"
    return "compute"  # kernels and memsets (HTA counts memsets as memory kernels; they are short)


def _row_key(e: dict[str, Any]) -> tuple[int, int]:
    """(device, stream) of a GPU event: its args, else pid/tid (kineto writes both)."""
    args = e.get("args") or {}
    dev = args.get("device", args.get("inDevice", e.get("pid", 0)))
    return int(dev), int(args.get("stream", e.get("tid", 0)))


@dataclass
class OwnRange:
    """A range this timeline opened (tl.span in kernels mode): name, where to draw it without GPU work,
    and its host window in timeline ms."""

    name: str
    label: str | None  # row label for its host extent (a str stream), None: the host row
    t0_ms: float
    t1_ms: float = float("nan")
    session: int = -1


def spans_from_trace(data: dict[str, Any], rank: int = 0, host_ops: bool = True, *,
                     to_ms: Callable[[float], float] | None = None, stream_names: dict[str, str] | None = None,
                     device: int | None = None, main_tid: int | None = None, own: list[OwnRange] | None = None,
                     window: tuple[float, float] | None = None) -> list[Span]:
    """Spans from a torch.profiler Chrome trace dict (rules in the module docstring).

    to_ms maps a trace `ts` (µs) to output ms (default ts / 1000). stream_names maps a probe's label to
    itself (labels of streams probed during the capture). device: the main GPU (others get a "cuda:D "
    prefix); default the busiest. own: this timeline's ranges, drawn even where they launched no GPU work.
    window: (start, end) in output ms; only work launched (or CPU ops started) inside it is kept.
    """
    to_ms = to_ms or (lambda ts: ts / 1000.0)
    events = [e for e in data.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e and "ts" in e]

    def t0(e: dict[str, Any]) -> float:
        return to_ms(float(e["ts"]))

    def t1(e: dict[str, Any]) -> float:
        return to_ms(float(e["ts"]) + float(e["dur"]))

    gpu = [e for e in events if _cat(e) in GPU_CATS]
    launches = [e for e in events if _cat(e) in LAUNCH_CATS and "correlation" in (e.get("args") or {})]
    launch_of = {int(e["args"]["correlation"]): e for e in launches}
    by_corr: dict[int, list[dict[str, Any]]] = {}
    for e in gpu:
        corr = (e.get("args") or {}).get("correlation")
        if corr is not None:
            by_corr.setdefault(int(corr), []).append(e)
    annotations = [e for e in events if _cat(e) == "user_annotation"]
    launch_ts = sorted((t0(e), e.get("tid"), int(e["args"]["correlation"])) for e in launches)
    launch_times = [x[0] for x in launch_ts]

    def launched_between(a: float, b: float, tid: Any = None) -> list[dict[str, Any]]:
        out = []
        for _, t, corr in launch_ts[bisect.bisect_left(launch_times, a):bisect.bisect_right(launch_times, b)]:
            if tid is None or t == tid:
                out += by_corr.get(corr, [])
        return out

    # Which (device, stream) is which named stream: the probes' kernels say.
    names: dict[tuple[int, int], str] = {}
    probe_events: set[int] = set()
    for a in annotations:
        name = str(a.get("name", ""))
        if name.startswith(PROBE) and name[len(PROBE):] in (stream_names or {}):
            for k in launched_between(t0(a), t1(a), a.get("tid")):
                names.setdefault(_row_key(k), name[len(PROBE):])
                probe_events.add(id(k))
    for a in (e for e in events if _cat(e) == "gpu_user_annotation"):  # traces without launch events
        name = str(a.get("name", ""))
        if not launches and name.startswith(PROBE) and name[len(PROBE):] in (stream_names or {}):
            key = (int(a.get("pid", 0)), int(a.get("tid", 0)))
            names.setdefault(key, name[len(PROBE):])
            probe_events |= {id(k) for k in gpu if _row_key(k) == key and t0(a) <= t0(k) and t1(k) <= t1(a)}

    def kept(e: dict[str, Any]) -> bool:
        if window is None:
            return True
        corr = (e.get("args") or {}).get("correlation")
        launch = launch_of.get(int(corr)) if corr is not None and _cat(e) in GPU_CATS else None
        t = t0(launch if launch is not None else e)
        return window[0] <= t <= window[1]

    gpu = [e for e in gpu if id(e) not in probe_events and kept(e)]
    nccl_rows = {_row_key(e) for e in gpu if _cat(e) == "kernel" and is_nccl_kernel(str(e.get("name", "")))}
    if device is None:
        counts = Counter(_row_key(e)[0] for e in gpu)
        device = counts.most_common(1)[0][0] if counts else 0

    def gpu_row(key: tuple[int, int]) -> str:
        label = names.get(key) or ("comm" if key in nccl_rows else f"stream {key[1]}")
        return label if key[0] == device else f"cuda:{key[0]} {label}"

    spans = [Span(str(e.get("name", "")), _gpu_kind(e), rank, gpu_row(_row_key(e)), t0(e), t1(e)) for e in gpu]
    has_gpu_work = bool(gpu)

    # Threads: the recording thread is "host"; by default the one whose tid is its process id (Linux main thread).
    cpu_events = [e for e in events if _cat(e) in ("cpu_op", "user_annotation")]
    if main_tid is None:
        main_pids = {e.get("pid") for e in cpu_events}
        main_tid = next((e.get("tid") for e in cpu_events if e.get("tid") in main_pids), None)
        if main_tid is None and cpu_events:
            main_tid = Counter(e.get("tid") for e in cpu_events).most_common(1)[0][0]

    def host_row(tid: Any, comm: bool = False) -> str:
        if tid == main_tid:
            return "host"
        return "comm" if comm else f"host thread {tid}"

    def range_spans(name: str, a: float, b: float, tid: Any) -> list[Span]:
        rows: dict[str, tuple[float, float]] = {}
        for k in launched_between(a, b, tid):
            if id(k) in probe_events or not kept(k):
                continue
            row = gpu_row(_row_key(k))
            lo, hi = rows.get(row, (t0(k), t1(k)))
            rows[row] = (min(lo, t0(k)), max(hi, t1(k)))
        return [Span(name, RANGE, rank, row, lo, hi) for row, (lo, hi) in rows.items()]

    # Named ranges: this timeline's own spans first (matched to their record_function by name and start).
    ours = [a for a in annotations if not _internal(str(a.get("name", "")))]
    by_name: dict[str, list[tuple[float, int]]] = {}
    for i, a in enumerate(ours):
        by_name.setdefault(str(a.get("name", "")), []).append((t0(a), i))
    for starts in by_name.values():
        starts.sort()
    matched: set[int] = set()
    for r in own or []:
        starts = by_name.get(r.name, [])
        k = bisect.bisect_left(starts, (r.t0_ms, -1))
        near = [j for j in (k - 1, k) if 0 <= j < len(starts) and abs(starts[j][0] - r.t0_ms) < 1.0]
        if near:  # its record_function in the trace: the profiler's own times for the range
            j = min(near, key=lambda j: abs(starts[j][0] - r.t0_ms))
            best = ours[starts.pop(j)[1]]
            matched.add(id(best))
            a, b = t0(best), t1(best)
        else:
            a, b = r.t0_ms, r.t1_ms
        found = range_spans(r.name, a, b, None) if launches else []
        spans += found or [Span(r.name, RANGE, rank, r.label or "host", a, b)]
    for ann in ours:
        if id(ann) in matched or COMM_OP.match(str(ann.get("name", ""))) or not kept(ann):
            continue
        found = range_spans(str(ann.get("name", "")), t0(ann), t1(ann), ann.get("tid")) if launches else []
        if not found and host_ops:
            found = [Span(str(ann.get("name", "")), RANGE, rank, host_row(ann.get("tid")), t0(ann), t1(ann))]
        spans += found
    if not launches:  # kineto's own GPU-side ranges, for traces without launch events
        for g in (e for e in events if _cat(e) == "gpu_user_annotation"):
            name = str(g.get("name", ""))
            if not _internal(name) and kept(g):
                key = (int(g.get("pid", 0)), int(g.get("tid", 0)))
                spans.append(Span(name, RANGE, rank, gpu_row(key), t0(g), t1(g)))

    if host_ops:
        spans += _host_op_spans(cpu_events, rank, has_gpu_work, host_row, t0, t1, kept)
    spans.sort(key=lambda s: (s.start_ms, -s.end_ms))
    return spans


def _internal(name: str) -> bool:
    return name.startswith((PROBE, ANCHOR))


def _host_op_spans(cpu_events, rank, has_gpu_work, host_row, t0, t1, kept) -> list[Span]:
    """Each thread's top-level CPU ops (named ranges are not ops: they neither count nor contain)."""
    out = []
    by_tid: dict[Any, list[dict[str, Any]]] = {}
    for e in cpu_events:
        name = str(e.get("name", ""))
        if _internal(name) or (_cat(e) == "user_annotation" and not COMM_OP.match(name)):
            continue
        by_tid.setdefault(e.get("tid"), []).append(e)
    for tid, evs in by_tid.items():
        end = float("-inf")
        for e in sorted(evs, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
            a, b = t0(e), t1(e)
            if a < end:
                continue  # nested in (or overlapping) the previous top-level op of this thread
            end = b
            if not kept(e):
                continue
            comm = bool(COMM_OP.match(str(e.get("name", ""))))
            kind = "comm" if comm and not has_gpu_work else "host"
            out.append(Span(str(e.get("name", "")), kind, rank, host_row(tid, comm and not has_gpu_work), a, b))
    return out


# ---------------------------------------------------------------------- recording (one profiler at a time)
def _perf_ms(origin_ns: int) -> float:
    return (time.perf_counter_ns() - origin_ns) / 1e6


def _profiler_running() -> bool:
    import torch

    return bool(torch._C._autograd._profiler_enabled())


@dataclass
class _Member:
    recorder: KernelRecorder
    start_ns: int
    end_ns: int | None = None


@dataclass
class _Session:
    """One torch.profiler run, shared by every recorder capturing while it runs (captures may nest)."""

    cuda: bool
    ident: int
    prof: Any = None
    members: list[_Member] = field(default_factory=list)
    anchors: list[tuple[str, int, int]] = field(default_factory=list)  # (name, perf ns before, after entering)

    def anchor(self, tries: int = 4) -> None:
        """Enter a few record_functions, reading perf_counter around each; keep the quickest (the first
        calls pay one-time costs, and the start timestamp lies somewhere inside the enter call)."""
        from torch.profiler import record_function

        best = None
        for i in range(tries):
            name = f"{ANCHOR}{len(self.anchors)}.{i}"
            before = time.perf_counter_ns()
            rf = record_function(name)
            rf.__enter__()
            after = time.perf_counter_ns()
            rf.__exit__(None, None, None)
            if best is None or after - before < best[2] - best[1]:
                best = (name, before, after)
        self.anchors.append(best)

    def start(self) -> None:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self.prof = profile(activities=acts)
        self.prof.__enter__()
        self.anchor()

    def stop(self) -> dict[str, Any]:
        """Stop the profiler (it synchronises the GPU) and return its Chrome trace."""
        try:
            self.anchor()
        finally:
            self.prof.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            self.prof.export_chrome_trace(path)
            with open(path) as f:
                return json.load(f)

    def to_perf_ns(self, data: dict[str, Any]) -> tuple[Callable[[float], float], float]:
        """A map from trace ts (µs) to perf_counter ns, and its uncertainty in ms (module docstring)."""
        at = {str(e.get("name")): float(e["ts"]) for e in data.get("traceEvents", [])
              if e.get("ph") == "X" and str(e.get("name", "")).startswith(ANCHOR)}
        pairs = [(at[n] * 1000.0, (b + a) / 2.0, (a - b) / 2.0) for n, b, a in self.anchors if n in at]
        if not pairs:  # no anchor in the trace: fall back on the Unix clock the trace is written in
            base = int(data.get("baseTimeNanoseconds", 0))
            offset = time.time_ns() - time.perf_counter_ns()
            return (lambda ts: ts * 1000.0 + base - offset), 1.0
        (x0, y0, u0), (x1, y1, u1) = pairs[0], pairs[-1]
        slope = (y1 - y0) / (x1 - x0) if x1 - x0 > 1e6 else 1.0  # two anchors over 1 ms apart: correct drift
        return (lambda ts: y0 + (ts * 1000.0 - x0) * slope), max(u0, u1) / 1e6


_ACTIVE: _Session | None = None
_SESSIONS = 0


class KernelRecorder:
    """The kernels-mode half of a Timeline: captures, named ranges, stream names, and their spans."""

    def __init__(self, rank: int, origin_ns: int, cuda: bool, device: Callable[[], int] | None,
                 host_ops: bool | None = None):
        self.rank, self.origin_ns, self.cuda = rank, origin_ns, cuda
        self._device = device
        self.host_ops = (not cuda) if host_ops is None else host_ops
        self.ranges: list[OwnRange] = []
        self.stream_labels: dict[Any, str] = {}  # torch stream -> label
        self.spans: list[Span] = []
        self.depth = 0
        self.session: _Session | None = None
        self.member: _Member | None = None
        self.pending = 0  # captures that ended while an enclosing one (another timeline's) still runs
        self.clock_uncertainty_ms = 0.0
        self.tid = threading.get_native_id()

    # ------------------------------------------------------------ capture
    def enter(self) -> None:
        global _ACTIVE, _SESSIONS
        self.depth += 1
        if self.depth > 1:
            return  # nested capture of the same timeline: the outer one records
        if _ACTIVE is None:
            if _profiler_running():
                self.depth -= 1
                raise RuntimeError("another torch.profiler is already running in this process; kernels mode "
                                   "records through its own profiler. Stop yours first, or read it afterwards "
                                   "with course_utils.timeline.from_profiler(prof)")
            _SESSIONS += 1
            session = _Session(self.cuda, _SESSIONS)
            try:
                session.start()
            except BaseException:
                self.depth -= 1
                raise
            _ACTIVE = session
        self.session = _ACTIVE
        self.session.cuda |= self.cuda
        self.member = _Member(self, time.perf_counter_ns())
        self.session.members.append(self.member)
        self.pending += 1
        if self.cuda:
            import torch

            dev = self._device()
            default = torch.cuda.default_stream(dev)
            self.stream_labels.setdefault(default, "default stream")
            for stream, label in self.stream_labels.items():
                self._probe(stream, label)

    def exit(self) -> None:
        global _ACTIVE
        self.depth -= 1
        if self.depth > 0:
            return
        session, self.session = self.session, None
        self.member.end_ns = time.perf_counter_ns()
        self.member = None
        if session is not None and session.members[0].recorder is self:  # the outermost capture ends the run
            _ACTIVE = None
            data = session.stop()
            to_perf, unc = session.to_perf_ns(data)
            for m in session.members:
                m.recorder._deliver(session.ident, data, to_perf, unc, m)

    @property
    def capturing(self) -> bool:
        return self.depth > 0

    def _deliver(self, ident: int, data: dict[str, Any], to_perf: Callable[[float], float], unc: float,
                 member: _Member) -> None:
        origin = self.origin_ns

        def to_ms(ts: float) -> float:
            return (to_perf(ts) - origin) / 1e6

        window = None
        if member is not None and member.end_ns is not None:
            window = ((member.start_ns - origin) / 1e6, (member.end_ns - origin) / 1e6)
        mine = [r for r in self.ranges if r.session == ident]
        dev = self._device() if (self.cuda and self._device is not None) else None
        self.spans += spans_from_trace(data, self.rank, self.host_ops, to_ms=to_ms,
                                       stream_names={lab: lab for lab in self.stream_labels.values()},
                                       device=dev, main_tid=self.tid, own=mine, window=window)
        self.ranges = [r for r in self.ranges if r.session != ident]
        self.clock_uncertainty_ms = max(self.clock_uncertainty_ms, unc)
        self.pending -= 1

    # ------------------------------------------------------------ ranges and streams
    def begin(self, name: str, label: str | None) -> tuple[OwnRange, Any]:
        from torch.profiler import record_function

        if not self.capturing:
            raise RuntimeError(f"span {name!r}: a kernels-mode Timeline records inside `with tl.capture():`; "
                               "put the span in a capture block (or use Timeline(mode='events'))")
        rf = record_function(name)
        r = OwnRange(name, label, _perf_ms(self.origin_ns), session=self.session.ident)
        rf.__enter__()
        self.ranges.append(r)
        return r, rf

    def end(self, r: OwnRange, rf: Any) -> None:
        rf.__exit__(None, None, None)
        r.t1_ms = _perf_ms(self.origin_ns)

    def name_stream(self, stream: Any, label: str) -> None:
        self.stream_labels[stream] = label
        if self.capturing:
            self._probe(stream, label)

    def _probe(self, stream: Any, label: str) -> None:
        """A one-cycle kernel on `stream` inside a record_function that names it: the trace then says which
        profiler stream id the torch stream has (a torch stream does not know its CUPTI id)."""
        import torch
        from torch.profiler import record_function

        with torch.cuda.stream(stream), record_function(PROBE + label):
            torch.cuda._sleep(1)

    def resolve(self) -> list[Span]:
        """Spans of every finished capture (raises while this timeline is still capturing)."""
        if self.capturing:
            raise RuntimeError("tl.spans() inside `with tl.capture():` — the kernels are known when the capture "
                               "ends; call it after the block")
        if self.pending:
            raise RuntimeError("this timeline's capture ran inside another timeline's capture that has not "
                               "ended yet; its kernels are known when that outer capture ends")
        return list(self.spans)
