"""Checks for lesson 03 (CUDA events).

ex03_predict_elapsed (any machine): what `start.elapsed_time(end)` reports for a schedule of kernels,
markers and a wait on two streams, judged against the course's model of streams (`model_event_times`).

ex03_fix_pipeline (GPU): `fixed_pipeline(chunks, producer, consumer, stage_ms)` must give the right
results when the GPU is slow where a race would show, keep the host free, and overlap the two streams.
The probe makes its own inputs and streams and runs the answer in three kinds of runs:
- "late_inputs": the current stream is busy for `delay_ms` before it writes the chunks. A consumer that
  does not wait for the producer's work (or waits on a marker recorded before it) reads `y` before it
  is written; a host that waits for the GPU is caught here (the call takes about `delay_ms`).
- "late_consumer": the consumer stream is busy for `delay_ms` before the pipeline starts, and right after
  the answer returns the probe allocates new tensors on the producer stream and fills them. Without
  `record_stream` (or another lifetime guard) the caching allocator hands them `y`'s blocks, so the
  consumer, still queued, reads the fill.
- "timed": a kernels-mode Timeline of the probe's own; only its `torch.cuda._sleep` kernels (the stages)
  are judged: 2n of them, on at least two streams, overlapping.
Before the runs the probe launches every kernel that it and the two stages use, calls the answer once (its
own kernels), and fills the caching allocator's cache on all three streams. The first launch of a kernel in
a process loads it (lazy module loading), and loading can wait until the GPU is idle: it would hide exactly the
races these runs look for. CUDA documents that a cudaMalloc may synchronise too (implicit synchronisation), so
no run makes one either.
"""

from __future__ import annotations

import numbers
import random
import time
from typing import Any

from . import Exercise, close, expect, register

EX_ELAPSED = "ex03_predict_elapsed"
EX_PIPELINE = "ex03_fix_pipeline"


# ----------------------------------------------------------------- the course's model of streams and events
def model_event_times(ops: list[tuple[str, str, Any]]) -> dict[str, float]:
    """When each event completes (ms), for operations the host queues at time 0, in this order.

    ops: ("sleep", stream, ms) a kernel that runs `ms`; ("record", stream, event) a marker;
    ("wait", stream, event) the stream's later work starts only once `event`, as last recorded before
    this call, is complete (an event never recorded counts as complete, as in CUDA). Each stream runs
    its queue in order, each item as soon as the one before it is done; queueing costs no time.
    """
    clock: dict[str, float] = {}
    done: dict[str, float] = {}
    for op, stream, arg in ops:
        t = clock.get(stream, 0.0)
        if op == "sleep":
            t += float(arg)
        elif op == "record":
            done[arg] = t
        elif op == "wait":
            t = max(t, done.get(arg, 0.0))
        else:
            raise ValueError(f"unknown operation {op!r} (sleep, record or wait)")
        clock[stream] = t
    return done


def elapsed_schedule(a_ms: float, b0_ms: float, b1_ms: float, b2_ms: float) -> list[tuple[str, str, Any]]:
    """The exercise's schedule as model operations (`b.wait_stream(a)` records a marker on a, then waits on it)."""
    return [("sleep", "a", a_ms),
            ("sleep", "b", b0_ms), ("record", "b", "start"), ("sleep", "b", b1_ms),
            ("record", "a", "a so far"), ("wait", "b", "a so far"),
            ("sleep", "b", b2_ms), ("record", "b", "end")]


def _model_elapsed(case: list[float]) -> float:
    t = model_event_times(elapsed_schedule(*case))
    return t["end"] - t["start"]


# ----------------------------------------------------------------- ex03_predict_elapsed
def _elapsed_inputs() -> dict:
    """Schedules on which each misreading of elapsed_time gives a different number from the model."""
    rng = random.Random()

    def ms(lo: float, hi: float) -> float:  # multiples of 0.5 ms
        return rng.randint(int(2 * lo), int(2 * hi)) / 2

    cases = []
    b0, b1 = ms(2, 8), ms(2, 8)
    cases.append([b0 + b1 + ms(5, 30), b0, b1, ms(2, 15)])  # a ends long after b reaches the wait
    b0, b1 = ms(5, 12), ms(5, 12)
    cases.append([ms(1, 4), b0, b1, ms(2, 15)])  # a is done before b reaches the wait
    b0, b1 = ms(4, 10), ms(4, 10)
    cases.append([b0 + ms(0.5, b1 - 0.5), b0, b1, ms(2, 10)])  # a ends while b runs its own work
    cases.append([ms(10, 30), 0.0, 0.0, ms(2, 10)])  # start and wait straight away
    cases += [[ms(0, 40), ms(0, 15), ms(0, 15), ms(0, 15)] for _ in range(3)]
    rng.shuffle(cases)
    return {"cases": cases}


