"""Checks for lesson 08 (overlap and bucketing).

ex08_bucketed_dp (CPU, gloo): the learner's `BucketedDP(module, bucket_cap_mb)`. The probe launches two gloo
ranks itself (course_utils.launch.run) and, on each, builds this module's `CheckNet` from a seed that differs
per rank (so only a broadcast makes the ranks agree), wraps it, and runs steps of `loss.backward()` then
`dp.finish()`, each recorded by its own kernels-mode Timeline (on a CPU: gloo's all-reduces on the comm row).
The model has the traps: an embedding tied to the output head (one Parameter reachable from two modules), a
frozen layer, and a branch that one step does not use. Several bucket caps. A last case pauses rank 1 for a
while at the start of its backward and both ranks in the middle of theirs: a rank whose hooks wait for their
all-reduce is held by rank 1, and a rank that all-reduces only in finish() starts no communication before
the middle pause is over. The probe returns plain data (starting parameters, gradients, times, comm spans);
the judge rebuilds the model from the seed, computes the single-process full-batch gradients itself, and
decides.

ex08_bucket_schedule (CPU): the learner's `bucket_schedule(grads, cap_bytes, alpha_ms, gbps)` against the
lesson's model of bucketed all-reduce during backward, on inputs this module makes up (see `model_schedule`).
"""

from __future__ import annotations

import math
import random
import time
from typing import Any

import torch
from torch import nn

from . import Exercise, close, expect, quiet_stderr, rank_error, register

# ---------------------------------------------------------------------------------- ex08_bucketed_dp (CPU)

EX_DP = "ex08_bucketed_dp"
MIB = 2**20
VOCAB, WIDTH, DEPTH, SEQS, SEQ_LEN = 24, 16, 3, 8, 6  # the check's model and batch (tiny: it runs on a CPU)
WORLD = 2


class _Pause(torch.autograd.Function):
    """Identity forward; its backward sleeps `ms` and notes when (perf_counter ns) in `marks`."""

    @staticmethod
    def forward(ctx, x, ms, name, marks):
        ctx.ms, ctx.name, ctx.marks = ms, name, marks
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        t0 = time.perf_counter_ns()
        time.sleep(ctx.ms / 1e3)
        ctx.marks[ctx.name] = (t0, time.perf_counter_ns())
        return grad, None, None, None


class CheckNet(nn.Module):
    """The check's model. Parameters in registration order: embed, frozen (no gradient), early layers, late
    layers, branch, norm; the head has no parameter of its own: its weight IS the embedding's."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, depth: int = DEPTH):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.frozen = nn.Linear(width, width)
        self.frozen.requires_grad_(False)
        self.early = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.late = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))
        self.branch = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied

    def forward(self, tokens, use_branch: bool = True, pauses: dict | None = None, marks: dict | None = None):
        pauses = pauses or {}
        h = self.embed(tokens)
        h = h + torch.tanh(self.frozen(h))
        for layer in self.early:
            h = h + torch.tanh(layer(h))
        if pauses.get("middle"):
            h = _Pause.apply(h, pauses["middle"], "middle", marks)
        for layer in self.late:
            h = h + torch.tanh(layer(h))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        logits = self.head(self.norm(h))
        if pauses.get("output"):
            logits = _Pause.apply(logits, pauses["output"], "output", marks)
        return logits


def build_model(seed: int) -> CheckNet:
    torch.manual_seed(seed)
    return CheckNet()


def make_batch(seed: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The full batch of a step: (tokens, next tokens), SEQS sequences; rank r takes rows r::WORLD."""
    g = torch.Generator().manual_seed(seed * 1000 + step)
    seq = torch.randint(0, VOCAB, (SEQS, SEQ_LEN + 1), generator=g)
    return seq[:, :-1], seq[:, 1:]


