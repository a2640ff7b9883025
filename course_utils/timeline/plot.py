"""Draw spans Nsight-style: rows by rank then stream, one colour per kind, ms from a common zero.

Only drawing here; the numbers printed under the plot come from `stats` (on the spans' true times). `plot`
first measures (`layout`: rows, lanes and the time axis; `footer`: the text under the plot), then draws.
Text is 11-13 pt on an 8-inch-wide figure: JupyterLab shrinks a wider picture to its output width (about 840 px
in a 1280 px window with the file browser open), so the smallest text still shows at 12 px or more, as large as
the notebook's own code.
"""

from __future__ import annotations

import functools
import math
import re
import textwrap
from dataclasses import dataclass
from typing import Any

from .spans import KINDS, MARK, RANGE, SLEEP_KERNEL, Span, is_sleep_kernel, lanes, row_label, subtract, union
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
EVENT_LABEL = "stream progress (between events)"
MODE_NOTES = {
    "kernels": "kernels mode: bars are what the profiler saw run (kernels and copies on a GPU, through CUPTI; "
               "CPU ops without one)",
    "events": "events mode: GPU bars are stream progress between CUDA events (a bar may include time the "
              "stream waited for the GPU), not kernel execution",
}
FIG_W = 8.0  # inches (100 px each in a notebook): with the legend beside it, about 1000 px before shrinking
FONT = 12  # axis labels, ticks; legend and footer one point smaller
BAR_FONT = 11  # names inside bars and marks
ROW_LABEL_MAX = 36  # "blocking stream (cudaStreamCreate)", "same stream: default stream" whole
RANGE_H = 0.45  # height of one lane of named ranges, in rows

__all__ = ["COLORS", "LABELS", "SLEEP_KERNEL", "Layout", "RowLayout", "bar_labels", "display_name", "footer",
           "is_sleep_kernel", "layout", "plot"]


def _short(label: str, n: int = ROW_LABEL_MAX) -> str:
    return label if len(label) <= n else label[: n - 1] + "…"


# Functor names that say how an elementwise kernel is built, not which op it runs ("AUnaryFunctor<..., MulFunctor>")
_GENERIC_FUNCTORS = {"AUnary", "BUnary", "Binary", "Unary", "CUDA", "Compare", "Reduce"}
_FUNCTOR = re.compile(r"(\w+?)Functor(?:OnSelf|OnOther)?(?:_(\w+))?\b")


def _signature_name(name: str) -> str:
    """The function's own name in a C++ signature (no return type, namespaces, template or arguments)."""
    name = name.removeprefix("void ").replace("(anonymous namespace)", "anon")
    short, depth = [], 0
    for ch in name:
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(0, depth - 1)
        elif ch == "(" and depth == 0:
            break
        elif depth == 0:
            short.append(ch)
    return "".join(short).strip().split("::")[-1].strip()


def _op_of(name: str) -> str | None:
    """The op an ATen elementwise kernel runs, from its functor: "...CUDAFunctorOnSelf_add<float>..." -> "add"."""
    for m in _FUNCTOR.finditer(name):
        if m.group(2):
            return m.group(2)
        if m.group(1) not in _GENERIC_FUNCTORS:
            return m.group(1).split("::")[-1].lower()
    return None


def display_name(name: str) -> str:
    """A kernel's name without return type, namespaces, template and call arguments (as HTA shortens them):
    "void at::native::vectorized_elementwise_kernel<4, ...>(int, ...)" -> "vectorized_elementwise_kernel";
    torch.cuda._sleep's "at::cuda::(anonymous namespace)::spin_kernel(long)" -> "sleep"."""
    if is_sleep_kernel(name):
        return "sleep"
    if not ("<" in name or name.startswith("void ") or ("::" in name and "(" in name)):
        return name  # not a C++ signature: "sleep (20 ms)" or "aten::matmul" stays as it is
    return _signature_name(name) or name


