"""Measure data movement the way nccl-tests reports it: size, time per call, algorithm bandwidth.

    r = measure("h2d pinned", nbytes, lambda: dev.copy_(host, non_blocking=True))
    r.algbw_gbps                    # bytes moved / time, in GB/s (1 GB = 1e9 bytes, as nccl-tests)
    print(format_table(results))    # one line per (op, size)
    plot_bandwidth(results, limits={"PCIe Gen5 x16": 63.0})

Copies (lesson 04) use it now; collectives can join later by filling `busbw_gbps` (nccl-tests' bus
bandwidth: algbw times a factor per collective). Measuring and drawing are separate functions.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch


@dataclass
class BenchResult:
    """One measured operation at one size. time_ms is the median over `iters` timed calls."""

    op: str
    size_bytes: int
    time_ms: float
    algbw_gbps: float
    busbw_gbps: float | None = None
    iters: int = 1

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchResult:
        return cls(**d)


def time_calls(fn: Callable[[], Any], cuda: bool | None = None, warmup: int = 2, min_iters: int = 3,
               max_iters: int = 200, budget_ms: float = 50.0) -> list[float]:
    """Call `fn` repeatedly and return each call's time in ms.

    On CUDA each call is bracketed by two events on the current stream (device time, the way the GPU
    saw it); otherwise by the host clock. Stops after `budget_ms` of measured time or `max_iters` calls.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times: list[float] = []
    while len(times) < max_iters:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        if len(times) >= min_iters and sum(times) >= budget_ms:
            break
    return times


def measure(op: str, size_bytes: int, fn: Callable[[], Any], cuda: bool | None = None, **kwargs: Any) -> BenchResult:
    """Time `fn`, which moves `size_bytes`, and report the median time and algbw (GB/s)."""
    times = time_calls(fn, cuda=cuda, **kwargs)
    t = statistics.median(times)
    return BenchResult(op=op, size_bytes=int(size_bytes), time_ms=t, algbw_gbps=size_bytes / (t * 1e6),
                       iters=len(times))


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_table(results: Iterable[BenchResult]) -> str:
    """nccl-tests-like table: op, size, time (us), algbw (GB/s), busbw (GB/s) where known."""
    lines = [f"{'op':>18} {'size':>10} {'time (us)':>11} {'algbw (GB/s)':>13} {'busbw (GB/s)':>13}"]
    for r in results:
        bus = f"{r.busbw_gbps:13.2f}" if r.busbw_gbps is not None else f"{'-':>13}"
        lines.append(f"{r.op:>18} {human_bytes(r.size_bytes):>10} {r.time_ms * 1e3:11.1f} {r.algbw_gbps:13.2f} {bus}")
    return "\n".join(lines)


def plot_bandwidth(results: Iterable[BenchResult], limits: dict[str, float] | None = None, title: str | None = None,
                   ax: Any = None):
    """Bandwidth (GB/s) against transfer size, one line per op, dashed lines for theoretical limits."""
    import matplotlib.pyplot as plt

    results = list(results)
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
    else:
        fig = ax.figure
    for op in dict.fromkeys(r.op for r in results):
        mine = sorted((r for r in results if r.op == op), key=lambda r: r.size_bytes)
        ax.plot([r.size_bytes for r in mine], [r.algbw_gbps for r in mine], marker="o", label=op)
    for i, (label, gbps) in enumerate((limits or {}).items()):
        if gbps:
            ax.axhline(gbps, linestyle="--", color=f"C{7 + i}", label=f"{label}: {gbps:g} GB/s")
    ax.set_xscale("log", base=2)
    sizes = sorted({r.size_bytes for r in results})
    if sizes:
        ticks = sizes[:: max(1, len(sizes) // 8)]
        ax.set_xticks(ticks, [human_bytes(s) for s in ticks], rotation=30)
    ax.set_xlabel("transfer size (bytes)")
    ax.set_ylabel("bandwidth (GB/s, 1 GB = 1e9 B)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig
