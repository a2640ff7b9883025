"""Checks for lesson 11 (sharded data parallel).

ex11_memory_model (CPU): the learner's `bytes_per_rank(n_params, world, method, mixed_precision)` against the
lesson's model of what a rank holds between steps when training with Adam: 4 + 4 + 8 bytes per parameter in fp32
(parameter, gradient, Adam's two states), 2 + 2 + 12 in mixed precision (the ZeRO paper's K = 12: an fp32 master
copy and two fp32 states); a sharded part holds ceil(n_params / world) values per rank; ZeRO-1 shards the
optimizer's part, ZeRO-2 the gradients' too, ZeRO-3 all three, DDP none.

ex11_sharded_adam (CPU, gloo ranks): the learner's `ShardedAdam(params, lr, betas, eps, weight_decay)` (ZeRO-1).
The probe launches gloo ranks at world sizes 2 and 3 and, on each, builds this module's `CheckNet` (the same
seed on every rank; parameter counts that do not divide evenly; a frozen layer) and runs two cases: plain
`model.parameters()`, and two parameter groups (the second with its own lr, betas and weight decay, and the frozen
layer in it). Each rank trains on its own rows; each step's `step()` runs under torch.profiler, which records the
c10d operators it calls. After the last step the probe measures what the optimizer keeps: the bytes of every live
tensor storage made since just before the optimizer was built (found through the garbage collector), less the
parameters and their gradients, plus what Python's own heap grew by (tracemalloc: states kept as Python floats or
numpy arrays; the lines of the answer's own file, a cell's). The judge computes one process's `torch.optim.Adam`
on the full batch itself and wants every rank's parameters to match it after the first step (where a mistake shows
in the parameters it touches; later steps spread it through forward) and after the last, only reduce-scatter /
all-gather (or send / recv) in `step()`, and at world sizes of 3 and more at most 16 bytes per value of the rank's
shard (two states, a copy of the shard and its gradient) plus SLACK_BYTES. Tensors held only by C++ objects (an
autograd graph kept alive) are not seen by the byte count.
"""

from __future__ import annotations

import gc
import math
import random
import tracemalloc
import warnings
from typing import Any

import torch
from torch import nn

from . import Exercise, _is_theirs, expect, passes, quiet_stderr, rank_error, register

# ------------------------------------------------------------------------------------ ex11_memory_model (CPU)

EX_MEM = "ex11_memory_model"
METHODS = ("ddp", "zero1", "zero2", "zero3")
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "zero3": 3}

# Cases every answer is asked about, each telling a wrong idea apart: (n_params, world, method, mixed_precision)
FIXED_MEMORY = [
    (10, 3, "zero1", False),        # ceil, not floor: 4 values per rank, not 3
    (1000, 4, "ddp", False),        # DDP shards nothing
    (1000, 4, "zero1", True),       # mixed precision: 12 bytes of optimizer per parameter
    (1000, 4, "zero2", False),      # ZeRO-2 shards the gradients, not the parameters
    (1001, 8, "zero3", True),       # ZeRO-3 shards all three
    (7_000_000_000, 64, "zero3", True),
]