def loss_of(model: CheckNet, tokens, targets, **flags) -> torch.Tensor:
    logits = model(tokens, **flags)
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def expected_buckets(model: nn.Module, cap_bytes: float) -> list[list[str]]:
    """Parameter names per bucket, by the rule the exercise states: parameters that require a gradient, in
    reverse order of module.parameters(); a bucket closes once it holds at least cap_bytes."""
    buckets, current, size = [], [], 0
    for name, p in reversed(list(model.named_parameters())):
        if not p.requires_grad:
            continue
        current.append(name)
        size += p.numel() * p.element_size()
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    if current:
        buckets.append(current)
    return buckets


def dp_inputs(seed: int | None = None) -> dict:
    """Seeds, caps (MiB) and steps; the caps give 8, 3 and 1 buckets on CheckNet."""
    seed = random.randrange(1, 1_000_000) if seed is None else seed
    mixed = [{"use_branch": True}, {"use_branch": True}, {"use_branch": False}, {"use_branch": True}]  # step 2:
    # the branch unused; steps 0 and 1 alike, so a state left over from a step shows before the unused one does
    paused = {"pauses": {"middle": 150.0, "output": 300.0}}  # output pause on rank 1 only (see _rank_flags)
    return {"seed": seed, "timeout_s": 120.0,
            "cases": [{"cap_mb": 0.001, "steps": mixed}, {"cap_mb": 0.003, "steps": mixed},
                      {"cap_mb": 100.0, "steps": mixed},
                      {"cap_mb": 0.001, "steps": [paused, paused], "paused": True}]}


def _rank_flags(spec: dict, rank: int) -> dict:
    flags = {"use_branch": spec.get("use_branch", True)}
    if "pauses" in spec:
        flags["pauses"] = {"middle": spec["pauses"]["middle"], "output": spec["pauses"]["output"] if rank == 1
                           else 0.0}
    return flags


def _grads(model: nn.Module) -> list:
    """Each parameter's .grad as a plain tensor (None stays None; anything else is described)."""
    out: list = []
    for p in model.parameters():
        g = p.grad
        if g is None or type(g) is torch.Tensor:
            out.append(None if g is None else g.detach().cpu().clone())
        else:
            out.append(f"a {type(g).__module__}.{type(g).__qualname__}")
    return out


def _dp_case(answer: Any, case: dict, seed: int, rank: int) -> dict:
    """One case on one rank: wrap a fresh model, run the steps, note what the judge needs."""
    import torch.distributed as dist

    from ..timeline import Timeline

    model = build_model(seed + rank)  # different on each rank: rank 0's must reach every rank
    dp = answer(model, case["cap_mb"])
    start = [p.detach().clone() for p in model.parameters()]
    steps = []
    for step, spec in enumerate(case["steps"]):
        tokens, targets = make_batch(seed, step)
        tokens, targets = tokens[rank::WORLD], targets[rank::WORLD]
        flags = _rank_flags(spec, rank)
        marks: dict = {}
        model.zero_grad(set_to_none=True)
        tl = Timeline(mode="kernels", device="cpu")
        dist.barrier()
        with quiet_stderr(), tl.capture():
            loss = loss_of(model, tokens, targets, marks=marks, **flags)
            t_backward = time.perf_counter_ns()
            loss.backward()
            t_backward_end = time.perf_counter_ns()
            dp.finish()
            t_finish_end = time.perf_counter_ns()
        origin = tl.origin_ns

        def ms(ns: int, origin: int = origin) -> float:
            return (ns - origin) / 1e6

        comm = [[s.start_ms, s.end_ms] for s in tl.spans()
                if s.kind == "comm" and "all_reduce" in s.name.lower().replace("allreduce", "all_reduce")
                and s.stream == "comm"]
        steps.append({"grads": _grads(model), "comm": comm, "backward_ms": ms(t_backward),
                      "backward_end_ms": ms(t_backward_end), "finish_end_ms": ms(t_finish_end),
                      "marks": {k: [ms(a), ms(b)] for k, (a, b) in marks.items()}})
    return {"start": start, "steps": steps}


def dp_worker(answer: Any, inputs: dict) -> list:
    """On each rank: every case, in order."""
    import torch.distributed as dist

    rank = dist.get_rank()
    return [_dp_case(answer, case, inputs["seed"], rank) for case in inputs["cases"]]


