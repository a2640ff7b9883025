"""Checks for lesson 01 (host and device)."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from . import expect, needs_gpu, passed

# A step on the GPU must leave the host free: issuing the steps may take at most this share of the
# time the GPU needs to finish them (the slow step, which waits every step, sits near 1.0).
ISSUE_SHARE_MAX = 0.5


def _problem_sizes(device: torch.device) -> dict[str, int]:
    # On a GPU the step must be heavy enough (a few ms) for "the host ran ahead" to be measurable.
    return {"width": 4096, "batch": 4096, "steps": 8} if device.type == "cuda" else \
        {"width": 64, "batch": 32, "steps": 4}


def check_hidden_syncs(step_fn: Callable, exercise: str = "ex01_hidden_syncs") -> None:
    """The step computes what slow_train_step computes, without reading device data on the host.

    Everywhere: same losses, gradient norms, accuracies and weights as slow_train_step after a few
    steps, and no host reads (`.item()`, `float(t)`, `.cpu()`, ...) inside the steps.
    On a GPU also: no more syncs than a step without logging (set_sync_debug_mode), and the host
    issues the steps in well under the time the GPU needs for them.
    """
    from .. import host_device as hd

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    s = _problem_sizes(device)

    # 1. Same numbers as the slow step (the fast step must still log loss, grad_norm and acc).
    ref, mine = hd.make_train_problem(device, s["width"], s["batch"]), hd.make_train_problem(device, s["width"],
                                                                                                s["batch"])
    want = hd.history_as_floats(hd.run_steps(hd.slow_train_step, ref, s["steps"])["history"])
    with hd.count_host_reads() as reads:
        got_raw = hd.run_steps(step_fn, mine, s["steps"])["history"]
    expect(len(got_raw) == len(want), exercise, f"{len(want)} history entries after {len(want)} steps",
           f"{len(got_raw)}", "append one dict per step")
    expect(all(isinstance(h, dict) and set(h) == set(want[0]) for h in got_raw), exercise,
           f"each history entry to be a dict with keys {sorted(want[0])}",
           sorted(got_raw[0]) if got_raw and isinstance(got_raw[0], dict) else got_raw[:1])
    got = hd.history_as_floats(got_raw)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        for key in w:
            expect(math.isclose(g[key], w[key], rel_tol=1e-3, abs_tol=1e-5), exercise,
                   f"step {i} {key} = {w[key]:.6g} (as slow_train_step logs it)", f"{g[key]:.6g}")
    for (name, p), q in zip(mine.model.named_parameters(), ref.model.parameters(), strict=True):
        expect(torch.allclose(p, q, rtol=1e-3, atol=1e-5), exercise,
               f"the same weights as slow_train_step after {s['steps']} steps", f"{name} differs")
    expect(reads.count == 0, exercise, "no host reads of tensor data inside the step",
           f"{reads.count / s['steps']:g} per step ({', '.join(sorted(set(reads.calls)))})",
           "keep loss, grad_norm and acc as tensors (detach them); read them after the loop")

    if not needs_gpu(exercise):
        return
    # 2. On the GPU: count the syncs PyTorch reports, and see the host run ahead of the device.
    floor = hd.train_step_costs(hd.bare_train_step, device, s["width"], s["batch"], s["steps"])
    costs = hd.train_step_costs(step_fn, device, s["width"], s["batch"], s["steps"])
    expect(costs["syncs_per_step"] <= floor["syncs_per_step"], exercise,
           f"at most {floor['syncs_per_step']:g} syncs per step (a step without logging)",
           f"{costs['syncs_per_step']:g}")
    share = costs["issue_ms"] / costs["total_ms"]
    expect(share <= ISSUE_SHARE_MAX, exercise,
           f"the host to issue {s['steps']} steps in at most {ISSUE_SHARE_MAX:.0%} of the time the GPU needs",
           f"{costs['issue_ms']:.1f} ms of {costs['total_ms']:.1f} ms ({share:.0%})",
           "something in the step still waits for the GPU")
    passed(exercise, f"{costs['syncs_per_step']:g} syncs per step; host issued {s['steps']} steps in "
                     f"{costs['issue_ms']:.1f} ms, GPU finished in {costs['total_ms']:.1f} ms")
