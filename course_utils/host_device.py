"""Lesson 01 measurements: the host launches, the device works, and some calls make the host wait.

Plain functions that measure and return data (dicts of numbers, lists of span dicts); `plot_*`
functions draw that data. The notebook calls them live on a GPU; benchmarks/record_references.py
calls `record_lesson01` on a GPU and stores the result, which the notebook shows on a CPU-only machine.
"""

from __future__ import annotations

import functools
import io
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .timeline import Timeline

# ---------------------------------------------------------------------------------------------- basics


def has_cuda() -> bool:
    return torch.cuda.is_available()


def sync(device: torch.device | str) -> None:
    """Wait for `device` to finish its queued work (a no-op on the CPU, where work is done at launch)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def live_or_recorded(recording: str, key: str, measure: Callable[[], Any], live: bool,
                     directory: Path | None = None) -> tuple[Any, str]:
    """Measure now when `live`, else take `key` from reference recording `recording`.

    Returns (data, label): the label says where the numbers come from, for a title or a print.
    Without a GPU and without the recording (not made yet), returns (None, a line saying how to make it),
    so a lesson can go on and show only what this machine can measure.
    """
    if live:
        return measure(), f"measured live on {torch.cuda.get_device_name()}"
    from . import reference

    try:
        rec = reference.load(recording, directory)
    except FileNotFoundError:
        return None, (f"no GPU here and no reference recording {recording!r} yet: this GPU measurement is "
                      f"not shown (make it on a GPU: python benchmarks/record_references.py {recording})")
    if key not in rec.data:
        raise KeyError(f"recording {recording!r} has no {key!r} (has {sorted(rec.data)}); "
                       "regenerate it with python benchmarks/record_references.py " + recording)
    return rec.data[key], rec.label()


@functools.lru_cache(maxsize=8)
def calibrate_sleep(device: int | None = None, probe_cycles: int = 20_000_000, repeats: int = 3) -> float:
    """Cycles per millisecond of `torch.cuda._sleep` on this GPU, timed with CUDA events.

    `_sleep(cycles)` spins one tiny kernel for a number of GPU clock cycles; the clock differs between
    GPUs (and with boost), so we time a known count once instead of assuming a frequency.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("calibrate_sleep needs a CUDA GPU")
    dev = torch.cuda.current_device() if device is None else device
    with torch.cuda.device(dev):
        torch.cuda._sleep(probe_cycles // 10)  # warm-up: first launch loads the kernel
        rates = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(probe_cycles)
            end.record()
            end.synchronize()
            rates.append(probe_cycles / start.elapsed_time(end))
    return statistics.median(rates)


def gpu_sleep(ms: float, cycles_per_ms: float | None = None) -> None:
    """Enqueue one kernel that keeps one SM busy for about `ms` milliseconds on the current stream."""
    rate = cycles_per_ms if cycles_per_ms is not None else calibrate_sleep()
    torch.cuda._sleep(max(1, int(ms * rate)))


def _median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


# ------------------------------------------------------------------------------- asynchronous launch


def launch_vs_finish(device: torch.device | str, size: int, n: int = 5, repeats: int = 3) -> dict[str, float]:
    """Host time for `n` matmuls of size x size: until the calls return, and until the work is done.

    On a GPU the calls return long before the work finishes (they only enqueue kernels); on the CPU
    the work is done inside the call, so both numbers agree.
    """
    x = torch.randn(size, size, device=device)
    y = x @ x  # warm-up (kernel selection, allocator)
    sync(device)
    launched, finished = [], []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(n):
            y = x @ x
        t1 = time.perf_counter()
        sync(device)
        t2 = time.perf_counter()
        launched.append(t1 - t0)
        finished.append(t2 - t0)
    del y
    return {"n": n, "size": size, "calls_return_ms": _median_ms(launched), "work_done_ms": _median_ms(finished)}


def async_launch_timeline(device: torch.device | str, size: int, n: int = 5) -> list[dict[str, Any]]:
    """Spans of `n` matmul launches on the host row and their kernels on the device row, then the wait.

    Returns span dicts (Span.to_dict()); draw them with Timeline.from_spans(spans).plot().
    """
    dev = torch.device(device)
    x = torch.randn(size, size, device=dev)
    y = x @ x
    sync(dev)
    tl = Timeline(device=dev)
    work_row = None if dev.type == "cuda" else "cpu work"
    for i in range(n):
        with tl.span(f"matmul {i}", kind="compute", stream=work_row):
            with tl.span(f"launch {i}", kind="host", stream="host"):
                y = x @ x
    with tl.span("torch.cuda.synchronize()", kind="host", stream="host"):
        sync(dev)
    del y
    return [s.to_dict() for s in tl.spans()]


# --------------------------------------------------------------------------------------- sync points


def _print_to_nowhere(t: torch.Tensor) -> None:
    print(t, file=io.StringIO())


# call as written in a program -> what the host does with tensor t
SYNC_POINTS: dict[str, Callable[[torch.Tensor], Any]] = {
    "t.shape": lambda t: t.shape,
    "t * 2": lambda t: t * 2,
    "t.sum()": lambda t: t.sum(),
    "t[0].item()": lambda t: t[0].item(),
    "print(t)": _print_to_nowhere,
    "t.cpu()": lambda t: t.cpu(),
    "t.tolist()": lambda t: t.tolist(),
    "if t.sum() > 0:": lambda t: bool(t.sum() > 0),
    "torch.cuda.synchronize()": lambda t: torch.cuda.synchronize(),
}


def sync_stalls(busy_ms: float = 20.0, numel: int = 8) -> dict[str, Any]:
    """How long each host operation in SYNC_POINTS blocks the host while the GPU is busy for `busy_ms`.

    For each operation: queue a `busy_ms` kernel, then time the operation on the host clock. Operations
    that only enqueue work or read metadata return at once; those that need the data (or a sync) wait
    for the kernel. Also counts the syncs `torch.cuda.set_sync_debug_mode` reports for each one.
    Returns {"busy_ms", "rows": [{"call", "host_ms", "syncs"}, ...] in SYNC_POINTS order, "spans": [...]}.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("sync_stalls needs a CUDA GPU: on the CPU no call ever waits for a device")
    rate = calibrate_sleep()
    t = torch.arange(numel, dtype=torch.float32, device="cuda")
    for op in SYNC_POINTS.values():  # warm-up every path
        op(t)
    torch.cuda.synchronize()
    tl = Timeline()
    rows = []
    for name, op in SYNC_POINTS.items():
        torch.cuda.synchronize()
        with tl.span(f"GPU busy {busy_ms:g} ms", kind="compute"):
            gpu_sleep(busy_ms, rate)
        with count_syncs() as counted:
            t0 = time.perf_counter()
            with tl.span(name, kind="host", stream="host"):
                op(t)
            elapsed = (time.perf_counter() - t0) * 1e3
        rows.append({"call": name, "host_ms": elapsed, "syncs": counted.count})
        torch.cuda.synchronize()
    return {"busy_ms": busy_ms, "rows": rows, "spans": [s.to_dict() for s in tl.spans()]}


@dataclass
class SyncCount:
    """Filled in when the `count_syncs()` / `count_host_reads()` block ends."""

    count: int = 0
    calls: list[str] = field(default_factory=list)


SYNC_WARNING = "called a synchronizing CUDA operation"  # c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync


@contextmanager
def count_syncs() -> Iterator[SyncCount]:
    """Count the synchronizing CUDA calls made inside the block (torch.cuda.set_sync_debug_mode("warn")).

    PyTorch warns once per operation that makes the host wait for the GPU (a device-to-host copy,
    `.item()`, a data-dependent shape, ...); we collect those warnings instead of printing them.
    An explicit `torch.cuda.synchronize()` is a sync you asked for; debug mode may not report it.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("count_syncs needs CUDA; on the CPU use count_host_reads()")
    result = SyncCount()
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield result
        finally:
            torch.cuda.set_sync_debug_mode(previous)
    # Only PyTorch's per-call warning counts; the first set_sync_debug_mode() in a process also warns that
    # the mode "does not yet detect all synchronizing operations", which is not a sync.
    result.calls = [str(w.message).splitlines()[0] for w in caught if SYNC_WARNING in str(w.message)]
    result.count = len(result.calls)


# Tensor methods that hand tensor *data* to Python: on a CUDA tensor each one waits for the GPU.
HOST_READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__",
              "__repr__", "__format__")


