"""Draw spans Nsight-style: rows by rank then stream, one colour per kind, ms from a common zero.

Only drawing here; the numbers printed under the plot come from `stats` (on the spans' true times).
Text is 11-13 pt on an 8-inch-wide figure: JupyterLab shrinks a wider picture to its output width (about 840 px
in a 1280 px window with the file browser open), so the smallest text still shows at 12 px or more, as large as
the notebook's own code.
"""

from __future__ import annotations

import math
import textwrap
from typing import Any

from .spans import KINDS, MARK, RANGE, Span, lanes, row_label, subtract, union
from .stats import timeline_stats

# One colour per kind of work, the same in every lesson's plot (as Nsight Systems keeps its colours); wait is
# drawn hatched.
COLORS = {
    "compute": "#1f77b4",  # blue
    "h2d": "#d62728",      # red
    "d2h": "#9467bd",      # purple
    "d2d": "#ff7f0e",      # orange
    "comm": "#2ca02c",     # green
    "host": "#8c8c8c",     # grey
    "wait": "#ffffff",
}
RANGE_COLOR = "#fff3b0"  # pale yellow band: a named range, drawn over work, never counted as work
LABELS = {"compute": "compute", "h2d": "memcpy H2D", "d2h": "memcpy D2H", "d2d": "memcpy D2D/P2P",
          "comm": "communication", "host": "host/CPU", "wait": "wait/idle"}
MODE_NOTES = {
    "kernels": "kernels mode: bars are what the profiler saw run (kernels and copies on a GPU, through CUPTI; "
               "CPU ops without one); yellow bands are named ranges, not work",
    "events": "events mode: GPU bars are stream progress between CUDA events (a bar may include time the "
              "stream waited for the GPU), not kernel execution",
}
FIG_W = 8.0  # inches (100 px each in a notebook): with the legend beside it, about 1000 px before shrinking
FONT = 12  # axis labels, ticks; legend and footer one point smaller
BAR_FONT = 11  # names inside bars and marks
ROW_LABEL_MAX = 24
RANGE_H = 0.45  # height of one lane of named ranges, in rows

__all__ = ["COLORS", "LABELS", "display_name", "plot"]


def _short(label: str, n: int = ROW_LABEL_MAX) -> str:
    return label if len(label) <= n else label[: n - 1] + "…"


def display_name(name: str) -> str:
    """A kernel's name without return type, namespaces, template and call arguments (as HTA shortens them):
    "void at::native::vectorized_elementwise_kernel<4, ...>(int, ...)" -> "vectorized_elementwise_kernel"."""
    if not ("<" in name or name.startswith("void ") or ("::" in name and "(" in name)):
        return name  # not a C++ signature: "sleep (20 ms)" or "aten::matmul" stays as it is
    short, depth = [], 0
    for ch in name.removeprefix("void "):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0:
            break
        elif depth == 0:
            short.append(ch)
    out = "".join(short).strip().split("::")[-1].strip()
    return out or name


def _fit(name: str, width_frac: float, axes_in: float = FIG_W - 2.5) -> str:
    """`name` cut to what fits in a bar `width_frac` of the axis wide (an estimate of the font's widths), or ''."""
    chars = int(width_frac * axes_in * 72 / (0.7 * BAR_FONT)) - 1
    if chars < 4:
        return ""
    return name if len(name) <= chars else name[: chars - 1] + "…"


def _inside(wait: Span, work: list[Span]) -> int | None:
    """Index of a work span on the same row that contains `wait` (a wait recorded inside a span)."""
    for i, s in enumerate(work):
        if s.start_ms <= wait.start_ms and wait.end_ms <= s.end_ms and s.kind != "wait":
            return i
    return None


