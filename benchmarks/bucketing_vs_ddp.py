"""Hand-written bucketed data parallel against torch DDP, in the same run: step times and their ratio.

    python benchmarks/bucketing_vs_ddp.py               two GPUs, NCCL (NVLink where there is one)
    python benchmarks/bucketing_vs_ddp.py --sockets     the same with NCCL forced onto TCP sockets
    python benchmarks/bucketing_vs_ddp.py --cpu         two gloo ranks on the CPU, tiny sizes (a smoke test)

`BucketedDP` is the master's solution of exercise ex08_bucketed_dp, read from the solution cell of
notebooks/08_overlap_and_bucketing.ipynb (course_utils holds no solution). The model is lesson 08's: DEPTH
MLP blocks (width -> 4 width -> width). By default the batch is picked as the lesson picks it: the first
size at which backward takes at least as long as one all-reduce of every gradient (so that communication
matters) and at least GROWTH times as long as at half the batch (so that the GPU's work, not the host's
Python and kernel launches, sets backward's pace: in a host-bound backward, Python hooks add straight to the
step time and the ratio would measure Python against C++, not communication). Both versions wrap their
own copy of the same model, use the same bucket cap, and run alternately in rounds (DDP first in even
rounds, BucketedDP first in odd ones) so that drifts on a shared host hit both; the step time is the
median over steps of the slower rank. Goal: BucketedDP / DDP <= 1.05.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MASTER = ROOT / "notebooks" / "08_overlap_and_bucketing.ipynb"
SOLUTION_ID = "ex08_bucketed_dp_solution"
SOCKETS_ENV = {"NCCL_P2P_DISABLE": "1", "NCCL_SHM_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
GOAL = 1.05
GROWTH = 1.5  # as the lesson's size_up


def load_bucketed_dp(master: Path = MASTER):
    """The BucketedDP class defined by the master's solution cell (run with the imports it needs)."""
    nb = json.loads(master.read_text())
    cells = [c for c in nb["cells"] if c["cell_type"] == "code"
             and c["metadata"].get("nbgrader", {}).get("grade_id") == SOLUTION_ID]
    if len(cells) != 1:
        raise RuntimeError(f"{master}: expected one cell with grade_id {SOLUTION_ID!r}, found {len(cells)}")
    ns: dict = {"__name__": "lesson08_master"}  # not importable: cloudpickle ships the class by value
    exec("import torch\nimport torch.distributed as dist\n", ns)
    exec(compile("".join(cells[0]["source"]), f"{master.name} ({SOLUTION_ID})", "exec"), ns)
    return ns["BucketedDP"]


def _device():
    import torch
    import torch.distributed as dist

    return torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")


def _sync(dev) -> None:
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _slowest(ms: float, dev) -> float:
    """The largest of every rank's `ms`."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([ms], device=dev)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _timed(fn, dev) -> float:
    """ms for one call of `fn`, started on every rank together and ended when this rank's GPU is done."""
    import torch
    import torch.distributed as dist

    dist.all_reduce(torch.zeros(1, device=dev))
    _sync(dev)
    t0 = time.perf_counter()
    fn()
    _sync(dev)
    return (time.perf_counter() - t0) * 1e3


def _make_model(width: int, depth: int, dev):
    """Lesson 08's model, the same on every rank and every call."""
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


def _data(n: int, width: int, dev):
    """A batch of `n` rows (inputs and targets), different on each rank."""
    import torch
    import torch.distributed as dist

    g = torch.Generator(device=dev).manual_seed(1234 + dist.get_rank())
    return torch.randn(n, width, generator=g, device=dev), torch.randn(n, width, generator=g, device=dev)


def _backward_ms(model, x, y, dev) -> float:
    """Backward's time on this batch (forward and backward less forward alone), on the slower rank."""
    from torch import nn

    def forward():
        return nn.functional.mse_loss(model(x), y)

    fwd = _slowest(min(_timed(forward, dev) for _ in range(3)), dev)
    both = _slowest(min(_timed(lambda: forward().backward(), dev) for _ in range(3)), dev)
    return both - fwd


def _pick_rows(width: int, depth: int, rows_to_try: list[int], dev) -> dict:
    """The lesson's choice of batch: the first size whose backward takes at least as long as one all-reduce of
    every gradient and GROWTH times as long as the size before (GPU-bound). Returns the timings and "rows"."""
    import torch
    import torch.distributed as dist

    model = _make_model(width, depth, dev)
    flat = torch.zeros(sum(p.numel() for p in model.parameters()), device=dev)
    dist.all_reduce(flat)
    allreduce = _slowest(min(_timed(lambda: dist.all_reduce(flat), dev) for _ in range(3)), dev)
    backward: dict[int, float] = {}
    rows = None
    for n in rows_to_try:
        ms = _backward_ms(model, *_data(n, width, dev), dev)
        before = backward.get(rows)  # the size before (None at the first)
        backward[n] = ms
        rows = n
        if ms >= allreduce and before is not None and ms >= GROWTH * before:
            break
    return {"allreduce_ms": allreduce, "backward_ms": backward, "rows": rows}


