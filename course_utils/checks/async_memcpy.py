"""Checks for lesson 04 (asynchronous copies).

ex04_copy_time         `predict_copy_ms(nbytes, link_gbit_s, latency_us)`: one copy's time on the course's
                       model (a fixed cost plus bytes over the link's rate). CPU.
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

MiB = 1 << 20


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
