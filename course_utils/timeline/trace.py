"""Chrome Trace Event JSON in and out: export spans for Perfetto, read torch.profiler traces as spans.

Format: https://docs.google.com/document/d/1CvAClvFfyA5R-PhYUmn5OOQtYMH4h6I0nSsKchNAySU
("X" complete events with ts/dur in µs, "M" metadata events naming processes and threads, "i" instants).
What a torch.profiler trace becomes is `profiler_trace`'s business (its docstring lists the rules).
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from .profiler_trace import spans_from_trace
from .spans import MARK, RANGE, Span, lanes

__all__ = ["from_profiler", "load_trace", "to_chrome_trace"]


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
    distributedInfo when not given. The rules are in `profiler_trace`'s docstring.
    """
    data = load_trace(trace)
    if rank is None:
        rank = int((data.get("distributedInfo") or {}).get("rank", 0))
    return spans_from_trace(data, rank=rank, host_ops=host_ops)
