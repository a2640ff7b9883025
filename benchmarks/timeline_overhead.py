"""What recording a Timeline costs, measured on this machine, in each mode.

    python benchmarks/timeline_overhead.py            # GPU parts need CUDA; on a CPU: host and kernels (CPU ops)
    python benchmarks/timeline_overhead.py --n 1000 --repeats 5 --png timeline.png

1. Host cost of one span, `with tl.span(...): pass` in a loop: host mode (perf_counter), events mode (two
   CUDA event records; next to two bare Event.record calls) and kernels mode (a record_function inside a
   running capture). Median of ten batches.
2. A loop of `n` small kernels, wall time from the first launch to the end of the work (synchronize),
   median of `repeats`: bare; events mode with a span around each kernel; kernels mode with the loop
   inside a capture, without and with a span per kernel (the profiler records every launch and kernel).
   Two loops: a launch-bound one (add_ on 1024 floats: the GPU waits for Python) and one whose kernels
   are longer than their launch (1024x1024 matmul). The span loops run under
   torch.cuda.set_sync_debug_mode("error"), so a synchronising call while recording would stop the run.
3. Kernels mode's fixed cost per capture: starting and stopping the profiler, reading its trace (spans()).
Every figure printed comes from this run.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from course_utils.timeline import Timeline  # noqa: E402


def per_call_us(fn, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def span_cost(n: int, mode: str, device: str | None = None) -> dict[str, float]:
    """Host µs per empty span (median of 10 batches; the mean also carries garbage-collector passes)."""
    tl = Timeline(device=device, mode=mode)
    out: dict[str, float] = {}
    with tl.capture():  # a no-op outside kernels mode

        def one():
            with tl.span("x"):
                pass

        per_call_us(one, 1000)  # warm-up
        batches = [per_call_us(one, n // 10) for _ in range(10)]
        out["span_us"], out["span_us_mean"] = statistics.median(batches), statistics.mean(batches)
        t0 = time.perf_counter()
    if mode == "kernels":
        out["stop_ms"] = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    tl.spans()
    out["resolve_us_per_span"] = (time.perf_counter() - t0) / (n + 1000) * 1e6
    if mode == "events":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def two_records():
            a.record()
            b.record()

        per_call_us(two_records, 1000)
        out["two_event_records_us"] = statistics.median(per_call_us(two_records, n // 10) for _ in range(10))
        torch.cuda.synchronize()
    return out


def loop_ms(step, n: int, mode: str | None, spans: bool) -> float:
    """Wall ms of n steps, from the first launch to the end of the work (the capture's start and stop excluded)."""
    tl = Timeline(mode=mode) if mode else None
    torch.cuda.synchronize()
    with tl.capture() if tl is not None else contextlib.nullcontext():
        torch.cuda.set_sync_debug_mode("error" if tl is not None else 0)
        try:
            t0 = time.perf_counter()
            if spans:
                for i in range(n):
                    with tl.span(f"k{i}"):
                        step()
            else:
                for _ in range(n):
                    step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        took = (time.perf_counter() - t0) * 1e3
    if tl is not None:
        tl.spans()
    return took


def slowdown(name: str, step, n: int, repeats: int) -> None:
    cases = {"bare": (None, False), "events, span per kernel": ("events", True),
             "kernels, capture only": ("kernels", False), "kernels, span per kernel": ("kernels", True)}
    for mode, spans in cases.values():  # warm-up: kernels, event pool, the profiler's first start
        loop_ms(step, n, mode, spans)
    times: dict[str, list[float]] = {k: [] for k in cases}
    for _ in range(repeats):  # interleaved so every case sees the same machine state
        for label, (mode, spans) in cases.items():
            times[label].append(loop_ms(step, n, mode, spans))
    bare = statistics.median(times["bare"])
    print(f"  {name} ({n} kernels):")
    for label, ts in times.items():
        t = statistics.median(ts)
        print(f"    {label:<26} {t:9.2f} ms   x{t / bare:5.2f}")


def capture_cost(repeats: int) -> None:
    """Kernels mode's fixed cost: an empty capture's enter + exit, and reading its trace."""
    enter, leave, read = [], [], []
    for _ in range(repeats + 1):
        tl = Timeline(mode="kernels")
        t0 = time.perf_counter()
        cm = tl.capture()
        cm.__enter__()
        t1 = time.perf_counter()
        cm.__exit__(None, None, None)
        t2 = time.perf_counter()
        tl.spans()
        t3 = time.perf_counter()
        enter.append((t1 - t0) * 1e3)
        leave.append((t2 - t1) * 1e3)
        read.append((t3 - t2) * 1e3)
    print(f"kernels mode, per capture (median of {repeats}, after a first one of {enter[0] + leave[0]:.0f} ms): "
          f"start {statistics.median(enter[1:]):.1f} ms, stop {statistics.median(leave[1:]):.1f} ms, "
          f"spans() {statistics.median(read[1:]):.2f} ms")


def demo_png(path: str) -> None:
    """A picture to look at: two side streams of compute and a pinned copy, with the host's launches."""
    import matplotlib

    matplotlib.use("Agg")
    x = torch.randn(4096, 4096, device="cuda")
    host = torch.empty(32 * 2**20 // 4, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    s1, s2, s3 = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    x @ x
    torch.cuda.synchronize()
    tl = Timeline(mode="kernels")
    for s, label in ((s1, "compute A"), (s2, "compute B"), (s3, "copy")):
        tl.name_stream(s, label)
    with tl.capture():
        with tl.span("launch loop", kind="host"):
            for i in range(3):
                with tl.span(f"mm A{i}", stream=s1):
                    x @ x
                with tl.span(f"mm B{i}", stream=s2):
                    x @ x
                with tl.span(f"h2d {i}", kind="h2d", stream=s3):
                    dev.copy_(host, non_blocking=True)
                tl.mark(f"step {i}", stream="host")
        with tl.span("synchronize", kind="host"):
            torch.cuda.synchronize()
    print(tl.stats().summary())
    fig = tl.plot(title=f"Timeline demo on {torch.cuda.get_device_name()}")
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"  saved {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1000, help="kernels per loop")
    p.add_argument("--spans", type=int, default=10000, help="spans timed for the per-span host cost")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--png", help="also save a demo timeline picture here (GPU only)")
    args = p.parse_args()

    print(f"torch {torch.__version__}, python {sys.version.split()[0]}")
    host = span_cost(args.spans, "host", device="cpu")
    print(f"host mode: {host['span_us']:.2f} µs per span (median of 10 batches; mean with GC passes "
          f"{host['span_us_mean']:.2f}), resolving {host['resolve_us_per_span']:.2f} µs/span")
    if not torch.cuda.is_available():
        k = span_cost(args.spans, "kernels", device="cpu")
        print(f"kernels mode (CPU ops only here): {k['span_us']:.2f} µs per span inside a capture "
              f"(mean {k['span_us_mean']:.2f}); stopping the capture and reading its trace: {k['stop_ms']:.1f} ms "
              f"for {args.spans + 1000} spans")
        print("no CUDA here: events mode and the kernel loops are skipped")
        return
    print(f"GPU: {torch.cuda.get_device_name()}")
    ev = span_cost(args.spans, "events")
    print(f"events mode: {ev['span_us']:.2f} µs host time per span (mean {ev['span_us_mean']:.2f}) "
          f"(two bare Event.record calls: {ev['two_event_records_us']:.2f} µs); "
          f"resolving in spans(): {ev['resolve_us_per_span']:.2f} µs/span")
    k = span_cost(args.spans, "kernels")
    print(f"kernels mode: {k['span_us']:.2f} µs host time per span inside a capture (mean {k['span_us_mean']:.2f}); "
          f"stopping the capture and reading its trace: {k['stop_ms']:.1f} ms for {args.spans + 1000} spans")
    capture_cost(args.repeats)
    small = torch.zeros(1024, device="cuda")
    a = torch.randn(1024, 1024, device="cuda")
    print("kernel loops, wall time from the first launch to the end of the work (no synchronisation while recording):")
    slowdown("launch-bound: add_ 1024", lambda: small.add_(1), args.n, args.repeats)
    slowdown("matmul 1024x1024", lambda: torch.mm(a, a), args.n, args.repeats)
    if args.png:
        demo_png(args.png)


if __name__ == "__main__":
    main()
