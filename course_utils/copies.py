"""Lesson 04, asynchronous copies: pinned vs pageable memory, copy bandwidth, copy/compute overlap.

Plain functions that measure and return data (dicts, BenchResult dicts, span dicts); the notebook draws
them with `bench.plot_bandwidth` and `Timeline.plot`. `RECORDINGS` makes the lesson's reference
recording, shown on machines without CUDA.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from . import bench

MiB = 1 << 20


def pcie_limit() -> tuple[float | None, str]:
    """The theoretical one-direction PCIe bandwidth of GPU 0 (GB/s) and a label, from `hardware.probe()`."""
    try:
        from .hardware import probe

        gpus = probe().gpus
    except Exception as exc:  # hardware facts are a nicety here, never a reason to fail
        return None, f"PCIe limit unknown ({type(exc).__name__})"
    if not gpus or gpus[0].pcie_gbps is None:
        return None, "PCIe limit unknown"
    g = gpus[0]
    return g.pcie_gbps, f"PCIe Gen{g.pcie_gen} x{g.pcie_width} limit"


def host_buffer(nbytes: int, pinned: bool) -> torch.Tensor:
    """A host byte buffer with its pages touched (pageable pages exist only once written)."""
    t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
    t.fill_(1)
    return t


def copy_sweep(sizes: list[int], ops: tuple[str, ...] = ("h2d", "d2h", "d2d"),
               memories: tuple[str, ...] = ("pinned", "pageable"), budget_ms: float = 30.0) -> list[bench.BenchResult]:
    """Bandwidth of `copy_` over `sizes` (bytes) for each direction and host memory kind, on GPU 0.

    On a machine without CUDA only host-to-host copies ("h2h pageable") are measured: RAM bandwidth.
    """
    results = []
    if not torch.cuda.is_available():
        for n in sizes:
            src, dst = host_buffer(n, False), host_buffer(n, False)
            results.append(bench.measure("h2h pageable", n, lambda d=dst, s=src: d.copy_(s), cuda=False,
                                         budget_ms=budget_ms))
        return results
    big = max(sizes)
    dev_a = torch.empty(big, dtype=torch.uint8, device="cuda")
    dev_b = torch.empty(big, dtype=torch.uint8, device="cuda")
    for mem in memories:
        host = host_buffer(big, mem == "pinned")
        for op in ops:
            if op == "d2d" and mem != memories[0]:
                continue  # no host memory involved: measure it once
            label = "d2d" if op == "d2d" else f"{op} {mem}"
            for n in sizes:
                h, a, b = host[:n], dev_a[:n], dev_b[:n]
                fn = {"h2d": lambda a=a, h=h: a.copy_(h, non_blocking=True),
                      "d2h": lambda a=a, h=h: h.copy_(a, non_blocking=True),
                      "d2d": lambda a=a, b=b: b.copy_(a, non_blocking=True)}[op]
                results.append(bench.measure(label, n, fn, cuda=True, budget_ms=budget_ms))
        del host
    return results


def sweep_data(sizes: list[int]) -> dict[str, Any]:
    """A copy sweep plus the PCIe limit to draw it against, as JSON-ready data."""
    limit, label = pcie_limit() if torch.cuda.is_available() else (None, "no GPU")
    return {"results": [r.to_dict() for r in copy_sweep(sizes)], "limit_gbps": limit, "limit_label": label}


def plot_sweep(data: dict[str, Any], title: str | None = None):
    """Draw `sweep_data` output: bandwidth against size, with the PCIe limit as a dashed line."""
    results = [bench.BenchResult.from_dict(d) for d in data["results"]]
    limits = {data["limit_label"]: data["limit_gbps"]} if data.get("limit_gbps") else {}
    return bench.plot_bandwidth(results, limits=limits, title=title)


def nonblocking_host_time(nbytes: int, repeats: int = 3) -> dict[str, Any]:
    """How long `dev.copy_(host, non_blocking=True)` holds the host, from pageable and from pinned memory.

    Returns, per memory kind, the host time until the call returned and until the copy was done (ms),
    medians over `repeats`.
    """
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out: dict[str, Any] = {"nbytes": nbytes}
    for mem in ("pageable", "pinned"):
        host = host_buffer(nbytes, mem == "pinned")
        dev.copy_(host)
        torch.cuda.synchronize()
        returned, done = [], []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            t1 = time.perf_counter()
            torch.cuda.synchronize()
            t2 = time.perf_counter()
            returned.append((t1 - t0) * 1e3)
            done.append((t2 - t0) * 1e3)
        out[mem] = {"returned_ms": sorted(returned)[repeats // 2], "done_ms": sorted(done)[repeats // 2]}
    return out


def pin_cost(nbytes: int) -> dict[str, Any]:
    """The cost of pinning on the fly: `pin_memory()` (first call and from the pinned cache) vs copying.

    All in host ms, each ending with the GPU idle.
    """
    host = host_buffer(nbytes, False)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()

    def timed(fn) -> float:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return (time.perf_counter() - t0) * 1e3

    box: dict[str, torch.Tensor] = {}
    first = timed(lambda: box.__setitem__("p", host.pin_memory()))
    del box["p"]  # back to PyTorch's pinned-memory cache
    cached = timed(lambda: box.__setitem__("p", host.pin_memory()))
    pinned = box["p"]
    dev.copy_(host)
    copy_pageable = timed(lambda: dev.copy_(host))
    copy_pinned = timed(lambda: dev.copy_(pinned, non_blocking=True))
    return {"nbytes": nbytes, "pin_first_ms": first, "pin_cached_ms": cached, "copy_pageable_ms": copy_pageable,
            "copy_pinned_ms": copy_pinned}


def overlap_spans(n_chunks: int = 6, chunk_bytes: int = 64 * MiB, compute_ms: float | None = None,
                  overlapped: bool = True) -> list[dict[str, Any]]:
    """Copy chunks to the GPU and compute on each, serially on one stream or on two streams with events.

    compute: a kernel of `compute_ms` (default: as long as one chunk's copy) that reads the chunk.
    Both streams are side streams. Returns the spans as dicts.
    """
    from .events import cycles_per_ms, sleep_ms
    from .timeline import Timeline

    host = [host_buffer(chunk_bytes, True) for _ in range(n_chunks)]
    dev = [torch.empty(chunk_bytes, dtype=torch.uint8, device="cuda") for _ in range(n_chunks)]
    if compute_ms is None:
        compute_ms = bench.measure("h2d", chunk_bytes, lambda: dev[0].copy_(host[0], non_blocking=True)).time_ms
    copy_s, compute_s = torch.cuda.Stream(), torch.cuda.Stream()
    if not overlapped:
        copy_s = compute_s
    cycles_per_ms()  # calibrate and load the kernels before timing: a first call is not a typical one
    dev[0].add_(1)
    torch.cuda.synchronize()
    tl = Timeline()
    tl.name_stream(copy_s, "copy" if overlapped else "copy + compute")
    tl.name_stream(compute_s, "compute" if overlapped else "copy + compute")
    torch.cuda.synchronize()
    for i in range(n_chunks):
        with tl.span(f"h2d {i}", kind="h2d", stream=copy_s):
            dev[i].copy_(host[i], non_blocking=True)
        ready = torch.cuda.Event()
        ready.record(copy_s)
        compute_s.wait_event(ready)
        with tl.span(f"compute {i}", kind="compute", stream=compute_s):
            dev[i].add_(1)
            sleep_ms(compute_ms)
    torch.cuda.synchronize()
    return [s.to_dict() for s in tl.spans()]


def _record() -> dict[str, Any]:
    """Everything lesson 04 shows, measured on this GPU."""
    sizes = [1 << k for k in range(10, 29, 2)]  # 1 KiB .. 256 MiB
    return {
        "sweep": sweep_data(sizes),
        "nonblocking": nonblocking_host_time(256 * MiB),
        "pin_cost": pin_cost(256 * MiB),
        "serial_spans": overlap_spans(overlapped=False),
        "overlap_spans": overlap_spans(overlapped=True),
    }


RECORDINGS = {"04_copies": _record}
