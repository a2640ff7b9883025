"""Numbers from a timeline's spans: busy/idle per row, overlap of communication and copies with compute.

Definitions (all on the spans' true times: bars widened for drawing never enter here):
- work is every span of a work kind (compute, h2d, d2h, d2d, comm, host); `wait` spans, named
  ranges and marks are not work, and a wait recorded inside a work span on the same row cuts that
  time out of the work (it is waiting). Times are unions of intervals, so nested or overlapping
  spans of one kind count once.
- comm_compute_overlap is Holistic Trace Analysis' "communication computation overlap"
  (hta/analyzers/communication_analysis.py, get_comm_comp_overlap): per rank, the time during which
  communication and compute run together divided by the time communication runs (both merged
  intervals). HTA computes it per rank; ours adds ranks up (hidden ms over comm ms, summed over ranks)
  and keeps each rank's value in `per_rank`. HTA counts memsets as memory kernels; here they are
  compute (they are rarely long enough to matter).
- copy_compute_overlap is the same ratio for copies (h2d, d2h, d2d) in place of communication.
- compute_overlap is ours (HTA has no such number): the fraction of compute time during which compute
  runs on two or more rows (streams) of one rank at once; it tells concurrent kernels from serialised ones.
- a row's busy time is the union of its work; idle = makespan - busy. The makespan runs from the first
  to the last span over all rows, marks and named ranges excluded (a range is drawn over work, or over
  host time where it launched none: it never stretches the numbers).
A ratio is None where it does not apply (no communication, no copies, compute on fewer than two rows).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .spans import (
    COPY_KINDS,
    MARK,
    RANGE,
    Intervals,
    Span,
    coverage,
    intersect,
    length,
    row_label,
    union,
    work_intervals,
)

__all__ = ["RowStats", "TimelineStats", "overlap_fraction", "timeline_stats"]

LABEL_MAX = 34  # characters of a row label in the text summary; longer ones are shortened with "…"


@dataclass
class RowStats:
    busy_ms: float
    idle_ms: float
    busy_fraction: float


@dataclass
class TimelineStats:
    """What `Timeline.stats()` returns. Ratios are None where they do not apply."""

    makespan_ms: float
    comm_compute_overlap: float | None
    copy_compute_overlap: float | None
    rows: dict[str, RowStats] = field(default_factory=dict)
    comm_ms: float = 0.0  # union of communication time, summed over ranks
    copy_ms: float = 0.0
    compute_ms: float = 0.0
    per_rank: dict[int, dict[str, float | None]] = field(default_factory=dict)
    compute_overlap: float | None = None

    def summary(self, events: bool = False) -> str:
        """A few lines of text, as printed under a plot: only the numbers that apply. events: the spans are
        CUDA-event spans (stream progress, not kernels), and the overlap line says so."""
        head = [f"makespan {self.makespan_ms:.3f} ms"]
        if self.compute_overlap is not None:
            what, when = ("2+ streams in progress at once", "when any was") if events else \
                ("compute on 2+ streams at once", "when any computed")
            head.append(f"{what}: {self.compute_overlap:.0%} of the {self.compute_ms:.3f} ms {when}")
        if self.comm_compute_overlap is not None:
            head.append(f"comm hidden under compute: {self.comm_compute_overlap:.0%} of {self.comm_ms:.3f} ms")
        if self.copy_compute_overlap is not None:
            head.append(f"copy hidden under compute: {self.copy_compute_overlap:.0%} of {self.copy_ms:.3f} ms")
        lines = head[:1] + [f"  {h}" for h in head[1:]]
        if self.rows:
            labels = {label: _short(label) for label in self.rows}
            w = max(len("row"), *(len(v) for v in labels.values()))
            lines.append(f"  {'row':<{w}}  {'busy ms':>10}  {'busy':>5}  {'idle ms':>10}")
            for label, r in self.rows.items():
                lines.append(f"  {labels[label]:<{w}}  {r.busy_ms:10.3f}  {r.busy_fraction:5.0%}  {r.idle_ms:10.3f}")
        return "\n".join(lines)


def _short(label: str) -> str:
    return label if len(label) <= LABEL_MAX else label[: LABEL_MAX - 1] + "…"


def overlap_fraction(spans: list[Span], kinds: tuple[str, ...], under: tuple[str, ...] = ("compute",)) -> tuple:
    """(hidden ms, total ms) of `kinds` time that `under` time covers, per rank, summed over ranks."""
    hidden = total = 0.0
    for rank in sorted({s.rank for s in spans}):
        mine = [s for s in spans if s.rank == rank]
        x = work_intervals(mine, kinds)
        hidden += length(intersect(x, work_intervals(mine, under)))
        total += length(x)
    return hidden, total


def _compute_overlap(mine: list[Span]) -> tuple[float, float, int]:
    """(ms of compute on 2+ rows, ms of compute, number of rows with compute) for one rank's spans."""
    by_row: dict[str, list[Span]] = {}
    for s in mine:
        by_row.setdefault(s.stream, []).append(s)
    per_row: list[Intervals] = [work_intervals(ss, ("compute",)) for ss in by_row.values()]
    per_row = [iv for iv in per_row if iv]
    total = length(union(iv for row in per_row for iv in row))
    return length(coverage(per_row, 2)), total, len(per_row)


