"""Checks for lesson 04 (asynchronous copies).

ex04_copy_time         `predict_copy_ms(nbytes, link_gbit_s, latency_us)`: one copy's time on the course's
                       model (a fixed cost plus bytes over the link's rate). CPU.
ex04_overlap_makespan  `makespan_ms(n_chunks, copy_ms, compute_ms, streams)`: copy-then-compute chunks on one
                       stream or on a copy stream and a compute stream. CPU.
ex04_prefetcher        `prefetch(batches, device)`: a double-buffered host-to-GPU prefetcher. GPU, with a CPU
                       part (correct and reading ahead with device="cpu").
ex04_losses_to_host    `losses_to_host(losses)`: the values of GPU scalars on the host, copied with non_blocking
                       and read only after one wait for the copies (not the whole device). GPU, with a CPU part
                       (the values, from CPU tensors).

The prefetcher's GPU verdicts come from what the probe itself sees: batches it builds from a seed the judge
picked (the judge recomputes every expected value from that seed), copies made to start late so that a
compute which does not wait for its copy reads a stale buffer on any GPU, a kernel-accurate timeline the
probe records (only the profiler's own memcpy records count as copies, only kernels on the probe's compute
stream as compute), and a long sleep queued ahead of the prefetcher so that an answer whose host waits
for the GPU is seen waiting.

losses_to_host is judged the same way: the probe writes the losses behind a sleep (an early read sees the
stale bytes PyTorch's pinned cache kept from a first run), counts the waits with count_syncs, and queues
longer work on another stream, which only a wait for the whole device waits for.
"""

from __future__ import annotations

import math
import numbers
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

from . import Exercise, close, expect, register

EX_COPY = "ex04_copy_time"
EX_MAKESPAN = "ex04_overlap_makespan"
EX_PREFETCH = "ex04_prefetcher"

MiB = 1 << 20
MIN_HIDDEN = 0.5  # share of the copy time the pipeline must hide (ideal for 6 batches: 5/6)
HOST_SHARE_MAX = 0.5  # the host may spend at most this share of the queued sleep issuing all batches
COMPUTE_ROW = "compute"  # the probe's compute stream, as named on its timeline


def _number(x: Any) -> float | None:
    """`x` as a plain float when it is a real number (int, float, numpy scalar, one-element tensor), else None.

    The judge then compares plain floats: an object that claims to equal anything never reaches it."""
    import torch

    if isinstance(x, bool):
        return None
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.is_complex():
            return None
        x = x.item()
    if not isinstance(x, numbers.Real):
        return None
    try:
        v = float(x)
    except (TypeError, ValueError, OverflowError):
        return None
    return v if math.isfinite(v) else None


def _call_all(answer: Callable, cases: list[list]) -> dict:
    values, types = [], []
    for case in cases:
        out = answer(*case)
        values.append(_number(out))
        types.append(type(out).__name__)
    return {"values": values, "types": types}


def _values(data: dict, cases: list, exercise: str) -> list:
    values = data.get("values")
    expect(type(values) is list and len(values) == len(cases), exercise, f"{len(cases)} answers", values)
    return values


# ------------------------------------------------------------------------------- ex04_copy_time (CPU)


def _copy_inputs() -> dict:
    rng = random.Random()
    cases = [
        [256 * MiB, 504.0, 10.0],        # a large copy over PCIe Gen5 x16 (32 GT/s x 16 lanes x 128/130)
        [1024, 504.0, 10.0],             # a tiny one: the fixed cost is all there is
        [3_000_000_000, 400.0, 2.5],     # 3 GB over 400 Gb/s InfiniBand
        [12 * MiB, 252.0, 0.0],          # PCIe Gen4 x16, no fixed cost
        [rng.randrange(1 << 10, 1 << 31), round(rng.uniform(100.0, 1000.0), 1), round(rng.uniform(1.0, 20.0), 2)],
    ]
    return {"cases": cases}


def _copy_probe(answer: Callable, inputs: dict) -> dict:
    return _call_all(answer, inputs["cases"])


