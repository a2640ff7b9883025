"""course_utils.measure's GPU sleep on the CPU, against a simulated GPU whose SM clock ramps up from idle (as a
real one does: an idle H200 sits at 345 MHz and boosts to 1980 MHz under load). `torch.cuda._sleep` counts SM
clock cycles, so its calibration must be timed at the clock the sleeps will run at. The live checks are in
test_timeline_gpu.py (test_sleeps_last_what_was_asked_and_are_labelled_with_their_length)."""

from __future__ import annotations

import pytest
import torch

from course_utils import measure
from course_utils.timeline import Span

IDLE_MHZ, BOOST_MHZ, RAMP_MS = 345.0, 1980.0, 20.0


class FakeGPU:
    """One stream; the clock rises linearly from idle to boost over the first RAMP_MS ms of busy time."""

    def __init__(self):
        self.t_ms = 0.0  # GPU time
        self.busy_ms = 0.0

    def mhz(self) -> float:
        return IDLE_MHZ + (BOOST_MHZ - IDLE_MHZ) * min(1.0, self.busy_ms / RAMP_MS)

    def sleep(self, cycles: int) -> None:
        left = float(cycles)
        while left > 0:  # integrate in 0.1 ms steps: cycles run at the clock of the moment
            step = min(0.1, left / (self.mhz() * 1e3))
            left -= step * self.mhz() * 1e3
            self.t_ms += step
            self.busy_ms += step


@pytest.fixture
def gpu(monkeypatch):
    g = FakeGPU()

    class Event:
        def __init__(self, enable_timing=False):
            self.t = None

        def record(self, stream=None):
            self.t = g.t_ms

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.t - self.t

    class Device:
        def __init__(self, dev):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", Device)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "_sleep", g.sleep)
    measure.cycles_per_ms.cache_clear()
    yield g
    measure.cycles_per_ms.cache_clear()


def test_calibration_is_timed_at_the_raised_clock(gpu):
    rate = measure.cycles_per_ms()
    assert rate == pytest.approx(BOOST_MHZ * 1e3, rel=0.01)  # cycles per ms at boost, not a mix with idle
    assert gpu.busy_ms >= RAMP_MS  # the burst before the timed sleeps brought the clock up


def test_sleeps_at_the_calibrated_clock_last_what_was_asked(gpu):
    check = measure.sleep_check((1.0, 5.0, 20.0))
    assert check.worst_ratio == pytest.approx(1.0, rel=0.01)
    assert "gpu_sleep(5) took 5.00 ms (100% of the request)" in check.summary()


def test_a_sleep_at_a_lower_clock_lasts_longer_and_the_check_says_so(gpu):
    rate = measure.cycles_per_ms()
    gpu.busy_ms = 0.0  # the GPU idled: its clock fell back
    check = measure.sleep_check((5.0,), rate)
    assert check.worst_ratio > 1.5  # what lessons saw as "6.6 ms" for a 5 ms sleep, and worse
    assert measure.sleep_check((5.0,), rate, warm=True).worst_ratio == pytest.approx(1.0, rel=0.01)


def test_gpu_sleep_returns_nothing_so_a_cell_ending_with_it_prints_nothing(gpu):
    assert measure.gpu_sleep(1.0) is None


def test_sleep_kernels_finds_the_sleeps_by_start_in_spans_or_their_dicts():
    spin = "at::cuda::(anonymous namespace)::spin_kernel(long)"
    spans = [Span(spin, "compute", 0, "b", 5.0, 11.6), Span("add", "compute", 0, "a", 0.0, 1.0),
             Span(spin, "compute", 0, "a", 1.0, 6.0), Span("r", "range", 0, "a", 0.0, 12.0)]
    got = measure.sleep_kernels(spans)
    assert [(s.stream, s.end_ms - s.start_ms) for s in got] == [("a", 5.0), ("b", pytest.approx(6.6))]
    assert [s["stream"] for s in measure.sleep_kernels([s.to_dict() for s in spans])] == ["a", "b"]


def test_without_a_gpu_the_sleep_tools_say_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    measure.cycles_per_ms.cache_clear()
    for call in (measure.cycles_per_ms, measure.sleep_check):
        with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
            call()
