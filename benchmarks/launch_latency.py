"""How fast course_utils.launch starts ranks, measured against the torchrun CLI on this machine.

    python benchmarks/launch_latency.py                    # gloo on the CPU
    python benchmarks/launch_latency.py --backend nccl     # on a GPU box (one GPU per rank)

1. Cold launch: a trivial job (init the process group, all_reduce a small tensor, return) on 2 fresh ranks,
   from Python with torch already imported (as in a notebook), against `torchrun --standalone` running the
   same job as a script. The two alternate, so both see the same machine load. Target: ratio <= 0.6.
   With gloo, also the same launch with every rank a fresh interpreter (as GPU ranks start) against
   the default, where one fork server imports torch once and forks the ranks: wall time and the CPU seconds
   the ranks used, at 2 and at 4 ranks.
2. Warm Pool round trip: Pool(4).run(fn) where fn all_reduces a small tensor and returns it. Target: median
   under 50 ms on the 2-core CPU machine.
3. Result throughput: each of 2 ranks of a warm Pool returns a 256 MiB float32 tensor it already holds (on its
   GPU with NCCL), so the time is pickling, the pipes and unpickling in the notebook's process. Compared with
   pickling and unpickling the same 2 x 256 MiB here with plain pickle (torch's own tensor pickling), best of
   3 each. Goal: under 3x.
Every figure printed comes from this run.
"""

from __future__ import annotations

import argparse
import os
import pickle
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from course_utils import launch  # noqa: E402

SCRIPT = """\
import os
import torch
import torch.distributed as dist

backend = {backend!r}
if backend == "nccl":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group(backend)
t = torch.ones(4, device="cuda" if backend == "nccl" else "cpu")
dist.all_reduce(t)
dist.destroy_process_group()
"""


def trivial_job():
    """The same job as SCRIPT, as a function for launch.run (the process group is already initialised)."""
    import torch
    import torch.distributed as dist

    t = torch.ones(4, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    return t


def small_all_reduce(rank_scale: float = 1.0):
    import torch
    import torch.distributed as dist

    t = torch.full((16,), float(dist.get_rank()) * rank_scale, device="cuda" if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t)
    return t


def time_once(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", choices=["gloo", "nccl"], default="gloo")
    parser.add_argument("--repeats", type=int, default=3, help="cold launches of each kind (default 3)")
    parser.add_argument("--calls", type=int, default=50, help="timed warm Pool calls (default 50)")
    parser.add_argument("--cold-nproc", type=int, default=2)
    parser.add_argument("--pool-nproc", type=int, default=4)
    parser.add_argument("--result-mib", type=int, default=256, help="MiB each rank returns (default 256)")
    parser.add_argument("--result-repeats", type=int, default=3)
    args = parser.parse_args()
    pool_nproc = args.pool_nproc
    if args.backend == "nccl":
        gpus = torch.cuda.device_count()
        if gpus < args.cold_nproc:
            sys.exit(f"--backend nccl needs {args.cold_nproc} GPUs; this machine has {gpus}")
        pool_nproc = min(pool_nproc, gpus)

    gpu_names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())}) \
        if args.backend == "nccl" else []
    print(f"machine: {os.cpu_count()} CPU cores, {platform.python_implementation()} {platform.python_version()}, "
          f"torch {torch.__version__}, backend {args.backend}" + (f", GPUs {gpu_names}" if gpu_names else ""))

    with tempfile.TemporaryDirectory(prefix="launch-bench-") as tmp:
        script = os.path.join(tmp, "job.py")
        with open(script, "w") as f:
            f.write(SCRIPT.format(backend=args.backend))
        torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    f"--nproc-per-node={args.cold_nproc}", script]
        ours, theirs = [], []
        for _ in range(args.repeats):  # alternate, so a busy moment hurts both alike
            ours.append(time_once(lambda: launch.run(trivial_job, nproc=args.cold_nproc, backend=args.backend)))
            # TMPDIR: torchrun leaves a torchelastic_* log directory behind; keep it inside ours
            theirs.append(time_once(lambda: subprocess.run(torchrun, check=True, stdout=subprocess.DEVNULL,
                                                           stderr=subprocess.DEVNULL,
                                                           env=dict(os.environ, TMPDIR=tmp))))
    ours_s, theirs_s = statistics.median(ours), statistics.median(theirs)
    print(f"\ncold launch, {args.cold_nproc} ranks, trivial all_reduce job ({args.repeats} each, alternating):")
    print(f"  course_utils.launch.run   median {ours_s:6.2f} s   runs {', '.join(f'{t:.2f}' for t in ours)}")
    print(f"  torchrun CLI              median {theirs_s:6.2f} s   runs {', '.join(f'{t:.2f}' for t in theirs)}")
    ratio = ours_s / theirs_s
    print(f"  ratio run/torchrun = {ratio:.2f}   (target <= 0.6: {'met' if ratio <= 0.6 else 'NOT met'})")

    if args.backend == "gloo":
        for nproc in (args.cold_nproc, 4):
            fork_server_vs_fresh(nproc, args.repeats)

    start = time.perf_counter()
    with launch.Pool(pool_nproc, backend=args.backend) as pool:
        started = time.perf_counter() - start
        for _ in range(5):  # warm-up: first calls pay for lazy set-up in gloo/NCCL
            pool.run(small_all_reduce)
        calls = [time_once(lambda: pool.run(small_all_reduce, 2.0)) for _ in range(args.calls)]
        expected = torch.full((16,), 2.0 * sum(range(pool_nproc)))
        assert all(torch.equal(v, expected) for v in pool.run(small_all_reduce, 2.0).values())
    ms = sorted(c * 1000 for c in calls)
    median = statistics.median(ms)
    print(f"\nwarm Pool round trip, {pool_nproc} ranks, all_reduce of 16 floats ({args.calls} calls; pool start "
          f"{started:.2f} s):")
    print(f"  median {median:.1f} ms   p10 {ms[len(ms) // 10]:.1f} ms   p90 {ms[(9 * len(ms)) // 10]:.1f} ms   "
          f"max {ms[-1]:.1f} ms   (target median < 50 ms: {'met' if median < 50 else 'NOT met'})")

    result_throughput(args.backend, args.result_mib, args.result_repeats)


