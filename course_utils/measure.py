"""Small measuring tools the lessons share: a GPU sleep of known length, and medians of repeats.

`torch.cuda._sleep(cycles)` spins one thread for a number of GPU clock cycles: one block on one SM,
so it leaves the rest of the GPU idle. Clocks differ between GPUs (and with boost), so
`cycles_per_ms()` times a known count once, with CUDA events, instead of assuming a frequency.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable

import torch


@functools.lru_cache(maxsize=8)
def cycles_per_ms(device: int | None = None, probe_cycles: int = 20_000_000, repeats: int = 3) -> float:
    """Cycles per millisecond of `torch.cuda._sleep` on this GPU (median of `repeats` timings)."""
    if not torch.cuda.is_available():
        raise RuntimeError("cycles_per_ms needs a CUDA GPU")
    dev = torch.cuda.current_device() if device is None else device
    with torch.cuda.device(dev):
        torch.cuda._sleep(probe_cycles // 10)  # warm-up: the first launch loads the kernel
        rates = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(probe_cycles)
            end.record()
            end.synchronize()
            rates.append(probe_cycles / start.elapsed_time(end))
    return statistics.median(rates)


def gpu_sleep(ms: float, rate: float | None = None) -> None:
    """Enqueue one kernel that keeps one SM busy for about `ms` ms on the current stream (host returns at once)."""
    torch.cuda._sleep(max(1, int(ms * (rate if rate is not None else cycles_per_ms()))))


def best_of(fn: Callable[[], float], repeats: int = 3) -> float:
    """The smallest of `repeats` calls of a timing function: noise on a shared machine only adds time."""
    return min(fn() for _ in range(repeats))
