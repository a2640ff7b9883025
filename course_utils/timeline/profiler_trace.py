"""torch.profiler traces in: index the trace's events once, then one small function per rule.

What a torch.profiler trace becomes (`spans_from_trace`):
- events of category kernel, gpu_memcpy and gpu_memset, with their "device" and "stream" args (the
  layout kineto's ChromeTraceLogger writes: pid = device, tid = stream, args {"device", "stream",
  "correlation", ...}): work on row "stream <id>" of their device. A copy's direction comes from its
  name ("Memcpy HtoD (Pinned -> Device)": h2d; DtoH: d2h; DtoD and PtoP: d2d). NCCL kernels (names
  starting "ncclDevKernel" or "ncclKernel") are kind comm, and a stream that runs them is the row "comm".
- named ranges (CPU "user_annotation" events: record_function, and a timeline's own spans) become
  `range` spans on each GPU row, from the first to the last kernel launched while the range was open
  (kernel and launch are joined by their "correlation" arg). That also covers ranges nested in ranges,
  which kineto's own "gpu_user_annotation" events miss; those are used only for traces without launch
  events. A range that launched no GPU work is still drawn, over its host time on its thread's host row
  ("host", or a timeline's own row label), whatever host_ops says: the user opened it, so it shows.
  Ranges are drawn over work and never counted as busy time.
- stream probes (a timeline's record_function "course_utils.timeline stream: <label>" around a 1-byte
  copy on a stream) name that stream's row when the label is one of `stream_names`; their work is
  dropped whatever the label (another timeline's probes, in nested captures, are not work either).
- with host_ops, each thread's top-level CPU ops become spans on "host" (the recording thread) or
  "host thread <tid>": kind host when the trace has GPU work (the host launching it), kind compute when
  it has none (on a CPU the ops are the computation). Communication ops ("gloo:...", "nccl:...",
  "c10d::...", "record_param_comms") are kind comm when the trace has no GPU work (gloo on a CPU: the
  "gloo:*" ranges on gloo's worker threads go to row "comm"); with GPU work they are host-side launches
  and the NCCL kernels are the communication. `aten::broadcast_tensors` is not communication.
Other events (runtime calls, "cuda_sync" records, python frames, flows, the profiler's own spans) are left out.

`spans_from_trace` reads a trace in three steps: `index_trace` sorts its events once (by category,
correlation id, launch time); `read` decides what is kept and which row each thing is drawn on (a
`Reading`); then each rule below turns its part of the trace into spans.
"""

from __future__ import annotations

import bisect
import re
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from .spans import RANGE, Span

__all__ = ["ANCHOR", "COMM_OP", "PROBE", "OwnRange", "Reading", "TraceIndex", "index_trace", "is_nccl_kernel",
           "memcpy_kind", "read", "spans_from_trace"]

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
LAUNCH_CATS = ("cuda_runtime", "cuda_driver")
# CPU-side names of collectives: the backends' own ranges, c10d's ops (incl. functional collectives), and
# the op PyTorch wraps every collective in. Anchored at the start, so aten::broadcast_tensors is not one.
COMM_OP = re.compile(r"^(gloo:|nccl:|ucc:|mpi:|c10d::|_c10d_functional::|c10d_functional::|record_param_comms$)")
PROBE = "course_utils.timeline stream: "  # record_function around a 1-byte copy that tells a stream's id
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


def _name(e: dict[str, Any]) -> str:
    return str(e.get("name", ""))


def _corr(e: dict[str, Any]) -> int | None:
    corr = (e.get("args") or {}).get("correlation")
    return None if corr is None else int(corr)


def _gpu_kind(e: dict[str, Any]) -> str:
    cat, name = _cat(e), _name(e)
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


def _gpu_range_key(e: dict[str, Any]) -> tuple[int, int]:
    """(device, stream) of kineto's GPU-side copy of a range: it carries only pid/tid."""
    return int(e.get("pid", 0)), int(e.get("tid", 0))


