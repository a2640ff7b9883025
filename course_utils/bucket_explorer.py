"""Bucket explorer: slide the bucket cap and see the predicted timeline of backward and its all-reduces.

    explorer = BucketExplorer(grads, alpha_ms, gbps, schedule=bucket_schedule)
    explorer                    # in a notebook: a slider over caps, the predicted timeline, exposed comm vs cap

It is a tool fed with the learner's numbers and model, not the model itself:
- grads: (bytes, ready ms) of each gradient in the order backward produces them (measured in lesson 08);
- alpha_ms, gbps: an all-reduce's latency and bandwidth (the learner's alpha-beta fit);
- schedule(grads, cap_bytes, alpha_ms, gbps) -> [(n_grads, start_ms, end_ms), ...]: each bucket's all-reduce
  (the learner's `bucket_schedule`, exercise ex08_bucket_schedule).
At each cap the view draws the gradients on a "backward" row and the all-reduces on a "comm" row with the
course's timeline plot, and under it the exposed communication (last all-reduce end - backward end) at
every cap, next to the rough model s/(n_b w) + n_b o (s bytes in all, n_b buckets, w bytes/ms, o ms per
all-reduce) and its best bucket size sqrt(s w o).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

from .timeline.spans import Span

Grad = tuple[int, float]
Schedule = Callable[[list[Grad], float, float, float], Sequence[Sequence[float]]]

__all__ = ["BucketExplorer", "best_cap_bytes", "default_caps", "exposed_ms", "predicted_spans", "rough_overhead_ms"]


def _check_grads(grads: Sequence[Sequence[float]]) -> list[Grad]:
    out: list[Grad] = []
    last = -math.inf
    for i, g in enumerate(grads):
        if len(g) != 2:
            raise ValueError(f"grads[{i}] = {g!r}: each gradient is (bytes, ready_ms)")
        nbytes, ready = int(g[0]), float(g[1])
        if nbytes <= 0 or ready < last:
            raise ValueError(f"grads[{i}] = {g!r}: bytes must be positive and ready times must not go back in time")
        out.append((nbytes, ready))
        last = ready
    if not out:
        raise ValueError("grads is empty: give (bytes, ready_ms) for each gradient, in backward order")
    return out


def _check_schedule(buckets: Any, grads: list[Grad]) -> list[tuple[int, float, float]]:
    try:
        out = [(int(n), float(a), float(b)) for n, a, b in buckets]
    except (TypeError, ValueError) as err:
        raise ValueError(f"the schedule function returned {buckets!r:.200}: it must return a list of "
                         "(n_grads, start_ms, end_ms), one per bucket") from err
    if sum(n for n, _, _ in out) != len(grads):
        raise ValueError(f"the schedule's buckets hold {sum(n for n, _, _ in out)} gradients, but backward made "
                         f"{len(grads)}: every gradient belongs to exactly one bucket")
    return out


def exposed_ms(grads: Sequence[Grad], buckets: Sequence[Sequence[float]]) -> float:
    """Communication left after backward: the last all-reduce's end minus the last gradient's ready time."""
    return max(float(b[2]) for b in buckets) - float(grads[-1][1])


def rough_overhead_ms(total_bytes: float, n_buckets: int, alpha_ms: float, gbps: float) -> float:
    """s / (n_b w) + n_b o: the last bucket's transfer, which nothing can hide, plus a latency per bucket."""
    w = gbps * 1e6  # bytes per ms
    return total_bytes / (n_buckets * w) + n_buckets * alpha_ms


def best_cap_bytes(total_bytes: float, alpha_ms: float, gbps: float) -> float:
    """The bucket size that minimises rough_overhead_ms: sqrt(s w o) (s bytes, w bytes/ms, o ms)."""
    return math.sqrt(total_bytes * gbps * 1e6 * alpha_ms)


def default_caps(total_bytes: float, n: int = 25) -> list[float]:
    """Caps from total/1024 to the total, evenly spaced on a log scale (bytes)."""
    lo, hi = math.log(total_bytes / 1024), math.log(total_bytes)
    return [math.exp(lo + (hi - lo) * i / (n - 1)) for i in range(n)]


def predicted_spans(grads: Sequence[Grad], buckets: Sequence[Sequence[float]]) -> list[Span]:
    """The predicted timeline as spans: one compute span per gradient on row "backward" (from the previous
    gradient's ready time to its own), one comm span per bucket on row "comm"."""
    spans, prev, first_i = [], 0.0, 0
    for i, (_, ready) in enumerate(grads):
        if i + 1 < len(grads) and grads[i + 1][1] <= ready:
            continue  # gradients ready at the same moment share one span
        name = f"grad {i}" if first_i == i else f"grads {first_i}-{i}"
        spans.append(Span(name, "compute", 0, "backward", prev, max(ready, prev)))
        prev, first_i = max(ready, prev), i + 1
    first = 0
    for n, start, end in buckets:
        size = sum(b for b, _ in grads[first:first + int(n)])
        first += int(n)
        spans.append(Span(f"{size / 1e6:.3g} MB", "comm", 0, "comm", float(start), float(end)))
    return spans


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.3g} MB"