@contextmanager
def count_host_reads() -> Iterator[SyncCount]:
    """Count calls that bring tensor data to Python (`.item()`, `.tolist()`, `.cpu()`, `float(t)`, `print(t)`...).

    Works on any device: on a CUDA tensor each such call is a sync point, so this finds sync points on
    a machine without a GPU too. Nested reads (print calling .item() inside) count once. Reads done
    inside C++ (a boolean mask index, `torch.nonzero`) are not seen; `count_syncs()` on a GPU sees those.
    """
    result = SyncCount()
    depth = [0]
    saved: dict[str, Any] = {}

    def wrap(name: str, method: Callable) -> Callable:
        @functools.wraps(method)
        def counted(self, *args, **kwargs):
            if depth[0] == 0:
                result.calls.append(name)
            depth[0] += 1
            try:
                return method(self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return counted

    for name in HOST_READS:
        saved[name] = torch.Tensor.__dict__.get(name)  # None: inherited from the C base class
        setattr(torch.Tensor, name, wrap(name, getattr(torch.Tensor, name)))
    try:
        yield result
    finally:
        for name, method in saved.items():
            if method is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, method)
        result.count = len(result.calls)


# -------------------------------------------------------------------------------------- timing right


def timing_methods(device: torch.device | str, size: int, n: int = 5, repeats: int = 3) -> dict[str, float | None]:
    """Time `n` matmuls three ways: perf_counter without a sync, with syncs, and with CUDA events (GPU only)."""
    dev = torch.device(device)
    x = torch.randn(size, size, device=dev)
    y = x @ x
    sync(dev)
    naive, synced, events = [], [], []
    for _ in range(repeats):
        sync(dev)
        t0 = time.perf_counter()  # wrong: measures how long it takes to *enqueue* the work
        for _ in range(n):
            y = x @ x
        naive.append(time.perf_counter() - t0)
        sync(dev)
        t0 = time.perf_counter()  # right: sync before (empty queue) and after (work done)
        for _ in range(n):
            y = x @ x
        sync(dev)
        synced.append(time.perf_counter() - t0)
        if dev.type == "cuda":  # right, and measured on the GPU: events recorded on the stream
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(n):
                y = x @ x
            end.record()
            end.synchronize()
            events.append(start.elapsed_time(end) / 1e3)
    del y
    return {"n": n, "size": size, "perf_counter_no_sync_ms": _median_ms(naive),
            "perf_counter_synced_ms": _median_ms(synced), "cuda_events_ms": _median_ms(events) if events else None}


