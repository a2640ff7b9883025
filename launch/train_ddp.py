#!/usr/bin/env python
r"""Train a small classifier with DistributedDataParallel, the way production jobs do (lesson 09).

    torchrun --standalone --nproc-per-node=2 launch/train_ddp.py --epochs 3
    torchrun --nnodes=2 --nproc-per-node=8 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 --rdzv-id=JOB \
        launch/train_ddp.py                                 (run the same command on every node)
    python launch/train_ddp.py --epochs 1                   (one process, no torchrun: a world of one)

What a real job needs, each behind a flag so a lesson can switch it on:
- DistributedSampler with set_epoch (--no-set-epoch shows the bug: the same order every epoch), drop_last for
  training, and evaluation that counts each sample once although the sampler pads the set;
- gradient accumulation with no_sync (--accum N: one all-reduce per N micro-batches);
- uneven inputs with Join (--uneven N: rank r gets r*N fewer batches; --no-join shows the hang);
- SyncBatchNorm converted before wrapping (--sync-bn, GPUs only);
- communication hooks (--comm-hook fp16|bf16|powersgd|allreduce) with the bytes they hand to all_reduce;
- a checkpoint written by rank 0 behind a barrier and loaded onto each rank's own device (--checkpoint, --resume);
- the unused-parameter error (--unused-layer) and its fix (--find-unused-parameters);
  TORCH_DISTRIBUTED_DEBUG=INFO makes the error name the parameters;
- step timing for scaling studies (--bench 256,64: per-rank batch sizes; benchmarks/ddp_scaling.py runs it).
The data are made here (Gaussian points labelled by a fixed random linear map); nothing is downloaded.
The device comes from LOCAL_RANK (this node's process number), never from the global RANK.
Rank 0's last line is `RESULT {json}`, for programs that run this script.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from datetime import timedelta
from itertools import islice

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.distributed.algorithms.join import Join
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

HOOKS = ("none", "allreduce", "fp16", "bf16", "powersgd")
HOOK_MODULES = "torch.distributed.algorithms.ddp_comm_hooks"  # where torch's comm hooks live


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64, help="samples per micro-batch on each rank")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--train-size", type=int, default=4096)
    p.add_argument("--eval-size", type=int, default=1001, help="not a multiple of the world size, on purpose")
    p.add_argument("--dim", type=int, default=32, help="input features")
    p.add_argument("--width", type=int, default=128)
    p.add_argument("--depth", type=int, default=2, help="hidden layers (Linear, BatchNorm1d, ReLU)")
    p.add_argument("--classes", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-set-epoch", action="store_true", help="the bug: never call sampler.set_epoch")
    p.add_argument("--sync-bn", action="store_true", help="SyncBatchNorm (GPUs only)")
    p.add_argument("--comm-hook", choices=HOOKS, default="none", help="none: DDP's built-in all-reduce")
    p.add_argument("--powersgd-rank", type=int, default=2)
    p.add_argument("--powersgd-start", type=int, default=10, help="plain all-reduce for the first N steps")
    p.add_argument("--uneven", type=int, default=0, metavar="N", help="rank r trains on r*N fewer batches")
    p.add_argument("--no-join", action="store_true", help="with --uneven: no Join, so the ranks hang")
    p.add_argument("--unused-layer", action="store_true", help="a layer forward never uses")
    p.add_argument("--find-unused-parameters", action="store_true")
    p.add_argument("--checkpoint", default=None, help="file written by rank 0 after every epoch")
    p.add_argument("--resume", action="store_true", help="start from --checkpoint if it exists")
    p.add_argument("--cpu", action="store_true", help="gloo on the CPU even where there are GPUs")
    p.add_argument("--timeout", type=float, default=600, help="seconds a collective may wait (default 10 min)")
    p.add_argument("--bench", default=None, metavar="B1,B2", help="time training steps at these per-rank batches")
    p.add_argument("--bench-steps", type=int, default=20)
    return p.parse_args(argv)


# ---------------------------------------------------------------------------------------------- the job


def setup(args: argparse.Namespace) -> torch.device:
    """Join the job torchrun started (or make a one-process job) and return this process's device."""
    # torchrun sets RANK and WORLD_SIZE (across all nodes), LOCAL_RANK (0..nproc_per_node-1 on this node),
    # MASTER_ADDR and MASTER_PORT. A node's GPUs are numbered from 0, so LOCAL_RANK picks the GPU: with
    # RANK, the second node of a 4-GPU-per-node job would ask for cuda:4..7, which it does not have.
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available() and not args.cpu
    if use_cuda and local_rank >= torch.cuda.device_count():
        sys.exit(f"LOCAL_RANK={local_rank} but this process sees {torch.cuda.device_count()} GPU(s): start at most "
                 "one process per GPU (torchrun --nproc-per-node), or pass --cpu")
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    if args.sync_bn and not use_cuda:
        sys.exit("--sync-bn needs GPUs: torch's SyncBatchNorm does not run on the CPU")
    if args.comm_hook == "bf16" and not use_cuda:
        sys.exit("--comm-hook bf16 needs NCCL (GPUs); on the CPU use --comm-hook fp16")
    if args.comm_hook == "powersgd" and not use_cuda and torch.cuda.is_available():
        # torch's powerSGD_hook (decompress) calls torch.cuda.synchronize(device) whenever CUDA is available,
        # and that raises for a CPU device: gloo training with PowerSGD works only where no GPU is visible.
        sys.exit("--comm-hook powersgd with --cpu on a machine with GPUs fails inside torch (its PowerSGD hook "
                 "calls torch.cuda.synchronize on the CPU device): train on the GPUs (drop --cpu), or hide them "
                 "with CUDA_VISIBLE_DEVICES= torchrun ...")
    backend = "nccl" if use_cuda else "gloo"
    timeout = timedelta(seconds=args.timeout)
    if "RANK" in os.environ:  # started by torchrun (or srun with torchrun's variables)
        dist.init_process_group(backend, timeout=timeout, device_id=device if use_cuda else None)
    else:  # plain `python train_ddp.py`: a world of one, no rendezvous needed
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    env = " ".join(f"{k}={os.environ.get(k, '-')}" for k in ("RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE"))
    print(f"[rank {dist.get_rank()}] {env} device={device} backend={backend}", flush=True)
    return device


