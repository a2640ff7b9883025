"""Chrome Trace Event JSON in and out: export spans for Perfetto, read torch.profiler traces as spans.

Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
("X" complete events with ts/dur in µs, "M" metadata events naming processes and threads, "i" instants).

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
"""

from __future__ import annotations

import bisect
import json
import os
import re
import tempfile
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .spans import MARK, RANGE, Span, lanes

__all__ = ["ANCHOR", "COMM_OP", "PROBE", "OwnRange", "from_profiler", "is_nccl_kernel", "load_trace", "memcpy_kind",
           "spans_from_trace", "to_chrome_trace"]



def to_chrome_trace(spans: list[Span], path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Trace dict (written to `path` when given): pid = rank, tid = one per stream lane, named by M events.

    Spans that overlap on one stream without nesting (Chrome's X events on one thread must nest) are
    split into extra lanes named "<stream> (lane 2)", ...; named ranges go to "<stream> (ranges)".
    Times are µs from the first event.
    """
    zero = min((s.start_ms for s in spans), default=0.0)
    events: list[dict[str, Any]] = []
    tids: dict[tuple[int, str, str, int], int] = {}
    for rank in sorted({s.rank for s in spans}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        mine = [s for s in spans if s.rank == rank]
        streams = list(dict.fromkeys(s.stream for s in mine))  # order of first appearance
        for stream in streams:
            groups = [("work", [s for s in mine if s.stream == stream and s.kind not in (MARK, RANGE)])]
            ranges = [s for s in mine if s.stream == stream and s.kind == RANGE]
            if ranges:
                groups.append(("ranges", ranges))
            for group, members in groups:
                lane_of = lanes(members, nest=True)
                for lane in sorted(set(lane_of)) or [0]:
                    tid = len(tids) + 1
                    tids[(rank, stream, group, lane)] = tid
                    name = stream if group == "work" else f"{stream} (ranges)"
                    name = name if lane == 0 else f"{name} (lane {lane + 1})"
                    events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
                    events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                                   "args": {"sort_index": tid}})
                for s, lane in zip(members, lane_of, strict=True):
                    events.append({"ph": "X", "name": s.name, "cat": s.kind, "pid": rank,
                                   "tid": tids[(rank, stream, group, lane)], "ts": (s.start_ms - zero) * 1000.0,
                                   "dur": s.duration_ms * 1000.0})
            for m in (s for s in mine if s.stream == stream and s.kind == MARK):
                events.append({"ph": "i", "s": "t", "name": m.name, "cat": MARK, "pid": rank,
                               "tid": tids[(rank, stream, "work", 0)], "ts": (m.start_ms - zero) * 1000.0})
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


def load_trace(trace: Any) -> dict[str, Any]:
    """A torch.profiler chrome trace as a dict, from a path, a dict, or a finished torch.profiler.profile."""
    if isinstance(trace, dict):
        return trace
    if isinstance(trace, (str, os.PathLike)):
        return json.loads(Path(trace).read_text())
    if hasattr(trace, "export_chrome_trace"):  # a torch.profiler.profile that has finished
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            try:
                trace.export_chrome_trace(path)
            except RuntimeError as err:  # kineto saves a trace only once
                raise RuntimeError("this profile was already exported; pass the JSON path it was exported to "
                                   "instead of the profile object") from err
            return json.loads(Path(path).read_text())
    raise TypeError(f"from_profiler takes a trace path, a trace dict or a torch.profiler.profile, not {type(trace)}")


def from_profiler(trace: Any, rank: int | None = None, host_ops: bool = True) -> list[Span]:
    """Spans from a torch.profiler trace (a chrome-trace JSON path, its dict, or a finished profile).

    GPU work (kernels, memcpys, memsets) goes to rows "stream N" (the profiler's stream id; "comm" for
    streams that run NCCL kernels, prefixed "cuda:D" for devices other than the busiest), named ranges
    (record_function) become `range` spans over the work they launched (over their host time on their
    thread's row when they launched none), and with host_ops the top-level CPU ops of each thread become
    spans (host launches next to GPU work; compute and comm without it).
    Times are ms from the trace's base time (its `ts` / 1000); rank comes from the trace's
    distributedInfo when not given. The rules are in this module's docstring.
    """
    data = load_trace(trace)
    if rank is None:
        rank = int((data.get("distributedInfo") or {}).get("rank", 0))
    return spans_from_trace(data, rank=rank, host_ops=host_ops)


# ------------------------------------------------------------------ torch.profiler traces -> spans
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
                     to_ms: Callable[[float], float] | None = None, stream_names: Iterable[str] = (),
                     device: int | None = None, main_tid: int | None = None, own: list[OwnRange] | None = None,
                     window: tuple[float, float] | None = None) -> list[Span]:
    """Spans from a torch.profiler Chrome trace dict (rules in the module docstring).

    to_ms maps a trace `ts` (µs) to output ms (default ts / 1000). stream_names: the labels of the streams
    probed during the capture (a probe's copy or kernel tells which profiler stream carries that label).
    device: the main GPU (others get a "cuda:D " prefix); default the busiest. own: a timeline's own
    ranges, drawn even where they launched no GPU work. window: (start, end) in output ms; only work
    launched (or CPU ops started) inside it is kept.
    """
    to_ms = to_ms or (lambda ts: ts / 1000.0)
    stream_names = set(stream_names)
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

    # Which (device, stream) is which named stream: the probes' work says. Every probe's work is dropped,
    # also that of probes whose label this timeline does not know (another timeline's, in nested captures).
    names: dict[tuple[int, int], str] = {}
    probe_events: set[int] = set()
    for a in annotations:
        name = str(a.get("name", ""))
        if name.startswith(PROBE):
            for k in launched_between(t0(a), t1(a), a.get("tid")):
                if name[len(PROBE):] in stream_names:
                    names.setdefault(_row_key(k), name[len(PROBE):])
                probe_events.add(id(k))
    gpu_annotations = [e for e in events if _cat(e) == "gpu_user_annotation"]
    for a in gpu_annotations:  # traces without launch events
        name = str(a.get("name", ""))
        if not launches and name.startswith(PROBE):
            key = (int(a.get("pid", 0)), int(a.get("tid", 0)))
            if name[len(PROBE):] in stream_names:
                names.setdefault(key, name[len(PROBE):])
            probe_events |= {id(k) for k in gpu if _row_key(k) == key and t0(a) <= t0(k) and t1(k) <= t1(a)}
    # Without launch events kineto's GPU-side copy of a range (same External id) draws it on its GPU row.
    on_gpu_rows = set() if launches else {(e.get("args") or {}).get("External id") for e in gpu_annotations}

    def drawn_by_kineto(ann: dict[str, Any] | None) -> bool:
        return ann is not None and (ann.get("args") or {}).get("External id", object()) in on_gpu_rows

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
    # A range that launched no GPU work is drawn over its host time (module docstring), never dropped.
    matched: set[int] = set()
    for r in own or []:
        starts = by_name.get(r.name, [])
        k = bisect.bisect_left(starts, (r.t0_ms, -1))
        near = [j for j in (k - 1, k) if 0 <= j < len(starts) and abs(starts[j][0] - r.t0_ms) < 1.0]
        best = None
        if near:  # its record_function in the trace: the profiler's own times for the range
            j = min(near, key=lambda j: abs(starts[j][0] - r.t0_ms))
            best = ours[starts.pop(j)[1]]
            matched.add(id(best))
            a, b = t0(best), t1(best)
        else:
            a, b = r.t0_ms, r.t1_ms
        found = range_spans(r.name, a, b, None) if launches else []
        if not found and not drawn_by_kineto(best):
            found = [Span(r.name, RANGE, rank, r.label or "host", a, b)]
        spans += found
    for ann in ours:  # ranges this timeline did not open: the user's record_function, another timeline's spans
        if id(ann) in matched or COMM_OP.match(str(ann.get("name", ""))) or not kept(ann):
            continue
        found = range_spans(str(ann.get("name", "")), t0(ann), t1(ann), ann.get("tid")) if launches else []
        if not found and not drawn_by_kineto(ann):
            found = [Span(str(ann.get("name", "")), RANGE, rank, host_row(ann.get("tid")), t0(ann), t1(ann))]
        spans += found
    if not launches:  # kineto's own GPU-side ranges, for traces without launch events
        for g in gpu_annotations:
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
            kind = "host" if has_gpu_work else ("comm" if comm else "compute")
            out.append(Span(str(e.get("name", "")), kind, rank, host_row(tid, comm and not has_gpu_work), a, b))
    return out