def _internal(name: str) -> bool:
    return name.startswith((PROBE, ANCHOR))


@dataclass
class OwnRange:
    """A range this timeline opened (tl.span in kernels mode): name, where to draw it without GPU work,
    and its host window in timeline ms."""

    name: str
    label: str | None  # row label for its host extent (a str stream), None: the host row
    t0_ms: float
    t1_ms: float = float("nan")
    session: int = -1


# ------------------------------------------------------------------ one pass over the trace
@dataclass
class TraceIndex:
    """A profiler trace's complete ("X") events, sorted once into what the rules below ask about."""

    to_ms: Callable[[float], float]  # trace ts (µs) -> output ms
    gpu: list[dict[str, Any]] = field(default_factory=list)  # kernels, copies, memsets
    launches: list[dict[str, Any]] = field(default_factory=list)  # runtime/driver calls with a correlation id
    launch_of: dict[int, dict[str, Any]] = field(default_factory=dict)  # correlation -> launch
    gpu_of: dict[int, list[dict[str, Any]]] = field(default_factory=dict)  # correlation -> GPU work it launched
    annotations: list[dict[str, Any]] = field(default_factory=list)  # CPU-side named ranges (record_function)
    gpu_annotations: list[dict[str, Any]] = field(default_factory=list)  # kineto's GPU-side copies of them
    cpu_events: list[dict[str, Any]] = field(default_factory=list)  # CPU ops and named ranges
    launch_at: list[tuple[float, Any, int]] = field(default_factory=list)  # (ms, tid, correlation), by time
    launch_ms: list[float] = field(default_factory=list)  # launch_at's times, for bisect

    def t0(self, e: dict[str, Any]) -> float:
        return self.to_ms(float(e["ts"]))

    def t1(self, e: dict[str, Any]) -> float:
        return self.to_ms(float(e["ts"]) + float(e["dur"]))

    def launched_between(self, a: float, b: float, tid: Any = None) -> list[dict[str, Any]]:
        """GPU work launched from `a` to `b` ms (by thread `tid` if given): the work a range enclosed."""
        out = []
        lo, hi = bisect.bisect_left(self.launch_ms, a), bisect.bisect_right(self.launch_ms, b)
        for _, t, corr in self.launch_at[lo:hi]:
            if tid is None or t == tid:
                out += self.gpu_of.get(corr, [])
        return out


def index_trace(data: dict[str, Any], to_ms: Callable[[float], float]) -> TraceIndex:
    """Sort a Chrome trace's complete events by category, correlation id and launch time, once."""
    ix = TraceIndex(to_ms)
    for e in data.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e or "ts" not in e:
            continue
        cat = _cat(e)
        if cat in GPU_CATS:
            ix.gpu.append(e)
            if _corr(e) is not None:
                ix.gpu_of.setdefault(_corr(e), []).append(e)
        elif cat in LAUNCH_CATS and _corr(e) is not None:
            ix.launches.append(e)
            ix.launch_of[_corr(e)] = e
        elif cat == "gpu_user_annotation":
            ix.gpu_annotations.append(e)
        elif cat in ("cpu_op", "user_annotation"):
            ix.cpu_events.append(e)
            if cat == "user_annotation":
                ix.annotations.append(e)
    ix.launch_at = sorted((ix.t0(e), e.get("tid"), _corr(e)) for e in ix.launches)
    ix.launch_ms = [x[0] for x in ix.launch_at]
    return ix


