"""Lesson 03, CUDA events: order streams with record/wait, time with events, a race and how to catch it.

Plain functions that run on a GPU and return data (dicts of numbers, lists of span dicts); the notebook
draws them. `RECORDINGS` makes the lesson's reference recording, shown on machines without CUDA.

Every demo uses two *side* streams: PyTorch's default stream is the legacy default stream, which
synchronises with other blocking streams and can hide a race.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch

from .host_device import calibrate_sleep, gpu_sleep

# ---------------------------------------------------------------- a kernel of known length
# One calibration for the whole course (lesson 01 introduces it); these are the names lesson 03 uses.
cycles_per_ms = calibrate_sleep
sleep_ms = gpu_sleep


def _on(tl: Any, name: str, stream: torch.cuda.Stream, kind: str = "compute") -> Any:
    """A timeline span on `stream` when a Timeline is given, else just make `stream` current."""
    return tl.span(name, kind=kind, stream=stream) if tl is not None else torch.cuda.stream(stream)


# ---------------------------------------------------------------- record, query, synchronize, elapsed_time
def event_basics(sleep: float = 20.0, n_records: int = 200) -> dict[str, Any]:
    """Record two events around a `sleep`-ms kernel and see what the host sees at each step."""
    s = torch.cuda.Stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    cycles_per_ms()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(s):
        start.record()
        sleep_ms(sleep)
        end.record()
    enqueue_ms = (time.perf_counter() - t0) * 1e3
    query_before = end.query()
    t1 = time.perf_counter()
    end.synchronize()
    wait_ms = (time.perf_counter() - t1) * 1e3
    query_after = end.query()
    probe = torch.cuda.Event()
    t2 = time.perf_counter()
    for _ in range(n_records):
        probe.record(s)
    record_us = (time.perf_counter() - t2) * 1e6 / n_records
    s.synchronize()
    return {"sleep_ms": sleep, "enqueue_host_ms": enqueue_ms, "query_before": query_before,
            "host_wait_ms": wait_ms, "query_after": query_after, "elapsed_ms": start.elapsed_time(end),
            "record_host_us": record_us}


# ---------------------------------------------------------------- producer and consumer on two side streams
def producer_consumer(wait: bool = True, sleep: float = 10.0, numel: int = 1 << 20, value: float = 1.0,
                      tl: Any = None) -> bool:
    """The producer stream spins `sleep` ms then writes `value`; the consumer doubles what it reads.

    With `wait` the consumer waits on an event the producer recorded after its write. Returns True when
    the consumer saw the producer's value.
    """
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    if tl is not None:
        tl.name_stream(producer, "producer")
        tl.name_stream(consumer, "consumer")
    buf = torch.zeros(numel, device="cuda")
    out = torch.empty_like(buf)
    torch.cuda.synchronize()
    ready = torch.cuda.Event()
    with _on(tl, "produce", producer):
        sleep_ms(sleep)
        buf.fill_(value)
    ready.record(producer)
    if wait:
        consumer.wait_event(ready)  # GPU-side: the host does not wait
    with _on(tl, "consume", consumer):
        torch.mul(buf, 2, out=out)
    torch.cuda.synchronize()
    return bool((out == 2 * value).all())


def race_trials(trials: int = 20, wait: bool = False, sleep: float = 2.0) -> dict[str, Any]:
    """Run the producer/consumer `trials` times with a new value each time; count the wrong results."""
    wrong = sum(not producer_consumer(wait=wait, sleep=sleep, numel=1 << 16, value=float(i + 1))
                for i in range(trials))
    return {"wait": wait, "trials": trials, "wrong": wrong}


def producer_consumer_spans(wait: bool, sleep: float = 10.0) -> list[dict[str, Any]]:
    """The producer/consumer pair on a Timeline: spans as dicts (what a recording stores)."""
    from .timeline import Timeline

    producer_consumer(wait=True, sleep=0.1)  # warm-up: the first use of a kernel loads it, which can stall
    tl = Timeline()
    producer_consumer(wait=wait, sleep=sleep, tl=tl)
    return [s.to_dict() for s in tl.spans()]


# ---------------------------------------------------------------- the stream sanitizer, in a worker process
SANITIZER_SCRIPT = '''\
"""The producer/consumer race, run under TORCH_CUDA_SANITIZER=1 (CSAN)."""
import torch

producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
buf = torch.zeros(1 << 16, device="cuda")
torch.cuda.synchronize()

# 1. with the event: CSAN stays quiet
ready = torch.cuda.Event()
with torch.cuda.stream(producer):
    buf.fill_(1.0)
ready.record(producer)
consumer.wait_event(ready)
with torch.cuda.stream(consumer):
    out = buf * 2
torch.cuda.synchronize()
print("with the wait: no report", flush=True)

# 2. without it: CSAN reports the race (and raises)
with torch.cuda.stream(producer):
    buf.fill_(2.0)
with torch.cuda.stream(consumer):
    out = buf * 2
torch.cuda.synchronize()
print("without the wait: no report either", flush=True)
'''


def run_sanitizer(script: str = SANITIZER_SCRIPT, timeout: float = 180.0) -> dict[str, Any]:
    """Run `script` in a fresh Python process with TORCH_CUDA_SANITIZER=1; return its output and verdict.

    The sanitizer must be on before CUDA starts, hence a worker process rather than this kernel.
    """
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "race.py")
        with open(path, "w") as f:
            f.write(script)
        env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, path], capture_output=True, text=True, env=env, timeout=timeout)
    output = proc.stdout + proc.stderr
    return {"returncode": proc.returncode, "detected": "CSAN detected a possible data race" in output,
            "report": sanitizer_report(output), "stdout": proc.stdout, "seconds": time.perf_counter() - t0}


def sanitizer_report(output: str, max_lines: int = 40) -> str:
    """The part of a CSAN run's output worth reading: from the first report on, without traceback noise."""
    lines = output.splitlines()
    start = next((i for i, line in enumerate(lines) if "CSAN detected" in line), None)
    if start is None:
        return "\n".join(lines[-max_lines:])
    return "\n".join(lines[start:start + max_lines])