def dp_probe(answer: Any, inputs: dict) -> dict:
    """Launch two gloo ranks that run the cases; plain data back, or what went wrong."""
    from .. import launch

    if not callable(answer):
        return {"error": f"BucketedDP is a {type(answer).__name__}, not a class"}
    try:
        ranks = launch.run(dp_worker, answer, inputs, nproc=WORLD, backend="gloo", timeout=inputs["timeout_s"])
    except launch.WorkerTimeout:
        return {"error": f"the two ranks had not finished after {inputs['timeout_s']:g} s (a rank waiting for "
                         "an all-reduce the other never started?)"}
    except launch.WorkerError as err:
        if err.exc_type == "NotImplementedError":
            raise NotImplementedError("BucketedDP is not written yet") from None
        return {"error": rank_error(err)}
    return {"ranks": [ranks[r] for r in range(WORLD)]}


def _describe_step(case: dict, step: int) -> str:
    spec = case["steps"][step]
    what = "the branch unused" if not spec.get("use_branch", True) else "every layer used"
    return f"step {step} of bucket_cap_mb={case['cap_mb']:g} ({what})"


def _expected_grads(model: CheckNet, seed: int, step: int, spec: dict) -> list:
    tokens, targets = make_batch(seed, step)
    model.zero_grad(set_to_none=True)
    loss_of(model, tokens, targets, use_branch=spec.get("use_branch", True)).backward()
    return [None if p.grad is None else p.grad.detach().clone() for p in model.parameters()]


def _compare(want: Any, got: Any, p: nn.Parameter) -> str | None:
    """None if `got` is right for parameter `p`; else what is wrong, in a few words."""
    if want is None:
        if not p.requires_grad:
            return None if got is None else "a .grad on a frozen parameter (it must stay None)"
        if got is None or (type(got) is torch.Tensor and got.shape == p.shape and not bool(got.any())):
            return None  # unused this step: no gradient, or zeros
        return "a nonzero gradient for a parameter this step did not use"
    if got is None:
        return "no gradient (.grad is None)"
    if type(got) is not torch.Tensor or got.shape != want.shape:
        return f"a {type(got).__name__} of shape {tuple(getattr(got, 'shape', ()))}, not a {tuple(want.shape)} tensor"
    scale = float(want.abs().max())
    if torch.allclose(got, want, rtol=1e-4, atol=1e-6 * max(scale, 1e-3)):
        return None
    ratio = float((got * want).sum() / (want * want).sum()) if scale > 0 else float("nan")
    return f"a gradient off by up to {float((got - want).abs().max()):.3g} (about {ratio:.3g}x the right one)"


def _check_grads(case: dict, step: int, model: CheckNet, want: list, got: list, rank: int) -> None:
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    expect(type(got) is list and len(got) == len(names), EX_DP, f"{len(names)} gradients from rank {rank}",
           got if type(got) is not list else len(got))
    for name, p, w, g in zip(names, params, want, got, strict=True):
        problem = _compare(w, g, p)
        expect(problem is None, EX_DP,
               f"on rank {rank}, after {_describe_step(case, step)}, `{name}`'s .grad to be the gradient of one "
               "process on the full batch (the average over ranks)", problem,
               _hint(problem or "", step, case["steps"][step]))


def _hint(problem: str, step: int, spec: dict) -> str:
    if "frozen" in problem:
        return "which parameters will never get a gradient, and should they be in a bucket at all?"
    if "did not use" in problem or "None" in problem or not spec.get("use_branch", True):
        return ("when a parameter gets no gradient in a step, its hook never fires: how does its bucket still get "
                "all-reduced, in the same order on every rank, and what should its other parameters end with?")
    if step > 0:
        return "step 0 was right: what does your object still hold from the previous step when the next begins?"
    return ("all-reduce sums: what must happen to the sum, exactly once, to make it the average? And is every "
            "parameter's slot in its bucket filled when the bucket is all-reduced?")


