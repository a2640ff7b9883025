"""Checks for lesson 02 (CUDA streams).

ex02_predict_makespan (CPU): the learner's `predict_makespan(schedule)` against the course's model of
streams, on schedules this module makes up. The model: each stream runs its kernels in launch order; kernels
on different streams run at the same time (the lesson's one-thread sleep kernels leave the GPU almost
idle); `("wait", waiter, waited)` is `waiter.wait_stream(waited)`: the waiter's later kernels start only
after everything queued on `waited` before the call (its waits included) has finished; the host launches
instantly and every stream starts idle at time 0.

ex02_run_split (GPU): the learner's `run_split(chains)` runs independent chains of steps on side
streams. The probe builds the chains itself (sleep kernels of its own length and a counts tensor it owns),
queues a head-start sleep and a zeroing of the counts on the current stream first, calls the answer inside
its own kernels-mode Timeline, and returns the sleep kernels the profiler saw plus what the current stream
and the host saw. The judge decides from those kernel times only.
"""

from __future__ import annotations

import functools
import math
import random
import time
from typing import Any

from . import Exercise, close, expect, register

# ------------------------------------------------------------------------- ex02_predict_makespan (CPU)

EX_PREDICT = "ex02_predict_makespan"
STREAM_NAMES = ("main", "s1", "s2")

# Schedules every answer is asked about, each one telling a wrong idea of streams apart from the model.
FIXED_SCHEDULES: list[list[tuple]] = [
    # two streams, no waits: concurrent (a sum says 12, the model 7)
    [("sleep", "main", 3.0), ("sleep", "s1", 5.0), ("sleep", "main", 4.0)],
    # fork and join: s1 starts after main's first kernel, main's last kernel after s1
    [("sleep", "main", 4.0), ("wait", "s1", "main"), ("sleep", "s1", 6.0), ("sleep", "main", 2.0),
     ("wait", "main", "s1"), ("sleep", "main", 1.0)],
    # a wait covers only the work queued before it: here nothing, so the two sleeps overlap
    [("wait", "s1", "main"), ("sleep", "main", 5.0), ("sleep", "s1", 5.0)],
    # waits pass on: main waits for s1, which waited for s2
    [("sleep", "s2", 5.0), ("wait", "s1", "s2"), ("wait", "main", "s1"), ("sleep", "main", 1.0)],
    # a chain over three streams, and a stream that goes on after it was waited for
    [("sleep", "s1", 2.0), ("wait", "s2", "s1"), ("sleep", "s2", 3.0), ("wait", "main", "s2"),
     ("sleep", "main", 1.0), ("sleep", "s1", 1.0)],
    # a wait concerns its two streams only: s2 goes on undisturbed (it is not a device-wide sync)
    [("sleep", "s2", 8.0), ("sleep", "main", 2.0), ("wait", "s1", "main"), ("sleep", "s1", 1.0)],
]


def model_makespan(schedule: list) -> float:
    """The course's model as a longest path through a graph of the schedule's operations.

    Every operation is a node on its stream: a sleep lasting its ms, a wait lasting 0. A node starts after
    the previous node of its stream; a wait also starts after the last node queued on the waited stream
    before it (so waits pass on what that stream itself waited for). The makespan is the latest end of a
    sleep; streams start idle at time 0 and the host launches instantly."""
    ends: list[float] = []  # end of each node, in schedule order
    last: dict[str, int] = {}  # stream -> index of the last node queued on it so far
    makespan = 0.0
    for op in schedule:
        kind, a, b = op
        if kind not in ("sleep", "wait"):
            raise ValueError(f"unknown operation {op!r}: a schedule has ('sleep', stream, ms) and ('wait', a, b)")
        before = [last[a]] if a in last else []
        if kind == "wait" and b in last:
            before.append(last[b])
        ends.append(max((ends[i] for i in before), default=0.0) + (float(b) if kind == "sleep" else 0.0))
        last[a] = len(ends) - 1
        if kind == "sleep":
            makespan = max(makespan, ends[-1])
    return makespan


def random_schedule(rng: random.Random, n_ops: int | None = None) -> list[tuple]:
    """A schedule over main/s1/s2 with whole-ms sleeps and about one wait in three operations."""
    n_ops = n_ops or rng.randint(6, 10)
    ops: list[tuple] = []
    while len(ops) < n_ops:
        if ops and rng.random() < 0.35:
            a, b = rng.sample(STREAM_NAMES, 2)
            ops.append(("wait", a, b))
        else:
            ops.append(("sleep", rng.choice(STREAM_NAMES), float(rng.randint(1, 9))))
    return ops


def predict_inputs(seed: int | None = None, n_random: int = 6) -> dict:
    seed = random.randrange(1_000_000) if seed is None else seed
    rng = random.Random(seed)
    schedules = [list(s) for s in FIXED_SCHEDULES] + [random_schedule(rng) for _ in range(n_random)]
    rng.shuffle(schedules)
    return {"seed": seed, "schedules": schedules}