def _elapsed_probe(answer: Any, inputs: dict) -> dict:
    out: list[Any] = []
    for case in inputs["cases"]:
        v = answer(*case)
        ok = isinstance(v, numbers.Real) and not isinstance(v, bool)
        out.append(float(v) if ok else f"a {type(v).__module__}.{type(v).__qualname__}")
    return {"predictions": out}


def _elapsed_hint(case: list[float], pred: float) -> str:
    a, b0, b1, b2 = case
    end_from_zero = model_event_times(elapsed_schedule(*case))["end"]
    if close(pred, b2, abs_=1e-6):
        return "that is the last kernel alone: what else happens on stream b between the two markers?"
    if close(pred, b1 + b2, abs_=1e-6):
        return "that adds up b's own kernels: can b's last kernel start before stream a's kernel is done?"
    if close(pred, end_from_zero, abs_=1e-6):
        return "that counts from time 0: when does the GPU reach `start` on stream b?"
    if close(pred, b1 + a + b2, abs_=1e-6):
        return "a's kernel started at time 0, like b's work: how much of it is left when b reaches the wait?"
    return "walk stream b's queue: when does it reach start, when may it pass the wait, when does it reach end?"


def _elapsed_judge(inputs: dict, data: dict) -> str:
    preds = data["predictions"]
    cases = inputs["cases"]
    expect(type(preds) is list and len(preds) == len(cases), EX_ELAPSED, f"{len(cases)} predictions",
           preds if type(preds) is not list else len(preds))
    for case, pred in zip(cases, preds, strict=True):
        call = "predict_elapsed({:g}, {:g}, {:g}, {:g})".format(*case)
        expect(type(pred) is float, EX_ELAPSED, f"{call} to return a number of ms", pred,
               "return a Python float (or int)")
        want = _model_elapsed(case)
        expect(close(pred, want, rel=0.0, abs_=0.01), EX_ELAPSED, f"{call} = {want:g} ms", f"{pred:g} ms",
               _elapsed_hint(case, pred))
    return f"{len(cases)} schedules predicted"


register(Exercise(EX_ELAPSED, entry="predict_elapsed", probe=_elapsed_probe, judge=_elapsed_judge,
                  inputs=_elapsed_inputs))

# ----------------------------------------------------------------- ex03_fix_pipeline
PIPE_CHUNKS = 6
PIPE_NUMEL = 1 << 22  # 16 MiB of float32: from 10 MiB up, the allocator gives each tensor a segment of its own
STAGE_MS = 5.0
DELAY_MS = 60.0  # longer than the whole pipeline, (PIPE_CHUNKS + 1) * STAGE_MS
HOST_SHARE_MAX = 0.5  # the call must return within this share of the delay the GPU still has queued
MIN_CONCURRENCY = 1.3  # stage kernels' summed time / their makespan; one stream at a time gives 1.0
MIN_STAGE_SHARE = 0.5  # a stage kernel runs at least this share of stage_ms
MOD, SCALE = 4099, 32  # chunk values ((j * a + b) % MOD) / SCALE: exact in float32, and so are 2x and 2x + 1
SAMPLES = 256  # output elements compared per chunk, at places the inputs pick
SENTINEL = -7.0  # what the probe writes where a result must not come from
RUN_KINDS = ("late_inputs", "late_consumer", "late_inputs", "late_consumer", "timed", "timed", "timed")
SPIN = "spin_kernel"  # the kernel behind torch.cuda._sleep (aten/src/ATen/cuda/Sleep.cu)


def chunk_value(j: int, a: int, b: int) -> float:
    """Element j of a chunk made from seed (a, b)."""
    return ((j * a + b) % MOD) / SCALE


