"""Checks for lesson 02 (CUDA streams)."""

from __future__ import annotations

from collections.abc import Callable

from . import expect, needs_gpu, passed

# Two independent chains of sleep kernels: the ideal split is 2x; launches and events cost a little.
TARGET_SPEEDUP = 1.6


def check_stream_split(run: Callable, exercise: str = "ex02_stream_split", target: float = TARGET_SPEEDUP) -> None:
    """`run(workload)` spreads the workload's independent chains over streams and makes the current
    stream wait for them: at least `target` times faster than all of it on one stream, measured here
    and now, with the right counts visible on the current stream as soon as `run` returns.
    """
    if not needs_gpu(exercise):
        return
    from .. import streams as st

    work = st.SleepChains()
    base = st.time_run(st.run_on_one_stream, work)
    mine = st.time_run(run, work)
    want = work.expected()
    for counts in mine["counts"]:
        expect(counts == want, exercise, f"counts {want} on the current stream right after run() returns",
               counts, "make the current stream wait for your side streams (wait_stream) before returning")
    speedup = base["ms"] / mine["ms"]
    expect(speedup >= target, exercise,
           f"a speed-up of at least {target:.2f}x over one stream ({base['ms']:.1f} ms)",
           f"{mine['ms']:.1f} ms, {speedup:.2f}x",
           "give each chain its own stream, launch everything before waiting, and don't synchronize inside")
    passed(exercise, f"{base['ms']:.1f} ms on one stream -> {mine['ms']:.1f} ms, {speedup:.2f}x")
