"""DDP scaling on this machine's GPUs: step time and efficiency on 1, 2, 4, ... GPUs, strong and weak (lesson 09).

    python benchmarks/ddp_scaling.py                       # every power of two up to the GPU count
    python benchmarks/ddp_scaling.py --gpus 1,2,4 --json scaling.json --plot scaling.png

For each GPU count n it runs launch/train_ddp.py --bench through torchrun (one process per GPU, NCCL) and
times a DDP training step (forward, backward with its bucketed all-reduces, SGD step) at two per-GPU batches:
- strong scaling: the global batch is fixed (--global-batch), so each GPU gets global/n samples;
  speedup = t(1) / t(n), efficiency = speedup / n (1.0: n GPUs finish the same work n times faster);
- weak scaling: the per-GPU batch is fixed (--batch), so the work grows with n;
  efficiency = t(1) / t(n) (1.0: n times the work in the same time).
Efficiency below 1 is time spent communicating that backward could not hide, plus waiting for the slowest
rank. The model (an MLP of --depth layers of --width) has width^2 * depth parameters to all-reduce.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "launch" / "train_ddp.py"


def run_bench(n: int, batches: list[int], args: argparse.Namespace) -> dict[str, float]:
    """Median step time (ms, slowest rank) per per-GPU batch size, on n GPUs."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n}", str(SCRIPT),
           "--bench", ",".join(map(str, batches)), "--bench-steps", str(args.steps),
           "--dim", str(args.width), "--width", str(args.width), "--depth", str(args.depth)]
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"))
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1][len("RESULT "):])["bench_ms"]


def measure(gpus: list[int], args: argparse.Namespace) -> dict:
    """The table: one row per GPU count with strong and weak step times, speedups and efficiencies."""
    rows = []
    for n in gpus:
        strong_b = args.global_batch // n
        ms = run_bench(n, sorted({strong_b, args.batch}), args)
        rows.append({"gpus": n, "strong_batch": strong_b, "strong_ms": ms[str(strong_b)],
                     "weak_batch": args.batch, "weak_ms": ms[str(args.batch)]})
        print(f"{n} GPU(s): strong {rows[-1]['strong_ms']:.2f} ms at {strong_b}/GPU, "
              f"weak {rows[-1]['weak_ms']:.2f} ms at {args.batch}/GPU", flush=True)
    base = rows[0]
    for r in rows:
        r["strong_speedup"] = base["strong_ms"] / r["strong_ms"]
        r["strong_efficiency"] = r["strong_speedup"] / r["gpus"]
        r["weak_efficiency"] = base["weak_ms"] / r["weak_ms"]
    return {"rows": rows, "global_batch": args.global_batch, "batch": args.batch, "width": args.width,
            "depth": args.depth, "params": args.width * args.width * args.depth, "gpu": gpu_name()}


def gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"


def table(result: dict) -> str:
    head = (f"{'GPUs':>4}  {'strong: batch/GPU':>17}  {'ms/step':>8}  {'speedup':>7}  {'efficiency':>10}  "
            f"{'weak: batch/GPU':>15}  {'ms/step':>8}  {'efficiency':>10}")
    lines = [head]
    for r in result["rows"]:
        lines.append(f"{r['gpus']:>4}  {r['strong_batch']:>17}  {r['strong_ms']:>8.2f}  {r['strong_speedup']:>7.2f}  "
                     f"{r['strong_efficiency']:>10.0%}  {r['weak_batch']:>15}  {r['weak_ms']:>8.2f}  "
                     f"{r['weak_efficiency']:>10.0%}")
    return "\n".join(lines)


def plot(result: dict, path: str | None = None):
    """Efficiency against GPU count, strong and weak, with the ideal line."""
    import matplotlib.pyplot as plt

    rows = result["rows"]
    n = [r["gpus"] for r in rows]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(n, [r["strong_efficiency"] for r in rows], "o-", label=f"strong (global batch {result['global_batch']})")
    ax.plot(n, [r["weak_efficiency"] for r in rows], "s-", label=f"weak ({result['batch']} per GPU)")
    ax.axhline(1.0, color="grey", lw=0.8, ls="--", label="ideal")
    ax.set_xticks(n)
    ax.set_xlabel("GPUs")
    ax.set_ylabel("scaling efficiency")
    ax.set_ylim(0, 1.1)
    ax.set_title(f"DDP, {result['params'] / 1e6:.0f}M parameters, {result['gpu']}")
    ax.legend(loc="lower left")
    fig.tight_layout()
    if path:
        fig.savefig(path, dpi=120)
    return fig


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gpus", default=None, help="GPU counts, e.g. 1,2,4 (default: powers of two up to all)")
    p.add_argument("--global-batch", type=int, default=4096, help="strong scaling: samples per step in all")
    p.add_argument("--batch", type=int, default=1024, help="weak scaling: samples per step per GPU")
    p.add_argument("--width", type=int, default=4096)
    p.add_argument("--depth", type=int, default=8)
    p.add_argument("--steps", type=int, default=20, help="timed steps per measurement (after 5 warm-up steps)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per torchrun launch")
    p.add_argument("--json", default=None, help="write the table here")
    p.add_argument("--plot", default=None, help="save the efficiency plot here (PNG)")
    args = p.parse_args(argv)
    import torch

    have = torch.cuda.device_count()
    if have == 0:
        print("ddp_scaling: needs CUDA GPUs; this machine has none", file=sys.stderr)
        return 2
    gpus = [int(g) for g in args.gpus.split(",")] if args.gpus else [n for n in (1, 2, 4, 8, 16) if n <= have]
    gpus = sorted(set([1] + gpus))  # efficiencies are relative to one GPU
    if max(gpus) > have:
        print(f"ddp_scaling: asked for {max(gpus)} GPUs, this machine has {have}", file=sys.stderr)
        return 2
    result = measure(gpus, args)
    print(table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.plot:
        plot(result, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
