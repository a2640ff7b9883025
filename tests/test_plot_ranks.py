"""course_utils.plot_ranks: cells per value, coloured by the rank that held the value before the call."""

from __future__ import annotations

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from course_utils import plot_ranks as pr  # noqa: E402


def test_pieces_and_origins():
    assert pr._pieces(None) == []
    assert pr._pieces(torch.tensor([[1.0, 2.0]])) == [[1.0, 2.0]]
    assert pr._pieces([torch.tensor([1.0]), torch.tensor([2.0, 3.0])]) == [[1.0], [2.0, 3.0]]
    results = {0: (torch.tensor([10.0, 11.0, 5.0]), None), 1: (torch.tensor([20.0, 5.0]), None)}
    assert pr._origins(results) == {10.0: 0, 11.0: 0, 20.0: 1}  # 5 is held by both ranks: it colours nothing


def test_all_gather_picture_colours_gathered_values_by_their_rank():
    x0, x1 = torch.tensor([10.0, 11.0]), torch.tensor([20.0, 21.0])
    after = torch.cat([x0, x1])
    fig = pr.plot_ranks({0: (x0, after), 1: (x1, after)}, "all_gather")
    ax = fig.axes[0]
    assert len([p for p in ax.patches if isinstance(p, Rectangle)]) == 2 + 2 + 4 + 4
    colours = plt.get_cmap("tab10")
    faces = [p.get_facecolor() for p in ax.patches if isinstance(p, Rectangle)]
    assert faces[2] == pytest.approx(colours(0)) and faces[4] == pytest.approx(colours(1))  # rank 0 after: 10, 11, 20
    assert ax.get_title(loc="left") == "all_gather"
    plt.close(fig)


def test_sums_are_grey_and_missing_tensors_say_so():
    fig = pr.plot_ranks({0: (torch.tensor([10.0]), torch.tensor([30.0])), 1: (torch.tensor([20.0]), None)})
    ax = fig.axes[0]
    faces = [p.get_facecolor() for p in ax.patches if isinstance(p, Rectangle)]
    assert faces[1] == pytest.approx(matplotlib.colors.to_rgba(pr.GREY))  # rank 0 after, 30: no rank's input
    assert any(t.get_text() == "(nothing)" for t in ax.texts)
    plt.close(fig)
    with pytest.raises(ValueError, match="at least one rank"):
        pr.plot_ranks({})


def test_long_tensors_are_cut():
    fig = pr.plot_ranks({0: (torch.arange(40.0), torch.arange(40.0))}, max_cells=8)
    ax = fig.axes[0]
    assert len([p for p in ax.patches if isinstance(p, Rectangle)]) == 16
    assert sum(t.get_text() == "…" for t in ax.texts) == 2
    plt.close(fig)
