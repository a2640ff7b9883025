"""Chrome Trace Event JSON in and out: export spans for Perfetto, read torch.profiler traces as spans.

Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
("X" complete events with ts/dur in µs, "M" metadata events naming processes and threads, "i" instants).
"""

from __future__ import annotations

import json
import os
import re
import tempfile
from pathlib import Path
from typing import Any

from .timeline import MARK, Span
from .timeline_plot import lanes


def to_chrome_trace(spans: list[Span], path: str | os.PathLike | None = None) -> dict[str, Any]:
    """Trace dict (written to `path` when given): pid = rank, tid = one per stream lane, named by M events.

    Spans that overlap on one stream without nesting (Chrome's X events on one thread must nest) are
    split into extra lanes named "<stream> (lane 2)", ... Times are µs from the first event.
    """
    zero = min((s.start_ms for s in spans), default=0.0)
    events: list[dict[str, Any]] = []
    tids: dict[tuple[int, str, int], int] = {}
    for rank in sorted({s.rank for s in spans}):
        events.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        mine = [s for s in spans if s.rank == rank]
        streams = list(dict.fromkeys(s.stream for s in mine))  # order of first appearance
        for stream in streams:
            work = [s for s in mine if s.stream == stream and s.kind != MARK]
            lane_of = lanes(work, nest=True)
            for lane in sorted(set(lane_of)) or [0]:
                tid = len(tids) + 1
                tids[(rank, stream, lane)] = tid
                name = stream if lane == 0 else f"{stream} (lane {lane + 1})"
                events.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": name}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": rank, "tid": tid,
                               "args": {"sort_index": tid}})
            for s, lane in zip(work, lane_of, strict=True):
                events.append({"ph": "X", "name": s.name, "cat": s.kind, "pid": rank, "tid": tids[(rank, stream, lane)],
                               "ts": (s.start_ms - zero) * 1000.0, "dur": s.duration_ms * 1000.0})
            for m in (s for s in mine if s.stream == stream and s.kind == MARK):
                events.append({"ph": "i", "s": "t", "name": m.name, "cat": MARK, "pid": rank,
                               "tid": tids[(rank, stream, 0)], "ts": (m.start_ms - zero) * 1000.0})
    trace = {"traceEvents": events, "displayTimeUnit": "ms"}
    if path is not None:
        Path(path).write_text(json.dumps(trace))
    return trace


# ------------------------------------------------------------------ torch.profiler traces -> spans
_COMM = re.compile(r"nccl|gloo|c10d|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_?to_?all|send|recv|barrier",
                   re.IGNORECASE)


def _kind(cat: str, name: str) -> str | None:
    cat = cat.lower()
    if cat == "gpu_memcpy":
        n = name.lower()
        if "htod" in n:
            return "h2d"
        if "dtoh" in n:
            return "d2h"
        return "d2d"  # DtoD, PtoP
    if cat == "gpu_memset":
        return "compute"
    if cat == "kernel":
        return "comm" if "nccl" in name.lower() else "compute"
    if cat in ("cpu_op", "user_annotation", "gpu_user_annotation"):
        return "comm" if _COMM.search(name) else "host"
    return None  # runtime calls, python frames, flows, ... are left out


def _load_trace(trace: Any) -> dict[str, Any]:
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
    """Spans from a torch.profiler chrome trace: kernels, memcpys, memsets, collectives and (host_ops) CPU ops.

    GPU work goes to rows "stream N" (the profiler's stream id), CPU ops to "host thread N". Collective
    kernels (nccl*) and CPU ops named like collectives (gloo:/c10d::/all_reduce...) become kind "comm".
    Times are ms on the profiler's clock; rank comes from the trace's distributedInfo when not given.
    """
    data = _load_trace(trace)
    if rank is None:
        rank = int((data.get("distributedInfo") or {}).get("rank", 0))
    gpu_cats = {"kernel", "gpu_memcpy", "gpu_memset"}
    spans = []
    for e in data.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        cat = str(e.get("cat", ""))
        name = str(e.get("name", ""))
        kind = _kind(cat, name)
        if kind is None or (not host_ops and cat.lower() not in gpu_cats):
            continue
        if cat.lower() in gpu_cats or cat.lower() == "gpu_user_annotation":
            stream = f"stream {e.get('args', {}).get('stream', e.get('tid'))}"
        else:
            stream = f"host thread {e.get('tid')}"
        start = float(e["ts"]) / 1000.0
        spans.append(Span(name, kind, rank, stream, start, start + float(e["dur"]) / 1000.0))
    spans.sort(key=lambda s: s.start_ms)
    return spans
