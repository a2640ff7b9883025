"""Kernel-accurate recording through torch.profiler (CUPTI): what really ran on the GPU, and when.

    tl = Timeline(mode="kernels")
    with tl.capture():                      # one torch.profiler run (CPU + CUDA activities)
        with tl.span("chain 0", stream=s):  # a named range (record_function), drawn over its kernels
            ...
    tl.spans()                              # kernels, copies, NCCL kernels (row "comm"), ranges

What becomes a span is `profiler_trace.spans_from_trace`'s business (the reading of the profiler's Chrome
trace: kernels, copies and NCCL kernels on their streams, named ranges over the work they launched).

Clocks. kineto writes every timestamp (CPU ops and, through CUPTI's timestamp callback, GPU activity)
on one clock: `ts` is µs since `baseTimeNanoseconds`, and ts * 1000 + baseTimeNanoseconds is Unix time
(system_clock, i.e. CLOCK_REALTIME, checked on torch 2.13: libkineto/src/ApproximateClock.cpp converts
its TSC reads to system_clock; output_json.cpp subtracts a base rounded to three months). The timeline's
origin is on time.perf_counter_ns (CLOCK_MONOTONIC), which every process on a host shares. Rather than
assume how the two clocks relate, each profiler run records two *anchors*: a record_function entered
right after the profiler starts and right before it stops, with perf_counter read around each. The two
(trace time, perf time) pairs give a linear map from trace time to the timeline's clock (uncertainty:
half the time to enter a record_function, a few µs, shown under merged plots). So kernel times of ranks
on one host land on one axis with no barrier-based guess.

Recording only here; reading the trace is in `profiler_trace`, numbers in `stats`, drawing in `plot`.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from .profiler_trace import ANCHOR, PROBE, OwnRange, spans_from_trace
from .spans import Span, side_stream_label

__all__ = ["KernelRecorder"]

_RAW_ROW = re.compile(r"stream \d+")  # profiler_trace's row for a stream no probe named


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
        with warnings.catch_warnings():  # one cycle per profile object here: there is nothing it could clear
            warnings.filterwarnings("ignore", message=".*Profiler clears events at the end of each cycle")
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
_PROBE_BUFFERS: dict[Any, Any] = {}  # device -> 2 bytes the stream probes copy between, kept for the process


def _probe_buffer(device: Any) -> Any:
    """Two bytes on `device`, allocated once per process (torch.empty: no kernel) and never freed, so probes on
    any stream may use them without record_stream; their contents do not matter."""
    import torch

    if device not in _PROBE_BUFFERS:
        _PROBE_BUFFERS[device] = torch.empty(2, dtype=torch.uint8, device=device)
    return _PROBE_BUFFERS[device]


class KernelRecorder:
    """The kernels-mode half of a Timeline: captures, named ranges, stream names, and their spans."""

    def __init__(self, rank: int, origin_ns: int, cuda: bool, device: Callable[[], int] | None,
                 host_ops: bool | None = None):
        self.rank, self.origin_ns, self.cuda = rank, origin_ns, cuda
        self._device = device
        self.host_ops = (not cuda) if host_ops is None else host_ops
        self.ranges: list[OwnRange] = []
        self.stream_labels: dict[Any, str] = {}  # torch stream -> label
        self.auto_labels: dict[str, str] = {}  # "stream <profiler id>" -> "side stream <n>", for unnamed streams
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
            try:
                data = session.stop()
            except BaseException:
                for m in session.members:  # nothing to deliver: no timeline waits for this run any more
                    m.recorder.pending -= 1
                raise
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
        spans = spans_from_trace(data, self.rank, self.host_ops, to_ms=to_ms, stream_names=self.stream_labels.values(),
                                 device=dev, main_tid=self.tid, own=mine, window=window)
        self.spans += self._side_stream_names(spans)
        self.ranges = [r for r in self.ranges if r.session != ident]
        self.clock_uncertainty_ms = max(self.clock_uncertainty_ms, unc)
        self.pending -= 1

    def _side_stream_names(self, spans: list[Span]) -> list[Span]:
        """Rows the trace could only call "stream <profiler id>" (streams nobody named) become "side stream 1",
        "side stream 2", ... in order of first appearance, the same name in every capture of this timeline.

        Every capture probes the default stream, so an unnamed row is never the default stream's."""
        named = set(self.stream_labels.values())
        for s in sorted(spans, key=lambda s: s.start_ms):
            if _RAW_ROW.fullmatch(s.stream) and s.stream not in self.auto_labels and s.stream not in named:
                self.auto_labels[s.stream] = side_stream_label(named | set(self.auto_labels.values()))
        return [replace(s, stream=self.auto_labels.get(s.stream, s.stream)) for s in spans]

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
        """A 1-byte device-to-device copy on `stream` inside a record_function that names it: the trace then
        says which profiler stream id the torch stream has (a torch stream does not know its CUPTI id).

        A copy (cudaMemcpyAsync), not a kernel: with CUDA's lazy loading (the default since CUDA 12.2) the
        first launch of a kernel in a process loads its module, and that can wait for the whole GPU to go idle,
        so a kernel probe could hold the host inside a capture, or at its start, until queued work finished.
        """
        import torch
        from torch.profiler import record_function

        buf = _probe_buffer(stream.device)
        with torch.cuda.stream(stream), record_function(PROBE + label):
            buf[1:].copy_(buf[:1])  # same device, dtype, contiguous: one cudaMemcpyAsync on `stream`, no kernel

    def resolve(self) -> list[Span]:
        """Spans of every finished capture (raises while this timeline is still capturing)."""
        if self.capturing:
            raise RuntimeError("tl.spans() inside `with tl.capture():` — the kernels are known when the capture "
                               "ends; call it after the block")
        if self.pending:
            raise RuntimeError("this timeline's capture ran inside another timeline's capture that has not "
                               "ended yet; its kernels are known when that outer capture ends")
        return list(self.spans)
