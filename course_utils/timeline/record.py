"""Timeline: record what ran when, in one of three modes, then summarise, plot, export or merge it.

    tl = Timeline()                   # mode=None: the best mode here, fixed now (see Modes)
    with tl.capture():                # kernels mode: one torch.profiler run; a no-op in the other modes
        with tl.span("chain 0", stream=s):
            y = x @ x
    tl.name_stream(s, "side 1")       # row label (else "default stream", or "side stream <n>" in order of appearance)
    # or all at once: Timeline(streams={"copy": s_copy, "compute": s_comp})
    tl.spans(); tl.stats(); tl.plot(); tl.to_chrome_trace("trace.json")

Modes:
- "kernels": every kernel, copy and NCCL kernel with its real start and end on its real stream, from
  torch.profiler (CUPTI); `tl.span` is a named range drawn over the work it launched, never counted as
  work. See `kernels.py`. Spans must sit inside `with tl.capture():`.
- "events": a span is two CUDA events recorded on its stream: it shows when the *stream* reached its
  start and its end (stream progress), which includes time the stream waited for the GPU to run other
  streams' kernels. Cheap (two event records per span), so it suits live use; labelled so in the plot.
  A `wait` span recorded inside a span is drawn as waiting, not work. See `events.py`.
- "host": the host clock only (`time.perf_counter_ns`), for CPU work and machines without CUDA.
`kind="host"` spans are host-clock spans in every mode. A timeline's mode is decided when it is made and
never changes: mode=None means kernels where the profiler can see CUDA kernels (CUPTI), else events on
a GPU, else host. So one cell's timeline means one thing from start to end, and code that its mode
cannot serve (a GPU span outside `capture()` in kernels mode) raises at once, saying what to do.
`with tl.capture():` around the work is right in every mode (a no-op outside kernels mode).

How times line up. Every timeline has an origin on the host clock (`time.perf_counter_ns`, which is
CLOCK_MONOTONIC on Linux and so shared by all processes of one host). Host spans are read from that
clock directly; kernels-mode times are mapped onto it (kernels.py); events-mode CUDA spans are placed by
an *anchor*, one event timed on the idle device when `spans()` waits for it (events.py; uncertainty:
`anchor_uncertainty_ms`). Several ranks: `tl.gather()` inside workers, or
`Timeline.merge([tl.export(), ...])` (ranks.py says how clocks are lined up).
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from .events import EventRecorder
from .spans import MARK, Span, check_kind
from .stats import TimelineStats

MODES = ("kernels", "events", "host")

__all__ = ["MODES", "Timeline"]


def _host_ms(origin_ns: int) -> float:
    return (time.perf_counter_ns() - origin_ns) / 1e6


class _Open:
    """Handle of a span being recorded; `Timeline.end(handle)` closes it (the `with` form does it for you)."""

    __slots__ = ("tl", "index", "name", "stream_ctx", "cuda_stream", "closed", "rng")

    def __init__(self, tl: Timeline, index: int, name: str, stream_ctx: Any, cuda_stream: Any, rng: Any = None):
        self.tl, self.index, self.name = tl, index, name
        self.stream_ctx, self.cuda_stream, self.closed, self.rng = stream_ctx, cuda_stream, False, rng

    def __enter__(self) -> _Open:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.tl.end(self)


class Timeline:
    """Record spans of work per stream (and per rank), then resolve, summarise, plot or export them.

    mode: "kernels", "events", "host" or None (the best one here: kernels where the profiler sees CUDA
    kernels, else events on a GPU, else host), fixed from then on; see the module docstring.
    device: None picks the current CUDA device when CUDA is available; "cpu" means the host clock (mode
    host, unless mode="kernels": the profiler's CPU ops, e.g. gloo collectives); "cuda:N" or an int picks
    a GPU. rank: None takes the process group's rank when torch.distributed is
    initialised, else 0. host_ops (kernels mode): also draw each thread's top-level CPU ops; default on
    only without CUDA. streams: {row label: torch.cuda.Stream} names those streams' rows, as `name_stream`
    does (e.g. `streams={"copy": s_copy, "compute": s_comp}`); unnamed streams are "default stream" and
    "side stream 1", "side stream 2", ... in order of appearance.
    """

    def __init__(self, device: str | int | torch.device | None = None, rank: int | None = None,
                 mode: str | None = None, host_ops: bool | None = None, streams: dict[str, Any] | None = None):
        if mode is not None and mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)} or None, not {mode!r}")
        if device is None:
            cuda = torch.cuda.is_available()
            self._device_index: int | None = None  # resolved at first use: avoids initialising CUDA here
        else:
            dev = torch.device(f"cuda:{device}" if isinstance(device, int) else device)
            cuda = dev.type == "cuda"
            if cuda and not torch.cuda.is_available():
                raise RuntimeError(f"Timeline(device={device!r}) asks for CUDA, but CUDA is not available here")
            self._device_index = dev.index if cuda and dev.index is not None else None
        if mode is None:
            mode = _best_mode(cuda)
        if mode == "events" and not cuda:
            mode = "host"  # no CUDA here: the same code records on the host clock
        self._mode = mode
        self._cuda = cuda and mode != "host"
        if rank is None:
            rank = torch.distributed.get_rank() if _dist_ready() else 0
        self.rank = int(rank)
        self.origin_ns = time.perf_counter_ns()
        self.host = socket.gethostname()
        self.anchor_uncertainty_ms = 0.0
        self.skew_ms: float | None = None  # set by merge/gather: remaining clock skew between ranks
        self.skew_note: str | None = None
        # Pending records in parallel lists of objects the garbage collector does not track (str, float):
        # a tuple or list per record would be, and after `import torch` its passes cost more than the span.
        self._names: list[str] = []
        self._kinds: list[str] = []
        self._labels: list[str] = []
        self._t0: list[Any] = []  # host ms (float) or a CUDA event
        self._t1: list[Any] = []
        self._resolved: list[Span] = []
        self._open: dict[int, str] = {}  # pending index -> name, for spans not yet closed
        self._barrier_ms: tuple[float, float] | None = None
        self._frozen = False
        self._kernels = None
        self._events: EventRecorder | None = None
        self._host_ops = host_ops
        if self.mode == "kernels":
            self._make_recorder()
        elif self.mode == "events":
            self._events = EventRecorder(self.origin_ns, self._device)
        for label, stream in (streams or {}).items():
            if isinstance(stream, str) or not isinstance(label, str):
                raise TypeError("streams= maps a row label (str) to its stream: streams={'copy': s_copy}")
            self.name_stream(stream, label)

    def _make_recorder(self) -> None:
        from .kernels import KernelRecorder

        self._kernels = KernelRecorder(self.rank, self.origin_ns, self._cuda, self._device if self._cuda else None,
                                       self._host_ops)

    # ---------------------------------------------------------------- recording
    @property
    def mode(self) -> str:
        """"kernels", "events" or "host": decided when the timeline is made, never changed afterwards."""
        return self._mode

    @property
    def uses_cuda(self) -> bool:
        """True when GPU work is timed on the GPU (kernels or events mode); False on the host clock."""
        return self._cuda

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self._device()) if self._cuda else torch.device("cpu")

    def _device(self) -> int:
        if self._device_index is None:
            self._device_index = torch.cuda.current_device()
        return self._device_index

    def _check_writable(self) -> None:
        if self._frozen:
            raise RuntimeError("this Timeline was rebuilt from stored spans; record into a new Timeline()")

    def capture(self) -> contextlib.AbstractContextManager:
        """`with tl.capture():` records what the block runs (kernels mode: one torch.profiler run, which
        synchronises the GPU when the block ends, never inside it). A no-op context in the other modes."""
        self._check_writable()
        if self.mode != "kernels":
            return contextlib.nullcontext(self)
        return self._capture()

    @contextlib.contextmanager
    def _capture(self) -> Iterator[Timeline]:
        self._kernels.enter()
        try:
            yield self
        finally:
            self._kernels.exit()

    def _add(self, name: str, kind: str, label: str, start: Any, end: Any) -> int:
        self._names.append(name)
        self._kinds.append(kind)
        self._labels.append(label)
        self._t0.append(start)
        self._t1.append(end)
        return len(self._names) - 1

    def _add_open(self, name: str, kind: str, label: str, start: Any) -> int:
        index = self._add(name, kind, label, start, None)
        self._open[index] = name
        return index

    def name_stream(self, stream: Any, label: str) -> None:
        """Label a CUDA stream's row (unnamed: 'default stream', else 'side stream <n>' in order of appearance).

        Name a stream before the work on it is recorded (events mode labels a span when it begins). Ignored
        where there is no CUDA (the same notebook code runs on a CPU)."""
        if not (self._cuda and isinstance(stream, torch.cuda.Stream)):
            return
        if self._kernels is not None:
            self._kernels.name_stream(stream, label)
        if self._events is not None:
            self._events.name_stream(stream, label)

    def _stream_arg(self, name: str, kind: str, stream: Any) -> tuple[Any, Any]:
        """(stream to record on or None, context that makes it current or None), checking the argument."""
        if isinstance(stream, str):
            raise TypeError(f"span {name!r}: on a GPU, stream= takes a torch.cuda.Stream (or None), not a label; "
                            f"use tl.name_stream(stream, {stream!r}) to name its row, or kind='host' for host work")
        if stream is None:
            return torch.cuda.current_stream(self._device()), None
        if not isinstance(stream, torch.cuda.Stream):
            raise TypeError(f"stream must be a torch.cuda.Stream or None, not {type(stream).__name__}")
        if stream.device.index != self._device():
            raise ValueError(f"span {name!r}: its stream lives on cuda:{stream.device.index}, but this timeline "
                             f"records cuda:{self._device()}; make a Timeline(device={stream.device.index}) for it")
        ctx = None
        if stream != torch.cuda.current_stream(self._device()):
            ctx = torch.cuda.stream(stream)  # the block's work goes to `stream`
            ctx.__enter__()
        return stream, ctx

    def begin(self, name: str, kind: str = "compute", stream: Any = None) -> _Open:
        """Open a span and return its handle; close it with `end(handle)`. Prefer `with tl.span(...)`.

        Useful where start and end sit in different places, e.g. a backward hook and its callback.
        """
        self._check_writable()
        check_kind(kind)
        host_clock = kind == "host" or not self._cuda
        if host_clock and stream is not None and not isinstance(stream, str):
            if kind == "host":
                raise TypeError(f"a host span's stream is a row label (str), not {type(stream).__name__}")
            raise TypeError(f"no CUDA here: stream must be None or a row label (str), got {type(stream).__name__}")
        if self.mode == "kernels" and kind != "host":
            return self._begin_range(name, kind, stream)
        if host_clock:
            return _Open(self, self._add_open(name, kind, stream or "host", _host_ms(self.origin_ns)), name, None, None)
        stream, ctx = self._stream_arg(name, kind, stream)  # events mode: two CUDA events on the stream
        start = self._events.record(stream)
        return _Open(self, self._add_open(name, kind, self._events.label(stream), start), name, ctx, stream)

    def _begin_range(self, name: str, kind: str, stream: Any) -> _Open:
        """Kernels mode: a named range (record_function), drawn over the work it launched once the trace is read."""
        if not self._kernels.capturing:
            other = "Timeline(mode='events') to time spans with CUDA events" if self._cuda else \
                "Timeline(mode='host') to time spans on the host clock"
            raise RuntimeError(f"span {name!r} is outside `with tl.capture():`, and this Timeline records kernels "
                               "(mode='kernels'), which only a capture sees: put the work inside `with "
                               f"tl.capture():`, or make a {other}, which needs no capture")
        label, cuda_stream, ctx = None, None, None
        if self._cuda:  # as in events mode: a CUDA stream or None (a str label is a mistake here too)
            cuda_stream, ctx = self._stream_arg(name, kind, stream)
        else:  # no CUDA: the range is drawn on this host row
            label = stream
        try:
            rng = self._kernels.begin(name, label)
        except BaseException:
            if ctx is not None:
                ctx.__exit__(None, None, None)
            raise
        return _Open(self, self._add_open(name, kind, label or "", None), name, ctx, cuda_stream, rng)

    def end(self, handle: _Open) -> None:
        """Close a span opened by `begin` (or the `with` form)."""
        if handle.tl is not self:
            raise ValueError(f"span {handle.name!r} belongs to another Timeline")
        if handle.closed:
            raise RuntimeError(f"span {handle.name!r} was already closed")
        if handle.rng is not None:  # kernels mode: a named range, resolved from the profiler's trace
            self._kernels.end(*handle.rng)
            self._t1[handle.index] = "range"
            if handle.stream_ctx is not None:
                handle.stream_ctx.__exit__(None, None, None)
        elif handle.cuda_stream is None:
            self._t1[handle.index] = _host_ms(self.origin_ns)
        else:
            self._t1[handle.index] = self._events.record(handle.cuda_stream)
            if handle.stream_ctx is not None:
                handle.stream_ctx.__exit__(None, None, None)
        handle.closed = True
        del self._open[handle.index]

    def span(self, name: str, kind: str = "compute", stream: Any = None) -> _Open:
        """`with tl.span(name, kind, stream):` records the block.

        kind: compute, h2d, d2h, d2d, comm, host or wait. stream: a torch.cuda.Stream (it becomes the
        current stream inside the block), None for the current stream, or for host-clock spans
        (kind="host", or any span on a machine without CUDA) a row label such as "host" or "loader".
        In kernels mode the span is a named range (record_function) over the work the block launched;
        in events mode it is the stream's progress from the block's start to its end.
        """
        return self.begin(name, kind, stream)

    def mark(self, name: str, stream: Any = None) -> None:
        """An instant: in events mode when `stream` (default: current) reaches this point; else host time."""
        self._check_writable()
        if self.mode != "events" or isinstance(stream, str):
            t = _host_ms(self.origin_ns)
            self._add(name, MARK, stream if isinstance(stream, str) else "host", t, t)
            return
        stream = stream if stream is not None else torch.cuda.current_stream(self._device())
        ev = self._events.record(stream)
        self._add(name, MARK, self._events.label(stream), ev, ev)

    # ---------------------------------------------------------------- resolving
    def spans(self) -> list[Span]:
        """All spans and marks recorded so far, in ms since this timeline's origin.

        Events mode: the one call that waits for the GPU (once, for the work recorded so far).
        Raises if a span is still open, or (kernels mode) inside its capture.
        """
        if self._open:
            names = ", ".join(repr(n) for n in self._open.values())
            raise RuntimeError(f"span(s) {names} opened and never closed: close them (leave the `with` block "
                               "or call tl.end(handle)) before tl.spans()")
        if self._names:
            self._resolve()
        out = list(self._resolved)
        if self._kernels is not None:
            out += self._kernels.resolve()
            out.sort(key=lambda s: (s.start_ms, -s.end_ms))
        return out

    def _resolve(self) -> None:
        anchor = None
        if any(isinstance(t, torch.cuda.Event) for t in self._t0):  # events mode: wait for the device once
            anchor = self._events.anchor()
            self.anchor_uncertainty_ms = max(self.anchor_uncertainty_ms, anchor.uncertainty_ms)
        for name, kind, label, start, end in zip(self._names, self._kinds, self._labels, self._t0, self._t1,
                                                 strict=True):
            if end == "range":
                continue  # kernels mode: the range comes from the profiler's trace
            if isinstance(start, torch.cuda.Event):
                t0, t1 = self._events.place(start, end, anchor)
            else:
                t0, t1 = start, end
            self._resolved.append(Span(name, kind, self.rank, label, t0, t1))
        if anchor is not None:
            self._events.release(anchor)
        for pending in (self._names, self._kinds, self._labels):
            pending.clear()
        self._t0.clear()
        self._t1.clear()

    # ---------------------------------------------------------------- several ranks
    @property
    def clock_uncertainty_ms(self) -> float:
        """How far this timeline's GPU times may sit from the host clock (anchor or profiler mapping)."""
        k = self._kernels.clock_uncertainty_ms if self._kernels is not None else 0.0
        return max(self.anchor_uncertainty_ms, k)

    def export(self) -> dict[str, Any]:
        """This rank's spans and clock facts as plain data (picklable, JSON-able) for `Timeline.merge`."""
        spans = self.spans()
        return {
            "rank": self.rank,
            "host": self.host,
            "mode": self.mode,
            "origin_ns": self.origin_ns,
            "barrier_ms": list(self._barrier_ms) if self._barrier_ms else None,
            "anchor_uncertainty_ms": self.clock_uncertainty_ms,
            "spans": [s.to_dict() for s in spans],
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
        """Put several ranks' recordings (Timelines or `export()` dicts) on one time axis (see `ranks.py`).

        clock="shared": ranks read one host clock, only origins differ. clock="barrier": ranks on several
        hosts, aligned on the first `align()` barrier; the second one's spread is the estimated skew.
        "auto" picks shared when all recordings come from one host. `skew_ms` and `skew_note` say how well.
        """
        from .ranks import merge_records

        recs = [t.export() if isinstance(t, Timeline) else dict(t) for t in timelines]
        spans, skew, note, mode = merge_records(recs, clock)
        merged = cls.from_spans(spans, mode=mode)
        merged.skew_ms = skew
        merged.skew_note = note
        return merged

    # ---------------------------------------------------------------- stored spans, analyses, drawing
    @classmethod
    def from_spans(cls, spans: Iterable[Span | dict[str, Any]] | dict[str, Any], mode: str | None = None) -> Timeline:
        """A read-only timeline of stored spans (e.g. a reference recording), to summarise and plot.

        spans: Span objects, their `to_dict()`s, or a whole `tl.export()` (which carries its mode).
        mode: how the spans were recorded ("kernels", "events", "host"), so the plot can say what bars mean.
        """
        if isinstance(spans, dict):
            if "spans" not in spans:
                raise ValueError("Timeline.from_spans takes spans, their dicts, or a tl.export() record")
            mode = mode or spans.get("mode")
            spans = spans["spans"]
        tl = cls(device="cpu", rank=0)
        tl._resolved = [s if isinstance(s, Span) else Span.from_dict(s) for s in spans]
        for s in tl._resolved:
            check_kind(s.kind, allow_extra=True)
        tl._frozen = True
        tl._mode = mode if mode is not None else "host"  # how the stored spans were recorded
        return tl

    def stats(self) -> TimelineStats:
        """Numbers about the recorded work: see `course_utils.timeline.stats.TimelineStats`."""
        from .stats import timeline_stats

        return timeline_stats(self.spans())

    def plot(self, title: str | None = None, **kwargs: Any):
        """An Nsight-style matplotlib Figure with the stats under it (see `course_utils.timeline.plot.plot`)."""
        from .plot import plot

        kwargs.setdefault("mode", self.mode)
        return plot(self.spans(), title=title, skew_ms=self.skew_ms, skew_note=self.skew_note, **kwargs)

    def to_chrome_trace(self, path: str | None = None) -> dict[str, Any]:
        """Chrome Trace Event JSON for Perfetto / chrome://tracing; written to `path` when given."""
        from .trace import to_chrome_trace

        return to_chrome_trace(self.spans(), path)

    def __repr__(self) -> str:
        where = {"kernels": "torch.profiler kernels", "events": "CUDA events", "host": "host clock"}[self.mode]
        if self._cuda and self._device_index is not None:
            where += f" on cuda:{self._device_index}"
        n = len(self._resolved) + len(self._names) + (len(self._kernels.spans) if self._kernels else 0)
        return f"Timeline(rank={self.rank}, mode={self.mode!r}: {where}, {n} spans/marks)"


def _best_mode(cuda: bool) -> str:
    """Kernels where the profiler can see CUDA kernels (a GPU and a torch built with CUPTI), else events on
    a GPU, else host. Asking the profiler counts devices; it does not initialise CUDA."""
    if not cuda:
        return "host"
    from torch.profiler import ProfilerActivity, supported_activities

    return "kernels" if ProfilerActivity.CUDA in supported_activities() else "events"


def _dist_ready() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()