def model_bytes(n_params: int, world: int, method: str, mixed_precision: bool) -> dict[str, int]:
    """The lesson's model: bytes of parameters, gradients and optimizer states on one rank, between steps."""
    shard = -(-n_params // world)
    sizes = (2, 2, 12) if mixed_precision else (4, 4, 8)
    stage = STAGE[method]
    return {"params": sizes[0] * (shard if stage >= 3 else n_params),
            "grads": sizes[1] * (shard if stage >= 2 else n_params),
            "optimizer": sizes[2] * (shard if stage >= 1 else n_params)}


def memory_inputs(seed: int | None = None, n_random: int = 12) -> dict:
    seed = random.randrange(1_000_000) if seed is None else seed
    rng = random.Random(seed)
    cases = [list(c) for c in FIXED_MEMORY]
    for _ in range(n_random):
        cases.append([int(10 ** rng.uniform(1, 11)), rng.choice([1, 2, 3, 5, 6, 7, 8, 16, 24, 1000]),
                      rng.choice(METHODS), rng.random() < 0.5])
    rng.shuffle(cases)
    return {"seed": seed, "cases": cases}


def _int_or_text(value: Any) -> int | str:
    """An int as it is (a float that holds a whole number becomes one); anything else described in words."""
    if type(value) is int:
        return value
    if type(value) is float and math.isfinite(value) and value.is_integer():
        return int(value)
    if type(value) in (float, str, bool):
        return f"{value!r:.60}"
    return f"a {type(value).__module__}.{type(value).__qualname__}"


def memory_probe(answer: Any, inputs: dict) -> dict:
    out: list[Any] = []
    for n, world, method, mixed in inputs["cases"]:
        got = answer(n, world, method, mixed)
        if type(got) is not dict:
            out.append(f"a {type(got).__module__}.{type(got).__qualname__}, not a dict")
            continue
        out.append({str(k): _int_or_text(v) for k, v in got.items() if type(k) is str})
    return {"answers": out}


def _call(case: list) -> str:
    n, world, method, mixed = case
    return f"bytes_per_rank({n}, {world}, {method!r}, mixed_precision={mixed})"


def memory_judge(inputs: dict, data: dict) -> str:
    got_all = data.get("answers")
    cases = inputs["cases"]
    expect(type(got_all) is list and len(got_all) == len(cases), EX_MEM, f"one answer per case ({len(cases)})",
           type(got_all).__name__)
    for case, got in zip(cases, got_all, strict=True):
        want = model_bytes(*case)
        expect(type(got) is dict and set(got) == set(want), EX_MEM,
               f"a dict with keys 'params', 'grads' and 'optimizer' from {_call(case)}", got)
        for part in ("params", "grads", "optimizer"):
            expect(got[part] == want[part], EX_MEM, f"{want[part]:,} bytes of {part} per rank from {_call(case)}",
                   got[part] if type(got[part]) is str else f"{got[part]:,}", _memory_hint(case, part, got[part]))
    return f"{len(cases)} cases, DDP and ZeRO-1/2/3, fp32 and mixed precision, as the model counts"


def _memory_hint(case: list, part: str, seen: Any) -> str:
    n, world, method, mixed = case
    floor = model_bytes(n, world, method, mixed)[part] * (n // world) / max(-(-n // world), 1)
    if n % world and seen == floor:
        return f"{n} values over {world} ranks: how many does the fullest rank hold once they are padded evenly?"
    per = {"params": "2 or 4", "grads": "2 or 4", "optimizer": "12 or 8"}[part]
    return (f"how many bytes per value ({per}, by precision), and which stage shards the {part}? "
            f"(the {method} rule, section 2)")


register(Exercise(EX_MEM, entry="bytes_per_rank", probe=memory_probe, judge=memory_judge, inputs=memory_inputs,
                  timeout_s=30))

# ------------------------------------------------------------------------------------ ex11_sharded_adam (CPU)

EX_ADAM = "ex11_sharded_adam"
ROWS, STEPS = 4, 3  # rows per rank in a step, steps per case
SLACK_BYTES = 16 * 1024  # what an optimizer may keep besides 16 bytes per shard value (step counts, small objects)
ALLOWED = {"c10d::_reduce_scatter_base_", "c10d::reduce_scatter_", "c10d::reduce_scatter_tensor_coalesced_",
           "c10d::_allgather_base_", "c10d::allgather_", "c10d::allgather_into_tensor_coalesced_",
           "c10d::allgather_coalesced_", "c10d::send", "c10d::recv_"}
GROUP_B = {"lr": 3e-3, "betas": (0.8, 0.99), "weight_decay": 0.1}  # the second group's own settings
LR = 1e-2


class CheckNet(nn.Module):
    """The check's model: tensors whose sizes divide evenly by neither 2, 3 nor 5, a frozen layer, and trainable
    totals (all parameters, and each of groups_of's two groups) that leave a remainder over 3 ranks, so that
    uneven shards are asked for at both world sizes (over 2 ranks, the plain total is even)."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(37, 131)
        self.frozen = nn.Linear(131, 131)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(131, 101)
        self.out = nn.Linear(101, 13)

    def forward(self, x):
        return self.out(torch.tanh(self.mid(torch.tanh(self.frozen(torch.tanh(self.inp(x)))))))


def build_model(seed: int) -> CheckNet:
    torch.manual_seed(seed)
    return CheckNet()


def groups_of(model: CheckNet, grouped: bool) -> Any:
    """What the check passes to ShardedAdam (and to torch.optim.Adam for the reference)."""
    if not grouped:
        return model.parameters()
    first = [model.inp.weight, model.inp.bias, model.mid.weight]
    second = [model.mid.bias, model.frozen.weight, model.frozen.bias, model.out.weight, model.out.bias]
    return [{"params": first}, {"params": second, **GROUP_B}]


def full_batch(seed: int, step: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed * 1000 + step)
    return torch.randn(world * ROWS, 37, generator=g), torch.randn(world * ROWS, 13, generator=g)


def adam_inputs(seed: int | None = None) -> dict:
    seed = random.randrange(1, 1_000_000) if seed is None else seed
    return {"seed": seed, "worlds": [2, 3], "timeout_s": 120.0}


def _live_storages() -> dict[int, torch.UntypedStorage]:
    """data_ptr -> every CPU tensor storage that a live Python tensor object holds. Holding a storage keeps its
    memory: while this dict lives, no tensor made later can take one of its addresses (states kept in a global from
    the case before, freed and made again, would otherwise hide at the old addresses)."""
    gc.collect()
    out = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on torch.distributed's deprecated aliases warns
        for obj in gc.get_objects():
            try:
                if isinstance(obj, torch.Tensor) and obj.device.type == "cpu":
                    s = obj.untyped_storage()
                    out[s.data_ptr()] = s
            except Exception:  # a tensor without storage (meta, a wrapper subclass)
                continue
    return out


def _adam_case(answer: Any, seed: int, grouped: bool, rank: int, world: int, measure: bool) -> dict:
    """One case on one rank: STEPS steps on the rank's rows, each step() under the profiler; with `measure`, the
    bytes the optimizer keeps."""
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    model = build_model(seed)
    batches = [full_batch(seed, step, world) for step in range(STEPS)]
    mine = [(x[rank * ROWS:(rank + 1) * ROWS], y[rank * ROWS:(rank + 1) * ROWS]) for x, y in batches]
    dist.barrier()
    before = _live_storages() if measure else {}
    if measure:
        tracemalloc.start()
    opt = answer(groups_of(model, grouped), lr=LR)
    ops: dict[str, int] = {}
    first: list[torch.Tensor] = []  # the parameters after one step, before a mistake spreads through forward
    for x, y in mine:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
            opt.step()
        for e in prof.events():
            if e.name.startswith("c10d::"):
                ops[e.name] = ops.get(e.name, 0) + 1
        first = first or [p.detach().clone() for p in model.parameters()]
    del prof
    out = _kept(model, before, _own_files(answer), first) if measure else {}  # before the copies below exist
    return {**out, "params": [p.detach().clone() for p in model.parameters()], "first": first, "ops": ops}


def _own_files(answer: Any) -> set[str]:
    """The file names the answer's own functions were compiled under: a notebook cell's. The grader (and the
    tests) exec a cell under a name like "<stem solution cell 14>", which `_is_theirs` alone cannot tell from a
    library's exec'd "<string>"."""
    objs = [answer, *vars(answer).values()] if isinstance(answer, type) else [answer]
    codes = (getattr(getattr(o, "__func__", o), "__code__", None) for o in objs)
    return {c.co_filename for c in codes if c is not None}


def _kept(model: nn.Module, before: dict[int, Any], own: set[str], ours: list[torch.Tensor]) -> dict:
    """Bytes kept since `before` (live storages then) by anything but the model's parameters and gradients and
    the check's own copies `ours`, and what the learner's own lines (real files, or the files `own` of the
    answer's functions) hold on Python's heap since tracemalloc started (states kept as Python floats or numpy
    arrays show there; a library's lazy imports and caches are not theirs)."""
    gc.collect()
    snapshot = tracemalloc.take_snapshot()
    tracemalloc.stop()
    heap = sum(s.size for s in snapshot.statistics("filename")  # "<string>": code a library made with exec
               if (f := s.traceback[0].filename) in own or (_is_theirs(f) and not f.startswith("<")))
    model_storages = {t.untyped_storage().data_ptr() for p in model.parameters()
                      for t in (p, p.grad) if type(t) is torch.Tensor}
    model_storages |= {t.untyped_storage().data_ptr() for t in ours}
    kept = sum(s.nbytes() for ptr, s in _live_storages().items() if ptr not in before and ptr not in model_storages)
    return {"kept_bytes": kept, "heap_bytes": heap}


def _warm_up() -> None:
    """What a first use imports and sets up (the profiler, an Adam step), done before anything is measured: under
    tracemalloc, imports are slow, and they are not the learner's memory."""
    from torch.profiler import ProfilerActivity, profile

    p = nn.Parameter(torch.zeros(2))
    opt = torch.optim.Adam([p])
    with quiet_stderr(), profile(activities=[ProfilerActivity.CPU]) as prof:
        p.sum().backward()
        opt.step()
    list(prof.events())


def adam_worker(answer: Any, inputs: dict) -> list:
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    _warm_up()
    return [_adam_case(answer, inputs["seed"], grouped, rank, world, measure=grouped and world >= 3)
            for grouped in (False, True)]


def adam_probe(answer: Any, inputs: dict) -> dict:
    """Launch gloo ranks at each world size; plain data back, or what went wrong."""
    from .. import launch

    if not callable(answer):
        return {"error": f"ShardedAdam is a {type(answer).__name__}, not a class"}
    out = {}
    for world in inputs["worlds"]:
        try:
            ranks = launch.run(adam_worker, answer, inputs, nproc=world, backend="gloo", timeout=inputs["timeout_s"])
        except launch.WorkerTimeout:
            return {"error": f"the {world} ranks had not finished after {inputs['timeout_s']:g} s (a rank waiting "
                             "for a collective the others never called?)"}
        except launch.WorkerError as err:
            if err.exc_type == "NotImplementedError":
                raise NotImplementedError("ShardedAdam is not written yet") from None
            return {"error": f"at world size {world}, {rank_error(err)}"}
        out[str(world)] = [ranks[r] for r in range(world)]
        if not passes(_judge_worlds, {**inputs, "worlds": [world]}, out):
            break  # this world size already fails: the judge says why, without the larger launches
    return {"worlds": out}


def reference_params(seed: int, grouped: bool, world: int, steps: int = STEPS) -> list[torch.Tensor]:
    """One process: torch.optim.Adam with the same groups, on the average of the ranks' gradients (each rank's
    gradient computed on its own rows, summed in rank order, divided by the world size: the ranks' arithmetic, so
    that only the order of a collective's sums differs)."""
    model = build_model(seed)
    opt = torch.optim.Adam(groups_of(model, grouped), lr=LR)
    params = [p for p in model.parameters() if p.requires_grad]
    for step in range(steps):
        x, y = full_batch(seed, step, world)
        total = [torch.zeros_like(p) for p in params]
        for r in range(world):
            model.zero_grad()
            nn.functional.mse_loss(model(x[r * ROWS:(r + 1) * ROWS]), y[r * ROWS:(r + 1) * ROWS]).backward()
            for t, p in zip(total, params, strict=True):
                t += p.grad
        for t, p in zip(total, params, strict=True):
            p.grad = t / world
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def shard_values(world: int, grouped: bool) -> int:
    """Values in one rank's shards: ceil(n_g / world) for each group's trainable values."""
    model = build_model(0)
    groups = groups_of(model, grouped)
    groups = groups if grouped else [{"params": list(groups)}]
    sizes = [sum(p.numel() for p in g["params"] if p.requires_grad) for g in groups]
    return sum(-(-n // world) for n in sizes)


def _case_name(grouped: bool) -> str:
    return ("two parameter groups (the second with lr=3e-3, betas=(0.8, 0.99), weight_decay=0.1 and the frozen "
            "layer)" if grouped else "model.parameters()")


def _param_problem(got: Any, want: torch.Tensor, start: torch.Tensor, frozen: bool) -> str | None:
    if type(got) is not torch.Tensor or got.shape != want.shape:
        return f"a {type(got).__name__} of shape {tuple(getattr(got, 'shape', ()))}, not {tuple(want.shape)}"
    if frozen:
        return None if torch.equal(got, start) else "a frozen parameter (requires_grad=False) that changed"
    if torch.allclose(got, want, rtol=1e-4, atol=2e-5):  # seen: 0 at 2 ranks, up to 2.2e-6 at 5 (sum order)
        return None
    if torch.equal(got, start):
        return "not changed at all by the steps"
    stuck = (got == start) & (want != start)
    if bool(stuck.any()):
        return f"{int(stuck.sum()):,} of its {got.numel():,} values not changed by the steps"
    return f"off by up to {float((got - want).abs().max()):.3g}"


def _adam_hint(problem: str, name: str, grouped: bool, other_ranks_agree: bool) -> str:
    if "frozen" in problem:
        return "which parameters must your optimizer leave out?"
    if not other_ranks_agree:
        return "the ranks disagree: after each rank steps its shard, how does every rank get the others' shards?"
    if "not changed" in problem:
        return "every value belongs to some rank's shard: what happens to the values past N * (n // N)?"
    if grouped and name.startswith(("mid.bias", "out.")):
        return "the second group has its own lr, betas and weight_decay: where do a group's settings go?"
    return ("is each rank's gradient shard the average over ranks (reduce-scatter sums), and do the shard bounds "
            "of the gradients, the parameters and the all-gather agree?")


def _check_params(world: int, grouped: bool, ranks: list, seed: int) -> None:
    """Every rank's parameters after the first step, then after the last: after one step a mistake shows in the
    parameters it touches only; later steps spread it through forward to every parameter. Frozen parameters
    first, for the same reason."""
    model = build_model(seed)
    names = [n for n, _ in model.named_parameters()]
    start = [p.detach() for p in model.parameters()]
    frozen = [not p.requires_grad for p in model.parameters()]
    order = sorted(range(len(names)), key=lambda i: not frozen[i])
    c = 1 if grouped else 0
    for key, steps in (("first", 1), ("params", STEPS)):
        want = reference_params(seed, grouped, world, steps)
        for rank in range(world):
            got = ranks[rank][c][key]
            expect(type(got) is list and len(got) == len(names), EX_ADAM,
                   f"{len(names)} parameters from rank {rank}", got if type(got) is not list else len(got))
            for i in order:
                problem = _param_problem(got[i], want[i], start[i], frozen[i])
                agree = all(type(r[c][key][i]) is torch.Tensor and r[c][key][i].shape == got[i].shape
                            and torch.equal(r[c][key][i], got[i]) for r in ranks)
                expect(problem is None, EX_ADAM,
                       f"`{names[i]}` on rank {rank} of {world} gloo ranks, after {steps} step{'s' * (steps > 1)} "
                       f"with {_case_name(grouped)}, to be what torch.optim.Adam gives in one process on the full "
                       "batch", problem, _adam_hint(problem or "", names[i], grouped, agree))


def _check_ops(world: int, grouped: bool, ranks: list) -> None:
    for rank, r in enumerate(ranks):
        ops = r[1 if grouped else 0]["ops"]
        bad = sorted(set(ops) - ALLOWED)
        expect(not bad, EX_ADAM, f"only reduce-scatter and all-gather (or send/recv) in step() on rank {rank} of "
               f"{world} gloo ranks ({_case_name(grouped)})", ", ".join(f"{k} x{ops[k]}" for k in bad),
               "a reduce-scatter hands each rank the sum of its own shard only: an all-reduce or a broadcast moves "
               "the whole vector to everyone")
        expect(bool(ops), EX_ADAM, f"collectives in step() on rank {rank} of {world} gloo ranks", "none",
               "each rank has its own gradient: how do the ranks average them?")


def _check_bytes(world: int, grouped: bool, ranks: list) -> None:
    shard = shard_values(world, grouped)
    limit = 16 * shard + SLACK_BYTES
    for rank, r in enumerate(ranks):
        case = r[1 if grouped else 0]
        parts = (case.get("kept_bytes"), case.get("heap_bytes"))
        kept = sum(parts) if all(type(x) is int for x in parts) else None
        expect(kept is not None and kept <= limit, EX_ADAM,
               f"at most {limit:,} bytes kept by your optimizer on rank {rank} of {world} gloo ranks between steps "
               f"({_case_name(grouped)}: 16 per value of its {shard:,}-value shard, plus {SLACK_BYTES:,})",
               f"{kept:,} bytes ({parts[0]:,} in tensors, {parts[1]:,} on Python's heap from your code)"
               if kept is not None else "no byte count",
               "keep Adam's states for this rank's shard only, and make whole-size buffers inside step() and let "
               "them go")


def _judge_worlds(inputs: dict, worlds: dict) -> None:
    """The verdict on the world sizes inputs["worlds"], each of which `worlds` holds."""
    for world in inputs["worlds"]:
        ranks = worlds[str(world)]
        expect(type(ranks) is list and len(ranks) == world and all(type(r) is list and len(r) == 2 for r in ranks),
               EX_ADAM, f"two cases from each of {world} ranks", type(ranks).__name__)
        for grouped in (False, True):
            _check_ops(world, grouped, ranks)
            _check_params(world, grouped, ranks, inputs["seed"])
            if grouped and world >= 3:  # at 2 ranks, 16 bytes per shard value is as much as whole states
                _check_bytes(world, grouped, ranks)


def adam_judge(inputs: dict, data: dict) -> str:
    err = data.get("error")
    expect(err is None, EX_ADAM, "ShardedAdam to run on gloo ranks", err,
           "read the rank's error; the check calls ShardedAdam(params, lr=...), opt.zero_grad(), loss.backward(), "
           "opt.step()")
    worlds = data.get("worlds")
    expect(type(worlds) is dict and set(worlds) <= {str(w) for w in inputs["worlds"]}, EX_ADAM,
           f"results at world sizes {inputs['worlds']}", type(worlds).__name__)
    _judge_worlds({**inputs, "worlds": [w for w in inputs["worlds"] if str(w) in worlds]}, worlds)
    # the probe stops after a world size that fails, so a missing one means the probe was cut short
    expect(sorted(worlds) == sorted(str(w) for w in inputs["worlds"]), EX_ADAM,
           f"results at world sizes {inputs['worlds']}", sorted(worlds))
    return (f"world sizes {inputs['worlds']}, plain and grouped: parameters match one process's Adam, only "
            "reduce-scatter/all-gather in step(), states sharded")


register(Exercise(EX_ADAM, entry="ShardedAdam", probe=adam_probe, judge=adam_judge, inputs=adam_inputs,
                  timeout_s=300))
