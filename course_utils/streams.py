"""Lesson 02 measurements: work on several CUDA streams, where it overlaps and where it cannot.

Each `*_on_streams` function launches a list of jobs round-robin over some streams, times every job
with a Timeline (CUDA events), and returns plain data: {"spans": [span dicts], "makespan_ms": ...}.
Draw it with `Timeline.from_spans(result["spans"]).plot()`. benchmarks/record_references.py calls
`record_lesson02` on a GPU; the notebook shows that recording on a machine without CUDA.
"""

from __future__ import annotations

import ctypes
import functools
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .host_device import calibrate_sleep
from .timeline import Timeline

Job = tuple[str, Callable[[], Any]]


def makespan_ms(spans: Sequence[dict[str, Any]], kind: str = "compute") -> float:
    """From the first start to the last end of the spans of `kind` (ms)."""
    sel = [s for s in spans if s["kind"] == kind]
    if not sel:
        raise ValueError(f"no {kind!r} spans to measure")
    return max(s["end_ms"] for s in sel) - min(s["start_ms"] for s in sel)


def side_streams(n: int) -> list[torch.cuda.Stream]:
    """`n` distinct streams from PyTorch's pool (created non-blocking: no implicit sync with the default stream)."""
    return [torch.cuda.Stream() for _ in range(n)]


@functools.lru_cache(maxsize=1)
def blocking_stream() -> torch.cuda.ExternalStream:
    """A stream made by plain `cudaStreamCreate`: a *blocking* stream, which the legacy default stream syncs with.

    PyTorch's own side streams are created with cudaStreamNonBlocking, so they never show this.
    """
    handle = ctypes.c_void_p()
    err = torch.cuda.cudart().cudaStreamCreate(ctypes.addressof(handle))
    code = int(getattr(err, "value", err))
    if code != 0 or not handle.value:
        raise RuntimeError(f"cudaStreamCreate failed with error {code}")
    return torch.cuda.ExternalStream(handle.value)


