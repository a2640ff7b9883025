"""Events mode: a span is two CUDA events recorded on its stream, placed on the host clock by one anchor.

The events-mode half of a Timeline (record.py holds the Timeline, kernels.py the kernels-mode half):
- events come from a pool and go back to it once their times are read, so a loop of spans allocates none;
- each CUDA stream gets a row label: the one `tl.name_stream` gave it, else 'default stream' or 'side stream <n>';
- the anchor: `tl.spans()` waits for the device once, records one event on the idle device and notes the
  host time around its completion; each event's time is the anchor's host time minus
  `event.elapsed_time(anchor)`, within half the time the anchor took (`Timeline.anchor_uncertainty_ms`).
An event says when its *stream* reached that point (stream progress), which includes time the stream waited
for the GPU to run other streams' kernels.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from .spans import side_stream_label

__all__ = ["Anchor", "EventRecorder"]


class Anchor:
    """One event that completed on the idle device, the host time it completed at (ms since the timeline's
    origin) and half the time its completion took to see (how far that host time may be off)."""

    __slots__ = ("event", "ms", "uncertainty_ms")

    def __init__(self, event: torch.cuda.Event, ms: float, uncertainty_ms: float):
        self.event, self.ms, self.uncertainty_ms = event, ms, uncertainty_ms


class EventRecorder:
    """The events-mode half of a Timeline: pooled CUDA events, stream row labels, and the anchor."""

    def __init__(self, origin_ns: int, device: Callable[[], int]):
        self.origin_ns = origin_ns
        self._device = device
        self.pool: list[torch.cuda.Event] = []
        self.stream_labels: dict[int, str] = {}  # stream.cuda_stream -> row label

    def event(self) -> torch.cuda.Event:
        return self.pool.pop() if self.pool else torch.cuda.Event(enable_timing=True)

    def record(self, stream: Any) -> torch.cuda.Event:
        """An event recorded on `stream`: it completes when the stream reaches this point."""
        ev = self.event()
        ev.record(stream)
        return ev

    def name_stream(self, stream: Any, label: str) -> None:
        self.stream_labels[stream.cuda_stream] = label

    def label(self, stream: Any) -> str:
        """The stream's row: its name, else 'default stream', else 'side stream <n>' in order of first use."""
        key = stream.cuda_stream
        if key not in self.stream_labels:
            if key == torch.cuda.default_stream(stream.device).cuda_stream:
                self.stream_labels[key] = "default stream"
            else:
                self.stream_labels[key] = side_stream_label(self.stream_labels.values())
        return self.stream_labels[key]

    def anchor(self) -> Anchor:
        """Wait for the device (the one wait: everything recorded so far has run), then time one event."""
        dev = self._device()
        torch.cuda.synchronize(dev)
        anchor = self.event()
        stream = torch.cuda.current_stream(dev)
        before = (time.perf_counter_ns() - self.origin_ns) / 1e6
        anchor.record(stream)
        anchor.synchronize()  # the device is idle, so the anchor completes right after it is recorded
        after = (time.perf_counter_ns() - self.origin_ns) / 1e6
        return Anchor(anchor, (before + after) / 2, (after - before) / 2)

    def place(self, start: torch.cuda.Event, end: torch.cuda.Event, anchor: Anchor) -> tuple[float, float]:
        """A span's start and end (a mark's: `end is start`) in ms since the origin; its events go back to the pool."""
        t0 = anchor.ms - start.elapsed_time(anchor.event)
        t1 = t0 if end is start else anchor.ms - end.elapsed_time(anchor.event)
        self.pool.append(start)
        if end is not start:
            self.pool.append(end)
        return t0, t1

    def release(self, anchor: Anchor) -> None:
        """The anchor's event back to the pool, once every span of this resolve is placed."""
        self.pool.append(anchor.event)
