"""Measure data movement the way nccl-tests reports it: size, time per call, algorithm and bus bandwidth.

Copies (lesson 04), in one process:
    r = measure("h2d pinned", nbytes, lambda: dev.copy_(host, non_blocking=True))
    r.algbw_gbps                    # bytes moved / time, in GB/s (1 GB = 1e9 bytes, as nccl-tests)

Collectives (lesson 06), called on every rank (e.g. `pool.run(bench.sweep, ["all_reduce"], sizes)`):
    results = sweep(["all_reduce", "all_gather"], size_range(1 << 10, 1 << 30), modes=("back_to_back", "blocking"))
    print(format_nccl_table(results))                 # nccl-tests' columns
    plot_bandwidth(results, limits=link_limits(world_size=2), y="busbw")
    fit = fit_alpha_beta(results, op="all_reduce")    # AlphaBeta(alpha_us, beta_gbps): t = alpha + S / beta

Definitions (nccl-tests, doc/PERFORMANCE.md and src/*.cu): S is the size of the whole buffer (for all_gather,
reduce_scatter, all_to_all, gather and scatter: n shards, the bigger of a rank's input and output); algbw = S / t;
busbw = algbw x a factor per collective, so that busbw can be held against one link's speed whatever the number of
ranks. Timing as nccl-tests does: warm-up calls first, `iters` calls launched back to back and timed as one (or,
in "blocking" mode, each waited for before the next), the time per call averaged over ranks.
Measuring and drawing are separate functions.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from typing import Any

import torch

COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "all_to_all", "gather",
               "scatter")
MODES = ("back_to_back", "blocking")
REDUCING = ("all_reduce", "reduce", "reduce_scatter")
ROOTED = ("broadcast", "reduce", "gather", "scatter")
SHARDED = ("all_gather", "reduce_scatter", "all_to_all", "gather", "scatter")  # S is n shards


@dataclass
class BenchResult:
    """One measured operation at one size. Copies: time_ms is the median over `iters` timed calls.
    Collectives: time_ms is the mean per call over `iters` calls, averaged over the ranks; size_bytes is S as
    nccl-tests defines it; input_bytes/output_bytes are the tensors one rank passed in and got out (on the root
    for gather's output and scatter's input); count is nccl-tests' count column (elements per rank's call)."""

    op: str
    size_bytes: int
    time_ms: float
    algbw_gbps: float
    busbw_gbps: float | None = None
    iters: int = 1
    mode: str | None = None
    world_size: int | None = None
    backend: str | None = None
    dtype: str | None = None
    count: int | None = None
    input_bytes: int | None = None
    output_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> BenchResult:
        return cls(**d)


# ------------------------------------------------------------------------------------------------ copies


def time_calls(fn: Callable[[], Any], cuda: bool | None = None, warmup: int = 2, min_iters: int = 3,
               max_iters: int = 200, budget_ms: float = 50.0) -> list[float]:
    """Call `fn` repeatedly and return each call's time in ms.

    On CUDA each call is bracketed by two events on the current stream (device time, the way the GPU
    saw it); otherwise by the host clock. Stops after `budget_ms` of measured time or `max_iters` calls.
    """
    cuda = torch.cuda.is_available() if cuda is None else cuda
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times: list[float] = []
    while len(times) < max_iters:
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        if len(times) >= min_iters and sum(times) >= budget_ms:
            break
    return times


def measure(op: str, size_bytes: int, fn: Callable[[], Any], cuda: bool | None = None, **kwargs: Any) -> BenchResult:
    """Time `fn`, which moves `size_bytes`, and report the median time and algbw (GB/s)."""
    times = time_calls(fn, cuda=cuda, **kwargs)
    t = statistics.median(times)
    return BenchResult(op=op, size_bytes=int(size_bytes), time_ms=t, algbw_gbps=size_bytes / (t * 1e6),
                       iters=len(times))


# ------------------------------------------------------------------------------------------------ collectives


def bus_factor(op: str, world_size: int) -> float:
    """busbw / algbw for `op` on `world_size` ranks, as nccl-tests computes it (src/<op>.cu, *GetBw)."""
    n = int(world_size)
    if n < 1:
        raise ValueError(f"world_size must be at least 1, got {world_size!r}")
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in SHARDED:
        return (n - 1) / n
    if op in ("broadcast", "reduce", "sendrecv"):
        return 1.0
    raise ValueError(f"unknown collective {op!r}; known: {', '.join(COLLECTIVES)}")


def size_range(min_bytes: int, max_bytes: int, factor: int = 2) -> list[int]:
    """min_bytes, min_bytes*factor, ... up to max_bytes (nccl-tests' -b, -e, -f)."""
    if min_bytes < 1 or max_bytes < min_bytes or factor < 2:
        raise ValueError(f"need 1 <= min_bytes <= max_bytes and factor >= 2, got {min_bytes}, {max_bytes}, {factor}")
    sizes, s = [], int(min_bytes)
    while s <= max_bytes:
        sizes.append(s)
        s *= factor
    return sizes


def collective_counts(op: str, size_bytes: int, world_size: int, element_size: int = 4) -> tuple[int, int, int]:
    """(input elements, output elements, S in bytes) of one rank's call for a requested size, as nccl-tests
    sizes its buffers: sharded collectives get n equal shards of a 16-byte multiple (at least one element)."""
    bus_factor(op, world_size)  # checks the name
    n, count = world_size, max(1, size_bytes // element_size)
    if op not in SHARDED:
        return count, count, count * element_size
    align = max(1, 16 // element_size)
    shard = max(1, (count // n) // align * align)
    whole = shard * n
    ins, outs = {"all_gather": (shard, whole), "gather": (shard, whole), "reduce_scatter": (whole, shard),
                 "scatter": (whole, shard), "all_to_all": (whole, whole)}[op]
    return ins, outs, whole * element_size


def _single(name: str) -> Callable:
    """torch 2.13 renamed all_gather_into_tensor / reduce_scatter_tensor to *_single; take whichever exists."""
    import torch.distributed as dist

    new = {"all_gather": "all_gather_single", "reduce_scatter": "reduce_scatter_single"}[name]
    old = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}[name]
    return getattr(dist, new, None) or getattr(dist, old)


def collective_call(op: str, size_bytes: int, group: Any = None, dtype: torch.dtype = torch.float32):
    """Buffers for `op` at `size_bytes` on this rank's device, and `call(async_op)` that runs it once.

    Returns (call, input tensor, output tensor, S bytes). Root is group rank 0. Buffers hold zeros, so repeated
    reductions stay finite. Call on every rank of `group`."""
    import torch.distributed as dist

    n, rank = dist.get_world_size(group), dist.get_rank(group)
    cuda = dist.get_backend(group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    elt = torch.empty((), dtype=dtype).element_size()
    n_in, n_out, size = collective_counts(op, size_bytes, n, elt)
    root = 0 if group is None else dist.get_global_rank(group, 0)
    is_root = rank == 0
    # gather's output list and scatter's input list exist on the root only
    inp = torch.zeros(0 if (op == "scatter" and not is_root) else n_in, dtype=dtype, device=device)
    if op in ("all_reduce", "broadcast", "reduce"):
        out = inp  # in place
    else:
        out = torch.zeros(0 if (op == "gather" and not is_root) else n_out, dtype=dtype, device=device)
    calls = {
        "all_reduce": lambda a: dist.all_reduce(inp, group=group, async_op=a),
        "broadcast": lambda a: dist.broadcast(inp, src=root, group=group, async_op=a),
        "reduce": lambda a: dist.reduce(inp, dst=root, group=group, async_op=a),
        "all_gather": lambda a: _single("all_gather")(out, inp, group=group, async_op=a),
        "reduce_scatter": lambda a: _single("reduce_scatter")(out, inp, group=group, async_op=a),
        "all_to_all": lambda a: dist.all_to_all_single(out, inp, group=group, async_op=a),
        "gather": lambda a: dist.gather(inp, list(out.chunk(n)) if is_root else None, dst=root, group=group,
                                        async_op=a),
        "scatter": lambda a: dist.scatter(out, list(inp.chunk(n)) if is_root else None, src=root, group=group,
                                          async_op=a),
    }
    return calls[op], inp, out, size


def measure_collective(op: str, size_bytes: int, mode: str = "back_to_back", warmup: int = 5, iters: int = 20,
                       group: Any = None, dtype: torch.dtype = torch.float32) -> BenchResult:
    """Time `op` at `size_bytes` on every rank of `group`, as nccl-tests does; the same result on every rank.

    warm-up calls (each waited for), a barrier, then `iters` calls timed by the host clock until all are done:
    launched back to back and waited for at the end ("back_to_back", nccl-tests' default), or each waited for
    before the next ("blocking", like nccl-tests -z 1 but with no barrier between calls). On NCCL, Work.wait()
    only makes the current stream wait, so the host also synchronizes the device before reading the clock. The
    time per call is averaged over ranks."""
    import torch.distributed as dist

    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if warmup < 1 or iters < 1:
        raise ValueError("need warmup >= 1 (the first call sets things up) and iters >= 1")
    call, inp, out, size = collective_call(op, size_bytes, group, dtype)
    cuda = inp.is_cuda

    def finish(works: list) -> None:
        for w in works:
            if w is not None:  # a rank outside a rooted call's work may get None
                w.wait()
        if cuda:
            torch.cuda.synchronize()

    for _ in range(warmup):
        finish([call(True)])
    dist.barrier(group=group)  # every rank starts its clock together
    t0 = time.perf_counter()
    if mode == "back_to_back":
        finish([call(True) for _ in range(iters)])
    else:
        for _ in range(iters):
            finish([call(True)])
    seconds = (time.perf_counter() - t0) / iters
    avg = torch.tensor([seconds], dtype=torch.float64, device=inp.device)
    dist.all_reduce(avg, group=group)
    n = dist.get_world_size(group)
    seconds = avg.item() / n
    algbw = size / seconds / 1e9
    elt = inp.element_size()
    return BenchResult(op=op, size_bytes=size, time_ms=seconds * 1e3, algbw_gbps=algbw,
                       busbw_gbps=algbw * bus_factor(op, n), iters=iters, mode=mode, world_size=n,
                       backend=dist.get_backend(group), dtype=str(dtype).removeprefix("torch."),
                       count=size // elt // (n if op in SHARDED else 1), input_bytes=_tensor_bytes(op, "in", inp, size),
                       output_bytes=_tensor_bytes(op, "out", out, size))


def _tensor_bytes(op: str, side: str, t: torch.Tensor, size: int) -> int:
    """Bytes of a rank's input or output tensor; gather's output list and scatter's input list as the root has
    them (every rank reports the same numbers)."""
    if (op, side) in (("gather", "out"), ("scatter", "in")):
        return size
    return t.numel() * t.element_size()


def sweep(ops: Iterable[str], sizes: Iterable[int], modes: Iterable[str] = ("back_to_back",), warmup: int = 5,
          iters: int = 20, group: Any = None, dtype: torch.dtype = torch.float32) -> list[BenchResult]:
    """measure_collective for every op, size and mode; call on every rank (e.g. `pool.run(bench.sweep, ...)`)."""
    results = []
    for op in ops:
        for size in sizes:
            for mode in modes:
                results.append(measure_collective(op, size, mode, warmup, iters, group, dtype))
            if torch.cuda.is_available():
                torch.cuda.empty_cache()  # the next size's buffers, not this one's, should fill the GPU's memory
    return results


# ------------------------------------------------------------------------------------------------ alpha-beta


@dataclass
class AlphaBeta:
    """t = alpha + S / beta, fitted to a sweep: alpha_us the fixed cost of a call (latency), beta_gbps the
    algorithm bandwidth it tends to for large S. bus_gbps = beta x busbw factor, comparable with a link's speed."""

    alpha_us: float
    beta_gbps: float
    op: str
    world_size: int
    mode: str | None = None
    bus_gbps: float | None = None
    min_bytes: int = 0
    max_bytes: int = 0
    points: int = 0

    def time_us(self, size_bytes: float) -> float:
        """The fitted time of one call moving `size_bytes` (S), in µs."""
        return self.alpha_us + size_bytes / (self.beta_gbps * 1e3)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> AlphaBeta:
        return cls(**d)


def fit_alpha_beta(results: Iterable[BenchResult | dict], op: str | None = None,
                   mode: str | None = "back_to_back") -> AlphaBeta:
    """Least-squares fit of t = alpha + S / beta to one op's results, on relative error (every size counts alike,
    so small sizes set alpha and large ones beta). alpha is kept >= 0. `mode` None: results of any mode."""
    rs = [r if isinstance(r, BenchResult) else BenchResult.from_dict(r) for r in results]
    ops = sorted({r.op for r in rs})
    if op is None:
        if len(ops) != 1:
            raise ValueError(f"the results hold several ops {ops}: say which one to fit with op=")
        op = ops[0]
    rs = [r for r in rs if r.op == op and (mode is None or r.mode in (mode, None))]
    sizes = sorted({r.size_bytes for r in rs})
    if len(sizes) < 2:
        raise ValueError(f"fitting {op!r} (mode {mode!r}) needs results at two sizes or more, got {sizes}")
    s = [float(r.size_bytes) for r in rs]
    t = [r.time_ms * 1e3 for r in rs]  # µs
    # Minimise sum(((a + x s - t) / t)^2) over a and x = 1/beta: normal equations of a 2x2 system.
    w = [1.0 / ti**2 for ti in t]
    saa, sax = sum(w), sum(wi * si for wi, si in zip(w, s, strict=True))
    sxx = sum(wi * si * si for wi, si in zip(w, s, strict=True))
    sat = sum(wi * ti for wi, ti in zip(w, t, strict=True))
    sxt = sum(wi * si * ti for wi, si, ti in zip(w, s, t, strict=True))
    det = saa * sxx - sax * sax
    a, x = (sat * sxx - sax * sxt) / det, (saa * sxt - sax * sat) / det
    if a < 0:  # noise at small sizes: a line through the origin instead
        a, x = 0.0, sxt / sxx
    if not x > 0 or x * max(s) < 1e-3 * min(t):  # the bandwidth term is lost in the fixed cost even at the top
        raise ValueError(f"{op!r}: the times do not grow with size, so no bandwidth can be fitted (sizes {sizes})")
    n = rs[0].world_size or 0
    beta = 1.0 / x / 1e3  # bytes per µs -> GB/s
    known = op in COLLECTIVES or op == "sendrecv"  # other names (a hand-written ring, ...) get no bus_gbps
    return AlphaBeta(alpha_us=a, beta_gbps=beta, op=op, world_size=n, mode=mode,
                     bus_gbps=beta * bus_factor(op, n) if n and known else None, min_bytes=sizes[0],
                     max_bytes=sizes[-1], points=len(rs))


# ------------------------------------------------------------------------------------------------ link limits

# One direction of one NVLink, GB/s, by compute capability (NVLink 1: P100; 2: V100; 3: A100; 4: H100/H200; 5: B200).
NVLINK_LINK_GBPS = {"6.0": 20.0, "7.0": 25.0, "8.0": 25.0, "9.0": 25.0, "10.0": 50.0}


def link_limits(machine: Any = None, world_size: int = 2) -> dict[str, float]:
    """{label: GB/s} the bus bandwidth of `world_size` ranks on GPUs 0..world_size-1 cannot beat with ring or
    tree algorithms: the NVLink bandwidth between the pair of them with the fewest links (one direction), else
    their PCIe links. NCCL's NVLink SHARP all_reduce (NVLS, on NVSwitch machines unless NCCL_NVLS_ENABLE=0)
    reduces inside the switch, so its busbw can go past this line. {} without enough GPUs, or for an NVLink
    generation this table does not know."""
    if machine is None:
        from .hardware import probe

        machine = probe()
    gpus = machine.gpus[:world_size]
    if world_size < 2 or len(gpus) < world_size:
        return {}
    topo = machine.topology
    pairs = [(i, j) for i in range(world_size) for j in range(world_size) if i < j]
    links = min((topo.nvlinks(i, j) for i, j in pairs), default=0) if topo and topo.links else 0
    if links:
        per = NVLINK_LINK_GBPS.get(gpus[0].compute_capability or "")
        return {f"NVLink x{links}, one direction": links * per} if per else {}
    pcie = [g.pcie_gbps for g in gpus]
    if all(pcie):
        g = min(gpus, key=lambda g: g.pcie_gbps)
        return {f"PCIe gen{g.pcie_gen} x{g.pcie_width}, one direction": g.pcie_gbps}
    return {}


# ------------------------------------------------------------------------------------------------ tables, plots


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if n == int(n) else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"


def format_table(results: Iterable[BenchResult]) -> str:
    """nccl-tests-like table: op, size, time (us), algbw (GB/s), and busbw (GB/s) where any result has one (a
    copy has none: there is no bus factor for one transfer)."""
    results = list(results)
    with_bus = any(r.busbw_gbps is not None for r in results)
    lines = [f"{'op':>18} {'size':>10} {'time (us)':>11} {'algbw (GB/s)':>13}" + (f" {'busbw (GB/s)':>13}" if with_bus
                                                                                    else "")]
    for r in results:
        bus = (f" {r.busbw_gbps:13.2f}" if r.busbw_gbps is not None else f" {'-':>13}") if with_bus else ""
        lines.append(f"{r.op:>18} {human_bytes(r.size_bytes):>10} {r.time_ms * 1e3:11.1f} {r.algbw_gbps:13.2f}{bus}")
    return "\n".join(lines)


def format_nccl_table(results: Iterable[BenchResult]) -> str:
    """One block per op in nccl-tests' layout: size, count, type, redop, root, then time/algbw/busbw for each
    timing mode side by side (where nccl-tests puts out-of-place and in-place), and the average busbw."""
    results = list(results)
    blocks = []
    for op in dict.fromkeys(r.op for r in results):
        mine = [r for r in results if r.op == op]
        modes = [m for m in MODES if any(r.mode == m for r in mine)] or [None]
        first = mine[0]
        head1 = f"# {op}: {first.world_size} ranks, {first.backend}, {first.iters} iterations per size\n"
        head1 += "#" + " " * 46 + "".join(f"{(m or '').replace('_', '-'):^25}" for m in modes)
        cols = "".join(f"{'time':>9} {'algbw':>7} {'busbw':>7}" for _ in modes)
        units = "".join(f"{'(us)':>9} {'(GB/s)':>7} {'(GB/s)':>7}" for _ in modes)
        lines = [head1, f"# {'size':>10} {'count':>12} {'type':>7} {'redop':>6} {'root':>5} " + cols,
                 f"# {'(B)':>10} {'(elements)':>12} {'':>7} {'':>6} {'':>5} " + units]
        for size in sorted({r.size_bytes for r in mine}):
            row = {r.mode: r for r in mine if r.size_bytes == size}
            r0 = next(iter(row.values()))
            line = (f"  {size:>10} {r0.count if r0.count is not None else '-':>12} {r0.dtype or '-':>7} "
                    f"{'sum' if op in REDUCING else 'none':>6} {0 if op in ROOTED else -1:>5} ")
            for m in modes:
                r = row.get(m)
                line += (f"{r.time_ms * 1e3:9.1f} {r.algbw_gbps:7.2f} {r.busbw_gbps or 0:7.2f}" if r
                         else f"{'-':>9} {'-':>7} {'-':>7}")
            lines.append(line)
        bus = [r.busbw_gbps for r in mine if r.busbw_gbps is not None]
        lines.append(f"# Avg bus bandwidth    : {statistics.mean(bus) if bus else math.nan:.3f}")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def plot_bandwidth(results: Iterable[BenchResult], limits: dict[str, float] | None = None, title: str | None = None,
                   ax: Any = None, y: str = "algbw"):
    """Bandwidth (GB/s) against size, one line per op (and timing mode), dashed lines for limits.
    y: "algbw" (bytes / time) or "busbw" (nccl-tests' bus bandwidth, the one to hold against a link's speed)."""
    import matplotlib.pyplot as plt

    if y not in ("algbw", "busbw"):
        raise ValueError(f"y must be 'algbw' or 'busbw', got {y!r}")
    results = list(results)
    if ax is None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
    else:
        fig = ax.figure
    ops = list(dict.fromkeys(r.op for r in results))
    for op, mode in dict.fromkeys((r.op, r.mode) for r in results):  # one colour per op, dashed when blocking
        mine = sorted((r for r in results if (r.op, r.mode) == (op, mode)), key=lambda r: r.size_bytes)
        values = [(r.busbw_gbps if y == "busbw" else r.algbw_gbps) for r in mine]
        label = op if mode is None else f"{op} ({mode.replace('_', '-')})"
        ax.plot([r.size_bytes for r in mine], values, marker="o" if mode != "blocking" else "x", label=label,
                color=f"C{ops.index(op) % 10}", linestyle="--" if mode == "blocking" else "-")
    for i, (label, gbps) in enumerate((limits or {}).items()):
        if gbps:
            ax.axhline(gbps, linestyle=(0, (6, 3)), color=("black", "dimgrey", "grey")[i % 3],
                       label=f"{label}: {gbps:g} GB/s")
    ax.set_xscale("log", base=2)
    sizes = sorted({r.size_bytes for r in results})
    if sizes:
        ticks = sizes[:: max(1, len(sizes) // 8)]
        ax.set_xticks(ticks, [human_bytes(s) for s in ticks], rotation=30)
    ax.set_xlabel("size S (bytes)")
    ax.set_ylabel(f"{y} (GB/s, 1 GB = 1e9 B)")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title)
    fig.tight_layout()
    return fig