def bar_labels(s: Span) -> list[str]:
    """Names for a bar, most telling first; the plot draws the first that fits (else the last, cut).

    A sleep kernel is named with its measured length ("sleep 5.0 ms"): a sleep lasts a number of SM clock
    cycles, so at a lower clock it runs longer than asked; the label shows what it really took. An ATen
    elementwise kernel is named by its op ("add (vectorized_elementwise_kernel)", then "add"); a copy or memset
    by its direction ("Memcpy HtoD (Pinned -> Device)", "Memcpy HtoD", "HtoD").
    """
    name = s.name
    if is_sleep_kernel(name):
        return [f"sleep {s.duration_ms:.1f} ms", "sleep"]
    short = display_name(name)
    out = [short]
    if short != name and "elementwise" in short:
        op = _op_of(name)
        if op:
            out = [f"{op} ({short})", op]
    elif short == name and name.startswith(("Memcpy ", "Memset ")) and "(" in name:
        short = name.split("(")[0].strip()
        out += [short, short.split()[-1]] if short.startswith("Memcpy ") else [short]  # ..., "Memcpy HtoD", "HtoD"
    return out


@functools.lru_cache(maxsize=4096)  # a plot of hundreds of bars measures the same few strings again and again
def _text_in(text: str, size: float = BAR_FONT) -> float:
    """Width of `text` in inches at `size` pt in matplotlib's default font, measured without a figure."""
    from matplotlib.font_manager import FontProperties
    from matplotlib.textpath import text_to_path

    return text_to_path.get_text_width_height_descent(text, FontProperties(size=size), ismath=False)[0] / 72


def _fit(name: str, width_in: float) -> str:
    """`name`, cut with an ellipsis to what fits in a bar `width_in` inches wide with a little margin, or ''."""
    room = width_in - 0.12
    if not name or room < _text_in("abc…"):
        return ""
    if _text_in(name) <= room:
        return name
    lo, hi = 1, len(name) - 1  # the longest prefix that fits with its ellipsis
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if _text_in(name[:mid] + "…") <= room else (lo, mid - 1)
    return name[:lo] + "…" if lo >= 3 else ""


def _fit_any(names: list[str], width_in: float) -> str:
    """The first of `names` that fits whole in the bar, else the last one cut to fit (or '')."""
    for n in names:
        if _fit(n, width_in) == n:
            return n
    return _fit(names[-1], width_in)


def _inside(wait: Span, work: list[Span]) -> int | None:
    """Index of a work span on the same row that contains `wait` (a wait recorded inside a span)."""
    for i, s in enumerate(work):
        if s.start_ms <= wait.start_ms and wait.end_ms <= s.end_ms and s.kind != "wait":
            return i
    return None


# ------------------------------------------------------------------ measuring: where everything goes
@dataclass
class RowLayout:
    """One row's spans, sorted into what is drawn where."""

    work: list[Span]  # work, and waits not recorded inside a work span, in lanes
    work_lanes: list[int]
    inner_waits: list[Span]  # waits recorded inside a work span: hatched over it
    ranges: list[Span]  # named ranges: a band at the top of the row, one lane per level of overlap
    range_lanes: list[int]
    marks: list[Span]  # by time

    @property
    def n_work(self) -> int:
        return max(self.work_lanes, default=0) + 1

    @property
    def band(self) -> float:
        """Height of the ranges' band, in rows."""
        return RANGE_H * (max(self.range_lanes, default=0) + 1) if self.ranges else 0.0

    @property
    def height(self) -> float:
        return self.n_work + self.band


@dataclass
class Layout:
    """Rows in drawing order and the time axis: ms from the first timed span."""

    rows: dict[str, RowLayout]
    zero: float
    span_ms: float


def layout(spans: list[Span]) -> Layout:
    """Rows by rank, then in order of first appearance; each row's work in lanes (see `RowLayout`)."""
    for s in spans:
        if s.kind not in KINDS and s.kind not in (MARK, RANGE):
            raise ValueError(f"span {s.name!r} has unknown kind {s.kind!r}")
    multi = len({s.rank for s in spans}) > 1
    labels: list[str] = []
    for s in sorted(spans, key=lambda s: s.rank):  # stable: within a rank, rows in order of first appearance
        label = row_label(s, multi)
        if label not in labels:
            labels.append(label)
    timed = [s for s in spans if s.kind != MARK] or spans
    zero = min((s.start_ms for s in timed), default=0.0)
    end = max((s.end_ms for s in spans if s.start_ms >= zero), default=1.0)  # marks after the work stay in view
    rows = {}
    for r in labels:
        mine = [s for s in spans if row_label(s, multi) == r]
        work = [s for s in mine if s.kind not in (MARK, RANGE, "wait")]
        waits = [s for s in mine if s.kind == "wait"]
        inner = {id(w): _inside(w, work) for w in waits}
        work += [w for w in waits if inner[id(w)] is None]
        ranges = [s for s in mine if s.kind == RANGE]
        marks = sorted((s for s in mine if s.kind == MARK), key=lambda s: s.start_ms)
        rows[r] = RowLayout(work, lanes(work), [w for w in waits if inner[id(w)] is not None], ranges,
                            lanes(ranges), marks)
    return Layout(rows, zero, max(end - zero, 1e-6))


