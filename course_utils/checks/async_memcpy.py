"""Checks for lesson 04 (asynchronous copies).

ex04_copy_time         `fit_copy(sizes, times_ms)`: the course's model of a copy (a fixed cost t0 plus bytes over
                       a rate) fitted to a sweep; judged by how close the model comes to the true times. CPU.
ex04_overlap_makespan  `makespan_ms(n_chunks, copy_ms, compute_ms, streams)`: copy-then-compute chunks on one
                       stream or on a copy stream and a compute stream. CPU.
ex04_prefetcher        in async_memcpy_prefetcher.py.
ex04_losses_to_host    `losses_to_host(losses)`: the values of GPU scalars on the host, copied with non_blocking
                       and read only after one wait for the copies (not the whole device). GPU, with a CPU part
                       (the values, from CPU tensors).

losses_to_host is judged from what its probe sees: the probe writes the losses behind a sleep (an early read sees the
stale bytes PyTorch's pinned cache kept from a first run), counts the waits with count_syncs, and queues
longer work on another stream, which only a wait for the whole device waits for.
"""

from __future__ import annotations

import math
import numbers
import random
import time
from collections.abc import Callable
from typing import Any

from . import Exercise, close, expect, register

EX_COPY = "ex04_copy_time"
EX_MAKESPAN = "ex04_overlap_makespan"



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

COPY_NOISE = 0.005  # each synthetic copy's time is off by up to ±0.5%, as a good measurement is
COPY_TOL = 0.025    # a fit passes when its model is within 2.5% of the true time at every size of the sweep


def _plain_lsq(sizes: list[int], times_ms: list[float]) -> tuple[float, float]:
    """(t0 µs, GB/s) by least squares on the times themselves: the large copies decide, so t0 carries their noise.
    A wrong method: the inputs are drawn so that it fails."""
    n, t = [float(s) for s in sizes], [x * 1e-3 for x in times_ms]
    k = len(n)
    mn, mt = sum(n) / k, sum(t) / k
    slope = sum((a - mn) * (b - mt) for a, b in zip(n, t, strict=True)) / sum((a - mn) ** 2 for a in n)
    return (mt - slope * mn) * 1e6, 1 / slope / 1e9


def _worst_miss(t0_us: float, gbps: float, sweep: dict) -> tuple[float, int]:
    """The largest relative miss of the model (t0_us, gbps) against the sweep's true times, and at which size."""
    misses = [(abs((t0_us * 1e-3 + n / (gbps * 1e6)) / _true_ms(sweep, n) - 1), n) for n in sweep["sizes"]]
    return max(misses)


def _true_ms(sweep: dict, n: int) -> float:
    return sweep["t0_us"] * 1e-3 + n / (sweep["gbps"] * 1e6)


def _one_copy_each(sizes: list[int], times_ms: list[float]) -> tuple[float, float]:
    """t0 from the smallest copy's time and the rate from the largest copy's bytes over its time, as if each held
    one term alone. A wrong method when the largest copy's time still holds a few percent of t0."""
    return times_ms[0] * 1e3, sizes[-1] / (times_ms[-1] * 1e-3) / 1e9


# Every sweep starts a little below the knee (the size whose bytes take as long as t0), so the smallest copy's
# time is not all t0. Two kinds: narrow, up to 16x the knee, so t0 is about 6% of the largest copy's time
# (reading the rate off the largest copy misses by that); wide, up to 1024x, as the lesson's own sweep goes, so
# 0.5% of the largest copy's time is several t0 (plain least squares on the times lets that noise set t0).
REACH = {"narrow": (16, _one_copy_each), "wide": (1024, _plain_lsq)}


def _copy_sweep(rng: random.Random, kind: str, noise: float) -> dict:
    """A sweep of copies from just below the knee, with times off by up to `noise`, drawn so that the wrong method
    REACH names for its kind misses by at least twice the tolerance."""
    reach, wrong = REACH[kind]
    while True:
        t0_us, gbps = round(rng.uniform(2.0, 30.0), 2), round(rng.uniform(5.0, 60.0), 1)
        knee = t0_us * 1e-6 * gbps * 1e9
        # from the power of two in (knee/8, knee/4]: the smallest copy's bytes take 1/9 to 1/5 of its time
        sizes = [1 << k for k in range(4, 40) if knee / 8 < (1 << k) and (1 << (k - 1)) < reach * knee]
        sweep = {"t0_us": t0_us, "gbps": gbps, "sizes": sizes, "kind": kind}
        sweep["times_ms"] = [_true_ms(sweep, n) * (1 + rng.uniform(-noise, noise)) for n in sizes]
        if noise == 0 or _worst_miss(*wrong(sizes, sweep["times_ms"]), sweep)[0] > 2 * COPY_TOL:
            return sweep