def say(*args) -> None:
    """Print on rank 0 only (every rank runs this script)."""
    if dist.get_rank() == 0:
        print(*args, flush=True)


# ---------------------------------------------------------------------------------------------- data and model


def make_data(n: int, dim: int, classes: int, seed: int) -> TensorDataset:
    """Gaussian points, each labelled with the class a fixed random linear map scores highest.

    Every rank makes the same data (same seeds); the DistributedSampler then gives each rank its share."""
    scores = torch.randn(dim, classes, generator=torch.Generator().manual_seed(1234))  # same for every split
    x = torch.randn(n, dim, generator=torch.Generator().manual_seed(seed))
    return TensorDataset(x, (x @ scores).argmax(dim=1))


class MLP(nn.Module):
    def __init__(self, dim: int, width: int, depth: int, classes: int, unused_layer: bool = False):
        super().__init__()
        layers: list[nn.Module] = []
        for i in range(depth):
            layers += [nn.Linear(dim if i == 0 else width, width), nn.BatchNorm1d(width), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(width, classes)
        # --unused-layer: an auxiliary head that forward never calls. DDP expects a gradient for every
        # parameter in every step, so it waits for these and reports an error at the next step.
        self.aux = nn.Linear(width, classes) if unused_layer else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x))


def wrap(model: nn.Module, args: argparse.Namespace, device: torch.device) -> DDP:
    """Move to this rank's device, convert BatchNorm to SyncBatchNorm if asked, then wrap in DDP."""
    model = model.to(device)
    if args.sync_bn:
        # Before wrapping: DDP registers its hooks on, and checks, the module it is given.
        model = nn.SyncBatchNorm.convert_sync_batchnorm(model)
    ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
              find_unused_parameters=args.find_unused_parameters)
    if args.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=args.powersgd_start)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
    elif args.comm_hook != "none":
        hook = {"allreduce": default_hooks.allreduce_hook, "fp16": default_hooks.fp16_compress_hook,
                "bf16": default_hooks.bf16_compress_hook}[args.comm_hook]
        ddp.register_comm_hook(None, hook)  # state None: the default process group
    return ddp


