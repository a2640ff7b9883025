"""Draw what each rank held before and after a collective, from the tensors the ranks returned.

    out = pool.run(demo)                          # {rank: (before, after)}
    plot_ranks(out, "all_gather_into_tensor(out, x)")

before and after are each a tensor, a list of tensors (drawn as separate pieces: a scatter or gather list), or
None (the rank has none). Every tensor is a row of cells with its values written in. A cell takes the colour of
the rank whose *before* held that value, so give each rank's input distinct values (say 10 * (rank + 1) + index);
a value that no input held, such as a sum, is drawn grey: the mark of a reduction.
"""

from __future__ import annotations

import math
from typing import Any

GREY = "#c8c8c8"


def _pieces(x: Any) -> list[list[float]]:
    """A tensor, a list of tensors, or None, as lists of plain numbers (tensors flattened)."""
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return [p for item in x for p in _pieces(item)]
    return [[float(v) for v in x.detach().reshape(-1).cpu().tolist()]]


def _origins(results: dict[int, tuple[Any, Any]]) -> dict[float, int]:
    """value -> the one rank whose `before` held it (values held by several ranks colour nothing)."""
    seen: dict[float, set[int]] = {}
    for rank, (before, _) in results.items():
        for piece in _pieces(before):
            for v in piece:
                seen.setdefault(v, set()).add(rank)
    return {v: next(iter(ranks)) for v, ranks in seen.items() if len(ranks) == 1}


def _label(v: float) -> str:
    if math.isnan(v):
        return ""
    return str(int(v)) if v == int(v) and abs(v) < 1e6 else f"{v:.3g}"


def _width(pieces: list[list[float]], max_cells: int) -> float:
    return sum(min(len(p), max_cells) + 0.4 for p in pieces) if pieces else 2.0


def plot_ranks(results: dict[int, tuple[Any, Any]], title: str | None = None, labels: tuple[str, str] = ("before",
               "after"), max_cells: int = 16):
    """A figure with one row per rank: its tensors before (left) and after (right) the call, cells coloured by
    the rank each value came from (grey: a value no rank started with, e.g. a sum). Returns the Figure."""
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch, Rectangle

    if not results:
        raise ValueError("plot_ranks needs {rank: (before, after)} for at least one rank")
    ranks = sorted(results)
    origin = _origins(results)
    sides = [[_pieces(results[r][i]) for r in ranks] for i in (0, 1)]
    widths = [max(_width(p, max_cells) for p in side) for side in sides]
    gap = 2.0
    offsets = [0.0, widths[0] + gap]
    total = offsets[1] + widths[1]
    fig, ax = plt.subplots(figsize=(min(16, 1.2 + 0.45 * total), 0.9 + 0.55 * len(ranks)))
    colours = plt.get_cmap("tab10")
    for row, rank in enumerate(ranks):
        y = -row
        ax.text(-0.3, y, f"rank {rank}", ha="right", va="center", fontsize=10)
        for side in (0, 1):
            x = offsets[side]
            pieces = sides[side][row]
            if not pieces or all(len(p) == 0 for p in pieces):
                ax.text(x, y, "(nothing)", va="center", fontsize=9, color="grey", style="italic")
                continue
            for piece in pieces:
                for v in piece[:max_cells]:
                    src = origin.get(v)
                    face = GREY if src is None else colours(src % 10)
                    ax.add_patch(Rectangle((x, y - 0.4), 0.92, 0.8, facecolor=face, edgecolor="white"))
                    ax.text(x + 0.46, y, _label(v), ha="center", va="center", fontsize=8,
                            color="black" if src is None else "white", fontweight="bold")
                    x += 1
                if len(piece) > max_cells:
                    ax.text(x, y, "…", va="center")
                    x += 0.6
                x += 0.4
    for side, label in enumerate(labels):
        ax.text(offsets[side], 0.75, label, fontsize=10, fontweight="bold", va="bottom")
    ax.annotate("", xy=(offsets[1] - 0.4, -(len(ranks) - 1) / 2), xytext=(widths[0] + 0.3, -(len(ranks) - 1) / 2),
                arrowprops={"arrowstyle": "->", "lw": 1.5})
    handles = [Patch(color=colours(r % 10), label=f"from rank {r}") for r in sorted(set(origin.values()))]
    handles.append(Patch(color=GREY, label="no rank's input (e.g. a sum)"))
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8, frameon=False)
    ax.set_xlim(-2.2, total + 0.2)
    ax.set_ylim(-len(ranks) + 0.3, 1.4)
    ax.axis("off")
    if title:
        ax.set_title(title, loc="left", fontsize=11)
    fig.tight_layout()
    return fig
