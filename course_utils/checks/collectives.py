"""Checks for lesson 06 (collectives).

ex06_busbw (CPU): the learner's `busbw_gbps(op, input_bytes, output_bytes, seconds, world_size)` against the
nccl-tests definitions, on cases this module picks: S is the whole buffer (for all_gather and gather the output,
n shards; for reduce_scatter and scatter the input; otherwise the tensor itself), algbw = S / t in GB/s (1e9 B),
busbw = algbw x 2(n-1)/n (all_reduce), (n-1)/n (all_gather, reduce_scatter, all_to_all, gather, scatter) or 1
(broadcast, reduce). The model here is written out on its own, not taken from course_utils.bench, so the two
check each other (tests/test_bench.py holds bench to nccl-tests' table).

ex06_time_collective (CPU, on gloo ranks): the learner's `time_collective(launch, iters, warmup)` runs on every
rank of a job this probe starts (course_utils.launch, 2 gloo ranks) with a `launch` it builds: each call starts
one all_reduce with async_op=True on a process group created at the first call, and that first call also pauses
`setup_s` seconds, standing in for the communicator set-up an NCCL group pays on first use (gloo's own set-up is
too quick to notice). The answer runs `runs` times, each on a fresh `launch`; the probe counts the launches,
waits for any Work the answer left running, and times the same all_reduce with its own loop before and after; the
judge wants, in every run, warmup + iters launches and the same number on every rank (the average over ranks), and
in the best run a time per call between `low` times the fastest of the probe's loops and `high` times the slowest
median of them.

Why an answer cannot hand its work to course_utils.bench. bench is the course's measuring tool: its table must
show busbw, so it holds the nccl-tests factors and a timing loop, i.e. both answers, and a student imports it.
The resolution: while a probe runs the student's function, every function of course_utils.bench (and this
module's model) is made unavailable *in place*: its code object is swapped for one that raises "... not allowed in
this exercise", and restored afterwards (`tools_unavailable`). Swapping the code, not the module attribute, also
catches a function the student bound earlier (`from course_utils.bench import bus_factor`). The same happens in
the ranks of ex06_time_collective. What remains possible is reading bench's source and retyping it, which is
reading the documentation; the exercises ask for the reasoning (which buffer is S, which factor, what a clock must
wait for), and the notebook compares the learner's functions with bench's on the learner's own measurements.
"""

from __future__ import annotations

import contextlib
import inspect
import math
import random
import statistics
import time
from collections.abc import Iterator
from typing import Any

from . import Exercise, close, expect, rank_error, register

NOT_ALLOWED = "not allowed in this exercise"
OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")

# ------------------------------------------------------------------------------------------ tools unavailable


def _raising_code(qualname: str):
    """A code object that raises RuntimeError saying `qualname` is not allowed (no closure: it fits any function)."""
    message = (f"{qualname} is {NOT_ALLOWED}: write it yourself (course_utils.bench and the check's own model are "
               "unavailable while your function is checked)")
    namespace: dict[str, Any] = {}
    exec(compile(f"def _unavailable(*args, **kwargs):\n    raise RuntimeError({message!r})\n", f"<{qualname}>",
                 "exec"), {}, namespace)
    return namespace["_unavailable"].__code__


def _functions_of(module: Any) -> Iterator[Any]:
    """Plain functions defined in `module`, at module level or as methods of its classes (dunders aside)."""
    for obj in list(vars(module).values()):
        if getattr(obj, "__module__", None) != module.__name__:
            continue
        if inspect.isfunction(obj):
            yield obj
        elif inspect.isclass(obj):
            for name, member in vars(obj).items():
                if name.startswith("__"):
                    continue
                if isinstance(member, (staticmethod, classmethod)):
                    member = member.__func__
                elif isinstance(member, property):
                    member = member.fget
                if inspect.isfunction(member):
                    yield member


@contextlib.contextmanager
def tools_unavailable() -> Iterator[None]:
    """Within the block, every function of course_utils.bench and this module's model raises; restored after."""
    from .. import bench

    swapped = []
    try:
        for fn in list(_functions_of(bench)) + list(_MODEL):
            if fn.__code__.co_freevars:  # a closure cannot take a code object without its cells
                continue
            swapped.append((fn, fn.__code__))
            fn.__code__ = _raising_code(f"{fn.__module__}.{fn.__qualname__}")
        yield
    finally:
        for fn, code in reversed(swapped):
            fn.__code__ = code


