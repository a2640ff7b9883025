"""Checks for lesson 04 (asynchronous copies): the prefetcher.

ex04_prefetcher        `prefetch(batches, device)`: a double-buffered host-to-GPU prefetcher. GPU, with a CPU
                       part (correct and reading ahead with device="cpu").

The GPU verdicts come from what the probe itself sees: batches it builds from a seed the judge
picked (the judge recomputes every expected value from that seed), copies made to start late so that a
compute which does not wait for its copy reads a stale buffer on any GPU, a kernel-accurate timeline the
probe records (only the profiler's own memcpy records count as copies, only kernels on the probe's compute
stream as compute), and a long sleep queued ahead of the prefetcher so that an answer whose host waits
for the GPU is seen waiting. The lesson's other exercises are in async_memcpy.py.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import Exercise, close, expect, register

EX_PREFETCH = "ex04_prefetcher"

MiB = 1 << 20
MIN_HIDDEN = 0.5  # share of the copy time the pipeline must hide (ideal for 6 batches: 5/6)
HOST_SHARE_MAX = 0.5  # the host may spend at most this share of the queued sleep issuing all batches
COMPUTE_ROW = "compute"  # the probe's compute stream, as named on its timeline


class _Source:
    """Host batches that note how many the prefetcher has taken (to see it reads ahead)."""

    def __init__(self, batches: list[Any]):
        self.batches, self.taken = batches, 0

    def __iter__(self) -> Iterator[Any]:
        for b in self.batches:
            self.taken += 1
            yield b

    def __len__(self) -> int:
        return len(self.batches)


def late_copy_batches(batches: list[Any], delay_ms: float, rate: float | None = None) -> list[Any]:
    """The same host batches, but every copy of one to the GPU starts `delay_ms` late.

    Before the copy, a sleep kernel is queued on the stream the copy goes to (whichever stream the
    prefetcher chose). Compute that waits for its copy still gets the right data; compute that does not
    wait reads a buffer that has not been filled yet, on any GPU, however fast its copy engines are.
    """
    import torch

    from ..measure import cycles_per_ms

    class LateCopy(torch.Tensor):
        cycles = max(1, int(delay_ms * (rate or cycles_per_ms())))

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if _copies_to_cuda(func, args, kwargs):
                torch.cuda._sleep(cls.cycles)
            with torch._C.DisableTorchFunctionSubclass():  # results are plain tensors again
                return func(*args, **kwargs)

    return [b.as_subclass(LateCopy) for b in batches]


def _copies_to_cuda(func: Any, args: tuple, kwargs: dict) -> bool:
    """Is this call a host-to-GPU copy (`dst.copy_(src)`, `src.to("cuda")`, `src.cuda()`)?"""
    import torch

    if func is torch.Tensor.copy_:
        return args[0].is_cuda and not args[1].is_cuda
    if func is torch.Tensor.cuda:
        return True
    if func is torch.Tensor.to:
        targets = list(args[1:]) + list(kwargs.values())
        return any((isinstance(t, torch.Tensor) and t.is_cuda) or (isinstance(t, (str, torch.device))
                   and torch.device(t).type == "cuda") for t in targets if not isinstance(t, (bool, torch.dtype)))
    return False


def _batches(seed: int, n: int, numel: int) -> list[Any]:
    """The host batches of one run: uniform floats from `seed`, made the same way in the judge."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.rand(numel, generator=g) for _ in range(n)]


def _consume(prefetch: Callable, batches: list[Any], device: Any, compute_ms: float = 0.0,
             rate: float | None = None) -> tuple[list[Any], list[int], list[str]]:
    """Use the prefetcher as a training loop would: compute `b * 2 + 1` on each batch as it comes.

    Compute reads its batch first (so a missing wait shows), then, on a GPU, sleeps `compute_ms`.
    Returns the results, how many batches the prefetcher had taken when each came out, and problems seen."""
    import torch

    from ..measure import gpu_sleep

    source = _Source(batches)
    outs, taken, problems = [], [], []
    for b in prefetch(source, device):
        taken.append(source.taken)
        i = len(taken) - 1
        if type(b) is not torch.Tensor:
            problems.append(f"batch {i} came out as a {type(b).__module__}.{type(b).__qualname__}, not a torch.Tensor")
            break
        if b.device.type != device.type or b.shape != batches[0].shape or b.dtype != batches[0].dtype:
            problems.append(f"batch {i} came out as {b.dtype} {tuple(b.shape)} on {b.device}; expected "
                            f"{batches[0].dtype} {tuple(batches[0].shape)} on {device.type}")
            break
        if i >= len(batches):
            problems.append(f"more batches came out than the {len(batches)} that went in")
            break
        outs.append(b * 2 + 1)
        if compute_ms > 0:
            gpu_sleep(compute_ms, rate)
    return outs, taken, problems


