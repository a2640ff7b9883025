"""Checks for lesson 03 (CUDA events)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from . import expect, needs_gpu, passed

EX_PIPELINE = "ex03_fix_pipeline"
MIN_CONCURRENCY = 1.3  # summed busy time of the rows / makespan; 1.0 means the two streams never overlap


def concurrency(stats: Any) -> float:
    """How many rows are busy at once on average: the rows' busy time summed, over the makespan."""
    busy = sum(row.busy_ms for row in stats.rows.values())
    return busy / stats.makespan_ms if stats.makespan_ms > 0 else 0.0


def judge_pipeline(wrong_runs: int, runs: int, conc: float, n_rows: int) -> None:
    """The verdict on measured facts (kept apart so it is testable without a GPU)."""
    expect(wrong_runs == 0, EX_PIPELINE, f"correct results in all {runs} runs", f"{wrong_runs} runs with wrong results",
           hint="the consumer stream must wait for an event the producer recorded *after* its work")
    expect(n_rows >= 2, EX_PIPELINE, "spans on two streams (producer and consumer)", f"{n_rows} row(s) on the timeline",
           hint="keep the tl.span(..., stream=producer/consumer) blocks of the broken pipeline")
    expect(conc >= MIN_CONCURRENCY, EX_PIPELINE,
           f"the two streams overlapping (busy time / makespan >= {MIN_CONCURRENCY})", f"{conc:.2f}",
           hint="wait on the GPU (stream.wait_event), per chunk; a host synchronize or a single stream serialises")


def check_fixed_pipeline(pipeline: Callable, runs: int = 12, n_chunks: int = 6, stage_ms: float = 3.0) -> None:
    """`pipeline(chunks, tl, stage_ms)` must give produce-then-consume results on every run, with overlap."""
    if not needs_gpu(EX_PIPELINE):
        return
    import torch

    from .. import events
    from ..timeline import Timeline

    wrong = 0
    for _ in range(runs):
        chunks = events.make_chunks(n_chunks, 1 << 16)
        tl = Timeline()
        outs = pipeline(chunks, tl, stage_ms)
        torch.cuda.synchronize()
        seen = len(outs) if isinstance(outs, list | tuple) else type(outs).__name__
        expect(isinstance(outs, list | tuple) and len(outs) == n_chunks, EX_PIPELINE, f"a list of {n_chunks} results",
               seen)
        wrong += not all(torch.equal(o, x * 2 + 1) for o, x in zip(outs, chunks, strict=True))
    st = tl.stats()  # the last run's timeline
    conc = concurrency(st)
    judge_pipeline(wrong, runs, conc, len(st.rows))
    passed(EX_PIPELINE, f"{runs} runs correct; streams overlap: busy/makespan = {conc:.2f}")