def _not_allowed(err: BaseException) -> bool:
    return isinstance(err, RuntimeError) and NOT_ALLOWED in str(err)


def _plain_number(value: Any) -> float | str:
    """A number as a float (a subclass of float brings no __eq__ of its own to the judge), else a description."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return f"a {type(value).__module__}.{type(value).__qualname__}, not a number"


# ------------------------------------------------------------------------------------------ ex06_busbw (CPU)

EX_BUSBW = "ex06_busbw"


def model_size(op: str, input_bytes: int, output_bytes: int) -> int:
    """S as nccl-tests counts it, from the bytes one rank's call reads and writes."""
    if op in ("all_gather", "gather"):
        return output_bytes  # the n shards gathered
    return input_bytes  # reduce_scatter, scatter: the n shards split; the others: one buffer, as big in as out


def model_factor(op: str, world_size: int) -> float:
    n = world_size
    return {"all_reduce": 2 * (n - 1) / n, "broadcast": 1.0, "reduce": 1.0}.get(op, (n - 1) / n)


def model_busbw(op: str, input_bytes: int, output_bytes: int, seconds: float, world_size: int) -> float:
    return model_size(op, input_bytes, output_bytes) / seconds / 1e9 * model_factor(op, world_size)


_MODEL = (model_size, model_factor, model_busbw)


def tensor_bytes(op: str, shard_bytes: int, world_size: int) -> tuple[int, int]:
    """(input bytes, output bytes) of one rank's PyTorch call on `world_size` ranks whose share of the whole buffer
    is `shard_bytes` (the whole is shard_bytes * world_size, for every collective)."""
    whole = shard_bytes * world_size
    return {"all_gather": (shard_bytes, whole), "gather": (shard_bytes, whole), "reduce_scatter": (whole, shard_bytes),
            "scatter": (whole, shard_bytes)}.get(op, (whole, whole))


# Cases every answer is asked about, each telling a wrong idea apart from the definitions: (op, world, shard, ms).
FIXED_CASES = [
    ("all_gather", 4, 1 << 20, 2.0),       # S is the output (n shards), not the shard a rank passes in
    ("reduce_scatter", 4, 1 << 20, 2.0),   # S is the input, not the shard a rank gets out
    ("all_reduce", 2, 1 << 26, 1.0),       # 2(n-1)/n is 1 on two ranks ...
    ("all_reduce", 8, 1 << 24, 3.0),       # ... and 1.75 on eight
    ("broadcast", 8, 1 << 22, 5.0),        # factor 1 whatever n
    ("reduce", 3, 1 << 22, 5.0),
    ("all_to_all", 4, 1 << 20, 1.5),       # (n-1)/n of the whole buffer
    ("gather", 5, 1 << 18, 0.8),           # as all_gather, to one rank
    ("scatter", 3, 1 << 18, 0.8),          # as reduce_scatter, from one rank
]


def _case(op: str, n: int, shard: int, ms: float) -> list:
    ins, outs = tensor_bytes(op, shard, n)
    return [op, ins, outs, ms / 1e3, n]


def busbw_inputs(seed: int | None = None, n_random: int = 10) -> dict:
    seed = random.randrange(1_000_000) if seed is None else seed
    rng = random.Random(seed)
    cases = [_case(*c) for c in FIXED_CASES]
    for _ in range(n_random):
        cases.append(_case(rng.choice(OPS), rng.choice((2, 3, 4, 5, 6, 8, 16)), 4 * rng.randint(256, 1 << 24),
                           round(rng.uniform(0.01, 50.0), 4)))
    rng.shuffle(cases)
    return {"seed": seed, "cases": cases}


def busbw_probe(answer: Any, inputs: dict) -> dict:
    """Ask the answer about every case with course_utils.bench unavailable; keep numbers, describe the rest."""
    values: list[Any] = []
    with tools_unavailable():
        for op, ins, outs, seconds, n in inputs["cases"]:
            try:
                values.append(_plain_number(answer(str(op), int(ins), int(outs), float(seconds), int(n))))
            except RuntimeError as err:
                if not _not_allowed(err):
                    raise
                return {"error": str(err)}
    return {"values": values}