def dp_judge(inputs: dict, data: dict) -> str:
    err = data.get("error")
    expect(err is None, EX_DP, "BucketedDP to run on two gloo ranks", err,
           "read the rank's error above; the check calls BucketedDP(model, cap_mb), model(...), loss.backward(), "
           "dp.finish()")
    ranks = data.get("ranks")
    cases = inputs["cases"]
    expect(type(ranks) is list and len(ranks) == WORLD and all(type(r) is list and len(r) == len(cases)
                                                              for r in ranks),
           EX_DP, f"results from {WORLD} ranks for {len(cases)} cases", type(ranks).__name__)
    seed = inputs["seed"]
    model = build_model(seed)  # rank 0's model: the one every rank must start from
    start = [p.detach().clone() for p in model.parameters()]
    n_checked = 0
    timing: list[dict] = []
    for c, case in enumerate(cases):
        buckets = expected_buckets(model, case["cap_mb"] * MIB)
        for rank in range(WORLD):
            got = ranks[rank][c]
            expect(type(got) is dict and type(got.get("start")) is list and len(got["start"]) == len(start),
                   EX_DP, "the starting parameters of every rank", type(got).__name__)
            same = all(type(a) is torch.Tensor and a.shape == b.shape and torch.equal(a, b)
                       for a, b in zip(got["start"], start, strict=True))
            expect(same, EX_DP, f"rank {rank} to start from rank 0's parameters once BucketedDP(model, "
                   f"bucket_cap_mb={case['cap_mb']:g}) returned on {WORLD} gloo ranks",
                   "different parameters", "the ranks build their models from different seeds: what must "
                   "BucketedDP do first so that every rank trains the same model?")
            expect(type(got.get("steps")) is list and len(got["steps"]) == len(case["steps"]), EX_DP,
                   f"{len(case['steps'])} steps", got.get("steps"))
        for step, spec in enumerate(case["steps"]):
            want = _expected_grads(model, seed, step, spec)
            for rank in range(WORLD):
                _check_grads(case, step, model, want, ranks[rank][c]["steps"][step]["grads"], rank)
                n_checked += 1
            s0 = ranks[0][c]["steps"][step]
            n_comm = len(s0["comm"])
            expect(n_comm == len(buckets), EX_DP,
                   f"{len(buckets)} all-reduces in {_describe_step(case, step)} (one per bucket: "
                   f"{[len(b) for b in buckets]} parameters per bucket)", f"{n_comm} on rank 0",
                   "walk the parameters that need a gradient in reverse order of module.parameters(), each once, "
                   "and close a bucket as soon as it holds at least the cap; one all-reduce per bucket")
            if case.get("paused"):
                timing.append(s0)
    if timing:
        paused = next(c for c in cases if c.get("paused"))
        out_ms = paused["steps"][0]["pauses"]["output"]
        case = f" (bucket_cap_mb={paused['cap_mb']:g} on {WORLD} gloo ranks)"
        held = [s["marks"]["middle"][0] - s["backward_ms"] for s in timing]
        expect(min(held) < out_ms / 2, EX_DP,
               f"rank 0's backward to reach its middle layers at once while rank 1 was still in a {out_ms:g} ms "
               f"pause{case}", f"rank 0 held {min(held):.0f} ms by rank 1",
               "does anything in your hook wait for the other rank? (an all-reduce without async_op=True, or "
               "a wait() on one)")
        lead = [s["marks"]["middle"][1] - min((a for a, _ in s["comm"]), default=math.inf) for s in timing]
        expect(max(lead) > 0, EX_DP,
               "an all-reduce on rank 0 to start during backward, before its middle pause ended (the late "
               f"layers' buckets were full by then){case}",
               "the first all-reduce after the pause" if all(math.isfinite(x) for x in lead) else "none",
               "where do you launch a bucket's all-reduce: when it is full, or in finish()?")
    return (f"{n_checked} gradient sets on {WORLD} gloo ranks match one process on the full batch, caps "
            f"{sorted({c['cap_mb'] for c in cases})} MiB; hooks did not wait, buckets launched during backward")