def _copy_hint(nbytes: int, gbit: float, lat_us: float, got: float) -> str:
    """A question pointing at the likely mistake, found by trying the usual ones."""
    bits = nbytes * 8
    suspects = [
        (lat_us / 1e3 + nbytes / (gbit * 1e9) * 1e3, "is the link's rate counted in bytes or in bits per second?"),
        (lat_us / 1e3 + bits / (gbit * 2**30) * 1e3, "is the G in Gbit/s 10^9 or 2^30?"),
        (lat_us / 1e3 + nbytes / (gbit * 2**30) * 1e3, "bits or bytes? And is the G in Gbit/s 10^9 or 2^30?"),
        (bits / (gbit * 1e9) * 1e3, "what does a copy cost when nbytes is tiny?"),
        (lat_us / 1e6 + bits / (gbit * 1e9), "in which unit does your function answer?"),
        (lat_us + bits / (gbit * 1e9) * 1e3, "in which unit is latency_us given?"),
    ]
    for value, hint in suspects:
        if math.isclose(got, value, rel_tol=1e-6):
            return hint
    return "which part of the time is fixed per copy, and which grows with the bytes?"


def _copy_judge(inputs: dict, data: dict) -> str:
    cases = inputs["cases"]
    values = _values(data, cases, EX_COPY)
    for (nbytes, gbit, lat_us), got, typ in zip(cases, values, data.get("types", [""] * len(cases)), strict=False):
        want = lat_us / 1e3 + nbytes * 8 / (gbit * 1e9) * 1e3  # ms: fixed cost + bits over bits per second
        call = f"predict_copy_ms({nbytes}, {gbit:g}, {lat_us:g})"
        expect(got is not None, EX_COPY, f"{call} to return a number of milliseconds", f"a value of type {typ}",
               hint="what type does your function return?")
        expect(close(got, want, rel=1e-6), EX_COPY, f"{call} = {want:.6g} ms", f"{got:.6g}",
               hint=_copy_hint(nbytes, gbit, lat_us, got))
    return f"{len(cases)} copies right, e.g. 256 MiB over {cases[0][1]:g} Gbit/s: {values[0]:.3f} ms"


register(Exercise(EX_COPY, entry="predict_copy_ms", probe=_copy_probe, judge=_copy_judge, inputs=_copy_inputs))


# ------------------------------------------------------------------------- ex04_overlap_makespan (CPU)


def _makespan_inputs() -> dict:
    rng = random.Random()
    cases = [
        [6, 2.0, 3.0, 1],
        [6, 2.0, 3.0, 2],   # compute is the slower stage
        [6, 3.0, 2.0, 2],   # copies are the slower stage
        [1, 2.0, 3.0, 2],   # one chunk: nothing to overlap
        [5, 1.5, 1.5, 2],
        [8, 0.5, 4.0, 1],
    ]
    for streams in (1, 2):
        cases.append([rng.randrange(2, 12), round(rng.uniform(0.2, 5.0), 3), round(rng.uniform(0.2, 5.0), 3), streams])
    return {"cases": cases}


def _makespan_probe(answer: Callable, inputs: dict) -> dict:
    return _call_all(answer, inputs["cases"])


def _makespan_hint(n: int, c: float, k: float, streams: int, got: float) -> str:
    if streams == 1:
        return "on one stream, can a copy and a compute ever run at the same time?"
    suspects = [
        (n * (c + k), "with the copies on their own stream, what is the copy engine doing while chunk i computes?"),
        (n * max(c, k), "what runs before the first chunk's copy is done, and after the last copy is done?"),
        (max(c, k) + n * min(c, k), "which stage sets the pace: the faster or the slower one?"),
        (c + n * k, "which stage sets the pace when a copy takes longer than a compute?"),
        (n * c + k, "which stage sets the pace when a compute takes longer than a copy?"),
    ]
    for value, hint in suspects:
        if math.isclose(got, value, rel_tol=1e-6):
            return hint
    return "draw the two streams for three chunks: when does each copy and each compute start?"