# ------------------------------------------------------------------ what one reading keeps, and where it draws it
@dataclass
class Reading:
    """The decisions shared by the rules: which events are kept and which row each is drawn on."""

    ix: TraceIndex
    rank: int
    window: tuple[float, float] | None  # output ms; None keeps everything
    stream_names: dict[tuple[int, int], str]  # (device, stream) -> a probed stream's label
    probe_work: set[int]  # id() of the probes' GPU work
    work: list[dict[str, Any]]  # the GPU work that becomes spans
    device: int  # the main GPU: rows of other GPUs get a "cuda:D " prefix
    main_tid: Any  # the recording thread: row "host"
    nccl_rows: set[tuple[int, int]] = field(default_factory=set)
    on_gpu_rows: set[Any] = field(default_factory=set)  # External ids of ranges kineto drew on GPU rows

    def kept(self, e: dict[str, Any]) -> bool:
        """Inside the window: GPU work by its launch time (work queued inside a capture may run after it)."""
        if self.window is None:
            return True
        corr = _corr(e)
        launch = self.ix.launch_of.get(corr) if corr is not None and _cat(e) in GPU_CATS else None
        t = self.ix.t0(launch if launch is not None else e)
        return self.window[0] <= t <= self.window[1]

    def gpu_row(self, key: tuple[int, int]) -> str:
        """A probed stream's label, else "comm" for a stream that runs NCCL kernels, else "stream <id>"."""
        label = self.stream_names.get(key) or ("comm" if key in self.nccl_rows else f"stream {key[1]}")
        return label if key[0] == self.device else f"cuda:{key[0]} {label}"

    def host_row(self, tid: Any, comm: bool = False) -> str:
        if tid == self.main_tid:
            return "host"
        return "comm" if comm else f"host thread {tid}"

    def drawn_by_kineto(self, ann: dict[str, Any] | None) -> bool:
        """True when kineto drew this range on a GPU row itself (traces without launch events)."""
        return ann is not None and (ann.get("args") or {}).get("External id", object()) in self.on_gpu_rows


def _probed_streams(ix: TraceIndex, known: set[str]) -> tuple[dict[tuple[int, int], str], set[int]]:
    """Which (device, stream) carries which label, and the probes' work (module docstring: stream probes).

    A torch stream does not know its profiler id, so a probe's work tells it. Every probe's work is dropped,
    also that of probes whose label this reading does not know (another timeline's, in nested captures).
    """
    names: dict[tuple[int, int], str] = {}
    work: set[int] = set()
    for a in ix.annotations:
        name = _name(a)
        if name.startswith(PROBE):
            for k in ix.launched_between(ix.t0(a), ix.t1(a), a.get("tid")):
                if name[len(PROBE):] in known:
                    names.setdefault(_row_key(k), name[len(PROBE):])
                work.add(id(k))
    if not ix.launches:  # no launch events to follow: kineto's GPU-side copy of the probe sits on its stream
        for a in ix.gpu_annotations:
            name = _name(a)
            if name.startswith(PROBE):
                key = _gpu_range_key(a)
                if name[len(PROBE):] in known:
                    names.setdefault(key, name[len(PROBE):])
                work |= {id(k) for k in ix.gpu if _row_key(k) == key and ix.t0(a) <= ix.t0(k) and ix.t1(k) <= ix.t1(a)}
    return names, work


def _main_thread(cpu_events: list[dict[str, Any]]) -> Any:
    """The recording thread when the caller does not say: the one whose tid is its process id (the main
    thread on Linux), else the busiest."""
    pids = {e.get("pid") for e in cpu_events}
    tid = next((e.get("tid") for e in cpu_events if e.get("tid") in pids), None)
    if tid is None and cpu_events:
        tid = Counter(e.get("tid") for e in cpu_events).most_common(1)[0][0]
    return tid


def read(ix: TraceIndex, rank: int, stream_names: Iterable[str] = (), device: int | None = None,
         main_tid: Any = None, window: tuple[float, float] | None = None) -> Reading:
    """Decide what is kept and where it is drawn (device None: the GPU with the most work)."""
    names, probe_work = _probed_streams(ix, set(stream_names))
    rd = Reading(ix, rank, window, names, probe_work, [], 0,
                 main_tid if main_tid is not None else _main_thread(ix.cpu_events))
    rd.work = [e for e in ix.gpu if id(e) not in probe_work and rd.kept(e)]
    rd.nccl_rows = {_row_key(e) for e in rd.work if _cat(e) == "kernel" and is_nccl_kernel(_name(e))}
    if device is None:
        counts = Counter(_row_key(e)[0] for e in rd.work)
        device = counts.most_common(1)[0][0] if counts else 0
    rd.device = device
    # Without launch events kineto's GPU-side copy of a range (same External id) draws it on its GPU row.
    if not ix.launches:
        rd.on_gpu_rows = {(e.get("args") or {}).get("External id") for e in ix.gpu_annotations}
    return rd