def _describe(case: list) -> str:
    from ..bench import human_bytes  # in the judge: bench is available again

    op, ins, outs, seconds, n = case
    return f"{op} on {n} ranks, input {human_bytes(ins)}, output {human_bytes(outs)}, {seconds * 1e3:g} ms per call"


def busbw_judge(inputs: dict, data: dict) -> str:
    expect("error" not in data, EX_BUSBW, "busbw_gbps to compute busbw itself", data.get("error"))
    values, cases = data.get("values"), inputs["cases"]
    expect(type(values) is list and len(values) == len(cases), EX_BUSBW, f"one value per case ({len(cases)})",
           type(values).__name__ if type(values) is not list else f"{len(values)} values")
    for case, got in zip(cases, values, strict=True):
        want = model_busbw(*case)
        expect(type(got) is float and math.isfinite(got), EX_BUSBW, f"a number of GB/s for {_describe(case)}", got,
               "return busbw in GB/s as a float")
        expect(close(got, want, rel=1e-6), EX_BUSBW, f"busbw {want:.6g} GB/s for {_describe(case)}",
               f"{got:.6g} GB/s",
               "which of the two tensors is the S that nccl-tests divides by the time, and how many bytes per byte "
               "of S must leave or enter the busiest rank in this collective?")
    return f"{len(cases)} cases over {len({c[0] for c in cases})} collectives, all as nccl-tests defines busbw"


register(Exercise(EX_BUSBW, entry="busbw_gbps", probe=busbw_probe, judge=busbw_judge, inputs=busbw_inputs,
                  needs_gpu=False, timeout_s=30))

# ------------------------------------------------------------------------------------ ex06_time_collective (CPU)

EX_TIME = "ex06_time_collective"


def time_inputs(seed: int | None = None) -> dict:
    seed = random.randrange(1_000_000) if seed is None else seed
    rng = random.Random(seed)
    return {"seed": seed, "nproc": 2, "numel": rng.choice((1 << 18, 3 << 17, 1 << 19)), "iters": rng.randint(8, 12),
            "warmup": rng.randint(2, 3), "setup_s": 1.0, "runs": 2, "repeats": 3, "low": 0.4, "high": 4.0,
            "timeout_s": 90}


def _probe_loop(buf: Any, group: Any, iters: int) -> float:
    """The probe's own measurement: `iters` async all_reduces back to back, all waited for; seconds per call."""
    import torch.distributed as dist

    t0 = time.perf_counter()
    works = [dist.all_reduce(buf, group=group, async_op=True) for _ in range(iters)]
    for w in works:
        w.wait()
    return (time.perf_counter() - t0) / iters


def _time_rank(answer: Any, inputs: dict) -> dict:
    """On every rank: reference timings, the answer `runs` times (each on a fresh `launch`), reference timings."""
    import torch
    import torch.distributed as dist

    iters, warmup, repeats = inputs["iters"], inputs["warmup"], inputs["repeats"]
    ref_buf = torch.zeros(inputs["numel"])
    ref_group = dist.new_group(backend="gloo")
    _probe_loop(ref_buf, ref_group, 2)  # warm
    before = [_probe_loop(ref_buf, ref_group, iters) for _ in range(repeats)]
    runs = []
    for _ in range(inputs["runs"]):
        buf = torch.zeros(inputs["numel"])
        state: dict[str, Any] = {"group": None, "launches": 0, "works": []}

        def launch(buf=buf, state=state):
            """Start one all_reduce (async_op=True) and return its Work. The first call sets the group up."""
            if state["group"] is None:
                state["group"] = dist.new_group(backend="gloo")
                time.sleep(inputs["setup_s"])  # stands in for an NCCL communicator's set-up on first use
            state["launches"] += 1
            work = dist.all_reduce(buf, group=state["group"], async_op=True)
            state["works"].append(work)
            return work

        dist.barrier()
        error = None
        with tools_unavailable():
            try:
                value = answer(launch, iters=iters, warmup=warmup)
            except NotImplementedError:
                return {"not_attempted": True}
            except RuntimeError as err:
                if not _not_allowed(err):
                    raise
                value, error = None, str(err)
        for work in state["works"]:  # whatever the answer left running
            work.wait()
        runs.append({"value": _plain_number(value), "error": error, "launches": state["launches"]})
        if error is not None:
            break
    dist.barrier()
    after = [_probe_loop(ref_buf, ref_group, iters) for _ in range(repeats)]
    return {"runs": runs, "before_s": before, "after_s": after}