def _makespan_judge(inputs: dict, data: dict) -> str:
    cases = inputs["cases"]
    values = _values(data, cases, EX_MAKESPAN)
    for (n, c, k, streams), got, typ in zip(cases, values, data.get("types", [""] * len(cases)), strict=False):
        # One stream runs copy, compute, copy, ...; with a copy stream, chunk i+1's copy runs under chunk i's
        # compute: the first copy and the last compute stick out, the slower stage sets the pace in between.
        want = n * (c + k) if streams == 1 else c + k + (n - 1) * max(c, k)
        call = f"makespan_ms({n}, {c:g}, {k:g}, streams={streams})"
        expect(got is not None, EX_MAKESPAN, f"{call} to return a number of milliseconds", f"a value of type {typ}",
               hint="what type does your function return?")
        expect(close(got, want, rel=1e-6), EX_MAKESPAN, f"{call} = {want:.6g} ms", f"{got:.6g}",
               hint=_makespan_hint(n, c, k, streams, got))
    return f"{len(cases)} schedules right"


register(Exercise(EX_MAKESPAN, entry="makespan_ms", probe=_makespan_probe, judge=_makespan_judge,
                  inputs=_makespan_inputs))


# ------------------------------------------------------------------------------- ex04_prefetcher (GPU)


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


# ------------------------------------------------------- ex04_losses_to_host (GPU, with a CPU part)

EX_LOSSES = "ex04_losses_to_host"
_clock = time.perf_counter  # taken at import, before any answer runs, so an answer that patches time's is not used


def _loss_values(seed: int, n: int) -> list[float]:
    """The losses of one run: float32 values from `seed`, as Python floats (made the same way in the judge)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return (torch.rand(n, generator=g) * 10).tolist()


def _losses_inputs() -> dict:
    rng = random.Random()
    # late_ms: the losses are written behind a sleep this long; side_ms: unrelated work on another stream,
    # long enough that a wait for the whole device stands out from a wait for the losses' stream.
    return {"seed": rng.randrange(1 << 30), "n": 8, "late_ms": 50.0, "side_ms": 300.0}


def _plain_float(v: Any) -> float | None:
    """A Python number as a plain float; None for anything else (a tensor is not read here: that would wait)."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    v = float(v)
    return v if math.isfinite(v) else None


def _run_losses(answer: Callable, losses: list[Any]) -> dict:
    out = answer(losses)
    if type(out) not in (list, tuple):
        return {"values": None, "type": f"a {type(out).__qualname__}"}
    return {"values": [_plain_float(v) for v in out], "type": ", ".join(sorted({type(v).__qualname__ for v in out}))}


def _losses_probe(answer: Callable, inputs: dict) -> dict:
    import torch

    n, seed = inputs["n"], inputs["seed"]
    cpu = _run_losses(answer, [torch.tensor(v) for v in _loss_values(seed, n)])  # 0-d float32 tensors
    if not inputs["gpu"]:
        return {"cpu": cpu}

    from ..measure import count_syncs, cycles_per_ms, gpu_sleep

    rate, gpu, side = cycles_per_ms(), torch.device("cuda", torch.cuda.current_device()), torch.cuda.Stream()
    # A first run on an idle GPU: the answer's kernels load (a first launch can wait for the GPU, lesson 01)
    # and PyTorch's pinned cache keeps the blocks of its copies, holding these other values: stale bytes to read.
    # Under count_syncs as the timed run is: its first use pays one-time costs (imports, the sync debug mode's
    # first warning) that the timed run must not.
    with count_syncs(cpu_as_device=False):
        _run_losses(answer, [torch.tensor(v, device=gpu) for v in _loss_values(seed + 1, n)])
    losses = [torch.zeros((), device=gpu) for _ in range(n)]
    values = torch.tensor(_loss_values(seed, n), device=gpu)
    torch.cuda.synchronize()
    side_done = torch.cuda.Event()
    with torch.cuda.stream(side):
        gpu_sleep(inputs["side_ms"], rate)         # unrelated work on another stream
        side_done.record()
    gpu_sleep(inputs["late_ms"], rate)             # the training step still running ...
    for i, loss in enumerate(losses):
        loss.copy_(values[i])                      # ... then each loss is written, on the current stream
    with count_syncs(cpu_as_device=False) as waits:
        t0 = _clock()
        run = _run_losses(answer, losses)
        run["host_ms"] = (_clock() - t0) * 1e3
        # Asked of the GPU, not of a clock: had the other stream's work finished when the answer returned?
        run["side_done"] = side_done.query()
    run["waits"] = waits.count
    torch.cuda.synchronize()
    return {"cpu": cpu, "gpu": run}


