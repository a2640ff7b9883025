"""What recording a Timeline costs, measured on this machine.

    python benchmarks/timeline_overhead.py            # GPU parts need CUDA; on a CPU only host spans
    python benchmarks/timeline_overhead.py --n 1000 --repeats 5 --png timeline.png

1. Host cost of one span: `with tl.span(...): pass` in a loop, per span, next to two bare
   `torch.cuda.Event.record` calls (what a CUDA span does at least). On a CPU: host-clock spans.
2. A loop of `n` small kernels with and without a span around each kernel, wall time from the first
   launch to the end of the work (synchronize), median of `repeats`. Two loops: a launch-bound one
   (add_ on 1024 floats: the GPU waits for Python) and one whose kernels are longer than their launch
   (1024x1024 matmul). Target: under 10% slowdown on the second. The span loops run under
   torch.cuda.set_sync_debug_mode("error"), so a synchronising call while recording would stop the run.
Every figure printed comes from this run.
"""

from __future__ import annotations

import argparse
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


def span_cost(n: int, device: str) -> dict[str, float]:
    tl = Timeline(device=device)

    def one():
        with tl.span("x"):
            pass

    per_call_us(one, 1000)
    tl.spans()  # resolve the warm-up; its events go back to the pool
    # Ten batches: the median is the span's own cost; the mean also carries the occasional full
    # garbage-collector pass (slow after `import torch`: many objects), which the allocations trigger.
    batches = [per_call_us(one, n // 10) for _ in range(10)]
    out = {"span_us": statistics.median(batches), "span_us_mean": statistics.mean(batches)}
    t0 = time.perf_counter()
    tl.spans()
    out["resolve_us_per_span"] = (time.perf_counter() - t0) / n * 1e6
    if device == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def two_records():
            a.record()
            b.record()

        per_call_us(two_records, 1000)
        out["two_event_records_us"] = statistics.median(per_call_us(two_records, n // 10) for _ in range(10))
        torch.cuda.synchronize()
    return out


def loop_ms(step, n: int, tl: Timeline | None) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    if tl is None:
        for _ in range(n):
            step()
    else:
        torch.cuda.set_sync_debug_mode("error")
        try:
            for i in range(n):
                with tl.span(f"k{i}"):
                    step()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def slowdown(name: str, step, n: int, repeats: int) -> dict[str, float]:
    loop_ms(step, n, None)
    loop_ms(step, n, Timeline())  # warm-up: kernels, event pool
    bare, spanned = [], []
    for _ in range(repeats):  # alternate so both see the same machine state
        bare.append(loop_ms(step, n, None))
        tl = Timeline()
        spanned.append(loop_ms(step, n, tl))
        spans = tl.spans()
    gpu_ms = statistics.median(s.duration_ms for s in spans)
    b, s = statistics.median(bare), statistics.median(spanned)
    print(f"  {name:<28} {n} kernels: bare {b:8.2f} ms, with spans {s:8.2f} ms, ratio {s / b:5.3f} "
          f"(median kernel span {gpu_ms * 1e3:.1f} µs)")
    return {"bare_ms": b, "spans_ms": s, "ratio": s / b}


def demo_png(path: str) -> None:
    """A picture to look at: two side streams of compute and a pinned copy, with the host's launches."""
    import matplotlib

    matplotlib.use("Agg")
    x = torch.randn(4096, 4096, device="cuda")
    host = torch.empty(32 * 2**20 // 4, pin_memory=True)
    dev = torch.empty_like(host, device="cuda")
    s1, s2, s3 = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    y = x @ x
    torch.cuda.synchronize()
    tl = Timeline()
    for s, label in ((s1, "compute A"), (s2, "compute B"), (s3, "copy")):
        tl.name_stream(s, label)
    with tl.span("launch loop", kind="host"):
        for i in range(3):
            with tl.span(f"mm A{i}", stream=s1):
                y = x @ x
            with tl.span(f"mm B{i}", stream=s2):
                y = x @ x
            with tl.span(f"h2d {i}", kind="h2d", stream=s3):
                dev.copy_(host, non_blocking=True)
            tl.mark(f"step {i}", stream="host")
    with tl.span("synchronize", kind="host"):
        torch.cuda.synchronize()
    del y
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
    host = span_cost(args.spans, "cpu")
    print(f"host-clock span: {host['span_us']:.2f} µs per span (median of 10 batches; mean with GC passes "
          f"{host['span_us_mean']:.2f}), resolving {host['resolve_us_per_span']:.2f} µs/span")
    if not torch.cuda.is_available():
        print("no CUDA here: CUDA-event spans and the kernel loops are skipped")
        return
    print(f"GPU: {torch.cuda.get_device_name()}")
    cuda = span_cost(args.spans, "cuda")
    print(f"CUDA span: {cuda['span_us']:.2f} µs host time per span (mean {cuda['span_us_mean']:.2f}) "
          f"(two bare Event.record calls: {cuda['two_event_records_us']:.2f} µs); "
          f"resolving in spans(): {cuda['resolve_us_per_span']:.2f} µs/span")
    small = torch.zeros(1024, device="cuda")
    a = torch.randn(1024, 1024, device="cuda")
    print("slowdown of a kernel loop with a span around each kernel (no synchronisation while recording):")
    slowdown("launch-bound: add_ 1024", lambda: small.add_(1), args.n, args.repeats)
    slowdown("matmul 1024x1024", lambda: torch.mm(a, a), args.n, args.repeats)
    if args.png:
        demo_png(args.png)


if __name__ == "__main__":
    main()
