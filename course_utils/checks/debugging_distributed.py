"""Checks for lesson 10 (debugging distributed jobs). All three are graded on a CPU with gloo ranks.

ex10_diagnose    `diagnose(report) -> (rank, fault, line)`: the culprit rank, the fault (one of FAULTS) and the
                 line where the culprit was when the run ended, from the text of a faulty run the learner has
                 never seen. `inputs()` writes fresh programs (a random world size, culprit, fault, collective
                 and padding, so every line number moves), runs each on gloo ranks through course_utils.launch
                 with TORCH_DISTRIBUTED_DEBUG=DETAIL set in the ranks and a launcher timeout of a few seconds,
                 and hands the probe only the reports. The truth stays in the process that made the inputs
                 (the grader's, or the notebook's kernel), in `_TRUTH` under a random token: the probe's
                 process, where the answer runs, never holds it.
ex10_fix_uneven  `train_uneven(model, batches, lr) -> steps`: data-parallel SGD on ranks that hold different
                 numbers of batches (never equal: each rank draws from its own residue class mod WORLD); every
                 rank must stop after as many steps as the shortest rank has batches.
ex10_fix_skip    `train_skip(model, batches, lr) -> skipped`: data-parallel SGD where a step whose loss is not
                 finite on ANY rank is skipped by EVERY rank; returns the skipped step numbers.

The two loops run on WORLD gloo ranks whose default group gives up after a few seconds (a loop that still hangs
fails fast). Each rank draws what makes it different (its number of batches, the step of its bad batch) inside
the rank from the operating system's randomness, so no other rank and no input knows it: a loop must
communicate to agree. The ranks report what they drew; the judge rebuilds the data from the seeds it made and
trains the single-process reference itself.
"""

from __future__ import annotations

import contextlib
import io
import linecache
import random
import secrets
import time
from typing import Any

from . import Exercise, expect, rank_error, register

EX_DIAG, EX_UNEVEN, EX_SKIP = "ex10_diagnose", "ex10_fix_uneven", "ex10_fix_skip"
FAULTS = ("crash", "stall", "extra collective", "shape mismatch")
WORLD = 2  # ranks of the training-loop checks

# --------------------------------------------------------------------------------------- ex10_diagnose

DIAG_LIMIT_S = 30.0  # the programs' group timeout: longer than the launcher's, so a hang is seen by the launcher
DIAG_RUN_S = 4.0  # the launcher's timeout for the program (ranks already started): then it shows every stuck stack
START_S = 120.0  # for starting ranks (a backstop: a busy 2-core machine takes seconds)
_TRUTH: dict[str, list] = {}  # token -> [[rank, fault, line], ...], in the process that made the inputs

_PADDING = ("h = x * 2", "scale = 1.0 / (rank + 1)", "tag = f'step-{rank}'", "n = x.numel()",
            "x = x * 1.0", "ids = list(range(8))", "mean = float(x.mean())", "h = x.clone()",
            "weights = torch.zeros(3)", "ok = bool(torch.isfinite(x).all())")
_COLLECTIVES = ("dist.all_reduce(x, group=g)", "dist.broadcast(x, 0, group=g)",
                "dist.all_reduce(x, op=dist.ReduceOp.MAX, group=g)")
_CRASHES = ("raise ValueError('corrupt sample in the batch')", "label = [3, 1, 2][7]",
            "ratio = float(x.sum()) / 0", "raise KeyError('label')")


def write_program(fault: str, rng: random.Random) -> tuple[str, int]:
    """A `train_step(limit_s, culprit)` with `fault` on rank `culprit`; (source, line the culprit ends on)."""
    body = ["rank = dist.get_rank()", "g = dist.new_group(timeout=timedelta(seconds=limit_s))",
            "x = torch.ones(8)"]
    body += rng.sample(_PADDING, rng.randint(0, 4))
    collective = rng.choice(_COLLECTIVES)
    where = None
    if fault in ("crash", "stall", "shape mismatch"):
        statement = {"crash": rng.choice(_CRASHES), "stall": f"time.sleep({rng.choice((60, 90, 120))})",
                     "shape mismatch": f"x = torch.ones({rng.choice((7, 9, 12))})"}[fault]
        body += ["if rank == culprit:", "    " + statement]
        where = len(body) + 1  # the source's first line is the def
        body += rng.sample(_PADDING, rng.randint(0, 3))
    body.append(collective)
    if fault == "shape mismatch":
        where = len(body) + 1  # every rank stops in the collective whose shapes differ
    body += rng.sample(_PADDING, rng.randint(0, 3))
    if fault == "extra collective":
        body += ["if rank == culprit:", "    " + collective]
        where = len(body) + 1
    body.append("return float(x.sum())")
    return "def train_step(limit_s, culprit):\n" + "".join(f"    {line}\n" for line in body), where


