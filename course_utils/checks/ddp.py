"""Checks for lesson 09 (DDP in practice). All three are graded on a CPU; two start two gloo ranks.

ex09_accumulate: the learner's `train(model, loader, optimizer, epochs, accum)`. The probe launches two gloo
ranks (course_utils.launch.run); on each it builds the data, a DistributedSampler with the check's seed, a
DataLoader, a linear model wrapped in DDP with a comm hook that counts the all-reduces (then does the usual
one), and an SGD optimizer whose step hook notes how many all-reduces had happened. The dataset notes the
sample indices in the order the answer fetched them. The judge rebuilds the data, the samplers' orders and the
single-process reference (each optimizer step: the gradient of the mean loss over the window's micro-batches of
all ranks) itself, and compares: the order of every epoch, one all-reduce per optimizer step and none
elsewhere, and the final weights.

ex09_checkpoint: the learner's `Checkpoint` class, `save(model, optimizer, epoch, path)` and
`load(model, optimizer, path, device) -> epoch`. On two gloo ranks the probe makes a model and an Adam state
from the check's seed, leaves a stale checkpoint at `path`, and records who calls torch.save (rank 0's call
is held back a little, so a rank that does not wait for it reads the stale file) and which map_location
torch.load gets. After save it wipes the weights and takes a fresh optimizer, then loads. The judge recomputes
the weights and Adam state from the seed and checks every rank got them back, that only rank 0 wrote, that the
file holds the inner module's state_dict (no "module." prefix), and that load mapped onto the given device.

ex09_local_device: the learner's `local_device(env, gpus)` on torchrun environments of multi-node layouts
this module makes up: "cuda:<LOCAL_RANK>" with GPUs, "cpu" without.
"""

from __future__ import annotations

import os
import random
import tempfile
import time
from typing import Any

from . import Exercise, expect, rank_error, register

WORLD = 2


def _launch(worker, answer: Any, inputs: dict, *args: Any, what: str) -> dict:
    """Run `worker(answer, inputs, *args)` on WORLD gloo ranks; {"ranks": [...]} or {"error": ...}."""
    from .. import launch

    try:
        ranks = launch.run(worker, answer, inputs, *args, nproc=WORLD, backend="gloo", timeout=inputs["timeout_s"])
    except launch.WorkerTimeout:
        return {"error": f"the two ranks had not finished after {inputs['timeout_s']:g} s (a rank waiting in a "
                         "collective the other never joined?)"}
    except launch.WorkerError as err:
        if err.exc_type == "NotImplementedError":
            raise NotImplementedError(f"{what} is not written yet") from None
        return {"error": rank_error(err)}
    return {"ranks": [ranks[r] for r in range(WORLD)]}


def _is_list(x: Any, n: int | None = None) -> bool:
    return type(x) is list and (n is None or len(x) == n)


def _close_tensors(got: Any, want: list, atol: float) -> bool:
    import torch

    return (_is_list(got, len(want)) and all(type(g) is torch.Tensor and g.shape == w.shape and g.dtype == w.dtype
                                             and bool(torch.allclose(g, w, rtol=1e-4, atol=atol))
                                             for g, w in zip(got, want, strict=True)))


# ------------------------------------------------------------------------------------- ex09_accumulate

EX_ACC = "ex09_accumulate"


def accumulate_inputs(seed: int | None = None) -> dict:
    rng = random.Random(seed)
    return {"n": 96, "dim": 5, "classes": 3, "batch": 4, "accum": 3, "epochs": 3, "lr": 0.2,
            "data_seed": rng.randrange(10**6), "sampler_seed": rng.randrange(10**6),
            "init_seed": rng.randrange(10**6), "timeout_s": 90.0}


def accumulate_data(inputs: dict) -> tuple:
    """The check's data: Gaussian points with random labels (a fixed generator per seed)."""
    import torch

    g = torch.Generator().manual_seed(inputs["data_seed"])
    x = torch.randn(inputs["n"], inputs["dim"], generator=g)
    return x, torch.randint(0, inputs["classes"], (inputs["n"],), generator=g)


def accumulate_model(inputs: dict):
    """A linear classifier with weights drawn from the check's seed (not from the global RNG)."""
    import torch

    model = torch.nn.Linear(inputs["dim"], inputs["classes"])
    g = torch.Generator().manual_seed(inputs["init_seed"])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    return model