# -------------------------------------------------------------------------- where a tensor is created


def creation_costs(device: torch.device | str, numel: int, repeats: int = 5) -> dict[str, float]:
    """Host time until ready: `torch.randn(n, device=d)` against `torch.randn(n).to(d)`.

    The first draws the numbers on the device; the second draws them on the CPU and copies them over.
    """
    dev = torch.device(device)
    for _ in range(2):  # warm-up
        torch.randn(numel, device=dev)
        torch.randn(numel).to(dev)
    sync(dev)
    on_device, copied = [], []
    for _ in range(repeats):
        t0 = time.perf_counter()
        a = torch.randn(numel, device=dev)
        sync(dev)
        on_device.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        b = torch.randn(numel).to(dev)
        sync(dev)
        copied.append(time.perf_counter() - t0)
        del a, b
    return {"numel": numel, "mib": numel * 4 / 2**20, "randn_on_device_ms": _median_ms(on_device),
            "randn_then_to_ms": _median_ms(copied)}


# ------------------------------------------------------------------------ the exercise: a train step


@dataclass
class TrainProblem:
    """A small MLP classifier and one batch, built the same way from the same seed every time."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    x: torch.Tensor
    y: torch.Tensor


def make_train_problem(device: torch.device | str, width: int, batch: int, classes: int = 10,
                       seed: int = 0) -> TrainProblem:
    """Build the model, optimizer and batch of the exercise (deterministic for a seed)."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, width), torch.nn.ReLU(),
        torch.nn.Linear(width, classes),
    )
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(batch, width, generator=g).to(device)
    y = torch.randint(0, classes, (batch,), generator=g).to(device)
    return TrainProblem(model, opt, x, y)


def slow_train_step(model, opt, x, y, history: list) -> None:
    """One SGD step that logs loss, gradient norm and accuracy, reading each of them on the host."""
    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    acc = (out.argmax(dim=1) == y).float().mean()
    history.append({"loss": loss.item(), "grad_norm": float(grad_norm), "acc": acc.cpu().tolist()})


def bare_train_step(model, opt, x, y, history: list) -> None:
    """The same step without any logging: the fewest syncs a step can have (the floor for the check)."""
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()


def history_as_floats(history: list[dict[str, Any]]) -> list[dict[str, float]]:
    """Turn logged values (floats or 0-d tensors) into floats, with one device-to-host copy in all."""
    if not history:
        return []
    keys = list(history[0])
    cells = [h[k] for h in history for k in keys]
    tensors = [c.detach().reshape(()).to(torch.float64) for c in cells if isinstance(c, torch.Tensor)]
    read = iter(torch.stack(tensors).tolist()) if tensors else iter(())  # the one read
    flat = [next(read) if isinstance(c, torch.Tensor) else float(c) for c in cells]
    return [dict(zip(keys, flat[i * len(keys):(i + 1) * len(keys)], strict=True)) for i in range(len(history))]