def predict_probe(answer: Any, inputs: dict) -> dict:
    """Ask the answer about each schedule (a fresh list of tuples each time); keep numbers, describe the rest."""
    out: list[Any] = []
    for schedule in inputs["schedules"]:
        value = answer([tuple(op) for op in schedule])
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append(float(value))  # float(): a subclass of float brings no __eq__ of its own to the judge
        else:
            out.append(f"a {type(value).__module__}.{type(value).__qualname__}, not a number")
    return {"predictions": out}


def _describe(schedule: list) -> str:
    return "[" + ", ".join(f"{op[0]} {op[1]} {op[2]:g} ms" if op[0] == "sleep" else f"{op[1]} waits for {op[2]}"
                           for op in schedule) + "]"


def predict_judge(inputs: dict, data: dict) -> str:
    preds = data.get("predictions")
    schedules = inputs["schedules"]
    expect(type(preds) is list and len(preds) == len(schedules), EX_PREDICT,
           f"one prediction per schedule ({len(schedules)})", type(preds).__name__ if type(preds) is not list
           else f"{len(preds)} predictions")
    for schedule, pred in zip(schedules, preds, strict=True):
        want = model_makespan(schedule)
        expect(type(pred) is float and math.isfinite(pred), EX_PREDICT,
               f"a number of milliseconds for schedule {_describe(schedule)}", pred,
               "return the makespan as a float (ms)")
        expect(close(pred, want, rel=1e-6, abs_=1e-9), EX_PREDICT,
               f"a makespan of {want:g} ms for schedule {_describe(schedule)}", f"{pred:g} ms",
               "when can each stream's next kernel start, and which of the waited stream's kernels does a wait "
               "cover: those launched before it, after it, and what that stream itself waited for?")
    return f"{len(schedules)} schedules, {sum(len(s) for s in schedules)} operations, all as the model predicts"


register(Exercise(EX_PREDICT, entry="predict_makespan", probe=predict_probe, judge=predict_judge,
                  inputs=predict_inputs, needs_gpu=False, timeout_s=30))

# ----------------------------------------------------------------------------- ex02_run_split (GPU)

EX_SPLIT = "ex02_run_split"
SPIN = "spin_kernel"  # the kernel behind torch.cuda._sleep


def split_inputs() -> dict:
    """The check's own workload and limits (the notebook's SleepChains and its sizes play no part)."""
    return {"n_chains": 3, "steps_per_chain": 4, "step_ms": 4.0, "head_start_ms": 40.0, "repeats": 3,
            "target_speedup": 2.0}


def _step(sleep: Any, cycles: int, counts: Any, chain: int) -> None:
    sleep(cycles)
    counts[chain].add_(1.0)


def split_probe(answer: Any, inputs: dict) -> dict:
    """Run `answer(chains)` `repeats` times on chains built here; return the sleep kernels the profiler saw,
    the counts the current stream saw right after the answer returned, and how long the host was held."""
    import torch

    from ..measure import cycles_per_ms
    from ..timeline import Timeline

    n, k = inputs["n_chains"], inputs["steps_per_chain"]
    rate = cycles_per_ms()
    sleep = torch.cuda._sleep
    step_cycles, head_cycles = int(inputs["step_ms"] * rate), int(inputs["head_start_ms"] * rate)
    runs = []
    for _ in range(inputs["repeats"]):
        counts = torch.full((n,), -100.0, device="cuda")  # stale values: the current stream zeroes them first
        seen = torch.empty_like(counts)  # allocated now: no allocation between the answer and the snapshot
        chains = [[functools.partial(_step, sleep, step_cycles, counts, c) for _ in range(k)] for c in range(n)]
        main = torch.cuda.current_stream()
        head_done = torch.cuda.Event()
        torch.cuda.synchronize()
        tl = Timeline(mode="kernels")
        with tl.capture():
            sleep(head_cycles)  # the current stream is busy for a while ...
            head_done.record(main)
            counts.zero_()  # ... then zeroes the counts: every step must come after this
            t0 = time.perf_counter()
            answer(chains)
            host_ms = (time.perf_counter() - t0) * 1e3
            still_running = not head_done.query()  # did the host come back before the GPU left the head start?
            seen.copy_(counts)  # on the current stream, right after the answer returned
            torch.cuda.synchronize()
        spins = [[s.stream, s.start_ms, s.end_ms] for s in tl.spans() if s.kind == "compute" and SPIN in s.name]
        runs.append({"spins": spins, "seen": seen.tolist(), "final": counts.tolist(), "host_ms": host_ms,
                     "head_still_running": still_running})
    return {"runs": runs}


