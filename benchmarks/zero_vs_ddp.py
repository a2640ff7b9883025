"""DDP against sharded data parallel, in the same run: step time and memory per rank, with their ratios.

    python benchmarks/zero_vs_ddp.py --nproc 2      two GPUs, NCCL (four: --nproc 4)
    python benchmarks/zero_vs_ddp.py --cpu          gloo ranks on the CPU, a small model (a smoke test)

Methods: DDP + torch.optim.Adam; the master's ZeRO-1 (`ShardedAdam`, the solution of exercise ex11_sharded_adam,
read from notebooks/11_sharded_data_parallel.ipynb: course_utils holds no solution); `ZeroRedundancyOptimizer` over
DDP; FSDP2 (`fully_shard` on each block, then the model). The model is lesson 11's stack of MLP blocks, big enough
that Adam's states are half of what training holds. Each method runs `--steps` timed steps after two untimed ones;
the step time is the median of the slower rank. Memory per rank: on GPUs the peak of
`torch.cuda.max_memory_allocated` over the steps, less what the batch took before the model existed; on the CPU
the bytes of the parameters, gradients and optimizer states the rank holds. Each is printed beside the lesson's
prediction (course_utils.checks.sharded_data_parallel.model_bytes, activations left out).
Goals (printed as met or not): the master's ZeRO-1 step within 10% of ZeroRedundancyOptimizer's; each method's memory
within 10% of the prediction; FSDP2 at 4 ranks at most 0.35x DDP's memory.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MASTER = ROOT / "notebooks" / "11_sharded_data_parallel.ipynb"
SOLUTION_ID = "ex11_sharded_adam_solution"
METHODS = ("ddp", "zero1", "zero_redundancy", "fsdp2")
PREDICT_AS = {"ddp": "ddp", "zero1": "zero1", "zero_redundancy": "zero1", "fsdp2": "zero3"}


def load_sharded_adam(master: Path = MASTER):
    """The ShardedAdam class defined by the master's solution cell, with the setup cells it needs."""
    nb = json.loads(master.read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"]
    setup = ["".join(c["source"]) for c in cells if "setup" in c["metadata"].get("tags", [])]
    solution = [c for c in cells if c["metadata"].get("nbgrader", {}).get("grade_id") == SOLUTION_ID]
    if len(solution) != 1:
        raise RuntimeError(f"{master}: expected one cell with grade_id {SOLUTION_ID!r}, found {len(solution)}")
    ns: dict = {"__name__": "lesson11_master"}  # not importable: cloudpickle ships the class by value
    exec(compile("\n".join(setup + ["".join(solution[0]["source"])]), f"{master.name} ({SOLUTION_ID})", "exec"), ns)
    return ns["ShardedAdam"]


def _model(width: int, depth: int, dev):
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

        def forward(self, x):
            return x + self.down(nn.functional.gelu(self.up(x)))

    torch.manual_seed(0)
    return nn.Sequential(*[Block() for _ in range(depth)]).to(dev)


def _wrap(method: str, model, sharded_adam, lr: float = 1e-3):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.optim import ZeroRedundancyOptimizer
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [next(model.parameters()).device.index] if dist.get_backend() == "nccl" else None
    if method == "ddp":
        module = DDP(model, device_ids=ids, gradient_as_bucket_view=True)  # no second copy of the gradients
        return module, torch.optim.Adam(module.parameters(), lr=lr)
    if method == "zero1":
        return model, sharded_adam(model.parameters(), lr=lr)
    if method == "zero_redundancy":
        module = DDP(model, device_ids=ids)
        return module, ZeroRedundancyOptimizer(module.parameters(), optimizer_class=torch.optim.Adam, lr=lr)
    for block in model:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def _held_bytes(module, opt) -> int:
    """Bytes of the parameters, gradients and optimizer tensors this rank holds (local shards of DTensors)."""
    import torch
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    seen: dict[int, int] = {}
    tensors = [p for p in module.parameters()] + [p.grad for p in module.parameters() if p.grad is not None]
    inner = getattr(opt, "optim", None) or getattr(opt, "adam", None) or opt  # ZeroRedundancyOptimizer, ShardedAdam
    for state in getattr(inner, "state", {}).values():
        tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    for group in getattr(inner, "param_groups", []):  # a sharded optimizer's own shards, and their gradients
        tensors += [t for p in group["params"] for t in (p, p.grad) if t is not None]
    for t in tensors:
        s = local(t).untyped_storage()
        seen[s.data_ptr()] = s.nbytes()
    return sum(seen.values())


def run_method(method: str, sharded_adam, width: int, depth: int, rows: int, steps: int) -> dict:
    """On each rank: the method's step times (ms) and memory (bytes), as the module docstring says."""
    import torch
    import torch.distributed as dist
    from torch import nn

    dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    cuda = dev.type == "cuda"
    g = torch.Generator(device=dev).manual_seed(1 + dist.get_rank())
    x, y = torch.randn(rows, width, generator=g, device=dev), torch.randn(rows, width, generator=g, device=dev)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    module, opt = _wrap(method, _model(width, depth, dev), sharded_adam)
    times = []
    for i in range(steps + 2):
        dist.barrier()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        nn.functional.mse_loss(module(x), y).backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize()
        if i >= 2:
            times.append((time.perf_counter() - t0) * 1e3)
    memory = torch.cuda.max_memory_allocated() - base if cuda else _held_bytes(module, opt)
    return {"step_ms": statistics.median(times), "bytes": memory}


def bench(sharded_adam, width: int, depth: int, rows: int, steps: int) -> dict:
    """Every method in turn on this rank, freeing each before the next."""
    import gc

    out = {}
    for method in METHODS:
        out[method] = run_method(method, sharded_adam, width, depth, rows, steps)
        gc.collect()
    return out


def report(results: dict, nproc: int, psi: int, where: str) -> dict:
    """Print the table and the goals; return the numbers."""
    from course_utils.checks.sharded_data_parallel import model_bytes

    step = {m: max(r[m]["step_ms"] for r in results.values()) for m in METHODS}
    mem = {m: max(r[m]["bytes"] for r in results.values()) for m in METHODS}
    want = {m: sum(model_bytes(psi, nproc, PREDICT_AS[m], False).values()) for m in METHODS}
    print(f"zero_vs_ddp: {nproc} ranks, {where}, Ψ = {psi / 1e6:.1f}M parameters, Adam fp32")
    print(f"  {'method':17s} {'step ms':>9s} {'vs DDP':>7s} {'MB per rank':>12s} {'predicted':>10s} {'vs DDP':>7s}")
    for m in METHODS:
        print(f"  {m:17s} {step[m]:9.2f} {step[m] / step['ddp']:7.2f} {mem[m] / 1e6:12.1f} {want[m] / 1e6:10.1f} "
              f"{mem[m] / mem['ddp']:7.2f}")
    goals = {"ZeRO-1 step within 10% of ZeroRedundancyOptimizer's": step["zero1"] <= 1.1 * step["zero_redundancy"]}
    for m in METHODS:
        goals[f"{m} memory within 10% of the prediction"] = abs(mem[m] / want[m] - 1) <= 0.1
    if nproc >= 4:
        goals["FSDP2 at most 0.35x DDP's memory"] = mem["fsdp2"] <= 0.35 * mem["ddp"]
    for name, ok in goals.items():
        print(f"  goal: {name}: {'met' if ok else 'NOT met'}")
    return {"step_ms": step, "bytes": mem, "predicted": want, "goals": goals}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--cpu", action="store_true", help="gloo ranks on the CPU, a small model")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--rows", type=int, default=None, help="rows per rank in a step")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per method")
    args = parser.parse_args(argv)

    import torch

    from course_utils import launch

    gpus = torch.cuda.device_count()
    if not args.cpu and gpus < args.nproc:
        parser.error(f"needs {args.nproc} GPUs (this machine has {gpus}); use --cpu for a smoke test on gloo")
    width = args.width or (128 if args.cpu else 4096)
    depth = args.depth or (2 if args.cpu else 8)
    rows = args.rows or (8 if args.cpu else 64)
    steps = args.steps or (3 if args.cpu else 10)
    results = launch.run(bench, load_sharded_adam(), width, depth, rows, steps, nproc=args.nproc,
                         backend="gloo" if args.cpu else "nccl", timeout=900)
    psi = depth * (2 * 4 * width * width + 5 * width)
    where = "gloo on the CPU" if args.cpu else f"NCCL, {torch.cuda.get_device_name(0)}"
    return report(results, args.nproc, psi, where)


if __name__ == "__main__":
    main()
