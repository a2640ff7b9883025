"""The course's ring all-reduce (the master solution of notebooks/07_ring_allreduce.ipynb) against NCCL's all_reduce.

    python benchmarks/ring_vs_nccl.py                     # every GPU of this machine, NCCL
    python benchmarks/ring_vs_nccl.py --nproc 2 --goals   # 2 GPUs; exit status 1 if a goal is missed
    python benchmarks/ring_vs_nccl.py --nproc 2 --tune    # the ring's piece size tried at 256 MiB and 1 GiB first
    python benchmarks/ring_vs_nccl.py --backend gloo --nproc 4 --max-bytes 16777216   # the same on CPU ranks

The ring is read out of the master notebook (its set-up cells and the ex07_ring_all_reduce solution cell), so
this measures exactly what the lesson teaches; PIECE_BYTES (the notebook's parameter) can be overridden.
For each size (float32, 1 KiB to 1 GiB by factors of 4): the library's all_reduce and the ring, timed the same
way as the notebook times them (warm-up calls, a barrier, calls back to back, the device synchronised; the best of
3 rounds; averaged over the ranks), their busbw (algbw x 2(n-1)/n, as nccl-tests) and the ratio ring / library;
the ring's result is checked against exact sums at every size. Then the alpha-beta fit of each one's times
(bench.fit_alpha_beta), which explains the gap at small sizes: the ring pays 2(n-1) steps of Python calls and
messages (2(n-1) x pieces batch_isend_irecv calls), NCCL one kernel.
Goals (the course's, on 2xH200): busbw ratio >= 0.90 at 256 MiB and >= 0.95 at 1 GiB.
Every figure printed comes from this run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from course_utils import bench, launch  # noqa: E402

MASTER = ROOT / "notebooks" / "07_ring_allreduce.ipynb"
EXERCISE = "ex07_ring_all_reduce"
GOALS = {1 << 28: 0.90, 1 << 30: 0.95}  # size -> least busbw ratio ring / library


def master_ring(path: Path = MASTER, piece_bytes: int | None = None):
    """ring_all_reduce as the master notebook defines it: its set-up cells before the solution, then the solution
    cell, executed in a fresh namespace (so the function travels to the ranks by value)."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    cells = [c for c in nb.cells if c.cell_type == "code"]
    grade = [c.metadata.get("nbgrader", {}).get("grade_id") for c in cells]
    if f"{EXERCISE}_solution" not in grade:
        raise SystemExit(f"{path}: no cell with grade_id {EXERCISE}_solution")
    sol = grade.index(f"{EXERCISE}_solution")
    ns: dict = {"__name__": "ring_master"}
    for c in cells[:sol]:
        if "setup" in c.metadata.get("tags", []):
            exec(compile(c.source, f"<{path.name} set-up cell>", "exec"), ns)
    exec(compile(cells[sol].source, f"<{path.name} {EXERCISE} solution>", "exec"), ns)
    if piece_bytes is not None:
        ns["PIECE_BYTES"] = piece_bytes
    return ns["ring_all_reduce"], ns["PIECE_BYTES"]


def bench_rank(ring, sizes: list[int], rounds: int = 3, warmup: int = 3, check: bool = True) -> list[dict]:
    """On every rank: per size, NCCL's (or gloo's) all_reduce and the ring, timed alike; the ring's sum checked."""
    import torch
    import torch.distributed as dist

    n, rank = dist.get_world_size(), dist.get_rank()
    nccl = dist.get_backend() == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")

    def sync():
        if nccl:
            torch.cuda.synchronize()

    def timed(fn, t, iters):
        for _ in range(warmup):
            fn(t)
        best = math.inf
        for _ in range(rounds):
            sync()
            dist.barrier()
            t0 = time.perf_counter()
            for _ in range(iters):
                fn(t)
            sync()
            best = min(best, (time.perf_counter() - t0) / iters)
        mean = torch.tensor([best], dtype=torch.float64, device=device)
        dist.all_reduce(mean)
        return mean.item() / n

    rows = []
    for size in sizes:
        numel = size // 4
        ok = None
        if check:  # small integers: exact sums in float32
            pattern = torch.arange(numel, device=device) % 7
            t = pattern.float() + rank
            ring(t)
            ok = bool(torch.equal(t, pattern.float() * n + n * (n - 1) / 2))
            del t, pattern
        t = torch.zeros(numel, device=device)  # zeros: repeated sums stay finite
        iters = 20 if nccl or size <= (1 << 20) else 5
        library = timed(lambda x: dist.all_reduce(x), t, iters)
        mine = timed(ring, t, iters)
        rows.append({"size": size, "library_s": library, "ring_s": mine, "correct": ok, "iters": iters})
        del t
        if nccl:
            torch.cuda.empty_cache()
    return rows


def busbw(size: int, seconds: float, n: int) -> float:
    return size / seconds / 1e9 * bench.bus_factor("all_reduce", n)