register(Exercise(EX_DP, entry="BucketedDP", probe=dp_probe, judge=dp_judge, inputs=dp_inputs, needs_gpu=False,
                  timeout_s=240))

# ---------------------------------------------------------------------------------- ex08_bucket_schedule (CPU)

EX_SCHED = "ex08_bucket_schedule"

# Cases every answer is asked about, each telling a wrong idea of the model apart from it:
# (grads as (bytes, ready ms) in backward order, cap bytes, alpha ms, GB/s)
FIXED_SCHEDULES: list[tuple[list[tuple[int, float]], float, float, float]] = [
    # a bucket that reaches the cap exactly closes ("at least"): two buckets of two, not three and one
    ([(100_000, 1.0), (100_000, 2.0), (100_000, 3.0), (100_000, 4.0)], 200_000, 0.02, 10.0),
    # communication-bound: each all-reduce waits for the one before it
    ([(4_000_000, 0.1), (4_000_000, 0.2), (4_000_000, 0.3)], 1, 0.05, 10.0),
    # compute-bound: each all-reduce starts when its bucket's last gradient is ready
    ([(10_000, 1.0), (10_000, 2.5), (10_000, 4.0)], 1, 0.01, 100.0),
    # what is left at the end is a bucket too
    ([(300_000, 1.0), (300_000, 2.0), (100_000, 3.0)], 500_000, 0.03, 25.0),
    # a bucket starts when its LAST gradient is ready, and a huge cap makes one bucket
    ([(2_000_000, 0.5), (1_000_000, 1.5), (3_000_000, 2.0)], 1e12, 0.04, 50.0),
    # a gradient larger than the cap is a bucket of its own
    ([(50_000, 0.2), (8_000_000, 0.9), (50_000, 1.1), (50_000, 1.3)], 1_000_000, 0.02, 20.0),
]


def model_schedule(grads: list, cap_bytes: float, alpha_ms: float, gbps: float) -> list[tuple[int, float, float]]:
    """The lesson's model: (number of gradients, start ms, end ms) of each bucket's all-reduce.

    Gradients come in backward order as (bytes, ready ms); a bucket takes them in that order and closes once it
    holds at least cap_bytes (what is left at the end is the last bucket). A bucket's all-reduce starts when
    its last gradient is ready and the previous all-reduce has ended (one at a time, in bucket order), and
    lasts alpha_ms + bytes / (gbps * 1e6) ms (GB/s is 1e9 bytes/s, so 1e6 bytes/ms)."""
    out: list[tuple[int, float, float]] = []
    n, size, free = 0, 0.0, 0.0

    def close_bucket(ready: float) -> None:
        nonlocal n, size, free
        start = max(ready, free)
        free = start + alpha_ms + size / (gbps * 1e6)
        out.append((n, start, free))
        n, size = 0, 0.0

    ready = 0.0
    for nbytes, ready in grads:
        n, size = n + 1, size + nbytes
        if size >= cap_bytes:
            close_bucket(ready)
    if n:
        close_bucket(ready)
    return out


def random_schedule(rng: random.Random) -> tuple[list[tuple[int, float]], float, float, float]:
    grads, t = [], 0.0
    for _ in range(rng.randint(4, 12)):
        t = round(t + rng.uniform(0.05, 3.0), 3)
        grads.append((int(10 ** rng.uniform(3, 7.5)), t))
    total = sum(b for b, _ in grads)
    cap = int(total / rng.choice([1.5, 2, 3, 5, 8]))
    return grads, cap, round(rng.uniform(0.005, 0.2), 4), round(10 ** rng.uniform(0, 2.5), 2)


def schedule_inputs(seed: int | None = None, n_random: int = 6) -> dict:
    seed = random.randrange(1_000_000) if seed is None else seed
    rng = random.Random(seed)
    cases = [list(c) for c in FIXED_SCHEDULES] + [list(random_schedule(rng)) for _ in range(n_random)]
    rng.shuffle(cases)
    return {"seed": seed, "cases": [{"grads": [list(g) for g in c[0]], "cap_bytes": float(c[1]),
                                     "alpha_ms": float(c[2]), "gbps": float(c[3])} for c in cases]}