def timeline_stats(spans: list[Span]) -> TimelineStats:
    """Makespan, per-row busy/idle, and the overlaps defined in this module's docstring, for `spans`."""
    timed = [s for s in spans if s.kind != MARK]
    extent = [s for s in timed if s.kind != RANGE]
    if not extent:
        return TimelineStats(0.0, None, None)
    t0, t1 = min(s.start_ms for s in extent), max(s.end_ms for s in extent)
    makespan = t1 - t0
    multi = len({s.rank for s in spans}) > 1
    by_row: dict[str, list[Span]] = {}
    for s in sorted(timed, key=lambda s: (s.rank, s.start_ms)):
        by_row.setdefault(row_label(s, multi), []).append(s)
    rows: dict[str, RowStats] = {}
    for label, ss in by_row.items():
        if all(s.kind == RANGE for s in ss):
            continue  # a row of named ranges only has no work to report
        busy = length(work_intervals(ss))
        rows[label] = RowStats(busy, makespan - busy, busy / makespan if makespan > 0 else 0.0)

    per_rank: dict[int, dict[str, float | None]] = {}
    comm_hidden = comm = copy_hidden = copy = both = compute = 0.0
    multi_row_compute = False
    for rank in sorted({s.rank for s in timed}):
        mine = [s for s in timed if s.rank == rank]
        ch, ct = overlap_fraction(mine, ("comm",))
        ph, pt = overlap_fraction(mine, COPY_KINDS)
        b, c, n_rows = _compute_overlap(mine)
        per_rank[rank] = {"comm_compute_overlap": ch / ct if ct > 0 else None,
                          "copy_compute_overlap": ph / pt if pt > 0 else None,
                          "compute_overlap": b / c if c > 0 and n_rows >= 2 else None,
                          "compute_ms": c, "comm_ms": ct, "copy_ms": pt}
        comm_hidden, comm, copy_hidden, copy = comm_hidden + ch, comm + ct, copy_hidden + ph, copy + pt
        both, compute = both + b, compute + c
        multi_row_compute |= n_rows >= 2
    return TimelineStats(
        makespan_ms=makespan,
        comm_compute_overlap=comm_hidden / comm if comm > 0 else None,
        copy_compute_overlap=copy_hidden / copy if copy > 0 else None,
        rows=rows, comm_ms=comm, copy_ms=copy, compute_ms=compute, per_rank=per_rank,
        compute_overlap=both / compute if compute > 0 and multi_row_compute else None,
    )