def footer(spans: list[Span], mode: str | None = None, skew_ms: float | None = None,
           skew_note: str | None = None) -> str:
    """The text under the plot: what bars mean in this mode, the stats, how well ranks are aligned."""
    text = timeline_stats(spans).summary(events=mode == "events")
    if mode in MODE_NOTES:
        note = MODE_NOTES[mode]
        if any(s.kind == RANGE for s in spans):  # only where the plot has them
            note += "; yellow bands are named ranges, not work"
        text = "\n".join(textwrap.wrap(note, 80)) + "\n" + text
    if skew_ms is not None:
        text += f"\n  ranks aligned to within about {skew_ms * 1000:.0f} µs" + (f" ({skew_note})" if skew_note else "")
    return text


# ------------------------------------------------------------------ drawing
class _Bars:
    """Draws bars on one axes; a bar narrower than `min_w` ms is widened to it, drawn at a third of the row's
    height (so that a row of many tiny kernels does not look busy) and marked with a caret."""

    def __init__(self, ax: Any, zero: float, min_w: float, in_per_ms: float):
        self.ax, self.zero, self.min_w, self.narrow = ax, zero, min_w, 0
        self.in_per_ms = in_per_ms  # the axes' width over its time span: how wide a bar will be on paper
        self._last_caret: dict[float, float] = {}  # the x of the last caret drawn at each height

    def bar(self, s: Span, y: float, h: float, **kw: Any) -> tuple[float, float]:
        x, w = s.start_ms - self.zero, s.duration_ms
        if w < self.min_w:
            w, self.narrow = self.min_w, self.narrow + 1
            y, h = y + h / 3, h / 3
            # One caret per few bar widths: hundreds of tiny kernels in a row would otherwise merge into a wall
            if x - self._last_caret.get(y, -math.inf) >= 3 * self.min_w:
                self.ax.plot(x + w / 2, y - 0.02, marker="v", color="black", markersize=5, linestyle="")
                self._last_caret[y] = x
        self.ax.broken_barh([(x, w)], (y, h), **kw)
        return x, w


def _draw_ranges(b: _Bars, row: RowLayout, y0: float, span_ms: float) -> None:
    """Named ranges: pale bars in a band at the top of the row, named where the name fits."""
    for s, lane in zip(row.ranges, row.range_lanes, strict=True):
        h = RANGE_H
        x, w = b.bar(s, y0 + lane * h + 0.03, h - 0.04, facecolor=RANGE_COLOR, edgecolor="black", linewidth=0.6)
        label = _fit(s.name, w * b.in_per_ms)
        if label:
            b.ax.text(x + 0.005 * span_ms, y0 + (lane + 0.5) * h, label, ha="left", va="center",
                      fontsize=BAR_FONT, color="black", clip_on=True)


def _draw_work(b: _Bars, row: RowLayout, top: float, span_ms: float) -> None:
    """Work bars in their lanes, each named in its longest stretch not covered by a wait drawn over it;
    then the waits recorded inside a span, hatched over the span they interrupt."""
    zero, lane_of = b.zero, {}
    for s, lane in zip(row.work, row.work_lanes, strict=True):
        lane_of[id(s)] = lane
        # facecolor, not color: `color` also sets the hatch colour, and a white wait would lose its hatching
        kw: dict[str, Any] = {"facecolor": COLORS[s.kind], "edgecolor": "black", "linewidth": 0.4}
        if s.kind == "wait":
            kw["hatch"] = "///"
        x, w = b.bar(s, top + lane + 0.08, 0.84, **kw)
        free = subtract([(x, x + w)], union((wt.start_ms - zero, wt.end_ms - zero) for wt in row.inner_waits
                                            if s.start_ms <= wt.start_ms and wt.end_ms <= s.end_ms))
        fx, fw = max(((a, c - a) for a, c in free), key=lambda p: p[1], default=(x, 0.0))
        label = _fit_any(bar_labels(s), fw * b.in_per_ms)  # only names that fit inside their bar
        if label:
            b.ax.text(fx + fw / 2, top + lane + 0.5, label, ha="center", va="center", fontsize=BAR_FONT,
                      color="black" if s.kind in ("wait", "host") else "white", clip_on=True,
                      # a name over a wait's hatching is unreadable without a plain patch behind it
                      bbox={"facecolor": "white", "edgecolor": "none", "pad": 1} if s.kind == "wait" else None)
    for wt in row.inner_waits:
        host = next(s for s in row.work if s.start_ms <= wt.start_ms and wt.end_ms <= s.end_ms and s.kind != "wait")
        b.bar(wt, top + lane_of[id(host)] + 0.08, 0.84, facecolor=COLORS["wait"], edgecolor="black",
              linewidth=0.4, hatch="///")