# ------------------------------------------------------------------ the rules, one function each
def gpu_work_spans(rd: Reading) -> list[Span]:
    """Kernels, copies and memsets on their stream's row, kind from category and name."""
    ix = rd.ix
    return [Span(_name(e), _gpu_kind(e), rd.rank, rd.gpu_row(_row_key(e)), ix.t0(e), ix.t1(e)) for e in rd.work]


def range_over_work(rd: Reading, name: str, a: float, b: float, tid: Any) -> list[Span]:
    """A range drawn on each GPU row from the first to the last work launched while it was open.

    Joined by correlation id rather than taken from kineto's gpu_user_annotation, which misses ranges
    nested in ranges.
    """
    ix = rd.ix
    rows: dict[str, tuple[float, float]] = {}
    for k in ix.launched_between(a, b, tid):
        if id(k) in rd.probe_work or not rd.kept(k):
            continue
        row = rd.gpu_row(_row_key(k))
        lo, hi = rows.get(row, (ix.t0(k), ix.t1(k)))
        rows[row] = (min(lo, ix.t0(k)), max(hi, ix.t1(k)))
    return [Span(name, RANGE, rd.rank, row, lo, hi) for row, (lo, hi) in rows.items()]


def _user_ranges(ix: TraceIndex) -> tuple[list[dict[str, Any]], dict[str, list[tuple[float, int]]]]:
    """Named ranges that are not the timeline's own machinery, and their (start, index) by name, sorted."""
    ours = [a for a in ix.annotations if not _internal(_name(a))]
    by_name: dict[str, list[tuple[float, int]]] = {}
    for i, a in enumerate(ours):
        by_name.setdefault(_name(a), []).append((ix.t0(a), i))
    for starts in by_name.values():
        starts.sort()
    return ours, by_name


def own_range_spans(rd: Reading, own: list[OwnRange]) -> tuple[list[Span], set[int]]:
    """A timeline's own spans, and id() of the trace ranges they matched.

    Each is matched to its record_function by name and a start within 1 ms (the timeline reads perf_counter
    just before entering it), so the profiler's own times are used. A range that launched no GPU work is
    drawn over its host time on its own row: the user opened it, so it shows (never dropped).
    """
    ours, by_name = _user_ranges(rd.ix)
    spans: list[Span] = []
    matched: set[int] = set()
    for r in own:
        starts = by_name.get(r.name, [])
        k = bisect.bisect_left(starts, (r.t0_ms, -1))
        near = [j for j in (k - 1, k) if 0 <= j < len(starts) and abs(starts[j][0] - r.t0_ms) < 1.0]
        best = None
        if near:
            j = min(near, key=lambda j: abs(starts[j][0] - r.t0_ms))
            best = ours[starts.pop(j)[1]]
            matched.add(id(best))
            a, b = rd.ix.t0(best), rd.ix.t1(best)
        else:  # its record_function is not in the trace: the timeline's host times
            a, b = r.t0_ms, r.t1_ms
        found = range_over_work(rd, r.name, a, b, None) if rd.ix.launches else []
        if not found and not rd.drawn_by_kineto(best):
            found = [Span(r.name, RANGE, rd.rank, r.label or "host", a, b)]
        spans += found
    return spans, matched