class BucketExplorer:
    """A slider over bucket caps and the predicted timeline at the chosen one (see the module docstring).

    `view` holds what is drawn now (cap_bytes, buckets, exposed_ms, spans); `figure` the matplotlib Figure and
    `image` the widget showing it. Moving `slider` (or calling `show(cap_bytes)`) redraws them.
    """

    def __init__(self, grads: Sequence[Sequence[float]], alpha_ms: float, gbps: float, schedule: Schedule,
                 caps: Sequence[float] | None = None, title: str = "predicted backward and all-reduces"):
        import ipywidgets as widgets

        if not callable(schedule):
            raise TypeError("schedule must be a function (grads, cap_bytes, alpha_ms, gbps) -> buckets")
        if not (alpha_ms >= 0 and gbps > 0):
            raise ValueError(f"alpha_ms must be >= 0 and gbps > 0, got {alpha_ms!r} and {gbps!r}")
        self.grads = _check_grads(grads)
        self.alpha_ms, self.gbps, self.schedule, self.title = float(alpha_ms), float(gbps), schedule, title
        self.total_bytes = sum(b for b, _ in self.grads)
        self.caps = sorted(float(c) for c in (caps or default_caps(self.total_bytes)))
        # the sweep under the timeline: the learner's model at every cap (an error shows here, at once)
        self.sweep = [(cap, self._buckets(cap)) for cap in self.caps]
        best = best_cap_bytes(self.total_bytes, self.alpha_ms, self.gbps)
        start = min(self.caps, key=lambda c: abs(math.log(c / best)))
        self.slider = widgets.SelectionSlider(options=[(_mb(c), c) for c in self.caps], value=start,
                                              description="bucket cap", continuous_update=False,
                                              layout=widgets.Layout(width="600px"))
        # The figure goes into an Image widget as PNG bytes: an Output widget capturing display() would tie the
        # view to the cell that made it (and headless runners such as nbclient wait on such captures).
        self.image = widgets.Image(format="png")
        self.widget = widgets.VBox([self.slider, self.image])
        self.view: dict[str, Any] = {}
        self.figure = None
        self.slider.observe(lambda change: self.show(change["new"]), names="value")
        self.show(start)

    def _buckets(self, cap: float) -> list[tuple[int, float, float]]:
        return _check_schedule(self.schedule(list(self.grads), cap, self.alpha_ms, self.gbps), self.grads)

    def show(self, cap_bytes: float) -> None:
        """Draw the predicted timeline at `cap_bytes` (what moving the slider does)."""
        import io

        import matplotlib.pyplot as plt

        from .timeline.plot import plot

        buckets = self._buckets(cap_bytes)
        spans = predicted_spans(self.grads, buckets)
        exposed = exposed_ms(self.grads, buckets)
        self.view = {"cap_bytes": cap_bytes, "buckets": buckets, "exposed_ms": exposed, "spans": spans}
        fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6.5), gridspec_kw={"height_ratios": [1.2, 1]})
        plot(spans, ax=top, show_stats=False, title=f"{self.title}\ncap {_mb(cap_bytes)}: {len(buckets)} buckets, "
                                                    f"{exposed:.3g} ms of communication after backward")
        caps = [c / 1e6 for c, _ in self.sweep]
        bottom.plot(caps, [exposed_ms(self.grads, b) for _, b in self.sweep], "o-", ms=3,
                    label="your model: last all-reduce end - backward end")
        rough = [rough_overhead_ms(self.total_bytes, len(b), self.alpha_ms, self.gbps) for _, b in self.sweep]
        bottom.plot(caps, rough, "--", color="grey", label="rough: s/(n_b w) + n_b o")
        best = best_cap_bytes(self.total_bytes, self.alpha_ms, self.gbps)
        bottom.axvline(best / 1e6, color="grey", linestyle=":", label=f"sqrt(s w o) = {_mb(best)}")
        bottom.plot([cap_bytes / 1e6], [exposed], "o", color="tab:red", ms=9, label="this cap")
        bottom.set_xscale("log")
        bottom.set_xlabel("bucket cap (MB)")
        bottom.set_ylabel("exposed comm (ms)")
        bottom.grid(alpha=0.3)
        bottom.legend(fontsize=9, loc="best", frameon=False)
        fig.tight_layout()
        self.figure = fig
        png = io.BytesIO()
        fig.savefig(png, format="png", dpi=80, bbox_inches="tight")
        self.image.value = png.getvalue()
        plt.close(fig)  # shown through the image widget only (not again at the end of the cell)

    def _ipython_display_(self) -> None:
        from IPython.display import display

        display(self.widget)
