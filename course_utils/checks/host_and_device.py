"""Checks for lesson 01 (host and device).

ex01_host_model (any machine): the learner's model of asynchronous execution predicts, for programs the
check makes up, when the host finishes, when the GPU finishes and how long the host waited.

ex01_hidden_syncs (GPU, with a CPU part): a training step that logs loss, gradient norm and accuracy
without reading device data on the host. Everywhere: the same numbers as a step that reads them every
time, and no host reads counted by `count_syncs` (on a CPU, reads of CPU tensors count as they would on a
GPU). On a GPU also: the host issues the steps in well under the time the GPU needs to run them.
"""

from __future__ import annotations

import math
import numbers
import random
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from . import Exercise, _line_of_theirs, close, expect, register

# ============================================================================ ex01_host_model

HOST_MODEL = "ex01_host_model"
_OPS = ("gpu", "cpu", "read")


def _host_model_inputs() -> dict:
    """Programs the check makes up: hand-picked corner cases, then random ones from a fresh seed."""
    corner = [
        [],                                                   # nothing to do
        [["gpu", 5.0]],                                        # the host never waits for a kernel it does not read
        [["read", 0.0]],                                       # a read with nothing queued returns at once
        [["gpu", 10.0], ["read", 0.0]],                        # the read waits for the whole kernel
        [["gpu", 10.0], ["cpu", 25.0], ["read", 0.0]],         # the host worked longer than the GPU: no wait
        [["gpu", 10.0], ["gpu", 10.0], ["gpu", 10.0], ["read", 0.0]],  # kernels queue behind each other
        [["cpu", 7.0], ["gpu", 3.0], ["read", 0.0], ["cpu", 2.0]],     # a kernel starts when it is launched
        [["gpu", 20.0], ["cpu", 5.0], ["gpu", 4.0], ["cpu", 30.0], ["gpu", 6.0], ["read", 0.0], ["read", 0.0]],
    ]
    rng = random.Random()  # a new program set for every check: answers cannot be tabulated
    programs = [list(p) for p in corner]
    for _ in range(12):
        n = rng.randint(3, 9)
        prog = []
        for _ in range(n):
            what = rng.choice(_OPS)
            prog.append([what, 0.0 if what == "read" else float(rng.randint(1, 40))])
        programs.append(prog)
    return {"programs": programs}


def _host_model_probe(answer: Callable, inputs: dict) -> dict:
    """Call the learner's model on each program (a fresh copy each time); keep plain numbers only."""
    results, problem = [], None
    for prog in inputs["programs"]:
        got = answer([tuple(step) for step in prog])
        try:
            values = list(got)
        except TypeError:
            values = None
        if values is None or len(values) != 3 or not all(
                isinstance(v, numbers.Real) and not isinstance(v, bool) for v in values):
            problem = (f"host_model({[tuple(s) for s in prog]}) returned {got!r} ({type(got).__name__}); "
                       "return three numbers: (host_done_ms, gpu_done_ms, blocked_ms)")
            break
        results.append([float(v) for v in values])  # float(): a number, whatever object held it
    return {"results": results, "problem": problem}


def _expected_host_model(program: list) -> tuple[float, float, float]:
    # Event view: the host clock advances by its own work and by waits; the GPU's queue drains in order.
    host_clock, queue_empty_at, waited = 0.0, 0.0, 0.0
    for what, ms in program:
        if what == "cpu":
            host_clock += ms
        elif what == "gpu":
            queue_empty_at = max(queue_empty_at, host_clock) + ms
        else:
            stall = max(queue_empty_at - host_clock, 0.0)
            waited, host_clock = waited + stall, host_clock + stall
    return host_clock, queue_empty_at, waited


def _host_model_judge(inputs: dict, data: dict) -> str:
    expect(data["problem"] is None, HOST_MODEL, "three numbers per program", data["problem"])
    programs = inputs["programs"]
    expect(len(data["results"]) == len(programs), HOST_MODEL, f"{len(programs)} results",
           len(data["results"]))
    names = ("host_done_ms", "gpu_done_ms", "blocked_ms")
    hints = {
        "host_done_ms": "does the host wait when it launches a kernel, or only when it needs a value?",
        "gpu_done_ms": "when does a kernel start if the GPU is still busy with an earlier one, and when if it "
                       "is idle?",
        "blocked_ms": "if the host worked longer than the queued kernels took, how long does a read wait?",
    }
    for prog, got in zip(programs, data["results"], strict=True):
        want = _expected_host_model(prog)
        for name, g, w in zip(names, got, want, strict=True):
            expect(close(g, w, rel=1e-9, abs_=1e-6), HOST_MODEL,
                   f"{name} = {w:g} for program {[tuple(s) for s in prog]}", f"{g:g}", hints[name])
    return f"{len(programs)} programs, corner cases and random ones"