def fork_server_vs_fresh(nproc: int, repeats: int) -> None:
    """launch.run of the trivial job: ranks forked by one fork server (the default for CPU ranks) against
    every rank a fresh interpreter; alternating; wall time and the CPU time of the processes it started."""
    from course_utils.launch import group

    times: dict[str, list[tuple[float, float]]] = {"1": [], "0": []}
    forked = group.use_fork_server
    try:
        for _ in range(repeats):
            for mode, runs in times.items():
                group.use_fork_server = forked if mode == "1" else (lambda gpus: False)  # fresh: as GPU ranks start
                cpu = resource.getrusage(resource.RUSAGE_CHILDREN)  # reaped descendants, forked ranks included
                wall = time_once(lambda: launch.run(trivial_job, nproc=nproc, backend="gloo"))
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                runs.append((wall, after.ru_utime + after.ru_stime - cpu.ru_utime - cpu.ru_stime))
    finally:
        group.use_fork_server = forked
    print(f"\ncold launch, {nproc} gloo ranks: forked by one fork server vs each a fresh interpreter "
          f"({repeats} each, alternating):")
    medians = {}
    for mode, name in (("1", "fork server"), ("0", "fresh interpreters")):
        wall, cpu = (statistics.median(x) for x in zip(*times[mode], strict=True))
        medians[mode] = wall, cpu
        print(f"  {name:<22} median {wall:6.2f} s wall, {cpu:6.2f} s CPU   runs "
              f"{', '.join(f'{w:.2f}' for w, _ in times[mode])}")
    print(f"  ratio fork server / fresh: wall {medians['1'][0] / medians['0'][0]:.2f}, "
          f"CPU {medians['1'][1] / medians['0'][1]:.2f}")


def result_throughput(backend: str, mib: int, repeats: int) -> None:
    """Line 3: 2 ranks x `mib` MiB back to the notebook, against pickle + unpickle of the same data here."""
    total_mb = 2 * mib * 2**20 / 1e6
    with launch.Pool(2, backend=backend) as pool:
        device = "f'cuda:{torch.cuda.current_device()}'" if backend == "nccl" else "'cpu'"
        pool.exec(f"big = torch.full(({mib} << 18,), float(dist.get_rank() + 1), device={device})")
        sent = []
        for _ in range(repeats):
            start = time.perf_counter()
            results = pool.exec("big")
            sent.append(time.perf_counter() - start)
            assert [r.numel() * 4 for r in results.values()] == [mib << 20] * 2 and results[1][-1].item() == 2.0
            del results
    local_tensors = [torch.full((mib << 18,), float(r + 1)) for r in range(2)]
    local = []
    for _ in range(repeats):
        start = time.perf_counter()
        for t in local_tensors:
            pickle.loads(pickle.dumps(t, protocol=pickle.HIGHEST_PROTOCOL))
        local.append(time.perf_counter() - start)
    ours, theirs = min(sent), min(local)
    ratio = ours / theirs
    print(f"\nresult throughput, 2 ranks x {mib} MiB float32 ({backend}; best of {repeats}):")
    print(f"  back from the ranks       {ours:6.2f} s   {total_mb / ours:7.0f} MB/s   runs "
          f"{', '.join(f'{t:.2f}' for t in sent)}")
    print(f"  pickle+unpickle here      {theirs:6.2f} s   {total_mb / theirs:7.0f} MB/s   runs "
          f"{', '.join(f'{t:.2f}' for t in local)}")
    print(f"  ratio ranks/local = {ratio:.2f}   (goal < 3: {'met' if ratio < 3 else 'NOT met'})")


if __name__ == "__main__":
    main()