def _losses_values_right(inputs: dict, run: Any, where: str, hint: str) -> None:
    n, want = inputs["n"], _loss_values(inputs["seed"], inputs["n"])
    expect(type(run) is dict, EX_LOSSES, f"the probe's run {where}", run)
    values = run.get("values")
    expect(type(values) is list and len(values) == n and None not in values, EX_LOSSES,
           f"losses_to_host(losses) to return a list of {n} Python floats {where}",
           f"{run.get('type')}" + (f", {len(values)} items" if type(values) is list else ""),
           hint="what does your function return? Read each value out of its host copy (.item(), .tolist())")
    wrong = [i for i in range(n) if values[i] != want[i]]
    i = wrong[0] if wrong else 0
    expect(not wrong, EX_LOSSES, f"losses_to_host(losses)[{i}] == {want[i]!r} {where}",
           f"{values[i]!r} (wrong at {len(wrong)} of {n} losses)", hint=hint)


def _losses_judge(inputs: dict, data: dict) -> str:
    n, late, side = inputs["n"], inputs["late_ms"], inputs["side_ms"]
    _losses_values_right(inputs, data.get("cpu"), f"for {n} losses as 0-d float32 CPU tensors",
                         "is each value the loss at the same position?")
    if not inputs["gpu"]:
        return (f"values right for {n} CPU tensors; not checked without a GPU: stale reads behind queued work, "
                "how often and for what the host waits")
    run = data.get("gpu")
    _losses_values_right(inputs, run, f"for {n} losses on the GPU, written behind {late:g} ms of queued work",
                         "did the host read a copy before it arrived? A non_blocking copy to the host fills its "
                         "pinned buffer only when the stream gets to it: wait (an event, the stream) before reading")
    waits = run.get("waits")
    expect(type(waits) is int and waits <= 1, EX_LOSSES,
           f"at most one wait for the GPU inside losses_to_host for {n} losses (count_syncs)", f"{waits} waits",
           hint="does each loss make the host wait (.item() or a blocking .cpu() on a GPU tensor)? Queue every "
                "copy with non_blocking=True, then wait once")
    host_ms = run.get("host_ms")
    expect(type(host_ms) is float and host_ms < side / 2 and run.get("side_done") is False, EX_LOSSES,
           f"the host back once the losses' stream is done (about {late:g} ms), not after the {side:g} ms of "
           f"unrelated work queued on another stream (at most {side / 2:g} ms, that work still running)",
           (f"{host_ms:.1f} ms" if type(host_ms) is float else repr(host_ms))
           + (", the other stream's work done" if run.get("side_done") is not False else ""),
           hint="does your function wait for the whole device (torch.cuda.synchronize())? An event recorded "
                "after the copies, or the current stream, waits for them alone")
    return (f"{n} losses right on CPU and on the GPU behind {late:g} ms of queued work; "
            f"{waits} sync{'' if waits == 1 else 's'} counted by count_syncs (an Event.synchronize() is not "
            f"counted); host back after {host_ms:.0f} ms while {side:g} ms of other work ran on another stream")


register(Exercise(EX_LOSSES, entry="losses_to_host", probe=_losses_probe, judge=_losses_judge,
                  inputs=_losses_inputs, needs_gpu=True, cpu_part=True))