def plot(spans: list[Span], title: str | None = None, min_width_frac: float = 0.004, show_stats: bool = True,
         skew_ms: float | None = None, ax: Any = None, mode: str | None = None, skew_note: str | None = None):
    """Return a matplotlib Figure of `spans`, with the stats under it.

    Bars narrower than `min_width_frac` of the axis are widened to it and marked with a caret, so a
    10 µs copy next to a 50 ms kernel stays visible (the stats use the true times). Named ranges are
    pale bands at the top of their row; marks are dashed vertical lines; a wait recorded inside a span
    is drawn hatched over it. mode ("kernels", "events", "host") adds a line saying what bars mean.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    for s in spans:
        if s.kind not in KINDS and s.kind not in (MARK, RANGE):
            raise ValueError(f"span {s.name!r} has unknown kind {s.kind!r}")
    multi = len({s.rank for s in spans}) > 1
    rows: list[str] = []
    for s in sorted(spans, key=lambda s: s.rank):  # stable: within a rank, rows in order of first appearance
        label = row_label(s, multi)
        if label not in rows:
            rows.append(label)
    timed = [s for s in spans if s.kind != MARK] or spans
    zero = min((s.start_ms for s in timed), default=0.0)
    end = max((s.end_ms for s in timed), default=1.0)
    span_ms = max(end - zero, 1e-6)
    min_w = min_width_frac * span_ms

    # Per row: work (and standalone waits) in lanes; waits inside a work span drawn over it; ranges in a band.
    layout = {}
    for r in rows:
        mine = [s for s in spans if row_label(s, multi) == r]
        work = [s for s in mine if s.kind not in (MARK, RANGE, "wait")]
        waits = [s for s in mine if s.kind == "wait"]
        inner = {id(w): _inside(w, work) for w in waits}
        work += [w for w in waits if inner[id(w)] is None]
        ranges = [s for s in mine if s.kind == RANGE]
        layout[r] = (work, lanes(work), [w for w in waits if inner[id(w)] is not None], ranges, lanes(ranges))
    n_text = 0
    stats = timeline_stats(spans) if show_stats else None
    text = ""
    if stats is not None:
        text = stats.summary()
        if mode in MODE_NOTES:
            text = "\n".join(textwrap.wrap(MODE_NOTES[mode], 80)) + "\n" + text
        if skew_ms is not None:
            text += f"\n  ranks aligned to within about {skew_ms * 1000:.0f} µs" + (f" ({skew_note})" if skew_note
                                                                                    else "")
        n_text = text.count("\n") + 1
    height = sum(max(ls, default=0) + 1 + (RANGE_H * (max(rl) + 1) if rg else 0.0)
                 for _, ls, _, rg, rl in layout.values())
    own_figure = ax is None
    if own_figure:
        n_handles = len({s.kind for s in spans if s.kind != MARK}) + 1  # legend entries, at most
        plot_h = 1.4 + 0.5 * max(height, 1) + 0.22 * math.ceil(n_handles / 3)
        text_h = 0.2 * n_text + 0.15 if n_text else 0.0
        fig = plt.figure(figsize=(FIG_W, plot_h + text_h))
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure

    y0, yticks, narrow = 0.0, [], 0

    def bar(s: Span, y: float, h: float, **kw: Any) -> tuple[float, float]:
        nonlocal narrow
        x, w = s.start_ms - zero, s.duration_ms
        if w < min_w:
            w, narrow = min_w, narrow + 1
            ax.plot(x + w / 2, y - 0.02, marker="v", color="black", markersize=5, linestyle="")
        ax.broken_barh([(x, w)], (y, h), **kw)
        return x, w

    for r in rows:
        work, work_lanes, inner_waits, ranges, range_lanes = layout[r]
        n_work = max(work_lanes, default=0) + 1
        n_rl = max(range_lanes, default=0) + 1
        band = RANGE_H * n_rl if ranges else 0.0
        row_h = n_work + band
        # named ranges: pale bars in a band at the top of the row, one lane per level of overlap
        for s, lane in zip(ranges, range_lanes, strict=True):
            h = RANGE_H
            x, w = bar(s, y0 + lane * h + 0.03, h - 0.04, facecolor=RANGE_COLOR, edgecolor="black", linewidth=0.6)
            label = _fit(s.name, w / span_ms)
            if label:
                ax.text(x + 0.005 * span_ms, y0 + (lane + 0.5) * h, label, ha="left", va="center",
                        fontsize=BAR_FONT, color="black", clip_on=True)
        top = y0 + band
        lane_of = {}
        for s, lane in zip(work, work_lanes, strict=True):
            lane_of[id(s)] = lane
            # facecolor, not color: `color` also sets the hatch colour, and a white wait would lose its hatching
            kw: dict[str, Any] = {"facecolor": COLORS[s.kind], "edgecolor": "black", "linewidth": 0.4}
            if s.kind == "wait":
                kw["hatch"] = "///"
            x, w = bar(s, top + lane + 0.08, 0.84, **kw)
            # name the bar in its longest stretch not covered by a wait drawn over it
            free = subtract([(x, x + w)], union((wt.start_ms - zero, wt.end_ms - zero) for wt in inner_waits
                                                if s.start_ms <= wt.start_ms and wt.end_ms <= s.end_ms))
            fx, fw = max(((a, b - a) for a, b in free), key=lambda p: p[1], default=(x, 0.0))
            label = _fit(display_name(s.name), fw / span_ms)  # only names that fit inside their bar
            if label:
                ax.text(fx + fw / 2, top + lane + 0.5, label, ha="center", va="center", fontsize=BAR_FONT,
                        color="black" if s.kind in ("wait", "host") else "white", clip_on=True)
        for wt in inner_waits:  # waiting inside a span: hatched over the span it interrupts
            host = next(s for s in work if s.start_ms <= wt.start_ms and wt.end_ms <= s.end_ms and s.kind != "wait")
            bar(wt, top + lane_of[id(host)] + 0.08, 0.84, facecolor=COLORS["wait"], edgecolor="black",
                linewidth=0.4, hatch="///")
        last_label = -math.inf
        for m in sorted((s for s in spans if s.kind == MARK and row_label(s, multi) == r), key=lambda s: s.start_ms):
            ax.plot([m.start_ms - zero] * 2, [y0, y0 + row_h], linestyle="--", color="black", linewidth=0.8)
            if m.start_ms - last_label > 0.08 * span_ms:  # name marks that are not crowded by the previous one
                ax.text(m.start_ms - zero, y0, f" {m.name}", fontsize=BAR_FONT, va="bottom")
                last_label = m.start_ms
        yticks.append(top + n_work / 2)
        y0 += row_h
    ax.set_yticks(yticks)
    ax.set_yticklabels([_short(r) for r in rows], fontsize=FONT)
    ax.set_ylim(y0 + 0.15, -0.15)  # first row on top, as in Nsight
    ax.set_xlim(-0.01 * span_ms, span_ms * 1.01)
    ax.set_xlabel("time (ms) from the first recorded event", fontsize=FONT)
    ax.tick_params(axis="x", labelsize=FONT)
    if mode == "events":
        ax.set_ylabel("stream progress (CUDA events)", fontsize=FONT)
    ax.grid(axis="x", alpha=0.3)
    kinds_seen = [k for k in KINDS if any(s.kind == k for s in spans)]
    handles: list[Any] = [Patch(facecolor=COLORS[k], edgecolor="black", hatch="///" if k == "wait" else None,
                                label=LABELS[k]) for k in kinds_seen]
    if any(s.kind == RANGE for s in spans):
        handles.append(Patch(facecolor=RANGE_COLOR, edgecolor="black", label="named range (not work)"))
    if narrow:
        handles.append(Line2D([], [], marker="v", color="black", linestyle="", label="widened to be visible"))
    legend_rows = 0
    if handles:  # above the plot, not beside it: the bars keep the figure's width
        ncol = min(len(handles), 3)
        legend_rows = math.ceil(len(handles) / ncol)
        ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.01), ncol=ncol, fontsize=FONT - 1,
                  frameon=False, borderaxespad=0.2, handlelength=1.6, columnspacing=1.5)
    if title:
        ax.set_title(title, fontsize=FONT + 1, pad=6 + legend_rows * (FONT + 4))
    if text and own_figure:
        # the axes keep the top of the figure; the text goes in the strip reserved under them
        fig.tight_layout(rect=(0.0, text_h / (plot_h + text_h), 1.0, 1.0))
        left = ax.get_position().x0
        fig.text(min(left, 0.02), (text_h - 0.05) / (plot_h + text_h), text, va="top", ha="left",
                 family="monospace", fontsize=FONT - 1)
    elif text:  # drawing into the caller's axes: put the text under them
        ax.annotate(text, xy=(0.0, 0.0), xycoords="axes fraction", xytext=(0, -48), textcoords="offset points",
                    va="top", ha="left", family="monospace", fontsize=FONT - 1)
        fig.tight_layout()
    else:
        fig.tight_layout()
    return fig
