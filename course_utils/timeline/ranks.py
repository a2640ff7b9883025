"""Several ranks on one time axis: the arithmetic of `Timeline.merge`, on `Timeline.export()` records.

One host: every process reads the same CLOCK_MONOTONIC (`time.perf_counter_ns`), and every timeline
keeps its spans in ms from its own origin on that clock, so merging only shifts each rank by the
difference of origins. What remains uncertain is how well each rank placed GPU times on its host clock
(the events-mode anchor, or the kernels-mode profiler anchors): the largest of those is the skew.
Several hosts: their clocks are unrelated, so each rank is shifted to make the exits of a first barrier
coincide (`Timeline.align`); the spread of a second barrier's exits after that shift estimates what is
left (a barrier's exits are not simultaneous either), and is reported as the skew.
"""

from __future__ import annotations

from typing import Any

from .spans import Span

__all__ = ["merge_records"]


def merge_records(recs: list[dict[str, Any]], clock: str = "auto") -> tuple[list[Span], float, str, str | None]:
    """(spans on one axis, skew in ms, how they were aligned, common mode or None) for export() records."""
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
        note = "one host clock"
    elif clock == "barrier":
        if any(not r.get("barrier_ms") for r in recs):
            raise ValueError("clock='barrier' needs every rank to have called tl.align() (gather() does)")
        shifts = [recs[0]["barrier_ms"][0] - r["barrier_ms"][0] for r in recs]
        second = [r["barrier_ms"][1] + s for r, s in zip(recs, shifts, strict=True)]
        skew = (max(second) - min(second)) + max(r.get("anchor_uncertainty_ms", 0.0) for r in recs)
        note = "hosts aligned on a barrier: estimated"
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
    modes = {r.get("mode") for r in recs}
    return spans, skew, note, modes.pop() if len(modes) == 1 else None