def other_range_spans(rd: Reading, matched: set[int]) -> list[Span]:
    """Ranges no timeline span matched (the user's record_function, another timeline's spans): over the work
    their thread launched, else over their host time on their thread's row. Collectives' CPU-side ranges are
    host ops, not named ranges."""
    ix, spans = rd.ix, []
    for ann in _user_ranges(ix)[0]:
        name = _name(ann)
        if id(ann) in matched or COMM_OP.match(name) or not rd.kept(ann):
            continue
        found = range_over_work(rd, name, ix.t0(ann), ix.t1(ann), ann.get("tid")) if ix.launches else []
        if not found and not rd.drawn_by_kineto(ann):
            found = [Span(name, RANGE, rd.rank, rd.host_row(ann.get("tid")), ix.t0(ann), ix.t1(ann))]
        spans += found
    return spans


def kineto_range_spans(rd: Reading) -> list[Span]:
    """kineto's own GPU-side ranges, used only for traces without launch events (nothing to join by)."""
    ix = rd.ix
    if ix.launches:
        return []
    return [Span(_name(g), RANGE, rd.rank, rd.gpu_row(_gpu_range_key(g)), ix.t0(g), ix.t1(g))
            for g in ix.gpu_annotations if not _internal(_name(g)) and rd.kept(g)]


def host_op_spans(rd: Reading) -> list[Span]:
    """Each thread's top-level CPU ops (named ranges are not ops: they neither count nor contain).

    With GPU work they are the host launching it (kind host, collectives included: the NCCL kernels are the
    communication); without, they are the computation, and collectives are comm (gloo's threads: row comm).
    """
    ix, has_gpu_work, out = rd.ix, bool(rd.work), []
    by_tid: dict[Any, list[dict[str, Any]]] = {}
    for e in ix.cpu_events:
        name = _name(e)
        if _internal(name) or (_cat(e) == "user_annotation" and not COMM_OP.match(name)):
            continue
        by_tid.setdefault(e.get("tid"), []).append(e)
    for tid, evs in by_tid.items():
        end = float("-inf")
        for e in sorted(evs, key=lambda e: (float(e["ts"]), -float(e["dur"]))):
            a, b = ix.t0(e), ix.t1(e)
            if a < end:
                continue  # nested in (or overlapping) the previous top-level op of this thread
            end = b
            if not rd.kept(e):
                continue
            comm = bool(COMM_OP.match(_name(e)))
            kind = "host" if has_gpu_work else ("comm" if comm else "compute")
            out.append(Span(_name(e), kind, rd.rank, rd.host_row(tid, comm and not has_gpu_work), a, b))
    return out


def spans_from_trace(data: dict[str, Any], rank: int = 0, host_ops: bool = True, *,
                     to_ms: Callable[[float], float] | None = None, stream_names: Iterable[str] = (),
                     device: int | None = None, main_tid: int | None = None, own: list[OwnRange] | None = None,
                     window: tuple[float, float] | None = None) -> list[Span]:
    """Spans from a torch.profiler Chrome trace dict (rules in the module docstring), sorted by start.

    to_ms maps a trace `ts` (µs) to output ms (default ts / 1000). stream_names: the labels of the streams
    probed during the capture (a probe's copy or kernel tells which profiler stream carries that label).
    device: the main GPU (others get a "cuda:D " prefix); default the busiest. main_tid: the recording
    thread (row "host"); default the process's main thread. own: a timeline's own ranges, drawn even where
    they launched no GPU work. window: (start, end) in output ms; only work launched (or CPU ops started)
    inside it is kept.
    """
    ix = index_trace(data, to_ms or (lambda ts: ts / 1000.0))
    rd = read(ix, rank, stream_names, device, main_tid, window)
    spans = gpu_work_spans(rd)
    mine, matched = own_range_spans(rd, own or [])
    spans += mine + other_range_spans(rd, matched) + kineto_range_spans(rd)
    if host_ops:
        spans += host_op_spans(rd)
    spans.sort(key=lambda s: (s.start_ms, -s.end_ms))
    return spans