register(Exercise(HOST_MODEL, entry="host_model", probe=_host_model_probe, judge=_host_model_judge,
                  inputs=_host_model_inputs, timeout_s=60.0))


# ============================================================================ ex01_hidden_syncs

HIDDEN_SYNCS = "ex01_hidden_syncs"
KEYS = ("loss", "grad_norm", "acc")
# A step on the GPU must leave the host free: issuing the steps may take at most this share of the time the
# GPU needs to finish them (a step that reads a value every time sits near 1.0; measured on an H100: about
# 0.1 without reads, 1.0 with three reads per step).
ISSUE_SHARE_MAX = 0.5
SMALL = {"width": 64, "batch": 32, "classes": 10, "steps": 4}  # correctness, on any device
BIG = {"width": 4096, "batch": 4096, "classes": 10, "steps": 8}  # GPU timing: a few ms of GPU work per step


def _hidden_syncs_inputs() -> dict:
    inputs = {"small": dict(SMALL), "big": dict(BIG), "repeats": 3}
    while True:  # about 2% of seeds never reach the clipping threshold, and then an answer without it passes
        inputs["seed"] = random.randrange(2**31)
        if max(norm for _, norm, _ in _reference(inputs)[0]) > 1.05:
            return inputs


def _make_problem(device: torch.device | str, width: int, batch: int, classes: int, seed: int):
    """The exercise's MLP, SGD optimizer and one batch, the same for a seed on any device."""
    g = torch.Generator().manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, width), torch.nn.ReLU(),
                                torch.nn.Linear(width, classes))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5)
    model = model.to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x = torch.randn(batch, width, generator=g).to(device)
    y = torch.randint(0, classes, (batch,), generator=g).to(device)
    return model, opt, x, y


def _logging_step(model, opt, x, y, history: list) -> None:
    # The judge's own step: it reads every value on the host (the slow way; the numbers are what count).
    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    history.append({"loss": loss.item(), "grad_norm": grad_norm.item(),
                    "acc": (out.argmax(dim=1) == y).float().mean().item()})


def _history_values(history: Any, steps: int) -> tuple[list | None, str | None]:
    """[[loss, grad_norm, acc], ...] as floats, read with one device-to-host copy; or (None, what is wrong)."""
    if type(history) is not list or len(history) != steps:
        n = len(history) if isinstance(history, list) else type(history).__name__
        return None, f"{n} history entries after {steps} steps (append one dict per step)"
    cells = []
    for i, h in enumerate(history):
        if type(h) is not dict or set(h) != set(KEYS):
            seen = sorted(map(str, h)) if isinstance(h, dict) else type(h).__name__
            return None, f"entry {i} is {seen}; each entry is a dict with keys {list(KEYS)}"
        for k in KEYS:
            v = h[k]
            if not ((isinstance(v, torch.Tensor) and v.numel() == 1)
                    or (isinstance(v, numbers.Real) and not isinstance(v, bool))):
                return None, f"entry {i} {k!r} is {type(v).__name__}; log a one-element tensor (or a number)"
            cells.append(v)
    tensors = [c.detach().reshape(()).to(torch.float64) for c in cells if isinstance(c, torch.Tensor)]
    try:  # the one read, after the loop
        read = iter(torch.stack([t.to(tensors[0].device) for t in tensors]).tolist() if tensors else [])
    except RuntimeError as err:
        return None, f"the logged values could not be read: {err}"
    flat = [next(read) if isinstance(c, torch.Tensor) else float(c) for c in cells]
    return [flat[i:i + len(KEYS)] for i in range(0, len(flat), len(KEYS))], None


def _hidden_syncs_probe(step: Callable, inputs: dict) -> dict:
    dev = torch.device("cuda" if inputs["gpu"] else "cpu")
    s = inputs["small"]
    model, opt, x, y = _make_problem(dev, s["width"], s["batch"], s["classes"], inputs["seed"])
    from ..measure import count_syncs

    history: list = []
    with count_syncs(cpu_as_device=not inputs["gpu"]) as counted:
        for _ in range(s["steps"]):
            step(model, opt, x, y, history)
    values, problem = _history_values(history, s["steps"])
    graph_kept = any(isinstance(v, torch.Tensor) and v.requires_grad
                     for h in history if isinstance(h, dict) for v in h.values())
    data = {"values": values, "problem": problem, "graph_kept": graph_kept, "syncs": counted.count,
            "calls": counted.calls, "where": [_your_line_at(w) for w in counted.where],
            "weights": [p.detach().cpu() for p in model.parameters()]}
    if inputs["gpu"]:
        data["timing"] = _time_steps(step, inputs["big"], inputs["seed"], inputs["repeats"])
    return data