def sampler_orders(inputs: dict) -> list[list[list[int]]]:
    """orders[rank][epoch]: the indices DistributedSampler(shuffle=True, seed) gives after set_epoch(epoch)."""
    from torch.utils.data import DistributedSampler

    out = []
    for rank in range(WORLD):
        sampler = DistributedSampler(range(inputs["n"]), num_replicas=WORLD, rank=rank, shuffle=True,
                                     seed=inputs["sampler_seed"])
        per_epoch = []
        for epoch in range(inputs["epochs"]):
            sampler.set_epoch(epoch)
            per_epoch.append(list(sampler))
        out.append(per_epoch)
    return out


def reference_weights(inputs: dict) -> list:
    """One process doing what the two ranks should: each optimizer step follows the gradient of the mean
    loss over the window's `accum` micro-batches of both ranks (WORLD * accum * batch samples)."""
    import torch
    import torch.nn.functional as F

    x, y = accumulate_data(inputs)
    model = accumulate_model(inputs)
    opt = torch.optim.SGD(model.parameters(), lr=inputs["lr"])
    b, accum = inputs["batch"], inputs["accum"]
    for epoch_orders in zip(*sampler_orders(inputs), strict=True):  # (rank 0's order, rank 1's order)
        n_batches = len(epoch_orders[0]) // b
        for step in range(n_batches // accum):
            opt.zero_grad()
            for order in epoch_orders:
                for m in range(step * accum, (step + 1) * accum):
                    idx = order[m * b:(m + 1) * b]
                    (F.cross_entropy(model(x[idx]), y[idx]) / (accum * WORLD)).backward()
            opt.step()
    return [p.detach().clone() for p in model.parameters()]


class _NotingDataset:
    """The check's dataset: notes every index fetched, in order."""

    def __init__(self, x, y):
        self.x, self.y, self.seen = x, y, []

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        self.seen.append(int(i))
        return self.x[i], self.y[i]


def accumulate_worker(answer: Any, inputs: dict) -> dict:
    """On each rank: the check's loader, DDP model (with a counting comm hook) and optimizer; run the answer."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP
    from torch.utils.data import DataLoader, DistributedSampler

    data = _NotingDataset(*accumulate_data(inputs))
    sampler = DistributedSampler(data, shuffle=True, seed=inputs["sampler_seed"])
    loader = DataLoader(data, batch_size=inputs["batch"], sampler=sampler)
    model = accumulate_model(inputs)
    ddp = DDP(model)
    syncs = []  # one entry per bucket all-reduce (the model is one bucket: one per synchronised backward)

    def counting_hook(state, bucket):
        syncs.append(bucket.buffer().numel())
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, counting_hook)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=inputs["lr"])
    at_steps = []  # how many all-reduces had happened at each optimizer step
    optimizer.register_step_post_hook(lambda *_: at_steps.append(len(syncs)))
    answer(ddp, loader, optimizer, inputs["epochs"], inputs["accum"])
    return {"indices": list(data.seen), "syncs_at_steps": list(at_steps), "syncs": len(syncs),
            "weights": [p.detach().clone() for p in model.parameters()]}


def accumulate_probe(answer: Any, inputs: dict) -> dict:
    if not callable(answer):
        return {"error": f"train is a {type(answer).__name__}, not a function"}
    return _launch(accumulate_worker, answer, inputs, what="train")


def accumulate_judge(inputs: dict, data: dict) -> str:
    expect("error" not in data, EX_ACC, "train to run on both ranks", data.get("error"))
    ranks = data.get("ranks")
    expect(_is_list(ranks, WORLD) and all(type(r) is dict for r in ranks), EX_ACC, f"{WORLD} ranks' results",
           type(ranks).__name__)
    orders = sampler_orders(inputs)
    epochs, per_rank = inputs["epochs"], len(orders[0][0])
    case = (f" (train(ddp, loader, optimizer, epochs={epochs}, accum={inputs['accum']}) on {WORLD} ranks, "
            f"{inputs['n']} samples, batches of {inputs['batch']})")
    for rank, res in enumerate(ranks):
        seen = res.get("indices")
        expect(_is_list(seen, epochs * per_rank), EX_ACC,
               f"rank {rank} to read {per_rank} samples per epoch for {epochs} epochs ({epochs * per_rank}){case}",
               f"{len(seen)} samples" if _is_list(seen) else seen, "one pass over the loader per epoch")
        for epoch in range(epochs):
            got = seen[epoch * per_rank:(epoch + 1) * per_rank]
            same_as = [e for e in range(epochs) if e != epoch and got == orders[rank][e]]
            expect(got == orders[rank][epoch], EX_ACC,
                   f"rank {rank}'s epoch {epoch} in the sampler's order for epoch {epoch} "
                   f"(starting {orders[rank][epoch][:4]}){case}",
                   f"an order starting {got[:4]}" + (f", the order of epoch {same_as[0]}" if same_as else ""),
                   "how does a DistributedSampler know which epoch it is, and when does it need to know?")
    n_steps = epochs * (per_rank // inputs["batch"]) // inputs["accum"]
    want_syncs = list(range(1, n_steps + 1))
    for rank, res in enumerate(ranks):
        at, total = res.get("syncs_at_steps"), res.get("syncs")
        expect(_is_list(at) and len(at) == n_steps, EX_ACC,
               f"{n_steps} optimizer steps on rank {rank} ({inputs['accum']} micro-batches each){case}",
               f"{len(at)} steps" if _is_list(at) else at)
        expect(at == want_syncs and total == n_steps, EX_ACC,
               f"one gradient all-reduce per optimizer step on rank {rank} (after each step: {want_syncs[:4]}...)"
               + case,
               f"after each step {at[:4]}..., {total} in all",
               "which micro-batches must DDP all-reduce, and where does DDP decide whether backward will "
               "all-reduce: in backward, or already in forward?")
    want = reference_weights(inputs)
    for rank, res in enumerate(ranks):
        expect(_close_tensors(res.get("weights"), want, atol=1e-5), EX_ACC,
               f"rank {rank}'s final weights to match one process training on both ranks' micro-batches "
               f"(each step: the mean loss over its window){case}",
               "different weights",
               "what gradient does backward leave after `accum` micro-batches, compared with one batch of "
               "accum times the size? And what does zero_grad do to the micro-batches before it?")
    return (f"{epochs} epochs in the sampler's orders, {n_steps} steps with one all-reduce each, weights as one "
            "process on the whole batch")


register(Exercise(EX_ACC, entry="train", probe=accumulate_probe, judge=accumulate_judge, inputs=accumulate_inputs,
                  needs_gpu=False, timeout_s=150))

# ------------------------------------------------------------------------------------- ex09_checkpoint

EX_CKPT = "ex09_checkpoint"
STALE_EPOCH = -7  # the stale checkpoint left at `path` before save() runs


def checkpoint_inputs(seed: int | None = None) -> dict:
    rng = random.Random(seed)
    return {"dim": 6, "hidden": 5, "classes": 3, "seed": rng.randrange(10**6), "epoch": rng.randrange(3, 60),
            "save_delay_s": 0.5, "timeout_s": 90.0}


def checkpoint_model(inputs: dict):
    import torch

    model = torch.nn.Sequential(torch.nn.Linear(inputs["dim"], inputs["hidden"]), torch.nn.ReLU(),
                                torch.nn.Linear(inputs["hidden"], inputs["classes"]))
    g = torch.Generator().manual_seed(inputs["seed"])
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    return model


def trained_state(inputs: dict, model=None, optimizer=None) -> tuple:
    """Two Adam steps with gradients drawn from the seed: the weights and Adam state a checkpoint must keep."""
    import torch

    model = model if model is not None else checkpoint_model(inputs)
    params = list(model.parameters())
    optimizer = optimizer if optimizer is not None else torch.optim.Adam(params, lr=0.1)
    g = torch.Generator().manual_seed(inputs["seed"] + 1)
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g)
        optimizer.step()
    state = [optimizer.state[p] for p in params]
    return ([p.detach().clone() for p in params], [s["exp_avg"].clone() for s in state],
            [s["exp_avg_sq"].clone() for s in state])


def checkpoint_worker(answer: Any, inputs: dict, path: str) -> dict:
    """On each rank: a trained model and optimizer; save; wipe; load into a fresh optimizer; report."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank = dist.get_rank()
    model = checkpoint_model(inputs)
    ddp = DDP(model)
    optimizer = torch.optim.Adam(ddp.parameters(), lr=0.1)
    trained_state(inputs, model, optimizer)
    saves, maps = [], []
    real_save, real_load = torch.save, torch.load

    def noting_save(obj, f, *args, **kwargs):
        saves.append(rank)
        if rank == 0:
            time.sleep(inputs["save_delay_s"])  # rank 0 writes late: who waits for it?
        return real_save(obj, f, *args, **kwargs)

    def noting_load(f, *args, **kwargs):
        where = kwargs.get("map_location", args[0] if args else None)
        maps.append(str(torch.device(where)) if isinstance(where, (str, torch.device)) else
                    "none" if where is None else f"a {type(where).__name__}")
        return real_load(f, *args, **kwargs)

    torch.save, torch.load = noting_save, noting_load
    try:
        answer.save(ddp, optimizer, inputs["epoch"], path)
        with torch.no_grad():  # a restarted job: fresh weights, a fresh optimizer
            for p in model.parameters():
                p.zero_()
        fresh = torch.optim.Adam(ddp.parameters(), lr=0.1)
        epoch = answer.load(ddp, fresh, path, torch.device("cpu"))
    finally:
        torch.save, torch.load = real_save, real_load
    dist.barrier()
    on_disk = real_load(path, map_location="cpu", weights_only=True)  # what the file holds, after everyone
    state = [fresh.state.get(p, {}) for p in model.parameters()]
    return {"saves": saves, "map_locations": maps,
            "epoch": epoch if type(epoch) is int else f"a {type(epoch).__name__}",
            "weights": [p.detach().clone() for p in model.parameters()],
            "exp_avg": [s["exp_avg"].clone() if "exp_avg" in s else None for s in state],
            "exp_avg_sq": [s["exp_avg_sq"].clone() if "exp_avg_sq" in s else None for s in state],
            "file_keys": sorted(on_disk) if isinstance(on_disk, dict) else f"a {type(on_disk).__name__}",
            "model_keys": sorted(on_disk["model"]) if isinstance(on_disk, dict) and isinstance(
                on_disk.get("model"), dict) else None}


def checkpoint_probe(answer: Any, inputs: dict) -> dict:
    import torch

    if not (callable(getattr(answer, "save", None)) and callable(getattr(answer, "load", None))):
        return {"error": f"Checkpoint is a {type(answer).__name__} without save() and load()"}
    with tempfile.TemporaryDirectory(prefix="ex09-ckpt-") as tmp:
        path = os.path.join(tmp, "checkpoint.pt")
        stale = checkpoint_model(inputs)  # a checkpoint from an earlier run: other weights, no Adam state
        with torch.no_grad():
            for p in stale.parameters():
                p.fill_(3.0)
        torch.save({"model": stale.state_dict(), "optimizer": torch.optim.Adam(stale.parameters()).state_dict(),
                    "epoch": STALE_EPOCH}, path)
        return _launch(checkpoint_worker, answer, inputs, path, what="Checkpoint")


def checkpoint_judge(inputs: dict, data: dict) -> str:
    expect("error" not in data, EX_CKPT, "save and load to run on both ranks", data.get("error"))
    ranks = data.get("ranks")
    expect(_is_list(ranks, WORLD) and all(type(r) is dict for r in ranks), EX_CKPT, f"{WORLD} ranks' results",
           type(ranks).__name__)
    writers = sorted({r for res in ranks for r in (res.get("saves") or [])})
    case = (f" (save(ddp, optimizer, epoch={inputs['epoch']}, path), then load(ddp, optimizer, path, cpu) on {WORLD} "
            "ranks)")
    expect(writers == [0] and ranks[0].get("saves") == [0], EX_CKPT, f"rank 0 alone to call torch.save, once{case}",
           f"torch.save called by ranks {writers}" + (f", {len(ranks[0].get('saves') or [])} times on rank 0"
                                                     if writers == [0] else ""),
           "the ranks hold identical copies: how many of them need to write, and what happens when several "
           "write one file at once?")
    weights, exp_avg, exp_avg_sq = trained_state(inputs)
    keys = sorted(name for name, _ in checkpoint_model(inputs).named_parameters())
    expect(ranks[0].get("file_keys") == ["epoch", "model", "optimizer"], EX_CKPT,
           "the file to hold a dict with keys epoch, model, optimizer", ranks[0].get("file_keys"))
    expect(ranks[0].get("model_keys") == keys, EX_CKPT,
           f"the file's model to be the state_dict of the module inside DDP (keys {keys})",
           f"keys {ranks[0].get('model_keys')}",
           "what does DDP's own state_dict add to every name, and could a program without DDP load that?")
    for rank, res in enumerate(ranks):
        epoch = res.get("epoch")
        expect(epoch == inputs["epoch"], EX_CKPT, f"load() on rank {rank} to return the saved epoch "
               f"{inputs['epoch']}{case}", epoch if epoch != STALE_EPOCH else f"{epoch}, the stale checkpoint's epoch",
               "did this rank read the file before rank 0 had finished writing it? What makes every rank wait "
               "for the writer?")
        expect(_close_tensors(res.get("weights"), weights, atol=1e-6), EX_CKPT,
               f"rank {rank}'s weights after load() to be the saved ones{case}", "other weights",
               "did this rank read the new file, and load it into the module inside DDP?")
        have = res.get("exp_avg"), res.get("exp_avg_sq")
        expect(_close_tensors(have[0], exp_avg, atol=1e-6) and _close_tensors(have[1], exp_avg_sq, atol=1e-6),
               EX_CKPT, f"rank {rank}'s Adam state (exp_avg, exp_avg_sq) after load() to be the saved one{case}",
               "no Adam state" if _is_list(have[0]) and all(x is None for x in have[0]) else "another state",
               "what besides the weights does training need to go on where it stopped?")
        maps = res.get("map_locations")
        expect(_is_list(maps) and len(maps) >= 1 and all(m == "cpu" for m in maps), EX_CKPT,
               f"torch.load on rank {rank} to map onto the device load() was given (map_location=cpu here)",
               f"map_location {maps}",
               "tensors saved by rank 0 remember rank 0's GPU: where do they land on rank 1 unless told?")
    return f"rank 0 wrote, both ranks read epoch {inputs['epoch']}, weights and Adam state back on the given device"


register(Exercise(EX_CKPT, entry="Checkpoint", probe=checkpoint_probe, judge=checkpoint_judge,
                  inputs=checkpoint_inputs, needs_gpu=False, timeout_s=150))

# ------------------------------------------------------------------------------------- ex09_local_device

EX_DEV = "ex09_local_device"
# (nodes, processes per node, GPUs each process sees): a layout torchrun could be asked to start.
LAYOUTS = [(2, 4, 4), (2, 4, 8), (3, 1, 1), (1, 2, 2), (2, 2, 0), (4, 2, 8)]


def layout_envs(nodes: int, nproc: int, gpus: int, port: int = 29500) -> list[dict]:
    """The torchrun environment of every worker of a job: one dict per worker, with the GPUs it sees."""
    out = []
    for node in range(nodes):
        for local in range(nproc):
            env = {"RANK": str(node * nproc + local), "LOCAL_RANK": str(local), "GROUP_RANK": str(node),
                   "ROLE_RANK": str(node * nproc + local), "WORLD_SIZE": str(nodes * nproc),
                   "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "node0", "MASTER_PORT": str(port),
                   "TORCHELASTIC_RUN_ID": "job"}
            if gpus == 1:  # one GPU per node, chosen by the launcher: the process sees it as cuda:0
                env["CUDA_VISIBLE_DEVICES"] = str(node % 8)
            out.append({"env": env, "gpus": gpus})
    return out


def device_inputs(seed: int | None = None) -> dict:
    rng = random.Random(seed)
    cases = [case for layout in LAYOUTS for case in layout_envs(*layout, port=rng.randrange(20000, 40000))]
    rng.shuffle(cases)
    return {"cases": cases}


def expected_device(case: dict) -> str:
    return f"cuda:{int(case['env']['LOCAL_RANK'])}" if case["gpus"] else "cpu"


def device_probe(answer: Any, inputs: dict) -> dict:
    import torch

    out = []
    for case in inputs["cases"]:
        got = answer(dict(case["env"]), int(case["gpus"]))
        out.append(str(got) if type(got) in (str, torch.device) else f"a {type(got).__name__}")
    return {"devices": out}


def device_judge(inputs: dict, data: dict) -> str:
    got, cases = data.get("devices"), inputs["cases"]
    expect(_is_list(got, len(cases)), EX_DEV, f"one device per case ({len(cases)})",
           type(got).__name__ if not _is_list(got) else len(got))
    for case, dev in zip(cases, got, strict=True):
        env = case["env"]
        where = (f"RANK={env['RANK']} LOCAL_RANK={env['LOCAL_RANK']} GROUP_RANK={env['GROUP_RANK']} of a job of "
                 f"WORLD_SIZE={env['WORLD_SIZE']}, {env['LOCAL_WORLD_SIZE']} per node, {case['gpus']} GPU(s) "
                 "visible")
        expect(type(dev) is str and dev == expected_device(case), EX_DEV,
               f"{expected_device(case)!r} for the worker with {where}", repr(dev),
               "which variable numbers the workers of one node (a node's GPUs are numbered from 0), and what "
               "should a worker use when it sees no GPU?")
    return f"{len(cases)} workers of {len(LAYOUTS)} layouts, each on its own node's GPU (or the CPU)"


register(Exercise(EX_DEV, entry="local_device", probe=device_probe, judge=device_judge, inputs=device_inputs,
                  needs_gpu=False, timeout_s=30))
