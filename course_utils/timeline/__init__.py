"""What ran when: Nsight-style timelines of a cell's own work, on one GPU or across ranks.

    from course_utils.timeline import Timeline
    tl = Timeline(mode="kernels")        # kernels (profiler/CUPTI), events (CUDA events), host; None: best here
    with tl.capture():
        with tl.span("chain 0", stream=s):
            y = x @ x
    tl.spans(); tl.stats(); tl.plot(); tl.to_chrome_trace("trace.json")

Modules, one idea each (arrows point one way; `spans` is the leaf):
    spans.py    Span, kinds, interval arithmetic (union, overlap, lanes)
    record.py   Timeline: the three modes, export/merge/gather, stored spans;  ranks.py  merging clocks
    kernels.py  kernel-accurate recording through torch.profiler (one profiler run shared by captures)
    events.py   events-mode recording: pooled CUDA events, stream labels, the anchor on the host clock
    stats.py    numbers (busy/idle, HTA's communication/computation overlap, ...)
    plot.py     Nsight-style drawing;  trace.py  Chrome trace out (Perfetto), profiler traces in
    profiler_trace.py  reading a torch.profiler trace: index it once, one function per rule
Importing this package initialises neither CUDA nor matplotlib.
"""

from __future__ import annotations

from typing import Any

from .record import MODES, Timeline
from .spans import COPY_KINDS, KINDS, MARK, RANGE, Span
from .stats import RowStats, TimelineStats, timeline_stats

__all__ = ["COPY_KINDS", "KINDS", "MARK", "MODES", "RANGE", "RowStats", "Span", "Timeline", "TimelineStats",
           "from_profiler", "timeline_stats"]


def from_profiler(trace: Any, rank: int | None = None, host_ops: bool = True) -> list[Span]:
    """Spans from a torch.profiler trace (a chrome-trace JSON path, its dict, or a profile object);
    see `course_utils.timeline.trace.from_profiler`."""
    from .trace import from_profiler as _from_profiler

    return _from_profiler(trace, rank=rank, host_ops=host_ops)