def _draw_marks(ax: Any, row: RowLayout, y0: float, zero: float, span_ms: float) -> None:
    """Marks: dashed vertical lines across the row, named unless crowded by the previous one."""
    last_label = -math.inf
    for m in row.marks:
        ax.plot([m.start_ms - zero] * 2, [y0, y0 + row.height], linestyle="--", color="black", linewidth=0.8)
        if m.start_ms - last_label > 0.08 * span_ms:
            x = m.start_ms - zero
            right = x > 0.85 * span_ms  # near the right edge: the name goes left of its line, inside the axes
            ax.text(x, y0, f"{m.name} " if right else f" {m.name}", fontsize=BAR_FONT, va="bottom",
                    ha="right" if right else "left")
            last_label = m.start_ms


def _draw_rows(b: _Bars, lay: Layout) -> tuple[list[float], float]:
    """Every row top to bottom; returns the y of each row's label and the bottom of the last row."""
    y0, yticks = 0.0, []
    for row in lay.rows.values():
        _draw_ranges(b, row, y0, lay.span_ms)
        top = y0 + row.band
        _draw_work(b, row, top, lay.span_ms)
        _draw_marks(b.ax, row, y0, lay.zero, lay.span_ms)
        yticks.append(top + row.n_work / 2)
        y0 += row.height
    return yticks, y0


def _legend(ax: Any, spans: list[Span], narrow: bool, mode: str | None = None) -> float:
    """One entry per kind drawn, above the axes and outside them (it never covers a bar); returns its height
    in points, so the title can sit above it. In events mode a "compute" bar is a stream's progress, and says so."""
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch

    kinds_seen = [k for k in KINDS if any(s.kind == k for s in spans)]
    handles: list[Any] = [Patch(facecolor=COLORS[k], edgecolor="black", hatch="///" if k == "wait" else None,
                                label=EVENT_LABEL if (mode == "events" and k == "compute") else LABELS[k])
                          for k in kinds_seen]
    if any(s.kind == RANGE for s in spans):
        handles.append(Patch(facecolor=RANGE_COLOR, edgecolor="black", label="named range (not work)"))
    if narrow:
        handles.append(Line2D([], [], marker="v", color="black", linestyle="", label="widened to be visible"))
    if not handles:
        return 0.0
    ncol = _legend_columns([h.get_label() for h in handles], ax.figure.get_figwidth())
    legend = ax.legend(handles=handles, loc="lower left", bbox_to_anchor=(0.0, 1.0), ncol=ncol,
                       fontsize=FONT - 1, frameon=False, borderaxespad=0.3, handlelength=1.6, columnspacing=1.5)
    rows = math.ceil(len(handles) / ncol)
    try:  # its real height (fonts differ between machines); a legend's size in points does not change with layout
        fig = ax.figure
        return legend.get_window_extent(fig.canvas.get_renderer()).height * 72 / fig.dpi + 0.3 * (FONT - 1)
    except (AttributeError, TypeError):  # a canvas without a renderer: the height of `rows` rows of text
        return rows * (FONT + 6) + 6


def _legend_columns(labels: list[str], fig_w: float) -> int:
    """As many columns as fit in one row of the figure's width (an estimate of the font's widths), rows balanced."""
    per_entry_in = [(len(label) * 0.6 * (FONT - 1) + (1.6 + 0.8 + 1.5) * (FONT - 1)) / 72 for label in labels]
    for rows in range(1, len(labels) + 1):
        ncol = math.ceil(len(labels) / rows)
        # matplotlib fills column by column, the first len % ncol columns one entry longer (Legend._init_legend_box)
        small, large = divmod(len(labels), ncol)
        sizes = [small + 1] * large + [small] * (ncol - large)
        starts = [sum(sizes[:c]) for c in range(ncol)]
        widths = [max(per_entry_in[a:a + n]) for a, n in zip(starts, sizes, strict=True) if n]
        if sum(widths) <= fig_w - 0.3:
            return ncol
    return 1