def run_program(source: str, filename: str, limit_s: float, culprit: int):
    """In a rank: the program under TORCH_DISTRIBUTED_DEBUG=DETAIL (what the environment variable sets at import)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    dist.set_debug_level(dist.DebugLevel.DETAIL)
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"dist": dist, "torch": torch, "time": time, "timedelta": timedelta}
    exec(compile(source, filename, "exec"), namespace)
    return namespace["train_step"](limit_s, culprit)


def shows(fault: str, culprit: int, line: int, report: str) -> bool:
    """Whether a report shows what the fault should make it show (else the machine was too busy to tell)."""
    if f"line {line}, in train_step" not in report:
        return False
    return {"crash": report.startswith(f"rank {culprit} failed first"),
            "stall": "were still running" in report and "time.sleep" in report,
            "extra collective": report.startswith(f"rank {culprit} was still running"),
            "shape mismatch": "Detected mismatch between collectives" in report}[fault]


def faulty_run(fault: str, rng: random.Random, tries: int = 3) -> tuple[str, list]:
    """Run a fresh program with `fault` on gloo ranks; (the launcher's report, [culprit, fault, line]).

    The ranks start first (a Pool), so the short timeout counts the program only. A report that does not show
    the fault (ranks slower than the timeout on a very busy machine) is not handed out: a fresh program runs."""
    for _ in range(tries - 1):
        report, truth = _faulty_run_once(fault, rng)
        if shows(fault, truth[0], truth[2], report):
            return report, truth
    return _faulty_run_once(fault, rng)


def _faulty_run_once(fault: str, rng: random.Random) -> tuple[str, list]:
    from .. import launch

    world = rng.randint(3, 4) if fault == "shape mismatch" else rng.randint(2, 3)  # the odd one out needs 3
    culprit = rng.randrange(world)
    source, line = write_program(fault, rng)
    filename = f"<train_step {secrets.token_hex(3)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)  # for the stacks
    try:
        with launch.Pool(world, backend="gloo", timeout=START_S) as pool:
            pool.run(run_program, source, filename, DIAG_LIMIT_S, culprit, timeout=DIAG_RUN_S)
        report = "every rank finished"
    except launch.LaunchError as err:
        report = str(err)
    return report, [culprit, fault, line]


def diagnose_inputs(seed: int | None = None) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(seed)
    faults = list(FAULTS)
    rng.shuffle(faults)
    rngs = [random.Random(rng.randrange(1 << 30)) for _ in faults]
    # The runs go at once (their ranks start first, so a busy machine cannot change what a run shows); what the
    # ranks print is not part of the report.
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()), \
            ThreadPoolExecutor(len(faults)) as threads:
        runs = list(threads.map(faulty_run, faults, rngs))
    reports, truth = [r for r, _ in runs], [t for _, t in runs]
    token = secrets.token_hex(8)
    _TRUTH[token] = truth
    return {"reports": reports, "token": token}


def _as_diagnosis(x: Any) -> list | None:
    """(rank, fault, line) as a plain list, or None when it is not two ints and a str in that order."""
    if type(x) not in (tuple, list) or len(x) != 3:
        return None
    rank, fault, line = x
    if type(rank) is not int or type(fault) is not str or type(line) is not int:
        return None
    return [rank, fault, line]


def diagnose_probe(answer: Any, inputs: dict) -> dict:
    out, types = [], []
    for report in inputs["reports"]:
        got = answer(report)
        out.append(_as_diagnosis(got))
        types.append(type(got).__name__)
    return {"diagnoses": out, "types": types}


def _diagnose_hint(report: str, want: list, got: list) -> str:
    rank, fault, line = want
    if got[1] != fault:
        return {"crash": "a rank's own Python error, raised before any collective: which rank failed first, "
                         "and with what?",
                "stall": "nothing failed: the launcher stopped ranks that were still running. Where was each "
                         "one? Which of them was not in a collective?",
                "extra collective": "one rank failed inside a collective while the others had finished "
                                    "normally: it called one more than they did",
                "shape mismatch": "TORCH_DISTRIBUTED_DEBUG=DETAIL compared the ranks' collectives: which "
                                  "tensor shape differs from the others'?"}[fault]
    if got[0] != rank:
        return "which rank is the odd one out: the one that failed on its own, or stood somewhere else?"
    return "the line is in the program's file (`File \"<train_step ...>\", line N`), where the culprit stopped"


def diagnose_judge(inputs: dict, data: dict) -> str:
    truth = _TRUTH.get(inputs.get("token"))
    expect(truth is not None, EX_DIAG, "inputs made in this process (the check keeps the answers where it made "
           "them)", "an unknown token")
    got_all, types = data.get("diagnoses"), data.get("types")
    expect(type(got_all) is list and len(got_all) == len(truth), EX_DIAG, f"{len(truth)} diagnoses",
           type(got_all).__name__)
    for i, (report, want, got) in enumerate(zip(inputs["reports"], truth, got_all, strict=True)):
        shown = "\n    ".join(report.splitlines()[:40])
        expect(got is not None, EX_DIAG, "diagnose(report) to return (rank, fault, line): an int, a str, an int",
               f"a {types[i] if type(types) is list and i < len(types) else '?'}")
        expect(got[1] in FAULTS, EX_DIAG, f"the fault to be one of {FAULTS}", repr(got[1]))
        expect(got == want, EX_DIAG, f"for the report\n    {shown}\n  the diagnosis {tuple(want)}", tuple(got),
               hint=_diagnose_hint(report, want, got))
    return f"{len(truth)} fresh faulty runs diagnosed: {', '.join(t[1] for t in truth)}"


# inputs_once: the fault reports cost a dozen or so rank processes; a grading run makes them once for the class.
register(Exercise(EX_DIAG, entry="diagnose", probe=diagnose_probe, judge=diagnose_judge, inputs=diagnose_inputs,
                  timeout_s=20.0, inputs_once=True))

# ------------------------------------------------------------------------- ex10_fix_uneven, ex10_fix_skip

_HANG_WORDS = ("Timed out", "timed out", "Connection closed", "Connection reset", "monitoredBarrier",
               "still running")


def loop_inputs(seed: int | None = None) -> dict:
    rng = random.Random(seed)
    return {"dim": 3, "batch": 4, "steps": 6, "lr": 0.1, "data_seed": rng.randrange(10**6),
            "init_seed": rng.randrange(10**6), "limit_s": 3.0, "timeout_s": 60.0}


def loop_data(inputs: dict, rank: int, n: int, bad: list[int]) -> list:
    """Rank `rank`'s n batches (x, y) from the check's seed; batches in `bad` hold a NaN."""
    import torch

    g = torch.Generator().manual_seed(inputs["data_seed"] * 16 + rank)
    out = []
    for step in range(n):
        x = torch.randn(inputs["batch"], inputs["dim"], generator=g)
        y = torch.randn(inputs["batch"], 1, generator=g)
        if step in bad:
            x[0, 0] = float("nan")
        out.append((x, y))
    return out


def loop_model(inputs: dict):
    import torch

    model = torch.nn.Linear(inputs["dim"], 1)
    g = torch.Generator().manual_seed(inputs["init_seed"])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def loop_reference(inputs: dict, lengths: list[int], bads: list[list[int]]) -> tuple[list, int, list[int]]:
    """One process doing what the ranks should: (weights, steps taken, steps skipped)."""
    import torch
    import torch.nn.functional as F

    model = loop_model(inputs)
    data = [loop_data(inputs, r, n, bad) for r, (n, bad) in enumerate(zip(lengths, bads, strict=True))]
    steps = min(lengths)
    skipped = sorted({s for bad in bads for s in bad if s < steps})
    for step in range(steps):
        if step in skipped:
            continue
        model.zero_grad()
        for x, y in (d[step] for d in data):
            (F.mse_loss(model(x), y) / len(data)).backward()  # the mean of the ranks' gradients
        with torch.no_grad():
            for p in model.parameters():
                p -= inputs["lr"] * p.grad
    return [p.detach().clone() for p in model.parameters()], steps, skipped


def loop_worker(answer: Any, inputs: dict, kind: str) -> dict:
    """One rank: draws its own difference, builds its data and model, runs the answer."""
    import torch.distributed as dist

    from .ranks_and_point_to_point import _short_timeout_group

    _short_timeout_group(inputs["limit_s"])
    rank, world = dist.get_rank(), dist.get_world_size()
    draw = random.SystemRandom()  # nobody else knows what this rank drew
    if kind == "uneven":  # ranks never hold as many batches as each other (n = rank mod world)
        n, bad = draw.choice(range(2 + (rank - 2) % world, inputs["steps"] + 1, world)), []
    else:  # one bad batch per rank, at a step no other rank can have (steps = rank mod world)
        n, bad = inputs["steps"], [draw.choice(range(rank, inputs["steps"], world))]
    model = loop_model(inputs)
    out = answer(model, loop_data(inputs, rank, n, bad), inputs["lr"])
    if kind == "uneven":
        value = out if type(out) is int else None
    else:
        value = sorted(out) if type(out) in (list, tuple) and all(type(s) is int for s in out) else None
    return {"n": n, "bad": bad, "value": value, "type": type(out).__name__,
            "weights": [p.detach().clone() for p in model.parameters()]}


def _loop_probe(kind: str, what: str):
    def probe(answer: Any, inputs: dict) -> dict:
        from .. import launch

        if not callable(answer):
            return {"error": f"{what} is a {type(answer).__name__}, not a function"}
        try:
            ranks = launch.run(loop_worker, answer, inputs, kind, nproc=WORLD, backend="gloo",
                               timeout=inputs["timeout_s"])
        except launch.WorkerTimeout as err:
            return {"error": "the ranks did not finish: " + str(err)[-2500:]}
        except launch.WorkerError as err:
            if err.exc_type == "NotImplementedError":
                raise NotImplementedError(f"{what} is not written yet") from None
            return {"error": rank_error(err)}
        return {"ranks": [ranks[r] for r in range(WORLD)]}
    return probe


def _loop_judge(kind: str, ex: str):
    def judge(inputs: dict, data: dict) -> str:
        import torch

        err = data.get("error")
        if err is not None:
            hung = any(w in err for w in _HANG_WORDS)
            # what each rank held is drawn on the rank (see loop_worker): the judge names what it asked for
            case = (f"holding different numbers of batches (2 to {inputs['steps']})" if kind == "uneven" else
                    f"holding {inputs['steps']} batches each, one NaN batch per rank at different steps")
            expect(False, ex, f"the loop to finish on {WORLD} ranks {case}", err,
                   hint=("a rank waited in a collective that another rank never called (or called with "
                         "different tensors): do all ranks call the same collectives, the same number of times, "
                         "in the same order?") if hung else "read the traceback of the rank that failed first")
        ranks = data.get("ranks")
        expect(type(ranks) is list and len(ranks) == WORLD and all(type(r) is dict for r in ranks), ex,
               f"{WORLD} ranks' results", type(ranks).__name__)
        lengths, bads = [r.get("n") for r in ranks], [r.get("bad") for r in ranks]
        expect(all(type(n) is int and 1 <= n <= inputs["steps"] for n in lengths)
               and all(type(b) is list and all(type(s) is int for s in b) for b in bads), ex,
               "the ranks' own batch counts", lengths)
        weights, steps, skipped = loop_reference(inputs, lengths, bads)
        for rank, res in enumerate(ranks):
            if kind == "uneven":
                expect(res.get("value") == steps, ex,
                       f"train_uneven to return {steps} on rank {rank} (ranks hold {lengths} batches: every rank "
                       f"stops after the shortest one's {steps})",
                       res.get("value") if res.get("value") is not None else f"a {res.get('type')}",
                       hint="how can rank 0 know how many batches rank 1 has? Ask every rank, with a collective")
            else:
                expect(res.get("value") == skipped, ex,
                       f"train_skip to return {skipped} on rank {rank} (bad batches at steps {bads} by rank)",
                       res.get("value") if res.get("value") is not None else f"a {res.get('type')}",
                       hint="a step is skipped by every rank when ANY rank's loss is not finite: how does a "
                            "rank learn about the others' losses?")
            got = res.get("weights")
            ok = (type(got) is list and len(got) == len(weights)
                  and all(type(g) is torch.Tensor and g.shape == w.shape and bool(torch.allclose(g, w, atol=1e-5))
                          for g, w in zip(got, weights, strict=True)))
            expect(ok, ex, f"rank {rank}'s weights to be those of data-parallel SGD (each step: the gradient "
                   f"averaged over the ranks, then p -= lr * grad; ranks held {lengths} batches, bad at steps {bads})",
                   "different weights",
                   hint="is every gradient all-reduced and divided by the world size, on the steps every rank "
                        "takes and only those?")
        what = f"ranks held {lengths} batches, all stopped after {steps}" if kind == "uneven" else \
            f"bad batches at {bads}, every rank skipped {skipped}"
        return f"{what}; weights as data-parallel SGD"
    return judge


register(Exercise(EX_UNEVEN, entry="train_uneven", probe=_loop_probe("uneven", "train_uneven"),
                  judge=_loop_judge("uneven", EX_UNEVEN), inputs=loop_inputs, timeout_s=90.0))
register(Exercise(EX_SKIP, entry="train_skip", probe=_loop_probe("skip", "train_skip"),
                  judge=_loop_judge("skip", EX_SKIP), inputs=loop_inputs, timeout_s=90.0))