@contextlib.contextmanager
def all_reduce_bytes(counter: dict):
    """Count the bytes that DDP's communication hooks hand to torch.distributed.all_reduce inside the block.

    The hooks call torch.distributed.all_reduce from Python on what they send (a 16-bit copy of the bucket,
    PowerSGD's P and Q matrices), so wrapping it counts what goes on the wire; calls from elsewhere (Join's
    small flags) are left out. DDP's built-in all-reduce (--comm-hook none) runs in C++ and is not seen here."""
    real = dist.all_reduce

    def counting(tensor, *args, **kwargs):
        if sys._getframe(1).f_globals.get("__name__", "").startswith(HOOK_MODULES):
            counter["bytes"] += tensor.numel() * tensor.element_size()
        return real(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield counter
    finally:
        dist.all_reduce = real


# ---------------------------------------------------------------------------------------------- training


def train_one_epoch(model: DDP, loader: DataLoader, optimizer: torch.optim.Optimizer, args: argparse.Namespace,
                    device: torch.device) -> dict:
    """One pass over this rank's batches; returns the mean loss over ranks and the optimizer steps taken."""
    model.train()
    n_batches = max(0, len(loader) - dist.get_rank() * args.uneven)  # --uneven: later ranks run out first
    loss_sum, steps = torch.zeros((), device=device), 0
    # Join lets ranks that ran out of batches shadow the others' all-reduces, so nobody waits forever.
    # With SyncBatchNorm the forward pass communicates too, which Join cannot shadow: then every rank stops
    # as soon as one runs out (throw_on_early_termination).
    join = args.uneven and not args.no_join
    context = Join([model], throw_on_early_termination=args.sync_bn) if join else contextlib.nullcontext()
    try:
        with context:
            for i, (x, y) in enumerate(islice(loader, n_batches)):
                x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
                # Windows of `accum` micro-batches counted on len(loader), the same on every rank, so that
                # the ranks all-reduce at the same micro-batches even when some run out early (--uneven).
                start = i - i % args.accum
                window = min(args.accum, len(loader) - start)  # micro-batches in this optimizer step
                sync = i - start == window - 1  # the window's last micro-batch all-reduces
                # no_sync must cover the forward pass too: DDP decides in forward whether backward syncs.
                with contextlib.nullcontext() if sync else model.no_sync():
                    loss = F.cross_entropy(model(x), y) / window  # the window's mean loss
                    loss.backward()
                loss_sum += loss.detach() * window
                if sync:
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                    steps += 1
    except RuntimeError as err:
        if "exhausted" not in str(err):  # Join's early-termination signal; anything else is a real error
            raise
        say(f"  a rank ran out of batches, so every rank stopped this epoch ({err})")
    # A rank that ran out in the middle of a window drops its part of it (Join has since made every rank's
    # weights equal again); its gradients must not leak into the next epoch's first step.
    optimizer.zero_grad(set_to_none=True)
    stats = torch.stack([loss_sum, torch.tensor(float(n_batches), device=device)])
    dist.all_reduce(stats)
    return {"loss": (stats[0] / stats[1]).item(), "steps": steps}


@torch.no_grad()
def evaluate(model: nn.Module, dataset: TensorDataset, batch_size: int, device: torch.device) -> dict:
    """Accuracy over the evaluation set with each sample counted once, next to what a padded count gives.

    DistributedSampler pads the set to a multiple of the world size by repeating its first samples, so that
    every rank runs as many batches. Rank r's j-th sample sits at position r + j * world of the padded list;
    positions past len(dataset) are the repeats, left out of the exact count."""
    rank, world = dist.get_rank(), dist.get_world_size()
    sampler = DistributedSampler(dataset, shuffle=False)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    model.eval()
    counts = torch.zeros(4, device=device)  # correct, seen (exact); correct, seen (padded)
    j = 0
    for x, y in loader:
        hit = (model(x.to(device)).argmax(dim=1) == y.to(device)).float()
        real = (rank + world * torch.arange(j, j + len(y), device=device) < len(dataset)).float()
        counts += torch.stack([(hit * real).sum(), real.sum(), hit.sum(), torch.ones_like(hit).sum()])
        j += len(y)
    dist.all_reduce(counts)
    model.train()
    c = counts.tolist()
    return {"acc": c[0] / c[1], "counted": int(c[1]), "padded_acc": c[2] / c[3], "padded_counted": int(c[3])}


# ---------------------------------------------------------------------------------------------- checkpoints


def save_checkpoint(path: str, model: DDP, optimizer: torch.optim.Optimizer, epoch: int) -> None:
    """Rank 0 writes (the ranks hold identical copies); everyone waits until the file is complete."""
    if dist.get_rank() == 0:
        state = {"model": model.module.state_dict(),  # the inner module: loads without DDP too
                 "optimizer": optimizer.state_dict(), "epoch": epoch}
        torch.save(state, path + ".tmp")
        os.replace(path + ".tmp", path)  # atomic: a crash mid-write never leaves half a checkpoint
    dist.barrier()  # no rank reads it, or exits and lets the job end, before rank 0 has written it


def load_checkpoint(path: str, model: DDP, optimizer: torch.optim.Optimizer, device: torch.device) -> int:
    """Every rank loads the file onto its own device; returns the epoch to start from."""
    # Tensors saved by rank 0 come from cuda:0; without map_location every rank would load onto cuda:0.
    state = torch.load(path, map_location=device)
    model.module.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    return state["epoch"] + 1


# ---------------------------------------------------------------------------------------------- benchmark


def benchmark(model: DDP, optimizer: torch.optim.Optimizer, args: argparse.Namespace, device: torch.device,
              batch_sizes: list[int]) -> dict:
    """Median time of a training step (forward, backward with its all-reduces, optimizer step) per batch size.

    Random data already on the device, so the loader is not timed; each step ends with a device sync, and
    the step time is the slowest rank's."""
    out = {}
    for b in batch_sizes:
        x = torch.randn(b, args.dim, device=device)
        y = torch.randint(0, args.classes, (b,), device=device)
        times = []
        for i in range(5 + args.bench_steps):  # 5 warm-up steps: allocator, NCCL set-up, DDP bucket rebuild
            dist.barrier()
            t0 = time.perf_counter()
            F.cross_entropy(model(x), y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 5:
                times.append(time.perf_counter() - t0)
        t = torch.tensor(sorted(times)[len(times) // 2] * 1e3, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[str(b)] = t.item()
        say(f"per-rank batch {b}: {out[str(b)]:.3f} ms per step (median of {args.bench_steps}, slowest rank)")
    return out


# ---------------------------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    device = setup(args)
    try:
        result = run(args, device)
        say("RESULT " + json.dumps(result))
        return result
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device) -> dict:
    """Build the model, then benchmark (--bench) or train and evaluate; returns what rank 0 reports."""
    torch.manual_seed(args.seed)  # the same initial weights everywhere (DDP also broadcasts rank 0's)
    model = wrap(MLP(args.dim, args.width, args.depth, args.classes, args.unused_layer), args, device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    world = dist.get_world_size()
    result: dict = {"world_size": world, "backend": dist.get_backend(), "device": str(device), "epochs": []}
    if args.bench:
        result["bench_ms"] = benchmark(model, optimizer, args, device, [int(b) for b in args.bench.split(",")])
        return result
    train = make_data(args.train_size, args.dim, args.classes, seed=args.seed + 1)
    evalset = make_data(args.eval_size, args.dim, args.classes, seed=args.seed + 2)
    # drop_last=True: every rank gets len // world distinct samples (no padding repeats in training)
    sampler = DistributedSampler(train, shuffle=True, seed=args.seed, drop_last=True)
    loader = DataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True,
                        pin_memory=device.type == "cuda")
    start = 0
    if args.resume and args.checkpoint and os.path.exists(args.checkpoint):
        start = load_checkpoint(args.checkpoint, model, optimizer, device)
        result["resumed_at_epoch"] = start
        say(f"resumed from {args.checkpoint}: starting at epoch {start}")
    say(f"world size {world}, {len(loader)} batches of {args.batch_size} per rank per epoch, "
        f"accum {args.accum}, comm hook {args.comm_hook}")
    sent = {"bytes": 0}
    for epoch in range(start, start + args.epochs):
        if not args.no_set_epoch:
            sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        order = list(islice(iter(sampler), 5))
        with all_reduce_bytes(sent) if args.comm_hook != "none" else contextlib.nullcontext():
            before = sent["bytes"]
            stats = train_one_epoch(model, loader, optimizer, args, device)
        ev = evaluate(model.module, evalset, args.batch_size, device)
        row = {"epoch": epoch, **stats, **ev, "first_indices": order}
        if args.comm_hook != "none" and stats["steps"]:
            row["bytes_per_step"] = (sent["bytes"] - before) / stats["steps"]
        result["epochs"].append(row)
        say(f"epoch {epoch}: train loss {stats['loss']:.4f}, {stats['steps']} steps, eval acc {ev['acc']:.4f} "
            f"over {ev['counted']} samples (padded: {ev['padded_acc']:.4f} over {ev['padded_counted']}), "
            f"rank 0's first samples {order}"
            + (f", {row['bytes_per_step'] / 1e3:.1f} kB all-reduced per step" if "bytes_per_step" in row else ""))
        if args.checkpoint:
            save_checkpoint(args.checkpoint, model, optimizer, epoch)
    result["grad_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
    return result


def exit_without_teardown() -> None:
    """End the process now that everything is written, skipping the interpreter's teardown.

    Under torch 2.13, DDP on gloo keeps its process group, and the group's threads, alive after
    destroy_process_group(). Those threads can abort the process while Python shuts down ("terminate called
    without an active exception", exit code -6). That happened to about 1 two-rank run in 10 on this course's
    CPU machines, after training had finished. The launcher's ranks leave the same way."""
    import atexit

    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
    exit_without_teardown()
