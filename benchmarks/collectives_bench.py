"""course_utils.bench's collective numbers against the plainest timing loop, in the same run, on this machine's GPUs.

    python benchmarks/collectives_bench.py                          # every GPU, five collectives, 1 MiB to 1 GiB
    python benchmarks/collectives_bench.py --nproc 2 --expect-allreduce-gbps 330   # 2xH200: the course's goal

For each collective and size it prints bench's busbw (bench.measure_collective: warm-up, barrier, 20 async calls
back to back, waited for, averaged over ranks), the busbw of a raw loop written out here (20 blocking calls
between two torch.cuda.synchronize(), nothing else; its busbw factors typed in here from nccl-tests, not taken
from bench), and their ratio; each is the best of --repeats runs, interleaved. Goal: every ratio within 5%. With
--expect-allreduce-gbps G it also says whether all_reduce at 1 GiB reached G within 10%. The exit status is 1 when
a goal is missed.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from course_utils import bench, launch  # noqa: E402

FACTOR = {"all_reduce": lambda n: 2 * (n - 1) / n, "all_gather": lambda n: (n - 1) / n,
          "reduce_scatter": lambda n: (n - 1) / n, "all_to_all": lambda n: (n - 1) / n, "broadcast": lambda n: 1.0}


def raw_busbw(op: str, size: int, iters: int = 20, warmup: int = 5) -> tuple[float, int]:
    """The plainest loop: (busbw in GB/s with the time averaged over ranks, S in bytes). Runs on every rank."""
    import torch
    import torch.distributed as dist

    n, dev = dist.get_world_size(), torch.device("cuda", torch.cuda.current_device())
    numel = size // 4
    shard = numel // n
    if op == "all_reduce":
        x = torch.zeros(numel, device=dev)
        fn, size = (lambda: dist.all_reduce(x)), numel * 4
    elif op == "broadcast":
        x = torch.zeros(numel, device=dev)
        fn, size = (lambda: dist.broadcast(x, src=0)), numel * 4
    elif op == "all_gather":
        x, out = torch.zeros(shard, device=dev), torch.zeros(shard * n, device=dev)
        ag = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        fn, size = (lambda: ag(out, x)), shard * n * 4
    elif op == "reduce_scatter":
        x, out = torch.zeros(shard * n, device=dev), torch.zeros(shard, device=dev)
        rs = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        fn, size = (lambda: rs(out, x)), shard * n * 4
    elif op == "all_to_all":
        x, out = torch.zeros(shard * n, device=dev), torch.zeros(shard * n, device=dev)
        fn, size = (lambda: dist.all_to_all_single(out, x)), shard * n * 4
    else:
        raise ValueError(f"no raw loop for {op!r}")
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    t = torch.tensor([(time.perf_counter() - t0) / iters], dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    seconds = t.item() / n
    return size / seconds / 1e9 * FACTOR[op](n), size


def _on_ranks(ops: list[str], sizes: list[int], repeats: int, iters: int, warmup: int) -> list[dict]:
    rows = []
    for op in ops:
        for size in sizes:
            best_bench = best_raw = 0.0
            s = size
            for _ in range(repeats):  # interleaved, so both see the same machine
                r = bench.measure_collective(op, size, warmup=warmup, iters=iters)
                raw, s = raw_busbw(op, size, iters, warmup)
                best_bench, best_raw = max(best_bench, r.busbw_gbps), max(best_raw, raw)
                assert r.size_bytes == s, (op, r.size_bytes, s)
            rows.append({"op": op, "size": s, "bench_busbw": best_bench, "raw_busbw": best_raw,
                         "ratio": best_bench / best_raw})
            import torch

            torch.cuda.empty_cache()
    return rows


def compare(nproc: int, ops: list[str], sizes: list[int], repeats: int = 3, iters: int = 20,
            warmup: int = 5) -> list[dict]:
    """Run the comparison on `nproc` NCCL ranks; rank 0's rows (every rank has the same)."""
    return launch.run(_on_ranks, ops, sizes, repeats, iters, warmup, nproc=nproc, backend="nccl", timeout=900)[0]


def _size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1].upper()] if text[-1].upper() in units else int(text)


def main() -> int:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nproc", type=int, default=torch.cuda.device_count())
    parser.add_argument("--ops", default="all_reduce,all_gather,reduce_scatter,broadcast,all_to_all")
    parser.add_argument("--sizes", default="1M,16M,256M,1G", help="comma-separated, with K/M/G suffixes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--expect-allreduce-gbps", type=float, default=None,
                        help="all_reduce busbw expected at 1 GiB (e.g. 330 on 2xH200); goal: within 10%%")
    args = parser.parse_args()
    if args.nproc < 2 or torch.cuda.device_count() < args.nproc:
        print(f"needs 2 GPUs or more (nproc={args.nproc}, GPUs here: {torch.cuda.device_count()})", file=sys.stderr)
        return 2
    ops, sizes = args.ops.split(","), [_size(s) for s in args.sizes.split(",")]
    limits = bench.link_limits(world_size=args.nproc)
    print(f"{args.nproc} ranks, NCCL, {torch.cuda.get_device_name(0)}; link limit: {limits or 'unknown'}")
    t0 = time.perf_counter()
    rows = compare(args.nproc, ops, sizes, args.repeats, args.iters, args.warmup)
    ok = True
    print(f"{'op':>15} {'size':>9} {'bench busbw':>12} {'raw busbw':>10} {'ratio':>7}  within 5%")
    for row in rows:
        good = abs(row["ratio"] - 1) <= 0.05
        ok &= good
        print(f"{row['op']:>15} {bench.human_bytes(row['size']):>9} {row['bench_busbw']:12.1f} "
              f"{row['raw_busbw']:10.1f} {row['ratio']:7.3f}  {'yes' if good else 'NO'}")
    if args.expect_allreduce_gbps:
        big = [r for r in rows if r["op"] == "all_reduce" and r["size"] == 1 << 30]
        if not big:
            print("all_reduce at 1 GiB was not measured (add 1G to --sizes and all_reduce to --ops)")
            ok = False
        else:
            got, want = big[0]["bench_busbw"], args.expect_allreduce_gbps
            good = abs(got / want - 1) <= 0.10
            ok &= good
            print(f"all_reduce 1 GiB: {got:.1f} GB/s busbw, expected about {want:g} (ratio {got / want:.3f}): "
                  f"{'within 10%' if good else 'NOT within 10%'}")
    print(f"{time.perf_counter() - t0:.0f} s; {'all goals met' if ok else 'a goal was missed'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
