"""Nsight-style timelines of a cell's own work: spans timed with CUDA events (host clock on CPU).

    tl = Timeline()
    with tl.span("matmul", kind="compute", stream=s):   # s is the current stream inside the block
        y = x @ x
    with tl.span("python loop", kind="host"):            # host clock, on the same time axis
        ...
    tl.mark("step 1")
    tl.spans()          # list[Span]; the only call that waits for the GPU
    tl.stats()          # numbers: busy/idle per row, comm/compute and copy/compute overlap, makespan
    tl.plot()           # matplotlib Figure
    tl.to_chrome_trace("trace.json")   # open in Perfetto (ui.perfetto.dev) or chrome://tracing

How times line up. Every timeline has an origin on the host clock (`time.perf_counter_ns`, which is
CLOCK_MONOTONIC on Linux and so shared by all processes of one host). Host spans are read from that
clock directly. CUDA spans are two events from a pool, recorded on the span's stream: recording costs
host time only and never waits for the GPU. `spans()` waits for the device once, then records one
*anchor* event on the idle device and notes the host time around its completion; each CUDA event's
time is the anchor's host time minus `event.elapsed_time(anchor)`. The anchor's uncertainty (the
host time between recording it and seeing it complete) is `Timeline.anchor_uncertainty_ms`.

Several ranks: inside workers, `tl.gather()` (a collective) returns every rank's spans on one axis;
or return `tl.export()` from each worker and call `Timeline.merge(...)` in the notebook. Ranks on one
host share the host clock; across hosts the clocks are aligned on a barrier and the spread of a second
barrier is reported as `skew_ms`.

Measuring (this module, `timeline_stats`) and drawing (`timeline_plot`, `timeline_trace`) are kept apart.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

KINDS = ("compute", "h2d", "d2h", "d2d", "comm", "host", "wait")
MARK = "mark"  # kind of an instant made by Timeline.mark; not a span of work

__all__ = ["KINDS", "MARK", "Span", "Timeline"]


@dataclass
class Span:
    """One interval of work on one row (rank, stream), in ms on the timeline's host clock."""

    name: str
    kind: str
    rank: int
    stream: str
    start_ms: float
    end_ms: float

    @property
    def duration_ms(self) -> float:
        return self.end_ms - self.start_ms

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Span:
        """Rebuild a span from `to_dict()` output (e.g. a reference recording), checking it."""
        missing = {"name", "kind", "rank", "stream", "start_ms", "end_ms"} - set(d)
        if missing:
            raise ValueError(f"span record {d!r} lacks {sorted(missing)}")
        _check_kind(d["kind"], allow_mark=True)
        s = cls(str(d["name"]), d["kind"], int(d["rank"]), str(d["stream"]), float(d["start_ms"]),
                float(d["end_ms"]))
        if s.end_ms < s.start_ms:
            raise ValueError(f"span {s.name!r} ends ({s.end_ms} ms) before it starts ({s.start_ms} ms)")
        return s


def _check_kind(kind: str, allow_mark: bool = False) -> None:
    if kind in KINDS or (allow_mark and kind == MARK):
        return
    raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}")


def _host_ms(origin_ns: int) -> float:
    return (time.perf_counter_ns() - origin_ns) / 1e6


class _Open:
    """Handle of a span being recorded; `Timeline.end(handle)` closes it (the `with` form does it for you)."""

    __slots__ = ("tl", "index", "name", "stream_ctx", "cuda_stream", "closed")

    def __init__(self, tl: Timeline, index: int, name: str, stream_ctx: Any, cuda_stream: Any):
        self.tl, self.index, self.name = tl, index, name
        self.stream_ctx, self.cuda_stream, self.closed = stream_ctx, cuda_stream, False

    def __enter__(self) -> _Open:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tl.end(self)