# ---------------------------------------------------------------- memory reuse across streams
def reuse_demo(use_record_stream: bool, sleep: float = 20.0, numel: int = 1 << 22) -> dict[str, Any]:
    """Stream b reads x late; meanwhile x is deleted and stream a allocates a new tensor of the same size.

    The caching allocator ties a block to the stream it was allocated on: freed, it is reused at once
    by that stream, unless `x.record_stream(b)` told it that b still uses the block.
    """
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    cycles_per_ms()
    with torch.cuda.stream(a):
        x = torch.full((numel,), 1.0, device="cuda")
    b.wait_stream(a)
    with torch.cuda.stream(b):
        sleep_ms(sleep)
        y = x * 2  # b reads x, `sleep` ms from now
    if use_record_stream:
        x.record_stream(b)
    address = x.data_ptr()
    del x  # the host is done with x; the GPU is not
    with torch.cuda.stream(a):
        z = torch.full((numel,), 5.0, device="cuda")
    torch.cuda.synchronize()
    return {"record_stream": use_record_stream, "reused_address": z.data_ptr() == address,
            "correct": bool((y == 2).all()), "y_first": float(y[0])}


# ---------------------------------------------------------------- the exercise's stages
def produce(x: torch.Tensor, stage_ms: float) -> torch.Tensor:
    """Stage 1: long work, then the result (2x) is written at the very end."""
    sleep_ms(stage_ms)
    return x * 2


def consume(y: torch.Tensor, stage_ms: float) -> torch.Tensor:
    """Stage 2: reads its input first (y + 1), then more long work."""
    out = y + 1
    sleep_ms(stage_ms)
    return out


def make_chunks(n: int, numel: int, seed: int | None = None) -> list[torch.Tensor]:
    """`n` fresh random chunks on the GPU (fresh data each run, so a stale read cannot look right)."""
    g = torch.Generator(device="cuda")
    g.manual_seed(int(seed if seed is not None else torch.seed() % (2**31)))
    return [torch.rand(numel, device="cuda", generator=g) for _ in range(n)]


def _record() -> dict[str, Any]:
    """Everything lesson 03 shows, measured on this GPU."""
    cycles_per_ms()
    return {
        "cycles_per_ms": cycles_per_ms(),
        "basics": event_basics(),
        "spans_no_wait": producer_consumer_spans(wait=False),
        "spans_wait": producer_consumer_spans(wait=True),
        "race": [race_trials(20, wait=False), race_trials(20, wait=True)],
        "sanitizer": run_sanitizer(),
        "reuse": [reuse_demo(False), reuse_demo(True)],
        "pipeline": _pipeline_spans(),
    }


def _pipeline_spans(n: int = 6, stage_ms: float = 5.0) -> dict[str, Any]:
    """The exercise's pipeline, fixed, on a timeline (for the CPU path of the notebook)."""
    from .timeline import Timeline

    tl = Timeline()
    chunks = make_chunks(n, 1 << 16, seed=0)
    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    tl.name_stream(producer, "producer")
    tl.name_stream(consumer, "consumer")
    producer.wait_stream(torch.cuda.current_stream())
    outs = []
    for i, x in enumerate(chunks):
        with tl.span(f"produce {i}", stream=producer):
            y = produce(x, stage_ms)
        consumer.wait_stream(producer)
        y.record_stream(consumer)
        with tl.span(f"consume {i}", stream=consumer):
            outs.append(consume(y, stage_ms))
    torch.cuda.current_stream().wait_stream(consumer)
    ok = all(torch.equal(o, x * 2 + 1) for o, x in zip(outs, chunks, strict=True))
    return {"correct": ok, "spans": [s.to_dict() for s in tl.spans()]}


RECORDINGS = {"03_events": _record}

__all__ = ["cycles_per_ms", "sleep_ms", "event_basics", "producer_consumer", "race_trials", "producer_consumer_spans",
           "run_sanitizer", "sanitizer_report", "reuse_demo", "produce", "consume", "make_chunks",
           "RECORDINGS", "SANITIZER_SCRIPT"]