def _pipeline_inputs() -> dict:
    rng = random.Random()
    used: set[tuple[int, int]] = set()

    def seeds() -> list[list[int]]:
        out = []
        while len(out) < PIPE_CHUNKS:
            s = (rng.randint(1, MOD - 1), rng.randint(0, MOD - 1))
            if s not in used:  # every chunk of every run differs: a stale read never looks right
                used.add(s)
                out.append(list(s))
        return out

    return {"n": PIPE_CHUNKS, "numel": PIPE_NUMEL, "stage_ms": STAGE_MS, "delay_ms": DELAY_MS,
            "sample": sorted(rng.sample(range(PIPE_NUMEL), SAMPLES)), "warmup": seeds(),
            "runs": [{"kind": kind, "seeds": seeds()} for kind in RUN_KINDS]}


def _shape_problem(outs: Any, n: int, numel: int) -> str | None:
    import torch

    if type(outs) not in (list, tuple) or len(outs) != n:
        return f"{type(outs).__name__} of length {len(outs) if type(outs) in (list, tuple) else '?'}"
    for i, o in enumerate(outs):
        if type(o) is not torch.Tensor:  # exact type: a subclass could compare equal to anything
            return f"result {i} is a {type(o).__module__}.{type(o).__qualname__}"
        if not o.is_cuda or o.dtype != torch.float32 or o.numel() != numel:
            return f"result {i}: {o.dtype} on {o.device} with {o.numel()} elements"
    return None


def _mallocs() -> int:
    """cudaMalloc calls of the caching allocator so far (one per new segment)."""
    import torch

    return int(torch.cuda.memory_stats().get("segment.all.allocated", 0))