def time_probe(answer: Any, inputs: dict) -> dict:
    """Run the answer on `nproc` gloo ranks (course_utils.launch); each rank's plain facts, or the error."""
    from ..launch import WorkerError, WorkerTimeout, run

    try:
        ranks = run(_time_rank, answer, inputs, nproc=inputs["nproc"], backend="gloo", timeout=inputs["timeout_s"])
    except WorkerError as err:
        return {"error": rank_error(err)}
    except WorkerTimeout as err:
        return {"error": f"{type(err).__name__}: {str(err)[-2000:]}"}
    if any(r.get("not_attempted") for r in ranks.values()):
        raise NotImplementedError("time_collective raised NotImplementedError")
    return {"ranks": [ranks[r] for r in sorted(ranks)]}


def time_judge(inputs: dict, data: dict) -> str:
    expect("error" not in data, EX_TIME, "time_collective to run on every rank without an error", data.get("error"))
    ranks = data.get("ranks")
    nproc, iters, warmup = inputs["nproc"], inputs["iters"], inputs["warmup"]
    expect(type(ranks) is list and len(ranks) == nproc, EX_TIME, f"a result from each of {nproc} ranks",
           ranks if type(ranks) is not list else len(ranks))
    values = []  # per run: the value every rank returned
    for i in range(len(ranks[0]["runs"])):
        for rank, r in enumerate(ranks):
            run = r["runs"][i]
            expect(run["error"] is None, EX_TIME, "time_collective to measure by itself", run["error"])
            expect(run["launches"] == warmup + iters, EX_TIME,
                   f"{warmup + iters} calls of launch() on rank {rank} ({warmup} warm-up, {iters} timed)",
                   f"{run['launches']} calls", "how many calls are warm-up, how many are timed, and what does the "
                   "first call on a fresh group pay for?")
            expect(type(run["value"]) is float and math.isfinite(run["value"]) and run["value"] > 0, EX_TIME,
                   f"a positive number of seconds per call on rank {rank}", run["value"])
        seen = [r["runs"][i]["value"] for r in ranks]
        expect(all(close(v, seen[0], rel=1e-9) for v in seen), EX_TIME,
               "the same number on every rank (the time per call averaged over the ranks, as nccl-tests reports it)",
               [f"{v:.6g} s" for v in seen], "each rank measured its own time: how do the ranks agree on one number?")
        values.append(seen[0])
    expect(len(values) == inputs["runs"], EX_TIME, f"{inputs['runs']} runs of time_collective", len(values))
    samples = [s for r in ranks for s in r["before_s"] + r["after_s"]]
    ref = max(statistics.median(r[key]) for r in ranks for key in ("before_s", "after_s"))
    lo, hi = inputs["low"] * min(samples), inputs["high"] * ref
    best = min(values, key=lambda v: abs(math.log(v / ref)))  # the upper bound on the best of the runs
    what = f"about the time an all_reduce of {inputs['numel']} floats on {nproc} gloo ranks takes here"
    # The lower bound on every run: a busy machine slows a run down, never below the collectives' own time, but it
    # can slow a loop that only launches them into the range in one run, so a bound on the best run alone would
    # let such a loop pass.
    expect(min(values) >= lo, EX_TIME, f"{what}: at least {lo * 1e3:.3f} ms per call in every run",
           f"{min(values) * 1e3:.4f} ms in one run",
           "had every timed collective finished when you read the clock the second time?")
    expect(best <= hi, EX_TIME, f"{what}: at most {hi * 1e3:.3f} ms per call (returned in seconds)",
           f"{best * 1e3:.4f} ms at best", "what did your clock see besides the timed calls?")
    ranks_said = "both ranks" if nproc == 2 else f"all {nproc} ranks"
    return (f"{len(values)} runs: {', '.join(f'{v * 1e3:.3f}' for v in values)} ms per call, each the same on "
            f"{ranks_said}; the check's own loop "
            f"measured {min(samples) * 1e3:.3f} to {ref * 1e3:.3f} ms (fastest, slowest median)")


register(Exercise(EX_TIME, entry="time_collective", probe=time_probe, judge=time_judge, inputs=time_inputs,
                  needs_gpu=False, timeout_s=120))