def on_streams(jobs: Sequence[Job], streams: Sequence[torch.cuda.Stream], labels: Sequence[str] | None = None,
               chunked: bool = False) -> dict[str, Any]:
    """Launch `jobs` over `streams` (round-robin, or in contiguous chunks), timing each with a Timeline.

    The launching loop itself is a host span, so a launch-bound loop shows up. The current stream waits
    for all `streams` at the end, as code that uses the results would have to.
    """
    main = torch.cuda.current_stream()
    torch.cuda.synchronize()
    tl = Timeline()
    for s, label in zip(streams, labels or [], strict=False):
        tl.name_stream(s, label)
    per = -(-len(jobs) // len(streams))
    with tl.span("host: launching", kind="host", stream="host"):
        for i, (name, job) in enumerate(jobs):
            stream = streams[i // per] if chunked else streams[i % len(streams)]
            with tl.span(name, kind="compute", stream=stream):
                job()
    for s in streams:
        if s != main:
            main.wait_stream(s)
    spans = [s.to_dict() for s in tl.spans()]
    return {"spans": spans, "makespan_ms": makespan_ms(spans), "n_streams": len(streams)}


# ---------------------------------------------------------------------------- where streams help


def sleep_jobs(n: int, kernel_ms: float) -> list[Job]:
    """`n` independent `_sleep` kernels of `kernel_ms` each: one thread each, leaving almost every SM idle."""
    cycles = int(kernel_ms * calibrate_sleep())
    return [(f"sleep {i}", functools.partial(torch.cuda._sleep, cycles)) for i in range(n)]


def sleep_on_streams(n_kernels: int, kernel_ms: float, n_streams: int) -> dict[str, Any]:
    """`n_kernels` sleep kernels round-robin over `n_streams` side streams."""
    out = on_streams(sleep_jobs(n_kernels, kernel_ms), side_streams(n_streams),
                     [f"side stream {i + 1}" for i in range(n_streams)])
    out["serial_ms"] = n_kernels * kernel_ms
    return out


def default_stream_pairs(kernel_ms: float, n_kernels: int = 4) -> dict[str, dict[str, Any]]:
    """The same alternating sleeps on three pairs of streams: two side streams, default + side, default + blocking.

    With the legacy default stream, a kernel there waits for all earlier work on *blocking* streams and
    blocks later work on them; non-blocking streams (PyTorch's pool) are exempt.
    """
    default = torch.cuda.default_stream()
    pairs = {
        "two side streams": (side_streams(2), ["side stream 1", "side stream 2"]),
        "default + side stream": ([default, side_streams(1)[0]], ["default stream", "side stream (non-blocking)"]),
        "default + blocking stream": ([default, blocking_stream()], ["default stream",
                                                                     "blocking stream (cudaStreamCreate)"]),
    }
    results = {}
    for name, (streams, labels) in pairs.items():
        with torch.cuda.stream(default):
            results[name] = on_streams(sleep_jobs(n_kernels, kernel_ms), streams, labels)
        results[name]["serial_ms"] = n_kernels * kernel_ms
    return results


# ------------------------------------------------------------------------- where they cannot help


def matmul_on_streams(size: int, n: int, n_streams: int, dtype: torch.dtype = torch.bfloat16) -> dict[str, Any]:
    """`n` independent size x size matmuls over `n_streams` side streams: each one already fills the GPU."""
    xs = [torch.randn(size, size, device="cuda", dtype=dtype) for _ in range(n)]
    for x in xs[:2]:
        x @ x  # warm-up
    outs: list[torch.Tensor] = []
    jobs = [(f"matmul {i}", functools.partial(lambda x: outs.append(x @ x), x)) for i, x in enumerate(xs)]
    return on_streams(jobs, side_streams(n_streams), [f"side stream {i + 1}" for i in range(n_streams)])


def tiny_op_jobs(n_chains: int, ops_per_chain: int, numel: int = 1024) -> list[Job]:
    """`n_chains` chains of `ops_per_chain` in-place adds on small tensors, launched from a Python loop."""
    tensors = [torch.zeros(numel, device="cuda") for _ in range(n_chains)]

    def chain(t: torch.Tensor) -> None:
        for _ in range(ops_per_chain):
            t.add_(1.0)

    return [(f"{ops_per_chain} tiny adds", functools.partial(chain, t)) for t in tensors]


def tiny_ops_on_streams(n_chains: int, ops_per_chain: int, n_streams: int) -> dict[str, Any]:
    """Chains of tiny kernels over `n_streams` side streams: the host's launch rate is the limit."""
    tiny_op_jobs(1, 10)[0][1]()  # warm-up
    out = on_streams(tiny_op_jobs(n_chains, ops_per_chain), side_streams(n_streams),
                     [f"side stream {i + 1}" for i in range(n_streams)], chunked=True)
    launch = [s for s in out["spans"] if s["kind"] == "host"][0]
    out["host_launch_ms"] = launch["end_ms"] - launch["start_ms"]
    return out


def launch_bound(result: dict[str, Any], slack: float = 1.15) -> bool:
    """True when the GPU finished within `slack` times the host's launch time: Python was the bottleneck.

    Which case a machine is in depends on its CPU: a host that launches faster than the GPU runs these
    tiny kernels makes the same loop GPU-bound, and then a second stream can help.
    """
    return result["makespan_ms"] <= slack * result["host_launch_ms"]


def host_cost_per_op_us(device: torch.device | str, n: int = 2000, numel: int = 1024) -> float:
    """Host time per tiny in-place add issued from Python (µs): on any device, the floor of a launch."""
    t = torch.zeros(numel, device=device)
    for _ in range(100):
        t.add_(1.0)
    t0 = time.perf_counter()
    for _ in range(n):
        t.add_(1.0)
    elapsed = time.perf_counter() - t0
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()
    return elapsed / n * 1e6


def handoff(kernel_ms: float) -> dict[str, Any]:
    """A producer on a side stream, a consumer on the current stream, ordered by `wait_stream`.

    `main.wait_stream(side)` enqueues a wait on `main` for the work queued on `side` so far; the host
    does not wait. The consumer's kernel starts only when the producer's has finished.
    """
    main, side = torch.cuda.current_stream(), side_streams(1)[0]
    x = torch.empty(1024, device="cuda")
    torch.cuda.synchronize()
    tl = Timeline()
    tl.name_stream(side, "side stream (producer)")
    side.wait_stream(main)  # x was allocated on main: the producer must not start before main gets there
    with tl.span("produce: sleep, then fill x", stream=side):
        torch.cuda._sleep(int(kernel_ms * calibrate_sleep()))
        x.fill_(1.0)
    with tl.span("main.wait_stream(side)", kind="host", stream="host"):
        main.wait_stream(side)
    with tl.span("consume: y = x * 2", stream=main):
        y = x * 2
    spans = [s.to_dict() for s in tl.spans()]
    return {"spans": spans, "y_ok": bool((y == 2).all().item())}


# ------------------------------------------------------------------------------------- the exercise


class SleepChains:
    """The exercise's workload: independent chains of steps; each step sleeps, then counts itself.

    Steps of one chain must run in order; different chains share nothing but the `counts` tensor
    (each writes its own element). After a run, `counts` must equal `expected()` as seen by the
    current stream.
    """

    def __init__(self, n_chains: int = 2, steps_per_chain: int = 4, step_ms: float = 5.0):
        self.step_ms = step_ms
        self.cycles = int(step_ms * calibrate_sleep())
        self.counts = torch.zeros(n_chains, device="cuda")
        self.chains: list[list[Callable[[], None]]] = [
            [functools.partial(self._step, c) for _ in range(steps_per_chain)] for c in range(n_chains)
        ]

    def _step(self, chain: int) -> None:
        torch.cuda._sleep(self.cycles)
        self.counts[chain].add_(1.0)

    def reset(self) -> None:
        self.counts.zero_()
        torch.cuda.synchronize()

    def expected(self) -> list[float]:
        return [float(len(c)) for c in self.chains]

    def serial_ms(self) -> float:
        return sum(len(c) for c in self.chains) * self.step_ms


def run_on_one_stream(workload: SleepChains) -> None:
    """The baseline: every step of every chain on the current stream, one after another."""
    for chain in workload.chains:
        for step in chain:
            step()


def time_run(run: Callable[[SleepChains], Any], workload: SleepChains, repeats: int = 3) -> dict[str, Any]:
    """Best wall time (ms) of `run(workload)` over `repeats`, and the counts the current stream saw after it.

    The counts are copied on the current stream right after `run` returns, before any sync: if `run`
    left the current stream free to go on before the chains finished, the copy sees unfinished counts.
    """
    times, seen = [], []
    for _ in range(repeats):
        workload.reset()
        t0 = time.perf_counter()
        run(workload)
        snapshot = workload.counts.clone()  # enqueued on the current stream
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        seen.append(snapshot.tolist())
    return {"ms": min(times), "counts": seen}


def split_chains_reference(workload: SleepChains) -> None:
    """One way to do the exercise (used by tests and the recording): one side stream per chain."""
    main = torch.cuda.current_stream()
    streams = side_streams(len(workload.chains))
    for s, chain in zip(streams, workload.chains, strict=True):
        s.wait_stream(main)
        with torch.cuda.stream(s):
            for step in chain:
                step()
    for s in streams:
        main.wait_stream(s)


# ---------------------------------------------------------------------------------------- recording

GPU_SIZES = {"kernel_ms": 5.0, "n_kernels": 8, "matmul": 8192, "n_matmuls": 4, "tiny_chains": 2,
             "tiny_ops": 400}


def record_lesson02() -> dict[str, Any]:
    """Every GPU measurement lesson 02 shows, at GPU_SIZES (run by benchmarks/record_references.py)."""
    s = GPU_SIZES
    work = SleepChains()
    return {
        "sizes": dict(s),
        "cycles_per_ms": calibrate_sleep(),
        "sleep": {str(n): sleep_on_streams(s["n_kernels"], s["kernel_ms"], n) for n in (1, 2, 4)},
        "default_stream": default_stream_pairs(s["kernel_ms"]),
        "matmul": {str(n): matmul_on_streams(s["matmul"], s["n_matmuls"], n) for n in (1, 2)},
        "tiny": {str(n): tiny_ops_on_streams(s["tiny_chains"], s["tiny_ops"], n) for n in (1, 2)},
        "host_us_per_op": host_cost_per_op_us("cuda"),
        "handoff": handoff(s["kernel_ms"]),
        "exercise": {"one_stream_ms": time_run(run_on_one_stream, work)["ms"],
                     "split_ms": time_run(split_chains_reference, work)["ms"], "serial_ms": work.serial_ms()},
    }


RECORDINGS = {"02_streams": record_lesson02}


# ------------------------------------------------------------------------------------------ drawing


def plot_makespans(results: dict[str, dict[str, Any]], title: str = ""):
    """Bars: makespan (ms) per configuration, with the speed-up over the first one written on each bar."""
    import matplotlib.pyplot as plt

    names = list(results)
    spans = [results[n]["makespan_ms"] for n in names]
    fig, ax = plt.subplots(figsize=(7, 0.6 * len(names) + 1.4))
    bars = ax.barh(names, spans, color="tab:blue")
    for bar, ms in zip(bars, spans, strict=True):
        ax.text(bar.get_width(), bar.get_y() + bar.get_height() / 2, f" {ms:.1f} ms, x{spans[0] / ms:.2f}",
                va="center")
    ax.invert_yaxis()
    ax.set_xlabel("makespan: first kernel start to last kernel end (ms)")
    ax.set_xlim(0, max(spans) * 1.35)
    ax.set_title(title or "Same work, different streams")
    fig.tight_layout()
    return fig