def _copy_inputs() -> dict:
    rng = random.Random()
    kinds = [("narrow", 0.0), ("narrow", COPY_NOISE), ("wide", COPY_NOISE), ("wide", COPY_NOISE)]
    return {"sweeps": [_copy_sweep(rng, kind, noise) for kind, noise in kinds]}


def _copy_probe(answer: Callable, inputs: dict) -> dict:
    fits, types = [], []
    for sweep in inputs["sweeps"]:
        out = answer(list(sweep["sizes"]), list(sweep["times_ms"]))
        pair = list(out) if isinstance(out, (tuple, list)) and len(out) == 2 else None
        fits.append([_number(x) for x in pair] if pair else None)
        types.append(type(out).__name__ if pair is None else ", ".join(type(x).__name__ for x in pair))
    return {"fits": fits, "types": types}


def _copy_hint(t0_us: float, gbps: float, sweep: dict) -> str:
    """A question pointing at the likely mistake, found by trying the usual ones on the true numbers."""
    t0, g = sweep["t0_us"], sweep["gbps"]
    smallest_us, largest_gbps = _one_copy_each(sweep["sizes"], sweep["times_ms"])
    if math.isclose(t0_us, smallest_us, rel_tol=1e-6):
        return "is the smallest copy's time all fixed cost, or does it move bytes too?"
    if math.isclose(gbps, largest_gbps, rel_tol=1e-6):
        return "is the largest copy's size over its time the rate, or does that time hold t0 too?"
    suspects = [
        (gbps, g * 8, "is the rate in bytes or in bits per second?"),
        (gbps, g * 1e9 / 2**30, "is the G in GB/s 10^9 or 2^30 bytes?"),
        (gbps, g * 1e3, "in which unit is the rate: GB/s, MB/s or bytes/s?"),
        (t0_us, t0 / 1e3, "in which unit is t0: µs or ms?"),
        (t0_us, t0 / 1e6, "in which unit is t0: µs or s?"),
        (t0_us, g, "in which order does fit_copy return its two numbers?"),
        (t0_us, 0.0, "what does a tiny copy cost, and which term of the model says so?"),
    ]
    for got, want, hint in suspects:
        if math.isclose(got, want, rel_tol=0.02, abs_tol=0.02 * t0 if want == 0.0 else 0.0):
            return hint
    return "which sizes tell you t0, and which the rate? Does each copy count alike in your fit?"


def _copy_judge(inputs: dict, data: dict) -> str:
    sweeps, fits = inputs["sweeps"], data.get("fits")
    expect(type(fits) is list and len(fits) == len(sweeps), EX_COPY, f"{len(sweeps)} fits", fits)
    for i, (sweep, fit, typ) in enumerate(zip(sweeps, fits, data.get("types", [""] * len(sweeps)), strict=False)):
        sizes = f"{len(sweep['sizes'])} sizes, {sweep['sizes'][0]} to {sweep['sizes'][-1]} bytes"
        times = "exact times" if i == 0 else f"times off by up to ±{COPY_NOISE:.1%}"
        what = f"fit_copy on sweep {i} ({sizes}, {times})"
        expect(fit is not None and None not in fit, EX_COPY, f"{what} to return two numbers (t0_us, rate_gbps)",
               typ, hint="what does fit_copy return?")
        t0_us, gbps = fit
        expect(gbps > 0, EX_COPY, f"{what}: a rate above 0 GB/s", f"{gbps:g}", hint=_copy_hint(t0_us, gbps, sweep))
        miss, n = _worst_miss(t0_us, gbps, sweep)
        expect(miss <= COPY_TOL, EX_COPY,
               f"{what}: a model within {COPY_TOL:.1%} of the true time at every size",
               f"t0 = {t0_us:.4g} µs, rate = {gbps:.4g} GB/s, off by {miss:.1%} at {n} bytes "
               f"({_true_ms(sweep, n) * 1e3:.4g} µs)", hint=_copy_hint(t0_us, gbps, sweep))
    return (f"{len(sweeps)} sweeps fitted, e.g. sweep 2: t0 {fits[2][0]:.2f} µs (true {sweeps[2]['t0_us']:g}), "
            f"rate {fits[2][1]:.2f} GB/s (true {sweeps[2]['gbps']:g})")


register(Exercise(EX_COPY, entry="fit_copy", probe=_copy_probe, judge=_copy_judge, inputs=_copy_inputs))


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