def _your_line_at(where: str) -> str:
    """count_syncs' "file:line" as "line N of your code: `...`" where the file is the learner's (read here, beside
    their code: only this process can read a notebook cell's lines), else as it is."""
    filename, _, lineno = where.rpartition(":")
    theirs = _line_of_theirs([(filename, int(lineno), "fast_train_step", "")]) if lineno.isdigit() else ""
    return theirs.removeprefix(", ") or f"at {where}"


def _time_steps(step: Callable, b: dict, seed: int, repeats: int) -> list[list[float]]:
    """[issue_ms, total_ms] per repeat: host time until the loop returned, and until the GPU finished."""
    model, opt, x, y = _make_problem("cuda", b["width"], b["batch"], b["classes"], seed)
    history: list = []
    for _ in range(2):  # warm-up: kernel selection, allocator, optimizer state
        step(model, opt, x, y, history)
    out = []
    for _ in range(repeats):
        history.clear()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(b["steps"]):
            step(model, opt, x, y, history)
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        out.append([(t1 - t0) * 1e3, (t2 - t0) * 1e3])
    return out


def _reference(inputs: dict) -> tuple[list[list[float]], list[torch.Tensor]]:
    s = inputs["small"]
    model, opt, x, y = _make_problem("cpu", s["width"], s["batch"], s["classes"], inputs["seed"])
    history: list = []
    for _ in range(s["steps"]):
        _logging_step(model, opt, x, y, history)
    return [[h[k] for k in KEYS] for h in history], [p.detach() for p in model.parameters()]


def _hidden_syncs_judge(inputs: dict, data: dict) -> str:
    ex = HIDDEN_SYNCS
    s = inputs["small"]
    device = "cuda" if inputs["gpu"] else "cpu"
    case = f"{s['steps']} steps of the {s['width']}-wide MLP, batch {s['batch']}, on {device}"
    expect(data["problem"] is None, ex, "the step to log loss, grad_norm and acc", data["problem"])
    expect(data["graph_kept"] is False, ex, "logged tensors that do not require grad",
           "a logged tensor with requires_grad=True",
           "what else does a tensor that requires grad keep alive, step after step?")
    want, weights = _reference(inputs)
    # Across devices float sums differ in the last bits; accuracy is a count, so one sample may flip.
    acc_tol = 1.0 / s["batch"] + 1e-6 if inputs["gpu"] else 1e-6
    for i, (got, ref) in enumerate(zip(data["values"], want, strict=True)):
        for k, g, w in zip(KEYS, got, ref, strict=True):
            ok = abs(g - w) <= acc_tol if k == "acc" else close(g, w, rel=1e-3, abs_=1e-5)
            expect(ok, ex, f"step {i} {k} = {w:.6g} (the step's own value, as .item() would read it; {case})",
                   f"{g:.6g}" if math.isfinite(g) else g,
                   "is the update the same: clipping before opt.step(), and the values taken where the slow step "
                   "takes them?")
    expect(len(data["weights"]) == len(weights), ex, f"{len(weights)} parameter tensors", len(data["weights"]))
    for i, (p, q) in enumerate(zip(data["weights"], weights, strict=True)):
        expect(p.shape == q.shape and torch.allclose(p, q, rtol=1e-3, atol=1e-5), ex,
               f"the same weights as the logging step after {case}", f"parameter {i} differs")
    reads = sorted(set(f"{c} {w}" for c, w in zip(data["calls"], data["where"], strict=True)))
    expect(data["syncs"] == 0, ex, f"no host reads of device data inside the step (count_syncs, {case})",
           f"{data['syncs'] / s['steps']:g} per step: {'; '.join(reads)}",
           "which of these lines needs a value on the host, and could it keep a tensor instead?")
    if not inputs["gpu"]:
        return "same numbers as the logging step; no host reads"
    timing = data["timing"]
    shares = [issue / total for issue, total in timing]
    best = min(range(len(shares)), key=shares.__getitem__)  # noise only makes the host look slower
    issue, total = timing[best]
    expect(shares[best] <= ISSUE_SHARE_MAX, ex,
           f"the host to issue {inputs['big']['steps']} steps in at most {ISSUE_SHARE_MAX:.0%} of the time the GPU "
           "needs to run them",
           f"{issue:.1f} ms of {total:.1f} ms ({shares[best]:.0%}, best of {len(shares)})",
           "does anything in the step wait for the GPU to finish?")
    return (f"no host reads; host issued {inputs['big']['steps']} steps in {issue:.1f} ms, the GPU finished "
            f"them after {total:.1f} ms")


register(Exercise(HIDDEN_SYNCS, entry="fast_train_step", probe=_hidden_syncs_probe, judge=_hidden_syncs_judge,
                  inputs=_hidden_syncs_inputs, needs_gpu=True, cpu_part=True, timeout_s=300.0))
