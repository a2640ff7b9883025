"""The bucket explorer (course_utils/bucket_explorer.py): its arithmetic, and that moving the slider changes the
view. The schedule it is fed here is a test's own copy of lesson 08's model (the explorer holds none)."""

from __future__ import annotations

import math

import matplotlib
import pytest

matplotlib.use("Agg")

from course_utils import bucket_explorer as be  # noqa: E402


def schedule(grads, cap_bytes, alpha_ms, gbps):
    """Lesson 08's model: buckets close at >= cap, one all-reduce at a time, alpha + bytes / bandwidth."""
    out, n, size, free = [], 0, 0, 0.0
    for i, (nbytes, ready) in enumerate(grads):
        n, size = n + 1, size + nbytes
        if size >= cap_bytes or i == len(grads) - 1:
            start = max(ready, free)
            free = start + alpha_ms + size / (gbps * 1e6)
            out.append((n, start, free))
            n, size = 0, 0
    return out


GRADS = [(4_000, 0.5), (4_000_000, 0.5), (4_000, 1.0), (4_000_000, 1.0), (4_000, 1.5), (4_000_000, 1.5),
         (4_000, 2.0), (4_000_000, 2.0)]


def test_exposed_and_rough_model_by_hand():
    buckets = schedule(GRADS, 1e12, 0.1, 10.0)  # one bucket: starts at 2.0, 16.016 MB at 10 GB/s = 1.6016 ms
    assert buckets == [(8, 2.0, pytest.approx(2.0 + 0.1 + 1.6016))]
    assert be.exposed_ms(GRADS, buckets) == pytest.approx(0.1 + 1.6016)
    # s / (n_b w) + n_b o with s = 16 MB, w = 10 GB/s = 1e7 bytes/ms, o = 0.1 ms
    assert be.rough_overhead_ms(16e6, 4, 0.1, 10.0) == pytest.approx(0.4 + 0.4)
    assert be.best_cap_bytes(16e6, 0.1, 10.0) == pytest.approx(math.sqrt(16e6 * 1e7 * 0.1))
    # the best cap minimises the rough model: n_b = s / cap
    best = be.best_cap_bytes(16e6, 0.1, 10.0)
    at = be.rough_overhead_ms(16e6, 16e6 / best, 0.1, 10.0)
    assert at <= be.rough_overhead_ms(16e6, 16e6 / best * 1.5, 0.1, 10.0)
    assert at <= be.rough_overhead_ms(16e6, 16e6 / best / 1.5, 0.1, 10.0)


def test_default_caps_span_the_gradients():
    caps = be.default_caps(1e8, n=9)
    assert len(caps) == 9 and caps[0] == pytest.approx(1e8 / 1024) and caps[-1] == pytest.approx(1e8)
    assert all(b > a for a, b in zip(caps, caps[1:], strict=False))


def test_predicted_spans_rows_and_times():
    buckets = schedule(GRADS, 4_000_000, 0.1, 10.0)  # each (bias, weight) pair reaches the cap: 4 buckets
    spans = be.predicted_spans(GRADS, buckets)
    compute = [s for s in spans if s.stream == "backward"]
    comm = [s for s in spans if s.stream == "comm"]
    assert [s.kind for s in compute] == ["compute"] * 4  # gradients ready together share one span
    assert [(s.start_ms, s.end_ms) for s in compute] == [(0.0, 0.5), (0.5, 1.0), (1.0, 1.5), (1.5, 2.0)]
    assert [s.kind for s in comm] == ["comm"] * 4
    assert [(s.start_ms, s.end_ms) for s in comm] == [(b[1], b[2]) for b in buckets]
    assert "4 MB" in comm[0].name or "4.0 MB" in comm[0].name


def test_moving_the_slider_changes_the_view():
    explorer = be.BucketExplorer(GRADS, 0.1, 10.0, schedule=schedule, caps=[1.0, 4e6, 1e7, 1e12])
    first = dict(explorer.view)
    assert explorer.slider.value == first["cap_bytes"]
    assert first["buckets"] == schedule(GRADS, first["cap_bytes"], 0.1, 10.0)
    fig, png = explorer.figure, explorer.image.value
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    title = fig.axes[0].get_title()
    assert f"{len(first['buckets'])} buckets" in title
    explorer.slider.value = explorer.caps[0]  # the smallest cap: one bucket per gradient
    assert explorer.view["cap_bytes"] == explorer.caps[0]
    assert len(explorer.view["buckets"]) == len(GRADS) != len(first["buckets"])
    assert explorer.figure is not fig and explorer.figure.axes[0].get_title() != title
    assert explorer.image.value != png  # the widget shows the new picture
    assert explorer.view["exposed_ms"] == pytest.approx(be.exposed_ms(GRADS, explorer.view["buckets"]))
    explorer.slider.value = explorer.caps[-1]  # the largest: one bucket
    assert len(explorer.view["buckets"]) == 1
    # the sweep under the timeline is the model at every cap
    assert [len(b) for _, b in explorer.sweep] == [len(schedule(GRADS, c, 0.1, 10.0)) for c in explorer.caps]


def test_starts_near_the_rough_best_cap():
    explorer = be.BucketExplorer(GRADS, 0.1, 10.0, schedule=schedule, caps=[1e3, 1e5, 1e7, 1e9])
    best = be.best_cap_bytes(sum(b for b, _ in GRADS), 0.1, 10.0)
    assert explorer.slider.value == min(explorer.caps, key=lambda c: abs(math.log(c / best)))


def test_a_schedule_that_breaks_the_rules_is_refused():
    with pytest.raises(ValueError, match="every gradient belongs to exactly one bucket"):
        be.BucketExplorer(GRADS, 0.1, 10.0, schedule=lambda g, c, a, b: [(1, 0.0, 1.0)])
    with pytest.raises(ValueError, match="list of"):
        be.BucketExplorer(GRADS, 0.1, 10.0, schedule=lambda g, c, a, b: 3.0)
    with pytest.raises(TypeError, match="function"):
        be.BucketExplorer(GRADS, 0.1, 10.0, schedule=None)


def test_an_unwritten_schedule_says_so():
    def stub(grads, cap_bytes, alpha_ms, gbps):
        raise NotImplementedError()

    with pytest.raises(NotImplementedError):
        be.BucketExplorer(GRADS, 0.1, 10.0, schedule=stub)


def test_bad_gradients_are_refused():
    with pytest.raises(ValueError, match="back in time"):
        be.BucketExplorer([(10, 2.0), (10, 1.0)], 0.1, 10.0, schedule=schedule)
    with pytest.raises(ValueError, match="empty"):
        be.BucketExplorer([], 0.1, 10.0, schedule=schedule)
    with pytest.raises(ValueError, match="gbps"):
        be.BucketExplorer(GRADS, 0.1, 0.0, schedule=schedule)