def _plain_number(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


def schedule_probe(answer: Any, inputs: dict) -> dict:
    """Ask the answer about each case (fresh lists each time); keep well-formed schedules, describe the rest."""
    out: list[Any] = []
    for case in inputs["cases"]:
        value = answer([(int(b), float(t)) for b, t in case["grads"]], case["cap_bytes"], case["alpha_ms"],
                       case["gbps"])
        if type(value) not in (list, tuple):
            out.append(f"a {type(value).__module__}.{type(value).__qualname__}, not a list")
            continue
        buckets: list[Any] = []
        for b in value:
            if type(b) in (list, tuple) and len(b) == 3 and all(_plain_number(x) for x in b):
                buckets.append([int(b[0]) if type(b[0]) is int else float(b[0]), float(b[1]), float(b[2])])
            else:
                buckets.append(f"{b!r:.80}"[:80] if type(b) in (list, tuple, int, float, str) else
                               f"a {type(b).__module__}.{type(b).__qualname__}")
        out.append(buckets)
    return {"schedules": out}


def _case_text(case: dict) -> str:
    grads = ", ".join(f"({b:,} B, {t:g} ms)" for b, t in case["grads"])
    return (f"grads=[{grads}], cap_bytes={case['cap_bytes']:,.0f}, alpha_ms={case['alpha_ms']:g}, "
            f"gbps={case['gbps']:g}")


def schedule_judge(inputs: dict, data: dict) -> str:
    got_all = data.get("schedules")
    cases = inputs["cases"]
    expect(type(got_all) is list and len(got_all) == len(cases), EX_SCHED, f"one schedule per case ({len(cases)})",
           type(got_all).__name__ if type(got_all) is not list else len(got_all))
    for case, got in zip(cases, got_all, strict=True):
        want = model_schedule([tuple(g) for g in case["grads"]], case["cap_bytes"], case["alpha_ms"], case["gbps"])
        where = f"for {_case_text(case)}"
        expect(type(got) is list, EX_SCHED, f"a list of (n_grads, start_ms, end_ms) {where}", got)
        expect(len(got) == len(want), EX_SCHED, f"{len(want)} buckets {where}", f"{len(got)} buckets",
               "when does a bucket close, and what happens to the gradients left when backward ends?")
        for k, (w, g) in enumerate(zip(want, got, strict=True)):
            expect(type(g) is list, EX_SCHED, f"bucket {k} as (n_grads, start_ms, end_ms) {where}", g,
                   "return a tuple of three numbers per bucket")
            expect(g[0] == w[0] and type(g[0]) is int, EX_SCHED, f"bucket {k} to hold {w[0]} gradients {where}",
                   g[0], "a bucket closes once it holds AT LEAST the cap: which gradient makes it reach that?")
            expect(close(g[1], w[1], rel=1e-6, abs_=1e-9), EX_SCHED,
                   f"bucket {k}'s all-reduce to start at {w[1]:.6g} ms {where}", f"{g[1]:.6g} ms",
                   "two things must have happened before a bucket's all-reduce can start: which gradient must be "
                   "ready, and what must the all-reduce before it have done?")
            expect(close(g[2], w[2], rel=1e-6, abs_=1e-9), EX_SCHED,
                   f"bucket {k}'s all-reduce to end at {w[2]:.6g} ms {where}", f"{g[2]:.6g} ms",
                   "how long does an all-reduce of B bytes take in the alpha-beta model, and how many bytes per "
                   "ms is a GB/s?")
    n = sum(len(model_schedule([tuple(g) for g in c["grads"]], c["cap_bytes"], c["alpha_ms"], c["gbps"]))
            for c in cases)
    return f"{len(cases)} backward passes, {n} buckets, all as the model predicts"


register(Exercise(EX_SCHED, entry="bucket_schedule", probe=schedule_probe, judge=schedule_judge,
                  inputs=schedule_inputs, needs_gpu=False, timeout_s=30))