class _PipelineRig:
    """What every run of the probe shares: the answer, the two streams it is given, the sizes and the clock."""

    def __init__(self, answer: Any, inputs: dict) -> None:
        import torch

        from ..measure import cycles_per_ms, gpu_sleep
        from ..timeline import Timeline

        self.gpu_sleep, self.Timeline = gpu_sleep, Timeline
        self.answer = answer
        self.n, self.numel = inputs["n"], inputs["numel"]
        self.stage, self.delay = inputs["stage_ms"], inputs["delay_ms"]
        self.rate = cycles_per_ms()
        self.dev = torch.device("cuda", torch.cuda.current_device())
        self.current = torch.cuda.current_stream()
        self.producer, self.consumer = torch.cuda.Stream(), torch.cuda.Stream()
        self.idx = torch.tensor(inputs["sample"], device=self.dev)

    def chunks_from(self, seeds: list[list[int]]) -> list:
        import torch

        j = torch.arange(self.numel, device=self.dev, dtype=torch.int64)
        return [((j * a + b) % MOD).to(torch.float32) / SCALE for a, b in seeds]

    def call(self, chunks: list) -> tuple[Any, float, int]:
        """The answer on `chunks`: what it returned, how long the host spent in it (ms), its cudaMallocs."""
        before = _mallocs()
        t0 = time.perf_counter()
        outs = self.answer(chunks, self.producer, self.consumer, self.stage)
        return outs, (time.perf_counter() - t0) * 1e3, _mallocs() - before

    def result(self, outs: Any, host_ms: float, mallocs: int) -> dict:
        problem = _shape_problem(outs, self.n, self.numel)
        if problem:
            return {"error": problem}
        return {"host_ms": host_ms, "mallocs": mallocs,
                "samples": [o.reshape(-1)[self.idx].cpu().tolist() for o in outs]}

    def late_inputs(self, seeds: list[list[int]]) -> dict:
        import torch

        src = self.chunks_from(seeds)
        chunks = [torch.full((self.numel,), SENTINEL, device=self.dev) for _ in seeds]  # not written yet
        torch.cuda.synchronize()
        self.gpu_sleep(self.delay, self.rate)  # the current stream is busy...
        for x, s in zip(chunks, src, strict=True):
            torch.mul(s, 1.0, out=x)  # ...then writes the inputs (a kernel: a copy could synchronise)
        outs, host_ms, mallocs = self.call(chunks)
        torch.cuda.synchronize()
        return self.result(outs, host_ms, mallocs)

    def late_consumer(self, seeds: list[list[int]]) -> dict:
        import torch

        chunks = self.chunks_from(seeds)
        torch.cuda.synchronize()
        with torch.cuda.stream(self.consumer):
            self.gpu_sleep(self.delay, self.rate)  # the consumer stream is busy before the pipeline starts
        outs, host_ms, mallocs = self.call(chunks)
        fills = self.refill_producer_blocks()
        torch.cuda.synchronize()
        r = self.result(outs, host_ms, mallocs)
        del fills
        return r

    def refill_producer_blocks(self) -> list:
        """The answer has returned: its intermediates are free as far as Python knows. New tensors on the
        producer stream get their blocks unless the allocator knows another stream still reads them. Fill
        until the allocator has no cached block left on this stream (it then calls cudaMalloc); the caller
        holds the fills until the results are read."""
        import torch

        fills, base = [], _mallocs()
        with torch.cuda.stream(self.producer):
            for _ in range(8 * self.n + 16):
                fills.append(torch.full((self.numel,), SENTINEL, device=self.dev))
                if _mallocs() > base:
                    break
        return fills

    def timed(self, seeds: list[list[int]]) -> dict:
        import torch

        chunks = self.chunks_from(seeds)
        torch.cuda.synchronize()
        tl = self.Timeline(mode="kernels")
        tl.name_stream(self.producer, "producer")
        tl.name_stream(self.consumer, "consumer")
        with tl.capture():
            outs, host_ms, mallocs = self.call(chunks)
            torch.cuda.synchronize()
        r = self.result(outs, host_ms, mallocs)
        r["kernels"] = [[s.start_ms, s.end_ms, s.stream] for s in tl.spans()
                        if s.kind == "compute" and SPIN in s.name]
        return r

    def warm_kernels(self, seeds: list[list[int]]) -> None:
        """Launch once every kernel the runs launch outside the answer (a first launch waits for the GPU)."""
        import torch

        x = self.chunks_from(seeds[:1])[0]  # the chunks' kernels
        late = torch.full((self.numel,), SENTINEL, device=self.dev)  # the sentinel fill
        torch.mul(x, 1.0, out=late)  # the late write of the inputs
        out = x * 2 + 1  # the stages' arithmetic: produce's 2 * x, consume's y + 1
        self.gpu_sleep(0.01, self.rate)  # the stages' and the delays' sleep
        out.reshape(-1)[self.idx].cpu().tolist()  # reading the samples
        torch.cuda.synchronize()

    def warm_answer(self, seeds: list[list[int]]) -> str | None:
        """Call the answer once (the first launches of its own kernels); what is wrong with its results' shape."""
        import torch

        warm = self.chunks_from(seeds)
        outs, _, _ = self.call(warm)
        torch.cuda.synchronize()
        return _shape_problem(outs, self.n, self.numel)

    def fill_cache(self) -> None:
        """Cache blocks of the chunks' size on all three streams, so that no run needs a cudaMalloc."""
        import torch

        for s in (self.current, self.producer, self.consumer):
            with torch.cuda.stream(s):
                held = [torch.empty(self.numel, device=self.dev) for _ in range(4 * self.n + 4)]
            del held
        torch.cuda.synchronize()


def _pipeline_probe(answer: Any, inputs: dict) -> dict:
    rig = _PipelineRig(answer, inputs)
    runners = {"late_inputs": rig.late_inputs, "late_consumer": rig.late_consumer, "timed": rig.timed}
    # Warm-up (see the module docstring): kernels launched once, the answer called once, then blocks of this
    # size cached on all three streams.
    rig.warm_kernels(inputs["warmup"])
    problem = rig.warm_answer(inputs["warmup"])
    if problem:
        return {"error": problem}
    rig.fill_cache()
    runs = []
    for run in inputs["runs"]:
        r = runners[run["kind"]](run["seeds"])
        if "error" in r:
            return {"error": r["error"]}
        runs.append(r)
    return {"runs": runs}


def _wrong_chunks(inputs: dict, run: dict, seeds: list[list[int]]) -> int:
    """How many chunks of a run have an output that is not 2x + 1 at the sampled places."""
    samples = run["samples"]
    expect(type(samples) is list and len(samples) == len(seeds), EX_PIPELINE, f"{len(seeds)} results per run",
           len(samples) if type(samples) is list else samples)
    wrong = 0
    for (a, b), got in zip(seeds, samples, strict=True):
        want = [2 * chunk_value(j, a, b) + 1 for j in inputs["sample"]]
        wrong += not (type(got) is list and len(got) == len(want) and all(
            type(g) is float and g == w for g, w in zip(got, want, strict=True)))
    return wrong


