"""The drawing of timelines, checked on rendered figures (CPU): bar labels a learner can read (sleeps with their
measured length, ops instead of C++ signatures), rows named after streams, and a layout where nothing covers
anything (legend above the axes, footer under the x-label). Realistic plots come from the lessons' reference
recordings, as the notebooks draw them on a machine without a GPU."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from course_utils.timeline import MARK, RANGE, Timeline  # noqa: E402
from course_utils.timeline.kernels import KernelRecorder  # noqa: E402
from course_utils.timeline.plot import _fit, _text_in, bar_labels, is_sleep_kernel  # noqa: E402
from tests.timeline_helpers import S, close_figures  # noqa: E402,F401  (close_figures: autouse)

SPIN = "at::cuda::(anonymous namespace)::spin_kernel(long)"  # the name kineto gives torch.cuda._sleep's kernel
ADD = ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctorOnSelf_add<float>, "
       "std::array<char*, 2ul> >(int, at::native::CUDAFunctorOnSelf_add<float>, std::array<char*, 2ul>)")
MUL = ("void at::native::vectorized_elementwise_kernel<4, at::native::AUnaryFunctor<float, float, float, "
       "at::native::binary_internal::MulFunctor<float> >, std::array<char*, 2ul> >(int, ...)")
DATA = Path(__file__).resolve().parents[1] / "course_utils" / "reference_data"


def _bar_texts(fig) -> list[str]:
    return [t.get_text() for t in fig.axes[0].texts]


# ------------------------------------------------------------------ what bars are called
def test_a_sleep_is_labelled_with_its_measured_length():
    assert is_sleep_kernel(SPIN) and not is_sleep_kernel("sleep (20 ms)")
    assert bar_labels(S(SPIN, "compute", 0, 6.62)) == ["sleep 6.6 ms", "sleep"]
    fig = Timeline.from_spans([S(SPIN, "compute", 0, 6.62), S(SPIN, "compute", 6.7, 6.9)], mode="kernels").plot()
    texts = _bar_texts(fig)
    assert "sleep 6.6 ms" in texts  # a wide bar: its real length, not the request
    assert not any("anonymous" in t or "at::cuda" in t for t in texts)


def test_elementwise_kernels_copies_and_memsets_are_named_by_what_they_do():
    assert bar_labels(S(ADD, "compute", 0, 1)) == ["add (vectorized_elementwise_kernel)", "add"]
    assert bar_labels(S(MUL, "compute", 0, 1))[-1] == "mul"
    assert bar_labels(S("Memcpy HtoD (Pinned -> Device)", "h2d", 0, 1)) == [
        "Memcpy HtoD (Pinned -> Device)", "Memcpy HtoD", "HtoD"]
    assert bar_labels(S("Memset (Device)", "compute", 0, 1)) == ["Memset (Device)", "Memset"]
    assert bar_labels(S("matmul 0", "compute", 0, 1)) == ["matmul 0"]  # a user's span keeps its name
    # each bar shows the most telling name that fits: a narrow copy says its direction, not "Memcp…"
    spans = [S("Memcpy HtoD (Pinned -> Device)", "h2d", 0, 1.3, "copy"), S(ADD, "compute", 1.3, 9.6, "compute")]
    texts = _bar_texts(Timeline.from_spans(spans, mode="kernels").plot())
    assert "HtoD" in texts and "add (vectorized_elementwise_kernel)" in texts


def test_labels_fit_inside_their_bars_on_the_rendered_figure():
    spans = [S(SPIN, "compute", i * 4.0, i * 4.0 + 3.99, f"side stream {i % 3 + 1}") for i in range(12)]
    spans += [S("Memcpy HtoD (Pinned -> Device)", "h2d", 48.0, 49.2, "copy"), S(ADD, "compute", 49.2, 49.25, "copy")]
    fig = Timeline.from_spans(spans, mode="kernels").plot(title="fit")
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    ax = fig.axes[0]
    bars = {round(p.get_extents().x0, 6): p.get_extents() for c in ax.collections for p in c.get_paths()}
    for t in ax.texts:
        if not t.get_text():
            continue
        box = t.get_window_extent(r)
        x_ms = t.get_position()[0]
        bar = min(bars.values(), key=lambda e: abs((e.x0 + e.x1) / 2 - x_ms))  # the bar the label is centred in
        left, right = ax.transData.transform([(bar.x0, 0), (bar.x1, 0)])[:, 0]
        assert left <= box.x0 and box.x1 <= right, (t.get_text(), box, left, right)
    assert _fit("x" * 50, 0.05) == "" and _text_in(_fit("a long kernel name", 0.8)) <= 0.8


# ------------------------------------------------------------------ rows: every stream has a name
class _Rec(KernelRecorder):
    def __init__(self, named=()):
        super().__init__(0, 0, False, None)
        self.stream_labels = {object(): label for label in named}


def test_unnamed_profiler_streams_become_side_streams_in_order_of_appearance():
    rec = _Rec(named=["default stream", "copy", "side stream 1"])
    first = rec._side_stream_names([S("k", "compute", 5, 6, "stream 26"), S("k", "compute", 1, 2, "stream 78"),
                                    S("c", "h2d", 0, 1, "copy"), S("n", "comm", 0, 1, "comm"),
                                    S("k", "compute", 7, 8, "stream 26"), S("k", "compute", 0, 1, "default stream")])
    # "side stream 1" is a name the user gave: the auto names skip it
    assert [s.stream for s in first] == ["side stream 3", "side stream 2", "copy", "comm", "side stream 3",
                                         "default stream"]
    later = rec._side_stream_names([S("k", "compute", 20, 21, "stream 99"), S("k", "compute", 22, 23, "stream 26")])
    assert [s.stream for s in later] == ["side stream 4", "side stream 3"]  # one name per stream, every capture


def test_timeline_takes_stream_names_at_construction():
    tl = Timeline(device="cpu", streams={"copy": None})  # no CUDA here: names are ignored, as with name_stream
    assert tl.mode == "host"
    with pytest.raises(TypeError, match="streams="):
        Timeline(device="cpu", streams={"copy": "s_copy"})


# ------------------------------------------------------------------ layout: nothing covers anything
def _boxes(fig):
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    ax = fig.axes[0]
    legend = ax.get_legend().get_window_extent(r)
    footer = [t.get_window_extent(r) for t in fig.texts + ax.texts if "makespan" in t.get_text()]
    labels = [t.get_window_extent(r) for t in ax.get_yticklabels() + [ax.xaxis.label, ax.yaxis.label, ax.title]
              if t.get_text()]
    return ax.get_window_extent(r), legend, footer, labels, ax.xaxis.label.get_window_extent(r)


def _reference(stem, *keys):
    data = json.loads((DATA / f"{stem}.json").read_text())["data"]
    for k in keys:
        data = data[k]
    return data


RECORDINGS = {
    "02 sleeps on 2 side streams": (("02_cuda_streams", "sleep", "2"), "kernels"),
    "02 split, three rows and the default stream": (("02_cuda_streams", "split", "spans"), "kernels"),
    "02 matmuls with named ranges": (("02_cuda_streams", "matmul", "2"), "kernels"),
    "01 events mode: host and GPU rows": (("01_host_and_device", "timeline"), "events"),
    "04 copy stream and compute stream": (("04_async_memcpy", "overlap", "2 stream"), "kernels"),
}


@pytest.mark.parametrize("name", list(RECORDINGS))
def test_legend_sits_above_the_axes_and_the_footer_below_everything(name):
    keys, mode = RECORDINGS[name]
    spans = _reference(*keys)
    fig = Timeline.from_spans(spans, mode=mode).plot(title=name)
    axes, legend, footer, labels, xlabel = _boxes(fig)
    assert legend.y0 >= axes.y1 - 1, "the legend covers bars"  # outside the axes, above them
    title = fig.axes[0].title.get_window_extent(fig.canvas.get_renderer())
    assert title.y0 >= legend.y1 - 1, "the title runs into the legend"
    (foot,) = footer
    assert foot.y1 <= xlabel.y0 + 1 and foot.y1 <= axes.y0, "the footer runs into the plot"
    assert all(not (foot.overlaps(lb)) for lb in labels), "a label runs into the footer"
    assert fig.axes[0].get_ylabel() == ""


def test_legend_uses_one_row_when_it_fits():
    spans = [S("c", "compute", 0, 50, "host"), S("h", "host", 0, 10, "host"), S("w", "wait", 10, 50, "host"),
             S("t", "compute", 50, 50.01, "GPU")]
    fig = Timeline.from_spans(spans).plot()
    fig.canvas.draw()
    texts = fig.axes[0].get_legend().get_texts()
    r = fig.canvas.get_renderer()
    ys = {round(t.get_window_extent(r).y0) for t in texts}
    assert len(texts) == 4 and len(ys) == 1  # compute, host/CPU, wait/idle, widened: one row, not 3 + 1


def test_a_mark_after_the_last_span_stays_inside_the_axes():
    fig = Timeline.from_spans([S("k", "compute", 0, 40, "GPU"), S("done", MARK, 0, 0, "host"),
                               S("done", MARK, 45, 45, "host")]).plot()
    fig.canvas.draw()
    ax = fig.axes[0]
    assert ax.get_xlim()[1] >= 45
    r = fig.canvas.get_renderer()
    fig_box = fig.get_window_extent(r)
    assert all(t.get_window_extent(r).x1 <= fig_box.x1 + 60 for t in ax.texts)


def test_plot_into_the_callers_axes_keeps_the_legend_above_them():
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(8, 6))
    spans = [S(SPIN, "compute", 0, 5, "a"), S("x", RANGE, 0, 5, "a")]
    Timeline.from_spans(spans, mode="kernels").plot(ax=bottom, show_stats=False)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    assert bottom.get_legend().get_window_extent(r).y0 >= bottom.get_window_extent(r).y1 - 1