def _result(kind: str, outs: list[Any], taken: list[int], problems: list[str], idx: list[int], **extra: Any) -> dict:
    """One run as plain data: per batch the float64 sum of the result and its values at the judge's indices."""
    import torch

    at = torch.tensor(idx)
    return {"kind": kind, "taken": taken, "problems": problems,
            "sums": [o.double().sum().item() for o in outs],
            "samples": [o[at.to(o.device)].tolist() for o in outs], **extra}


def _schedule(inputs: dict) -> list[str]:
    """The runs the probe makes, in order (run j uses seed inputs['seed'] + j)."""
    r = inputs["repeats"]
    return ["cpu"] + (["late"] * 2 + ["overlap"] * r + ["host"] * r if inputs["gpu"] else [])


def _prefetch_inputs() -> dict:
    rng = random.Random()
    cpu_numel, gpu_numel = 1000, 32 * MiB // 4
    return {"seed": rng.randrange(1 << 30), "n_batches": 6, "cpu_numel": cpu_numel, "gpu_numel": gpu_numel,
            "cpu_idx": sorted({0, cpu_numel - 1, *rng.sample(range(cpu_numel), 30)}),
            "gpu_idx": sorted({0, gpu_numel - 1, *rng.sample(range(gpu_numel), 30)}),
            "late_ms": 2.0, "head_ms": 100.0, "repeats": 2}


def _prefetch_probe(prefetch: Callable, inputs: dict) -> dict:
    import torch

    n, seed = inputs["n_batches"], inputs["seed"]
    kinds = _schedule(inputs)
    runs = []
    outs, taken, problems = _consume(prefetch, _batches(seed, n, inputs["cpu_numel"]), torch.device("cpu"))
    runs.append(_result("cpu", outs, taken, problems, inputs["cpu_idx"]))
    if not inputs["gpu"]:
        return {"runs": runs}

    from .. import bench
    from ..measure import cycles_per_ms, gpu_sleep
    from ..timeline import Timeline

    gpu, numel, idx = torch.device("cuda", torch.cuda.current_device()), inputs["gpu_numel"], inputs["gpu_idx"]
    rate = cycles_per_ms()
    # The training loop's stream: a fresh side stream, one for all runs (its cached blocks are reused).
    compute = torch.cuda.Stream()
    src, dst = torch.rand(numel).pin_memory(), torch.empty(numel, device=gpu)
    copy_ms = bench.measure("h2d", numel * 4, lambda: dst.copy_(src, non_blocking=True)).time_ms
    compute_ms = max(0.5, 2 * copy_ms)  # each batch's compute takes about two copies: room to hide them
    # Fill the compute stream's share of the caching allocator first, so nothing is allocated from CUDA during
    # the runs (CUDA lists device allocations among the operations that may keep streams apart), and launch the
    # kernels the runs use once (`_compute_step_ms`, the copies above): a kernel's first launch loads its code,
    # and loading can wait until the GPU is idle, which would hide a missing wait in the first run.
    with torch.cuda.stream(compute):
        warm = [torch.empty(numel, device=gpu) for _ in range(n + 4)]
    del warm
    step_ms = _compute_step_ms(compute, torch.rand(numel, device=gpu), compute_ms, rate)

    def host_batches(j: int) -> list[Any]:
        return [b.pin_memory() for b in _batches(seed + j, n, numel)]

    for j, kind in enumerate(kinds[1:], start=1):
        batches = host_batches(j)
        torch.cuda.synchronize()
        extra: dict[str, Any] = {}
        if kind == "late":  # every copy starts late: compute that does not wait for it reads stale data
            with torch.cuda.stream(compute):
                outs, taken, problems = _consume(prefetch, late_copy_batches(batches, inputs["late_ms"], rate), gpu)
        elif kind == "overlap":  # what ran when, from the profiler: only its memcpy records are copies
            tl = Timeline(mode="kernels")
            tl.name_stream(compute, COMPUTE_ROW)
            with torch.cuda.stream(compute), tl.capture():
                outs, taken, problems = _consume(prefetch, batches, gpu, compute_ms, rate)
                torch.cuda.synchronize()
            extra["spans"] = [s.to_dict() for s in tl.spans()]
        else:  # "host": with a long sleep queued first, a host that waits for the GPU is seen waiting
            with torch.cuda.stream(compute):
                gpu_sleep(inputs["head_ms"], rate)
                t0 = time.perf_counter()
                outs, taken, problems = _consume(prefetch, batches, gpu)
                extra["host_ms"] = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        runs.append(_result(kind, outs, taken, problems, idx, **extra))
        del outs
    return {"runs": runs, "copy_ms": copy_ms, "compute_ms": compute_ms, "step_ms": step_ms}


