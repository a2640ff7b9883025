"""Numbers from a timeline's spans: busy/idle per row, overlap of communication and copies with compute.

Overlap follows HTA's definition (hta/analyzers/breakdown_analysis: "communication computation
overlap"): the fraction of a rank's communication time during which compute runs on the same rank,
i.e. the part of communication hidden under compute. Times are unions of intervals, so nested or
overlapping spans of one kind count once. Marks and `wait` spans are not work: a wait is idle time.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from .timeline import MARK, Span

COPY_KINDS = ("h2d", "d2h", "d2d")
IDLE_KINDS = ("wait", MARK)

Intervals = list[tuple[float, float]]


def union(intervals: Iterable[tuple[float, float]]) -> Intervals:
    """Sorted, disjoint intervals covering the same time as `intervals`."""
    out: Intervals = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def length(intervals: Intervals) -> float:
    return sum(b - a for a, b in intervals)


def intersect(x: Intervals, y: Intervals) -> Intervals:
    """Intersection of two sorted disjoint interval lists."""
    out, i, j = [], 0, 0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        if a < b:
            out.append((a, b))
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return out


def row_label(span: Span, multi_rank: bool) -> str:
    """A row is one stream of one rank; the rank is named only when there are several."""
    return f"rank {span.rank}: {span.stream}" if multi_rank else span.stream


@dataclass
class RowStats:
    busy_ms: float
    idle_ms: float
    busy_fraction: float


@dataclass
class TimelineStats:
    """What `Timeline.stats()` returns. Overlaps are None where there is nothing to hide (no comm/copy)."""

    makespan_ms: float
    comm_compute_overlap: float | None
    copy_compute_overlap: float | None
    rows: dict[str, RowStats] = field(default_factory=dict)
    comm_ms: float = 0.0  # union of communication time, summed over ranks
    copy_ms: float = 0.0
    compute_ms: float = 0.0
    per_rank: dict[int, dict[str, float | None]] = field(default_factory=dict)

    def summary(self) -> str:
        """A few lines of text, as printed under a plot."""
        def pct(x: float | None) -> str:
            return "n/a" if x is None else f"{x:.0%}"

        lines = [f"makespan {self.makespan_ms:.3f} ms   "
                 f"comm hidden under compute {pct(self.comm_compute_overlap)} (of {self.comm_ms:.3f} ms)   "
                 f"copy hidden under compute {pct(self.copy_compute_overlap)} (of {self.copy_ms:.3f} ms)"]
        for label, r in self.rows.items():
            lines.append(f"  {label:<28} busy {r.busy_ms:9.3f} ms ({r.busy_fraction:4.0%})   idle {r.idle_ms:9.3f} ms")
        return "\n".join(lines)


def _kind_time(spans: list[Span], kinds: tuple[str, ...]) -> Intervals:
    return union((s.start_ms, s.end_ms) for s in spans if s.kind in kinds)


def overlap_fraction(spans: list[Span], kinds: tuple[str, ...], under: tuple[str, ...] = ("compute",)) -> tuple:
    """(hidden ms, total ms) of `kinds` time that `under` time covers, per rank, summed over ranks."""
    hidden = total = 0.0
    for rank in sorted({s.rank for s in spans}):
        mine = [s for s in spans if s.rank == rank]
        x = _kind_time(mine, kinds)
        hidden += length(intersect(x, _kind_time(mine, under)))
        total += length(x)
    return hidden, total


def timeline_stats(spans: list[Span]) -> TimelineStats:
    """Makespan, per-row busy/idle and comm/copy overlap with compute for `spans`."""
    work = [s for s in spans if s.kind not in IDLE_KINDS]
    timed = [s for s in spans if s.kind != MARK]
    if not timed:
        return TimelineStats(0.0, None, None)
    t0, t1 = min(s.start_ms for s in timed), max(s.end_ms for s in timed)
    makespan = t1 - t0
    multi = len({s.rank for s in spans}) > 1
    rows: dict[str, RowStats] = {}
    for s in sorted(timed, key=lambda s: (s.rank, s.start_ms)):
        rows.setdefault(row_label(s, multi), RowStats(0.0, 0.0, 0.0))
    for label in rows:
        busy = length(union((s.start_ms, s.end_ms) for s in work if row_label(s, multi) == label))
        rows[label] = RowStats(busy, makespan - busy, busy / makespan if makespan > 0 else 0.0)
    comm_hidden, comm = overlap_fraction(spans, ("comm",))
    copy_hidden, copy = overlap_fraction(spans, COPY_KINDS)
    per_rank: dict[int, dict[str, float | None]] = {}
    for rank in sorted({s.rank for s in spans}):
        mine = [s for s in spans if s.rank == rank]
        ch, ct = overlap_fraction(mine, ("comm",))
        ph, pt = overlap_fraction(mine, COPY_KINDS)
        per_rank[rank] = {"comm_compute_overlap": ch / ct if ct > 0 else None,
                          "copy_compute_overlap": ph / pt if pt > 0 else None}
    compute = sum(length(_kind_time([s for s in spans if s.rank == r], ("compute",))) for r in per_rank)
    return TimelineStats(
        makespan_ms=makespan,
        comm_compute_overlap=comm_hidden / comm if comm > 0 else None,
        copy_compute_overlap=copy_hidden / copy if copy > 0 else None,
        rows=rows, comm_ms=comm, copy_ms=copy, compute_ms=compute, per_rank=per_rank,
    )
