"""Draw spans Nsight-style: rows by rank then stream, one colour per kind, ms from a common zero.

Only drawing here; the numbers printed under the plot come from `timeline_stats`.
"""

from __future__ import annotations

import math
from typing import Any

from .timeline import KINDS, MARK, Span
from .timeline_stats import row_label, timeline_stats

# The course's colours (COURSE_DESIGN.md, "Timeline look"); wait is drawn hatched.
COLORS = {
    "compute": "#1f77b4",  # blue
    "h2d": "#d62728",      # red
    "d2h": "#9467bd",      # purple
    "d2d": "#ff7f0e",      # orange
    "comm": "#2ca02c",     # green
    "host": "#8c8c8c",     # grey
    "wait": "#ffffff",
}
LABELS = {"compute": "compute", "h2d": "memcpy H2D", "d2h": "memcpy D2H", "d2d": "memcpy D2D/P2P",
          "comm": "communication", "host": "host/CPU", "wait": "wait/idle"}


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


def plot(spans: list[Span], title: str | None = None, min_width_frac: float = 0.004, show_stats: bool = True,
         skew_ms: float | None = None, ax: Any = None):
    """Return a matplotlib Figure of `spans`.

    Bars narrower than `min_width_frac` of the axis are widened to it and marked with a caret, so a
    10 µs copy next to a 50 ms kernel stays visible. Marks are dashed vertical lines on their row.
    """
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    for s in spans:
        if s.kind not in KINDS and s.kind != MARK:
            raise ValueError(f"span {s.name!r} has unknown kind {s.kind!r}")
    multi = len({s.rank for s in spans}) > 1
    rows: list[str] = []
    for s in sorted(spans, key=lambda s: s.rank):  # stable: within a rank, rows in order of first appearance
        label = row_label(s, multi)
        if label not in rows:
            rows.append(label)
    zero = min((s.start_ms for s in spans), default=0.0)
    end = max((s.end_ms for s in spans), default=1.0)
    span_ms = max(end - zero, 1e-6)
    min_w = min_width_frac * span_ms

    # Each row gets as many lanes as its overlapping spans need (e.g. nested host spans).
    row_spans = {r: [s for s in spans if row_label(s, multi) == r and s.kind != MARK] for r in rows}
    row_lanes = {r: lanes(ss) for r, ss in row_spans.items()}
    n_lanes = {r: max(row_lanes[r], default=0) + 1 for r in rows}
    height = sum(n_lanes.values())

    stats = timeline_stats(spans) if show_stats else None
    n_text = (len(stats.rows) + 2) if stats else 0
    if ax is None:
        fig_h = 1.2 + 0.45 * height + 0.18 * n_text
        fig, ax = plt.subplots(figsize=(11, fig_h))
    else:
        fig = ax.figure

    y0, yticks, narrow = 0.0, [], 0
    for r in rows:
        lane_h = 1.0 / n_lanes[r]
        for s, lane in zip(row_spans[r], row_lanes[r], strict=True):
            x, w = s.start_ms - zero, s.duration_ms
            if w < min_w:
                w, narrow = min_w, narrow + 1
                ax.plot(x + w / 2, y0 + (lane + 1) * lane_h - 0.05, marker="v", color="black", markersize=4)
            kw: dict[str, Any] = {"color": COLORS[s.kind], "edgecolor": "black", "linewidth": 0.4}
            if s.kind == "wait":
                kw["hatch"] = "///"
            ax.broken_barh([(x, w)], (y0 + lane * lane_h + 0.08 * lane_h, 0.84 * lane_h), **kw)
            if w > 0.06 * span_ms:  # name the bar when it is wide enough to hold a label
                ax.text(x + w / 2, y0 + (lane + 0.5) * lane_h, s.name, ha="center", va="center", fontsize=7,
                        color="black" if s.kind in ("wait", "host") else "white", clip_on=True)
        last_label = -math.inf
        for m in sorted((s for s in spans if s.kind == MARK and row_label(s, multi) == r), key=lambda s: s.start_ms):
            ax.plot([m.start_ms - zero] * 2, [y0, y0 + 1], linestyle="--", color="black", linewidth=0.8)
            if m.start_ms - last_label > 0.05 * span_ms:  # name marks that are not crowded by the previous one
                ax.text(m.start_ms - zero, y0 + 1.0, f" {m.name}", fontsize=7, va="bottom", rotation=0)
                last_label = m.start_ms
        yticks.append(y0 + 0.5)
        y0 += 1.0
    ax.set_yticks(yticks)
    ax.set_yticklabels(rows)
    ax.set_ylim(y0 + 0.15, -0.15)  # first row on top, as in Nsight
    ax.set_xlim(-0.01 * span_ms, span_ms * 1.01)
    ax.set_xlabel("time (ms) from the first recorded event")
    ax.grid(axis="x", alpha=0.3)
    kinds_seen = [k for k in KINDS if any(s.kind == k for s in spans)]
    handles = [Patch(facecolor=COLORS[k], edgecolor="black", hatch="///" if k == "wait" else None, label=LABELS[k])
               for k in kinds_seen]
    if narrow:
        handles.append(plt.Line2D([], [], marker="v", color="black", linestyle="", label="widened to be visible"))
    if handles:
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    if title:
        ax.set_title(title)
    if stats is not None:
        text = stats.summary()
        if skew_ms is not None:
            text += f"\n  ranks aligned to within about {skew_ms * 1000:.0f} µs"
        # offset in points below the axis label, so the gap does not depend on the number of rows
        ax.annotate(text, xy=(0.0, 0.0), xycoords="axes fraction", xytext=(0, -42), textcoords="offset points",
                    va="top", ha="left", family="monospace", fontsize=8)
    fig.tight_layout()
    return fig