class Timeline:
    """Record spans of work per stream (and per rank), then resolve, summarise, plot or export them.

    device: None picks the current CUDA device when CUDA is available, else the host clock;
    "cpu" forces the host clock; "cuda:N" or an int picks a GPU. rank: None takes the process group's
    rank when torch.distributed is initialised, else 0.
    """

    def __init__(self, device: str | int | torch.device | None = None, rank: int | None = None):
        if device is None:
            self._cuda = torch.cuda.is_available()
            self._device_index: int | None = None  # resolved at the first CUDA span: avoids initialising CUDA here
        else:
            dev = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
            self._cuda = dev.type == "cuda"
            if self._cuda and not torch.cuda.is_available():
                raise RuntimeError(f"Timeline(device={device!r}) asks for CUDA, but CUDA is not available here")
            self._device_index = dev.index if self._cuda and dev.index is not None else None
        if rank is None:
            rank = torch.distributed.get_rank() if _dist_ready() else 0
        self.rank = int(rank)
        self.origin_ns = time.perf_counter_ns()
        self.host = socket.gethostname()
        self.anchor_uncertainty_ms = 0.0
        self.skew_ms: float | None = None  # set by merge/gather: remaining clock skew between ranks
        # Pending records in parallel lists of objects the garbage collector does not track (str, float):
        # a tuple or list per record would be, and after `import torch` its passes cost more than the span.
        self._names: list[str] = []
        self._kinds: list[str] = []
        self._labels: list[str] = []
        self._t0: list[Any] = []  # host ms (float) or a CUDA event
        self._t1: list[Any] = []
        self._resolved: list[Span] = []
        self._open: dict[int, str] = {}  # pending index -> name, for spans not yet closed
        self._pool: list[torch.cuda.Event] = []
        self._stream_labels: dict[int, str] = {}
        self._barrier_ms: tuple[float, float] | None = None
        self._frozen = False

    # ---------------------------------------------------------------- recording
    @property
    def uses_cuda(self) -> bool:
        """True when spans of GPU work are timed with CUDA events; False on the host clock."""
        return self._cuda

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._device()) if self._cuda else torch.device("cpu")

    def _device(self) -> int:
        if self._device_index is None:
            self._device_index = torch.cuda.current_device()
        return self._device_index

    def _add(self, name: str, kind: str, label: str, start: Any, end: Any) -> int:
        self._names.append(name)
        self._kinds.append(kind)
        self._labels.append(label)
        self._t0.append(start)
        self._t1.append(end)
        return len(self._names) - 1

    def _event(self) -> torch.cuda.Event:
        return self._pool.pop() if self._pool else torch.cuda.Event(enable_timing=True)

    def name_stream(self, stream: Any, label: str) -> None:
        """Label a CUDA stream's row (default labels: 'default stream', 'stream 1', 'stream 2', ...)."""
        if self._cuda and isinstance(stream, torch.cuda.Stream):
            self._stream_labels[stream.cuda_stream] = label

    def _label(self, stream: Any) -> str:
        key = stream.cuda_stream
        if key not in self._stream_labels:
            default = torch.cuda.default_stream(stream.device).cuda_stream
            n = sum(1 for k in self._stream_labels if k != default)
            self._stream_labels[key] = "default stream" if key == default else f"stream {n + 1}"
        return self._stream_labels[key]

    def begin(self, name: str, kind: str = "compute", stream: Any = None) -> _Open:
        """Open a span and return its handle; close it with `end(handle)`. Prefer `with tl.span(...)`.

        Useful where start and end sit in different places, e.g. a backward hook and its callback.
        """
        if self._frozen:
            raise RuntimeError("this Timeline was rebuilt from stored spans; record into a new Timeline()")
        _check_kind(kind)
        host_clock = kind == "host" or not self._cuda
        if host_clock:
            if stream is not None and not isinstance(stream, str):
                if kind == "host":
                    raise TypeError(f"a host span's stream is a row label (str), not {type(stream).__name__}")
                raise TypeError(f"no CUDA here: stream must be None or a row label (str), got {type(stream).__name__}")
            label = stream or "host"
            index = self._add(name, kind, label, _host_ms(self.origin_ns), None)
            self._open[index] = name
            return _Open(self, index, name, None, None)
        if isinstance(stream, str):
            raise TypeError(f"span {name!r}: on a GPU, stream= takes a torch.cuda.Stream (or None), not a label; "
                            f"use tl.name_stream(stream, {stream!r}) to name its row, or kind='host' for host work")
        ctx = None
        if stream is None:
            stream = torch.cuda.current_stream(self._device())
        else:
            if not isinstance(stream, torch.cuda.Stream):
                raise TypeError(f"stream must be a torch.cuda.Stream or None, not {type(stream).__name__}")
            if stream.device.index != self._device():
                raise ValueError(f"span {name!r}: its stream lives on cuda:{stream.device.index}, but this timeline "
                                 f"records cuda:{self._device()}; make a Timeline(device={stream.device.index}) for it")
            if stream != torch.cuda.current_stream(self._device()):
                ctx = torch.cuda.stream(stream)  # the block's work goes to `stream`
                ctx.__enter__()
        start = self._event()
        start.record(stream)
        index = self._add(name, kind, self._label(stream), start, None)
        self._open[index] = name
        return _Open(self, index, name, ctx, stream)

    def end(self, handle: _Open) -> None:
        """Close a span opened by `begin` (or the `with` form)."""
        if handle.tl is not self:
            raise ValueError(f"span {handle.name!r} belongs to another Timeline")
        if handle.closed:
            raise RuntimeError(f"span {handle.name!r} was already closed")
        if handle.cuda_stream is None:
            self._t1[handle.index] = _host_ms(self.origin_ns)
        else:
            ev = self._event()
            ev.record(handle.cuda_stream)
            self._t1[handle.index] = ev
            if handle.stream_ctx is not None:
                handle.stream_ctx.__exit__(None, None, None)
        handle.closed = True
        del self._open[handle.index]

    def span(self, name: str, kind: str = "compute", stream: Any = None) -> _Open:
        """`with tl.span(name, kind, stream):` times the work enqueued inside the block on `stream`.

        kind: compute, h2d, d2h, d2d, comm, host or wait. stream: a torch.cuda.Stream (it becomes the
        current stream inside the block), None for the current stream, or for host-clock spans
        (kind="host", or any span on a machine without CUDA) a row label such as "host" or "loader".
        """
        return self.begin(name, kind, stream)

    def mark(self, name: str, stream: Any = None) -> None:
        """An instant: on a GPU, when `stream` (default: current) reaches this point; else host time."""
        if self._frozen:
            raise RuntimeError("this Timeline was rebuilt from stored spans; record into a new Timeline()")
        if not self._cuda or isinstance(stream, str):
            t = _host_ms(self.origin_ns)
            self._add(name, MARK, stream or "host", t, t)
            return
        stream = stream if stream is not None else torch.cuda.current_stream(self._device())
        ev = self._event()
        ev.record(stream)
        self._add(name, MARK, self._label(stream), ev, ev)

    # ---------------------------------------------------------------- resolving
    def spans(self) -> list[Span]:
        """All spans and marks recorded so far, in ms since this timeline's origin.

        The one call that waits for the GPU: once, for the work recorded so far. Raises if a span is still open.
        """
        if self._open:
            names = ", ".join(repr(n) for n in self._open.values())
            raise RuntimeError(f"span(s) {names} opened and never closed: close them (leave the `with` block "
                               "or call tl.end(handle)) before tl.spans()")
        if self._names:
            self._resolve()
        return list(self._resolved)

    def _resolve(self) -> None:
        cuda_events = any(isinstance(t, torch.cuda.Event) for t in self._t0)
        if cuda_events:
            dev = self._device()
            torch.cuda.synchronize(dev)  # the one wait: everything recorded so far has run
            anchor = self._event()
            stream = torch.cuda.current_stream(dev)
            before = _host_ms(self.origin_ns)
            anchor.record(stream)
            anchor.synchronize()  # the device is idle, so the anchor completes right after it is recorded
            after = _host_ms(self.origin_ns)
            anchor_ms = (before + after) / 2
            self.anchor_uncertainty_ms = max(self.anchor_uncertainty_ms, (after - before) / 2)
        for name, kind, label, start, end in zip(self._names, self._kinds, self._labels, self._t0, self._t1,
                                                 strict=True):
            if isinstance(start, torch.cuda.Event):
                t0 = anchor_ms - start.elapsed_time(anchor)
                t1 = t0 if end is start else anchor_ms - end.elapsed_time(anchor)
                self._pool.append(start)
                if end is not start:
                    self._pool.append(end)
            else:
                t0, t1 = start, end
            self._resolved.append(Span(name, kind, self.rank, label, t0, t1))
        if cuda_events:
            self._pool.append(anchor)
        for pending in (self._names, self._kinds, self._labels):
            pending.clear()
        self._t0.clear()
        self._t1.clear()

    # ---------------------------------------------------------------- several ranks
    def export(self) -> dict[str, Any]:
        """This rank's spans and clock facts as plain data (picklable, JSON-able) for `Timeline.merge`."""
        return {
            "rank": self.rank,
            "host": self.host,
            "origin_ns": self.origin_ns,
            "barrier_ms": list(self._barrier_ms) if self._barrier_ms else None,
            "anchor_uncertainty_ms": self.anchor_uncertainty_ms,
            "spans": [s.to_dict() for s in self.spans()],
        }

    def align(self, group: Any = None) -> None:
        """Collective: note the host time at the exit of two barriers, so ranks on different hosts can be aligned.

        Every rank of `group` must call it (gather() calls it for you).
        """
        import torch.distributed as dist

        if not _dist_ready():
            raise RuntimeError("Timeline.align/gather need torch.distributed initialised (e.g. inside "
                               "course_utils.launch.run workers)")
        dist.barrier(group=group)
        first = _host_ms(self.origin_ns)
        dist.barrier(group=group)
        self._barrier_ms = (first, _host_ms(self.origin_ns))

    def gather(self, group: Any = None) -> Timeline:
        """Collective: every rank's spans on one time axis, returned on every rank (see `merge`)."""
        import torch.distributed as dist

        self.align(group)
        mine = self.export()
        everyone: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(everyone, mine, group=group)
        return Timeline.merge(everyone)

    @classmethod
    def merge(cls, timelines: Iterable[Timeline | dict[str, Any]], clock: str = "auto") -> Timeline:
        """Put several ranks' recordings (Timelines or `export()` dicts) on one time axis.

        clock="shared": ranks read the same host clock (one host: CLOCK_MONOTONIC), so only origins differ;
        remaining skew is the CUDA anchors' uncertainty. clock="barrier": shift each rank so the exits of
        the first `align()` barrier coincide; remaining skew is the spread of the second barrier's exits.
        "auto" picks shared when all recordings come from one host.
        """
        recs = [t.export() if isinstance(t, Timeline) else dict(t) for t in timelines]
        if not recs:
            raise ValueError("Timeline.merge needs at least one recording")
        ranks = [r["rank"] for r in recs]
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"Timeline.merge got ranks {ranks}: each rank must appear once "
                             "(make per-rank timelines with Timeline(rank=r))")
        if clock == "auto":
            clock = "shared" if len({r["host"] for r in recs}) == 1 else "barrier"
        if clock == "shared":
            base = min(r["origin_ns"] for r in recs)
            shifts = [(r["origin_ns"] - base) / 1e6 for r in recs]
            skew = max(r.get("anchor_uncertainty_ms", 0.0) for r in recs)
        elif clock == "barrier":
            if any(not r.get("barrier_ms") for r in recs):
                raise ValueError("clock='barrier' needs every rank to have called tl.align() (gather() does)")
            shifts = [recs[0]["barrier_ms"][0] - r["barrier_ms"][0] for r in recs]
            second = [r["barrier_ms"][1] + s for r, s in zip(recs, shifts, strict=True)]
            skew = (max(second) - min(second)) + max(r.get("anchor_uncertainty_ms", 0.0) for r in recs)
        else:
            raise ValueError(f"clock must be 'auto', 'shared' or 'barrier', not {clock!r}")
        spans = []
        for r, shift in zip(recs, shifts, strict=True):
            for d in r["spans"]:
                s = Span.from_dict(d)
                s.rank = r["rank"]
                s.start_ms += shift
                s.end_ms += shift
                spans.append(s)
        merged = cls.from_spans(spans)
        merged.skew_ms = skew
        return merged

    # ---------------------------------------------------------------- stored spans, analyses, drawing
    @classmethod
    def from_spans(cls, spans: Iterable[Span | dict[str, Any]]) -> Timeline:
        """A read-only timeline of stored spans (e.g. a reference recording), to summarise and plot."""
        tl = cls(device="cpu", rank=0)
        tl._resolved = [s if isinstance(s, Span) else Span.from_dict(s) for s in spans]
        for s in tl._resolved:
            _check_kind(s.kind, allow_mark=True)
        tl._frozen = True
        return tl

    def stats(self):
        """Numbers about the recorded work: see `course_utils.timeline_stats.TimelineStats`."""
        from .timeline_stats import timeline_stats

        return timeline_stats(self.spans())

    def plot(self, title: str | None = None, **kwargs: Any):
        """An Nsight-style matplotlib Figure with the stats under it (see `course_utils.timeline_plot.plot`)."""
        from .timeline_plot import plot

        return plot(self.spans(), title=title, skew_ms=self.skew_ms, **kwargs)

    def to_chrome_trace(self, path: str | None = None) -> dict[str, Any]:
        """Chrome Trace Event JSON for Perfetto / chrome://tracing; written to `path` when given."""
        from .timeline_trace import to_chrome_trace

        return to_chrome_trace(self.spans(), path)

    def __repr__(self) -> str:
        clock = f"CUDA events on cuda:{self._device_index}" if self._cuda else "host clock"
        n = len(self._resolved) + len(self._names)
        return f"Timeline(rank={self.rank}, {clock}, {n} spans/marks)"


def from_profiler(trace: Any, rank: int | None = None, host_ops: bool = True) -> list[Span]:
    """Spans from a torch.profiler trace (a chrome-trace JSON path, its dict, or a profile object)."""
    from .timeline_trace import from_profiler as _from_profiler

    return _from_profiler(trace, rank=rank, host_ops=host_ops)


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