_RESULT_RULES = {
    "late_inputs": ("right results when the chunks are written late (the current stream was busy for {delay:g} ms)",
                    "does the consumer wait for the producer's work on each chunk, with a marker recorded after "
                    "that work was queued? Does the producer wait for the stream that wrote the chunks?"),
    "late_consumer": ("right results when the consumer stream is busy for {delay:g} ms and new tensors are "
                      "allocated on the producer stream right after your function returns",
                      "when your function returns, which stream still has to read each y? What tells the "
                      "caching allocator that y's memory is still in use there?"),
    "timed": ("right results in the timed runs", "compare with the runs above"),
}


def judge_pipeline(inputs: dict, data: dict) -> str:
    """The verdict on what the probe measured (plain data), with every expected value computed here."""
    n, delay, stage = inputs["n"], inputs["delay_ms"], inputs["stage_ms"]
    case = f" ({n} chunks of {inputs['numel']:,} float32 values, stages of {stage:g} ms)"
    expect(data.get("error") is None, EX_PIPELINE,
           f"a list of {n} float32 CUDA tensors with {inputs['numel']} elements each", data.get("error"),
           "return the consumer's outputs, one plain tensor per chunk, in order")
    runs = data.get("runs")
    expect(type(runs) is list and len(runs) == len(inputs["runs"]), EX_PIPELINE, f"{len(inputs['runs'])} runs",
           len(runs) if type(runs) is list else runs)
    pairs = list(zip(inputs["runs"], runs, strict=True))
    for kind in ("late_inputs", "late_consumer", "timed"):
        mine = [(spec, r) for spec, r in pairs if spec["kind"] == kind]
        wrong = sum(_wrong_chunks(inputs, r, spec["seeds"]) for spec, r in mine)
        what, hint = _RESULT_RULES[kind]
        expect(wrong == 0, EX_PIPELINE, what.format(delay=delay) + case, f"{wrong} of {n * len(mine)} chunks wrong",
               hint)
    late = [r for spec, r in pairs if spec["kind"] != "timed"]
    worst = max(float(r["host_ms"]) for r in late)
    expect(worst <= HOST_SHARE_MAX * delay, EX_PIPELINE,
           f"the call to return within {HOST_SHARE_MAX * delay:g} ms while the GPU still had {delay:g} ms queued{case}",
           f"{worst:.1f} ms (cudaMalloc calls in that call: {max(int(r['mallocs']) for r in late)})",
           "does anything in your function make the host wait for the GPU (a synchronize, an event's "
           "synchronize, reading a value)?")
    best = 0.0
    for spec, r in pairs:
        if spec["kind"] != "timed":
            continue
        stages = [k for k in r["kernels"] if k[1] - k[0] >= MIN_STAGE_SHARE * stage]
        expect(len(stages) == 2 * n, EX_PIPELINE, f"{2 * n} stage kernels of about {stage:g} ms (produce and "
               f"consume, once per chunk) on the probe's timeline{case}", f"{len(stages)}",
               "call produce and consume once per chunk, and nothing else that sleeps")
        streams = {k[2] for k in stages}
        expect(len(streams) >= 2, EX_PIPELINE, f"stage kernels on two streams{case}", sorted(streams),
               "where do produce and consume run?")
        span = max(k[1] for k in stages) - min(k[0] for k in stages)
        best = max(best, sum(k[1] - k[0] for k in stages) / span if span > 0 else 0.0)
    expect(best >= MIN_CONCURRENCY, EX_PIPELINE,
           f"the two streams overlapping (stage kernels' time / their makespan >= {MIN_CONCURRENCY}){case}",
           f"{best:.2f}",
           "while chunk i is consumed, can chunk i + 1 be produced? What makes one stream wait for the other's "
           "whole queue?")
    return (f"right in all {len(runs)} runs; returned in {worst:.1f} ms with {delay:g} ms queued; "
            f"stage kernels' time / makespan = {best:.2f} (1 = one stream at a time; {2 * n / (n + 1):.2f} = the "
            f"most {n} chunks allow: both busy but for the first and the last stage)")


register(Exercise(EX_PIPELINE, entry="fixed_pipeline", probe=_pipeline_probe, judge=judge_pipeline,
                  inputs=_pipeline_inputs, needs_gpu=True, timeout_s=180.0))