def run_steps(step_fn: Callable, problem: TrainProblem, steps: int) -> dict[str, Any]:
    """Run `steps` steps; time how long the host needs to issue them and until the device is done.

    Returns {"history": [...], "issue_ms": host time of the loop, "total_ms": until the work finished}.
    """
    history: list = []
    dev = problem.x.device
    sync(dev)
    t0 = time.perf_counter()
    for _ in range(steps):
        step_fn(problem.model, problem.opt, problem.x, problem.y, history)
    t1 = time.perf_counter()
    sync(dev)
    t2 = time.perf_counter()
    return {"history": history, "issue_ms": (t1 - t0) * 1e3, "total_ms": (t2 - t0) * 1e3}


def train_step_costs(step_fn: Callable, device: torch.device | str, width: int, batch: int,
                     steps: int) -> dict[str, float]:
    """Issue time, total time and syncs (GPU) or host reads (CPU) per step of `step_fn`, after a warm-up."""
    dev = torch.device(device)
    problem = make_train_problem(dev, width, batch)
    run_steps(step_fn, problem, 2)  # warm-up
    counter = count_syncs if dev.type == "cuda" else count_host_reads
    with counter() as counted:
        out = run_steps(step_fn, problem, steps)
    return {"steps": steps, "issue_ms": out["issue_ms"], "total_ms": out["total_ms"],
            "syncs_per_step": counted.count / steps}


# ---------------------------------------------------------------------------------------- recording


# Sizes for the GPU: each measurement takes well under a second on one H100.
GPU_SIZES = {"matmul": 4096, "n": 8, "busy_ms": 20.0, "numel": 32 * 2**20, "width": 4096, "batch": 4096,
             "steps": 8}


def record_lesson01() -> dict[str, Any]:
    """Every GPU measurement lesson 01 shows, at GPU_SIZES (run by benchmarks/record_references.py)."""
    s = GPU_SIZES
    dev = torch.device("cuda")
    return {
        "sizes": dict(s),
        "launch": launch_vs_finish(dev, s["matmul"], s["n"]),
        "timeline": async_launch_timeline(dev, s["matmul"], s["n"]),
        "stalls": sync_stalls(s["busy_ms"]),
        "timing": timing_methods(dev, s["matmul"], s["n"]),
        "creation": creation_costs(dev, s["numel"], repeats=3),
        "train_slow": train_step_costs(slow_train_step, dev, s["width"], s["batch"], s["steps"]),
        "train_bare": train_step_costs(bare_train_step, dev, s["width"], s["batch"], s["steps"]),
    }


RECORDINGS = {"01_host_device": record_lesson01}


# ------------------------------------------------------------------------------------------ drawing


def plot_sync_stalls(data: dict[str, Any], title: str = ""):
    """Bar chart: host time of each operation while the GPU was busy for data['busy_ms'] ms."""
    import matplotlib.pyplot as plt

    names = [r["call"] for r in data["rows"]]
    values = [r["host_ms"] for r in data["rows"]]
    fig, ax = plt.subplots(figsize=(8, 3.6))
    colors = ["tab:red" if v > 0.5 * data["busy_ms"] else "tab:blue" for v in values]
    ax.barh(names, values, color=colors)
    ax.axvline(data["busy_ms"], color="grey", ls="--", label=f"GPU kernel queued: {data['busy_ms']:g} ms")
    ax.invert_yaxis()
    ax.set_xlim(0, max(max(values), data["busy_ms"]) * 1.6)
    ax.set_xlabel("host time of the call (ms)")
    ax.set_title(title or "Which calls make the host wait for the GPU (red: waited)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    return fig


def plot_train_costs(costs: dict[str, dict[str, float]], title: str = ""):
    """Grouped bars per step function: time to issue the steps and time until the GPU finished them (ms)."""
    import matplotlib.pyplot as plt
    import numpy as np

    names = list(costs)
    idx = np.arange(len(names))
    fig, ax = plt.subplots(figsize=(7, 3.2))
    ax.bar(idx - 0.2, [costs[n]["issue_ms"] for n in names], 0.4, label="host: loop returned")
    ax.bar(idx + 0.2, [costs[n]["total_ms"] for n in names], 0.4, label="device: work finished")
    ax.set_xticks(idx, [f"{n}\n{costs[n]['syncs_per_step']:g} syncs/step" for n in names])
    ax.set_ylabel(f"time for {costs[names[0]]['steps']} steps (ms)")
    ax.set_title(title or "Issuing steps vs finishing them")
    ax.legend()
    fig.tight_layout()
    return fig
