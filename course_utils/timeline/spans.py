"""Span, the record every part of the timeline shares, and arithmetic on time intervals.

A span is one interval on one row (a rank's stream, or a host row), in ms on the timeline's clock.
Its kind says what it was: work (compute, h2d, d2h, d2d, comm, host), waiting (wait), a named range
drawn over work but never counted as work (range), or an instant (mark). This module is the leaf of
the package: everything else imports it, it imports nothing of ours.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any

KINDS = ("compute", "h2d", "d2h", "d2d", "comm", "host", "wait")
RANGE = "range"  # a named range (record_function / tl.span in kernels mode): drawn over work, never work
MARK = "mark"  # an instant made by Timeline.mark
COPY_KINDS = ("h2d", "d2h", "d2d")
NOT_WORK = ("wait", RANGE, MARK)  # kinds that never count as busy time
SLEEP_KERNEL = "spin_kernel"  # the kernel behind torch.cuda._sleep (aten/src/ATen/cuda/Sleep.cu)


def is_sleep_kernel(name: str) -> bool:
    """True for the kernel of torch.cuda._sleep / course_utils.measure.gpu_sleep."""
    return SLEEP_KERNEL in name


def side_stream_label(taken: Iterable[str]) -> str:
    """The row of a stream nobody named: "side stream <n>", the smallest n that no row in `taken` has (so
    unnamed streams are numbered in order of first use, around names given by hand)."""
    used, n = set(taken), 1
    while f"side stream {n}" in used:
        n += 1
    return f"side stream {n}"

__all__ = ["COPY_KINDS", "KINDS", "MARK", "NOT_WORK", "RANGE", "Intervals", "Span", "check_kind", "coverage",
           "intersect", "lanes", "length", "row_label", "subtract", "union", "work_intervals"]

Intervals = list[tuple[float, float]]


@dataclass
class Span:
    """One interval on one row (rank, stream), in ms on the timeline's host clock."""

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
        check_kind(d["kind"], allow_extra=True)
        s = cls(str(d["name"]), d["kind"], int(d["rank"]), str(d["stream"]), float(d["start_ms"]),
                float(d["end_ms"]))
        if s.end_ms < s.start_ms:
            raise ValueError(f"span {s.name!r} ends ({s.end_ms} ms) before it starts ({s.start_ms} ms)")
        return s


def check_kind(kind: str, allow_extra: bool = False) -> None:
    """Raise ValueError unless `kind` is a work/wait kind (or, with allow_extra, a range or mark)."""
    if kind in KINDS or (allow_extra and kind in (RANGE, MARK)):
        return
    extra = f" (or {RANGE}, {MARK})" if allow_extra else ""
    raise ValueError(f"kind {kind!r} is not one of {', '.join(KINDS)}{extra}")


def row_label(span: Span, multi_rank: bool) -> str:
    """A row is one stream of one rank; the rank is named only when there are several."""
    return f"rank {span.rank}: {span.stream}" if multi_rank else span.stream


# ------------------------------------------------------------------ interval arithmetic
def union(intervals: Iterable[tuple[float, float]]) -> Intervals:
    """Sorted, disjoint intervals covering the same time as `intervals` (touching ones merge)."""
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


def subtract(x: Intervals, y: Intervals) -> Intervals:
    """The parts of `x` not covered by `y` (both sorted and disjoint)."""
    out: Intervals = []
    j = 0
    for a, b in x:
        while j < len(y) and y[j][1] <= a:
            j += 1
        k, cur = j, a
        while k < len(y) and y[k][0] < b:
            if y[k][0] > cur:
                out.append((cur, y[k][0]))
            cur = max(cur, y[k][1])
            k += 1
        if cur < b:
            out.append((cur, b))
    return out


def coverage(groups: Iterable[Intervals], at_least: int = 2) -> Intervals:
    """Time covered by at least `at_least` of the groups (each group a sorted disjoint interval list)."""
    edges: list[tuple[float, int]] = []
    for g in groups:
        for a, b in g:
            edges += [(a, 1), (b, -1)]
    out: Intervals = []
    depth, start = 0, 0.0
    for t, d in sorted(edges, key=lambda e: (e[0], e[1])):  # ends before starts at one instant: touching != overlap
        if d > 0 and depth + 1 == at_least:
            start = t
        if d < 0 and depth == at_least and t > start:
            out.append((start, t))
        depth += d
    return union(out)


def work_intervals(spans: Iterable[Span], kinds: tuple[str, ...] | None = None) -> Intervals:
    """Union of the spans' work time (kinds: only those; default every work kind), minus the waits on
    each span's own row: a `wait` span recorded inside a work span on the same row is waiting, not work.

    Spans of several rows and ranks may be passed together; waits only cut work on their own row.
    """
    spans = list(spans)
    rows: dict[tuple[int, str], tuple[list, list]] = {}
    for s in spans:
        work, waits = rows.setdefault((s.rank, s.stream), ([], []))
        if s.kind == "wait":
            waits.append((s.start_ms, s.end_ms))
        elif s.kind not in NOT_WORK and (kinds is None or s.kind in kinds):
            work.append((s.start_ms, s.end_ms))
    pieces: Intervals = []
    for work, waits in rows.values():
        pieces += subtract(union(work), union(waits))
    return union(pieces)


def lanes(spans: list[Span], nest: bool = False) -> list[int]:
    """A lane index per span so that spans in one lane of a row do not overlap.

    nest=True lets a span share a lane with one that fully contains it (nesting, as Chrome traces allow).
    """
    order = sorted(range(len(spans)), key=lambda i: (spans[i].start_ms, -spans[i].end_ms))
    stacks: list[list[float]] = []  # per lane: ends of the spans still open at the current start
    out = [0] * len(spans)
    for i in order:
        s = spans[i]
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= s.start_ms:
                stack.pop()
            if not stack or (nest and s.end_ms <= stack[-1]):
                stack.append(s.end_ms)
                out[i] = lane
                break
        else:
            stacks.append([s.end_ms])
            out[i] = len(stacks) - 1
    return out