def report(rows: list[dict], n: int, backend: str, piece_bytes: int) -> dict:
    print(f"all_reduce, float32, {n} ranks, {backend}; the ring from {MASTER.name} (PIECE_BYTES = "
          f"{bench.human_bytes(piece_bytes)})")
    print(f"{'size':>10} {'pieces':>7} {'library us':>11} {'busbw':>8} {'ring us':>10} {'busbw':>8} {'ring/nccl':>10} "
          f"{'sum ok':>7}")
    for r in rows:
        chunk_bytes = -(-r["size"] // 4 // n) * 4
        pieces = max(1, -(-chunk_bytes // piece_bytes))
        r["ratio"] = r["library_s"] / r["ring_s"]
        print(f"{bench.human_bytes(r['size']):>10} {pieces:>7} {r['library_s'] * 1e6:>11.1f} "
              f"{busbw(r['size'], r['library_s'], n):>8.3g} {r['ring_s'] * 1e6:>10.1f} "
              f"{busbw(r['size'], r['ring_s'], n):>8.3g} {r['ratio']:>10.3f} {str(r['correct']):>7}")
    print("(busbw in GB/s; ring/nccl is the ratio of busbw, i.e. library time / ring time; "
          "'nccl' stands for the library's backend)")
    fits = {}
    for name, key in (("library", "library_s"), ("ring", "ring_s")):
        results = [bench.BenchResult(op=name, size_bytes=r["size"], time_ms=r[key] * 1e3,
                                     algbw_gbps=r["size"] / r[key] / 1e9) for r in rows]
        fits[name] = bench.fit_alpha_beta(results, mode=None)
    steps = 2 * (n - 1)
    print("\nalpha-beta fit of each one's times (t = alpha + S / beta):")
    for name, f in fits.items():
        print(f"  {name:>7}: alpha {f.alpha_us:8.1f} us, beta {f.beta_gbps:8.2f} GB/s algbw "
              f"({f.beta_gbps * bench.bus_factor('all_reduce', n):.2f} busbw)")
    per_step = fits["ring"].alpha_us / steps
    print(f"  the ring's alpha is {fits['ring'].alpha_us / max(fits['library'].alpha_us, 1e-3):.1f}x the library's: "
          f"{steps} steps of about {per_step:.1f} us each (Python calls, a batch_isend_irecv and its kernel or "
          "message per step), where the library runs all its steps in one call")
    print("  the fits' ratio alpha-beta(library) / alpha-beta(ring) next to the measured one:")
    for r in rows:
        model = fits["library"].time_us(r["size"]) / fits["ring"].time_us(r["size"])
        print(f"  {bench.human_bytes(r['size']):>10}: measured {r['ratio']:.3f}, fits {model:.3f}")
    return {"n": n, "backend": backend, "piece_bytes": piece_bytes, "rows": rows,
            "fits": {k: f.to_dict() for k, f in fits.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=None, help="ranks (default: every GPU; 4 with gloo)")
    p.add_argument("--backend", choices=("nccl", "gloo"), default="nccl")
    p.add_argument("--min-bytes", type=int, default=1 << 10)
    p.add_argument("--max-bytes", type=int, default=1 << 30)
    p.add_argument("--piece-mib", type=float, default=None, help="override the notebook's PIECE_BYTES (MiB)")
    p.add_argument("--tune", action="store_true", help="first try piece sizes at 256 MiB and 1 GiB")
    p.add_argument("--goals", action="store_true", help="exit 1 unless ratio >= 0.90 at 256 MiB, >= 0.95 at 1 GiB")
    p.add_argument("--json", type=Path, default=None, help="write the rows and fits here")
    p.add_argument("--timeout", type=float, default=900.0)
    args = p.parse_args(argv)

    import torch

    nproc = args.nproc or (torch.cuda.device_count() if args.backend == "nccl" else 4)
    if args.backend == "nccl" and (nproc < 2 or torch.cuda.device_count() < nproc):
        print(f"needs {max(nproc, 2)} GPUs for NCCL, this machine has {torch.cuda.device_count()}", file=sys.stderr)
        return 2
    piece = None if args.piece_mib is None else int(args.piece_mib * (1 << 20))
    sizes = bench.size_range(args.min_bytes, args.max_bytes, factor=4)
    with launch.Pool(nproc, backend=args.backend, timeout=300) as pool:
        if args.tune:
            tune_sizes = [s for s in (1 << 28, 1 << 30) if s <= args.max_bytes] or [sizes[-1]]
            print(f"piece size tuning at {', '.join(bench.human_bytes(s) for s in tune_sizes)} (ring/library busbw):")
            for mib in (4, 8, 16, 32, 64, 128, 1024):
                ring, _ = master_ring(piece_bytes=mib << 20)
                rows = pool.run(bench_rank, ring, tune_sizes, check=False, timeout=args.timeout)[0]
                print(f"  pieces of {mib:>5} MiB: " + ", ".join(
                    f"{bench.human_bytes(r['size'])} {r['library_s'] / r['ring_s']:.3f}" for r in rows))
            print()
        ring, piece_bytes = master_ring(piece_bytes=piece)
        t0 = time.perf_counter()
        rows = pool.run(bench_rank, ring, sizes, timeout=args.timeout)[0]
        elapsed = time.perf_counter() - t0
    out = report(rows, nproc, args.backend, piece_bytes)
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    nccl = "-"
    if args.backend == "nccl":
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    print(f"\n{gpu}, torch {torch.__version__}, NCCL {nccl}; sweep took {elapsed:.1f} s")
    if args.json:
        args.json.write_text(json.dumps({**out, "gpu": gpu, "torch": torch.__version__}, indent=1))
    failed = [r for r in rows if r["correct"] is False]
    if failed:
        print(f"WRONG SUMS at {[bench.human_bytes(r['size']) for r in failed]}")
        return 1
    if args.goals:
        missed = []
        for size, goal in GOALS.items():
            row = next((r for r in rows if r["size"] == size), None)
            if row is None:
                missed.append(f"{bench.human_bytes(size)} not measured")
            elif row["ratio"] < goal:
                missed.append(f"{bench.human_bytes(size)}: {row['ratio']:.3f} < {goal}")
        print("goals: " + ("met (" + ", ".join(f"{bench.human_bytes(s)} >= {g}" for s, g in GOALS.items()) + ")"
                           if not missed else "MISSED: " + "; ".join(missed)))
        return 1 if missed else 0
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