def _axes_width_in(ax: Any, lay: Layout, own_figure: bool) -> float:
    """The axes' width once laid out: our figure less the row labels and margins; else the caller's axes now."""
    if not own_figure:
        return ax.get_position().width * ax.figure.get_figwidth()
    labels = max((_text_in(_short(r), FONT) for r in lay.rows), default=0.0)
    return FIG_W - labels - 0.45  # tick marks, padding, the right margin


def _axes(ax: Any, lay: Layout, yticks: list[float], bottom: float, mode: str | None) -> None:
    """Row labels, the first row on top (as in Nsight), time in ms on x."""
    ax.set_yticks(yticks)
    ax.set_yticklabels([_short(r) for r in lay.rows], fontsize=FONT)
    ax.set_ylim(bottom + 0.15, -0.15)
    ax.set_xlim(-0.01 * lay.span_ms, lay.span_ms * 1.01)
    ax.set_xlabel("time (ms) from the first recorded event", fontsize=FONT)
    ax.tick_params(axis="x", labelsize=FONT)
    # No y-label: a vertical one is taller than a plot of one or two rows and ran into the text under it; the
    # footer's first line says what the bars mean in this mode ("events mode: ... stream progress ...").
    ax.grid(axis="x", alpha=0.3)


def _place_text(fig: Any, ax: Any, text: str, own_figure: bool, plot_h: float, text_h: float) -> None:
    """The footer under the axes: in a strip reserved for it in our own figure, else under the caller's axes."""
    if text and own_figure:
        fig.tight_layout(rect=(0.0, text_h / (plot_h + text_h), 1.0, 1.0))
        left = ax.get_position().x0
        fig.text(min(left, 0.02), (text_h - 0.05) / (plot_h + text_h), text, va="top", ha="left",
                 family="monospace", fontsize=FONT - 1)
    elif text:
        ax.annotate(text, xy=(0.0, 0.0), xycoords="axes fraction", xytext=(0, -48), textcoords="offset points",
                    va="top", ha="left", family="monospace", fontsize=FONT - 1)
        fig.tight_layout()
    else:
        fig.tight_layout()


def plot(spans: list[Span], title: str | None = None, min_width_frac: float = 0.004, show_stats: bool = True,
         skew_ms: float | None = None, ax: Any = None, mode: str | None = None, skew_note: str | None = None):
    """Return a matplotlib Figure of `spans`, with the stats under it.

    Bars narrower than `min_width_frac` of the axis are widened to it and marked with a caret, so a
    10 µs copy next to a 50 ms kernel stays visible (the stats use the true times). Named ranges are
    pale bands at the top of their row; marks are dashed vertical lines; a wait recorded inside a span
    is drawn hatched over it. mode ("kernels", "events", "host") adds a line saying what bars mean.
    """
    import matplotlib.pyplot as plt

    lay = layout(spans)
    text = footer(spans, mode, skew_ms, skew_note) if show_stats else ""
    n_text = text.count("\n") + 1 if show_stats else 0
    own_figure = ax is None
    plot_h = text_h = 0.0
    if own_figure:  # tall enough for the rows, the legend above them and the footer under them
        n_handles = len({s.kind for s in spans if s.kind != MARK}) + 1  # legend entries, at most
        height = sum(r.height for r in lay.rows.values())
        plot_h = 1.4 + 0.5 * max(height, 1) + 0.22 * math.ceil(n_handles / 3)
        text_h = 0.2 * n_text + 0.15 if n_text else 0.0
        fig = plt.figure(figsize=(FIG_W, plot_h + text_h))
        ax = fig.add_subplot(1, 1, 1)
    else:
        fig = ax.figure
    in_per_ms = _axes_width_in(ax, lay, own_figure) / (lay.span_ms * 1.02)
    bars = _Bars(ax, lay.zero, min_width_frac * lay.span_ms, in_per_ms)
    yticks, bottom = _draw_rows(bars, lay)
    _axes(ax, lay, yticks, bottom, mode)
    legend_pt = _legend(ax, spans, bool(bars.narrow), mode)
    if title:
        ax.set_title(title, fontsize=FONT + 1, pad=4 + legend_pt)
    _place_text(fig, ax, text, own_figure, plot_h, text_h)
    return fig