def _compute_step_ms(stream: Any, b: Any, compute_ms: float, rate: float, repeats: int = 3) -> float:
    """GPU time of one batch's compute in the overlap runs (`b * 2 + 1`, then the sleep), alone on `stream`."""
    import torch

    from ..measure import gpu_sleep

    times = []
    with torch.cuda.stream(stream):
        for _ in range(repeats + 1):  # the first is a warm-up
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            b * 2 + 1
            gpu_sleep(compute_ms, rate)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return sorted(times[1:])[repeats // 2]


def _union_ms(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b > end:
            total += b - max(a, end)
            end = b
    return total


def copy_hidden(spans: list[dict], n_batches: int, compute_row: str = COMPUTE_ROW,
                compute_cap_ms: float | None = None) -> tuple[float | None, str]:
    """Share of copy time hidden under compute, from a run's kernel-accurate spans, and a note.

    Copies: the profiler's host-to-device memcpy records (kind "h2d"), one per batch. Compute: kernels on the
    probe's compute stream. hidden = (copy busy + compute busy - makespan) / copy busy, the makespan running
    from the first copy's start to the last compute's end: one stream gives about 0, a perfect pipeline of
    n batches whose compute is longer than a copy (n-1)/n. Extra copies or compute elsewhere cannot raise it
    (copies are counted, other streams' kernels are ignored), and compute busy is capped at
    `compute_cap_ms` (what the probe's own compute takes), so kernels an answer adds to the compute stream
    cannot either. Returns (None, why) when it cannot be measured.
    """
    copies = [(s["start_ms"], s["end_ms"]) for s in spans if s.get("kind") == "h2d"]
    compute = [(s["start_ms"], s["end_ms"]) for s in spans
               if s.get("kind") == "compute" and s.get("stream") == compute_row]
    if len(copies) != n_batches:
        return None, f"{len(copies)} host-to-device copies on the profiler's record for {n_batches} batches"
    if not compute:
        return None, f"no kernels on the {compute_row!r} stream on the profiler's record"
    t0, t1 = min(a for a, _ in copies), max(b for _, b in compute)
    copy_busy = _union_ms(copies)
    compute_busy = _union_ms([(max(a, t0), min(b, t1)) for a, b in compute if b > t0 and a < t1])
    if compute_cap_ms is not None:
        compute_busy = min(compute_busy, compute_cap_ms)
    if copy_busy <= 0:
        return None, "copies of zero length"
    hidden = (copy_busy + compute_busy - (t1 - t0)) / copy_busy
    return hidden, f"makespan {t1 - t0:.2f} ms for {copy_busy:.2f} ms of copies and {compute_busy:.2f} ms of compute"


def _expected(seed: int, n: int, numel: int, idx: list[int]) -> tuple[list[float], list[list[float]]]:
    import torch

    at = torch.tensor(idx)
    outs = [b * 2 + 1 for b in _batches(seed, n, numel)]
    return [o.double().sum().item() for o in outs], [o[at].tolist() for o in outs]


def _prefetch_judge(inputs: dict, data: dict) -> str:
    n = inputs["n_batches"]
    kinds = _schedule(inputs)
    runs = data.get("runs")
    expect(type(runs) is list and [r.get("kind") for r in runs] == kinds, EX_PREFETCH,
           f"the probe's runs {kinds}", [r.get("kind") for r in runs] if type(runs) is list else runs)
    for j, (kind, run) in enumerate(zip(kinds, runs, strict=True)):
        numel = inputs["cpu_numel"] if kind == "cpu" else inputs["gpu_numel"]
        where = ("with device='cpu'" if kind == "cpu" else f"on the GPU (run {j}, {kind})") + \
            f", {n} batches of {numel:,} float32 values"
        problems = run["problems"]
        expect(not problems, EX_PREFETCH, f"each batch yielded as a torch.Tensor on the device asked for {where}",
               problems[0] if problems else "", hint="what does your generator yield, and where does it live?")
        expect(len(run["sums"]) == n, EX_PREFETCH, f"{n} batches out for {n} in {where}", len(run["sums"]),
               hint="does your generator yield the last batch too?")
        idx = inputs["cpu_idx"] if kind == "cpu" else inputs["gpu_idx"]
        sums, samples = _expected(inputs["seed"] + j, n, numel, idx)
        wrong = [i for i in range(n) if not (close(run["sums"][i], sums[i], rel=1e-9)
                                               and run["samples"][i] == samples[i])]
        expect(not wrong, EX_PREFETCH, f"every batch's data right {where}", f"wrong data in batches {wrong}",
               hint="when the compute reads buffer k, has the copy into it finished, and has no later copy "
                    "started writing into it?")
        ahead = [t - (i + 1) for i, t in enumerate(run["taken"])]
        expect(all(a >= 1 for a in ahead[:-1]), EX_PREFETCH,
               f"batch i+1 already taken (its copy started) when batch i is handed out {where}",
               f"batches taken ahead: {ahead}", hint="when does the copy of batch i+1 start: before or after you "
                                                       "yield batch i?")
    if not inputs["gpu"]:
        return "correct and reading ahead with device='cpu'"

    step = data.get("step_ms")
    expect(type(step) is float and step > 0, EX_PREFETCH, "the probe's own compute time per batch", step)
    # Compute busy counts at most the probe's own compute (+10% for clocks that vary between runs).
    measured = [copy_hidden(r["spans"], n, compute_cap_ms=1.1 * n * step) for r in runs if r["kind"] == "overlap"]
    for hidden, note in measured:
        expect(hidden is not None, EX_PREFETCH, "one host-to-device copy per batch and compute on the loop's "
               "stream, on the profiler's record", note, hint="how many copies does your prefetcher make per batch?")
    hidden, note = max(measured, key=lambda m: m[0])
    expect(hidden >= MIN_HIDDEN, EX_PREFETCH, f"at least {MIN_HIDDEN:.0%} of the copy time hidden under compute "
           "(best of the runs)", f"{hidden:.0%} ({note})",
           hint="on which stream do your copies run, and can they start while the previous batch computes?")
    host = min(r["host_ms"] for r in runs if r["kind"] == "host")
    head = inputs["head_ms"]
    expect(host <= HOST_SHARE_MAX * head, EX_PREFETCH,
           f"all {n} batches handed out while {head:g} ms of earlier work still queued on the GPU (at most "
           f"{HOST_SHARE_MAX * head:g} ms of host time)", f"{host:.1f} ms",
           hint="does anything in your generator make the host wait for the GPU?")
    return (f"correct on {len(runs)} runs; {hidden:.0%} of the copy time hidden ({note}); "
            f"host handed out {n} batches in {host:.1f} ms ahead of {head:g} ms of queued GPU work")


register(Exercise(EX_PREFETCH, entry="prefetch", probe=_prefetch_probe, judge=_prefetch_judge,
                  inputs=_prefetch_inputs, needs_gpu=True, cpu_part=True, timeout_s=180.0))