def _compare(bucketed_dp, width: int, depth: int, rows: int, cap_mb: float, steps: int, warmup: int,
             rounds: int, dev) -> dict:
    """Both versions on their own copy of the model and the same batch: their gradients' largest relative
    difference after one step, then each one's step times (ms), in alternating rounds."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    x, y = _data(rows, width, dev)
    plain, mine = _make_model(width, depth, dev), _make_model(width, depth, dev)
    ids = [dev.index] if dev.type == "cuda" else None
    ddp, dp = DDP(plain, device_ids=ids, bucket_cap_mb=cap_mb), bucketed_dp(mine, cap_mb)

    def step_ddp():
        plain.zero_grad(set_to_none=True)
        nn.functional.mse_loss(ddp(x), y).backward()

    def step_mine():
        mine.zero_grad(set_to_none=True)
        nn.functional.mse_loss(mine(x), y).backward()
        dp.finish()

    step_ddp()
    step_mine()
    _sync(dev)
    out = {"max_rel_diff": max(float((a.grad - b.grad).abs().max() / b.grad.abs().max())
                               for a, b in zip(mine.parameters(), plain.parameters(), strict=True))}
    for _ in range(warmup):
        step_ddp()
        step_mine()
    out["ddp_ms"], out["bucketed_ms"] = [], []
    for r in range(rounds):
        order = [("ddp_ms", step_ddp), ("bucketed_ms", step_mine)]
        for key, fn in order if r % 2 == 0 else order[::-1]:
            out[key] += [_timed(fn, dev) for _ in range(steps)]
    return out


def bench(bucketed_dp, width: int, depth: int, rows: int | None, rows_to_try: list[int], cap_mb: float,
          steps: int, warmup: int, rounds: int) -> dict:
    """On each rank: pick the batch (unless given), check both versions' gradients agree, time them."""
    dev = _device()
    out = _pick_rows(width, depth, rows_to_try, dev) if rows is None else {"rows": rows}
    return {**out, **_compare(bucketed_dp, width, depth, out["rows"], cap_mb, steps, warmup, rounds, dev)}


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sockets", action="store_true", help="NCCL over TCP sockets (" +
                        " ".join(f"{k}={v}" for k, v in SOCKETS_ENV.items()) + ")")
    parser.add_argument("--cpu", action="store_true", help="two gloo ranks on the CPU with tiny sizes")
    parser.add_argument("--width", type=int, default=None)
    parser.add_argument("--depth", type=int, default=None)
    parser.add_argument("--rows", type=int, default=None, help="rows per rank (default: picked as lesson 08 does)")
    parser.add_argument("--cap-mb", type=float, default=None, help="bucket cap in MiB (default 25; CPU 0.1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per version per round")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)

    import torch

    from course_utils import launch

    gpus = torch.cuda.device_count()
    if not args.cpu and gpus < 2:
        parser.error(f"needs two GPUs (this machine has {gpus}); use --cpu for a smoke test on gloo")
    cpu = args.cpu
    width = args.width or (64 if cpu else 1024)
    depth = args.depth or (6 if cpu else 12)
    cap = args.cap_mb or (0.1 if cpu else 25.0)
    steps = args.steps or (3 if cpu else 10)
    rows_to_try = [2**k for k in range(3, 11)] if cpu else [2**k for k in range(6, 16)]
    saved = {k: os.environ.get(k) for k in SOCKETS_ENV}
    if args.sockets:
        os.environ.update(SOCKETS_ENV)  # the ranks inherit the environment; NCCL reads it when it starts
    try:
        results = launch.run(bench, load_bucketed_dp(), width, depth, args.rows, rows_to_try, cap, steps,
                             3 if cpu else 5, args.rounds, nproc=2, backend="gloo" if cpu else "nccl",
                             timeout=args.timeout)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    r0 = results[0]
    ddp = max(statistics.median(r["ddp_ms"]) for r in results.values())
    mine = max(statistics.median(r["bucketed_ms"]) for r in results.values())
    link = "gloo on the CPU" if cpu else ("NCCL over sockets" if args.sockets else "NCCL")
    device = "CPU" if cpu else torch.cuda.get_device_name(0)
    print(f"bucketing_vs_ddp: 2 ranks, {link}, {device}; {depth} blocks of width {width}, "
          f"{r0['rows']} rows per rank, buckets of {cap:g} MiB")
    if "allreduce_ms" in r0:
        print(f"  one all-reduce of every gradient {r0['allreduce_ms']:.2f} ms; backward "
              + ", ".join(f"{n} rows {ms:.2f} ms" for n, ms in r0["backward_ms"].items()))
    print(f"  gradients BucketedDP vs DDP: max relative difference "
          f"{max(r['max_rel_diff'] for r in results.values()):.1e}")
    n = len(r0["ddp_ms"])
    print(f"  DDP        {ddp:9.3f} ms per step (median of {n}, slower rank)")
    print(f"  BucketedDP {mine:9.3f} ms per step (median of {n}, slower rank)")
    ratio = mine / ddp
    print(f"  ratio BucketedDP / DDP = {ratio:.3f}: goal (<= {GOAL}) {'met' if ratio <= GOAL else 'NOT met'}")
    return {"ddp_ms": ddp, "bucketed_ms": mine, "ratio": ratio, "rows": r0["rows"],
            "max_rel_diff": max(r["max_rel_diff"] for r in results.values()), "link": link, "device": device}


if __name__ == "__main__":
    main()