def _split_case(inputs: dict) -> str:
    """The workload the check gave run_split, for its messages."""
    return (f"{inputs['n_chains']} chains of {inputs['steps_per_chain']} steps of {inputs['step_ms']:g} ms after a "
            f"{inputs['head_start_ms']:g} ms head start")


def _split_run(inputs: dict, run: dict, j: int = 0) -> dict:
    """Run j's facts from its kernel times; raises CheckFailed for what must hold in every run."""
    n, k, step_ms, head_ms = (inputs["n_chains"], inputs["steps_per_chain"], inputs["step_ms"],
                              inputs["head_start_ms"])
    case = f" (run {j + 1} of {inputs['repeats']}: {_split_case(inputs)})"
    want = [float(k)] * n
    # Sleeps under 50 µs are not steps (a timeline names a stream with a one-cycle sleep, should one show).
    spins = [(str(s), float(a), float(b)) for s, a, b in run["spins"] if float(b) - float(a) >= 0.05]
    heads = [x for x in spins if x[2] - x[1] >= 0.5 * head_ms]
    steps = [x for x in spins if x[2] - x[1] < 0.5 * head_ms]
    expect(len(heads) == 1, EX_SPLIT, f"one {head_ms:g} ms sleep kernel (the check's head start){case}",
           f"{len(heads)}", "launch only the steps you are given")
    expect(len(steps) == n * k, EX_SPLIT, f"{n * k} step kernels{case}",
           f"{len(steps)} sleep kernels besides the check's own", "call every step of every chain exactly once")
    shortest = min(b - a for _, a, b in steps)
    expect(shortest >= 0.8 * step_ms, EX_SPLIT, f"each step's sleep to last about {step_ms:g} ms{case}",
           f"a sleep of {shortest:.2f} ms", "call the steps as they are given; do not change them")
    head_end = heads[0][2]
    first = min(a for _, a, _ in steps)
    expect(first >= head_end - 0.5, EX_SPLIT,
           f"no step to start before the work already queued on the current stream had finished{case}",
           f"a step starting {head_end - first:.1f} ms before the current stream's earlier work ended",
           "what had the caller queued on the current stream before calling you, and which of your streams "
           "know about it?")
    durations = [b - a for _, a, b in steps]
    makespan = max(b for _, _, b in steps) - first
    expect(makespan >= 0.9 * k * sum(durations) / len(durations), EX_SPLIT,
           f"the {k} steps of a chain one after another (makespan at least {k} steps){case}",
           f"all steps done within {makespan:.1f} ms", "can two steps of the same chain run at the same time?")
    expect(run["final"] == want, EX_SPLIT, f"counts {want} once the GPU had finished{case}", run["final"],
           "does every step run exactly once, after the work the current stream queued before your function?")
    expect(run["seen"] == want, EX_SPLIT, f"counts {want} on the current stream right after run_split returned{case}",
           run["seen"], "what does the current stream know about your side streams' work when you return?")
    return {"busy_ms": sum(durations), "makespan_ms": makespan, "streams": len({s for s, _, _ in steps}),
            "host_ms": float(run["host_ms"]), "head_still_running": run["head_still_running"] is True}


def split_judge(inputs: dict, data: dict) -> str:
    runs = data.get("runs")
    expect(type(runs) is list and len(runs) == inputs["repeats"], EX_SPLIT, f"{inputs['repeats']} measured runs",
           runs if type(runs) is not list else len(runs))
    facts = [_split_run(inputs, run, j) for j, run in enumerate(runs)]
    case = f" ({_split_case(inputs)}, best of {len(facts)} runs)"
    head_ms, target = inputs["head_start_ms"], inputs["target_speedup"]
    free = [f for f in facts if f["head_still_running"] and f["host_ms"] < 0.5 * head_ms]
    expect(bool(free), EX_SPLIT,
           f"run_split to return while the GPU was still busy with the check's {head_ms:g} ms head start{case}",
           f"the host held for {min(f['host_ms'] for f in facts):.1f} ms at best",
           "which call in your function makes the host wait for the GPU, and what could wait on the GPU instead?")
    best = max(facts, key=lambda f: f["busy_ms"] / f["makespan_ms"])
    speedup = best["busy_ms"] / best["makespan_ms"]
    expect(speedup >= target, EX_SPLIT,
           f"the chains to overlap: at least {target:g}x (step kernel time {best['busy_ms']:.1f} ms / makespan){case}",
           f"{speedup:.2f}x, steps on {best['streams']} stream(s)",
           "how many streams do the chains need so that none waits for another?")
    return (f"best of {len(facts)}: {best['busy_ms']:.1f} ms of steps in {best['makespan_ms']:.1f} ms on "
            f"{best['streams']} streams, {speedup:.2f}x; host back after {min(f['host_ms'] for f in free):.2f} ms")


register(Exercise(EX_SPLIT, entry="run_split", probe=split_probe, judge=split_judge, inputs=split_inputs,
                  needs_gpu=True, timeout_s=120))
