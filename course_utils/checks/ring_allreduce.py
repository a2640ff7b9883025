"""Checks for lesson 07 (ring all-reduce).

ex07_allreduce_time (CPU): the learner's `allreduce_time(algorithm, n, nbytes, alpha, bandwidth)` against the
lesson's alpha-beta model, on queries this module picks. One message of m bytes costs alpha + m / bandwidth
(seconds); a step is one message per rank, all at once; the model ignores the additions:
    naive  2(n-1) (alpha + S/B)          rank 0 receives n-1 whole buffers one after another, sends n-1 back
    tree   2 ceil(log2 n) (alpha + S/B)  a binomial tree: ceil(log2 n) levels up, as many down
    ring   2(n-1) (alpha + S/(n B))      2(n-1) steps of one chunk of S/n bytes

ex07_ring_all_reduce (CPU, gloo): the learner's `ring_all_reduce(tensor, group=None)` runs on gloo ranks at
world sizes 2, 3 and 5 (with 2 ranks left and right neighbours coincide and most chunk-index bugs hide), on
tensors of small integers whose sums are exact, with numels that world sizes do not divide. The probe starts
the ranks itself (launch.Pool, one per world size) and, inside each rank, before it unpickles the answer:
- makes the library's collectives raise (torch.distributed's functions, the ProcessGroup and Backend
  methods, the functional collectives), so only point-to-point calls work;
- wraps ProcessGroup.send/recv to log every message (peer, bytes) and to notice a receive posted into memory
  that a send still in flight reads (or the reverse): a send or receive is in flight until its Work's wait()
  returned, or is_completed() said True, to the answer.
A rank that hangs (a deadlock) ends at a short timeout. The judge decides from the result tensors and the logs.
"""

from __future__ import annotations

import contextlib
import math
import random
from typing import Any

from . import Exercise, close, expect, passes, rank_error, register

# ------------------------------------------------------------------------- ex07_allreduce_time (CPU)

EX_TIME = "ex07_allreduce_time"
ALGORITHMS = ("naive", "tree", "ring")


def model_time(algorithm: str, n: int, nbytes: float, alpha: float, bandwidth: float) -> float:
    """The lesson's alpha-beta model of one all-reduce of `nbytes` over `n` ranks (seconds)."""
    if algorithm == "naive":
        return 2 * (n - 1) * (alpha + nbytes / bandwidth)
    if algorithm == "tree":
        return 2 * math.ceil(math.log2(n)) * (alpha + nbytes / bandwidth)
    if algorithm == "ring":
        return 2 * (n - 1) * (alpha + nbytes / (n * bandwidth))
    raise ValueError(f"unknown algorithm {algorithm!r}: choose one of {ALGORITHMS}")


# Queries every answer is asked about, each telling a wrong idea apart from the model: world sizes that are and
# are not powers of two (ceil of log2), latency-bound and bandwidth-bound sizes (which term is wrong).
FIXED_QUERIES: list[list] = [
    ["ring", 2, 1 << 30, 20e-6, 300e9],
    ["ring", 5, 1 << 20, 50e-6, 2e9],
    ["ring", 8, 1 << 10, 10e-6, 300e9],
    ["tree", 5, 1 << 24, 30e-6, 50e9],
    ["tree", 3, 1 << 10, 100e-6, 1e9],
    ["tree", 8, 1 << 28, 15e-6, 350e9],
    ["naive", 4, 1 << 26, 20e-6, 25e9],
    ["naive", 6, 1 << 12, 80e-6, 3e9],
    ["naive", 2, 1 << 20, 10e-6, 100e9],
    ["tree", 2, 1 << 20, 10e-6, 100e9],
]


def time_inputs(seed: int | None = None, n_random: int = 12) -> dict:
    seed = random.randrange(1_000_000) if seed is None else seed
    rng = random.Random(seed)
    queries = [list(q) for q in FIXED_QUERIES]
    for _ in range(n_random):
        queries.append([rng.choice(ALGORITHMS), rng.randint(2, 16), 1 << rng.randint(8, 31),
                        rng.choice((5, 10, 20, 50, 100)) * 1e-6, rng.choice((1, 3, 12, 50, 150, 350)) * 1e9])
    rng.shuffle(queries)
    return {"seed": seed, "queries": queries}


def time_probe(answer: Any, inputs: dict) -> dict:
    out: list[Any] = []
    for algorithm, n, nbytes, alpha, bandwidth in inputs["queries"]:
        value = answer(algorithm, n, nbytes, alpha, bandwidth)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out.append(float(value))  # float(): a subclass brings no __eq__ of its own to the judge
        else:
            out.append(f"a {type(value).__module__}.{type(value).__qualname__}, not a number")
    return {"times": out}


def _describe_query(q: list) -> str:
    algorithm, n, nbytes, alpha, bandwidth = q
    return (f"allreduce_time({algorithm!r}, n={n}, nbytes={nbytes}, alpha={alpha * 1e6:g} us, "
            f"bandwidth={bandwidth / 1e9:g} GB/s)")


def time_judge(inputs: dict, data: dict) -> str:
    times, queries = data.get("times"), inputs["queries"]
    expect(type(times) is list and len(times) == len(queries), EX_TIME, f"one time per query ({len(queries)})",
           type(times).__name__ if type(times) is not list else f"{len(times)} times")
    for q, got in zip(queries, times, strict=True):
        want = model_time(*q)
        expect(type(got) is float and math.isfinite(got), EX_TIME, f"a number of seconds for {_describe_query(q)}",
               got, "return the time as a float, in seconds")
        expect(close(got, want, rel=1e-6), EX_TIME, f"{want * 1e6:.2f} us for {_describe_query(q)}",
               f"{got * 1e6:.2f} us",
               "count the steps each algorithm takes one after another, and how many bytes one rank sends or "
               "receives in each step")
    return f"{len(queries)} queries over {len({q[1] for q in queries})} world sizes, all as the model predicts"


register(Exercise(EX_TIME, entry="allreduce_time", probe=time_probe, judge=time_judge, inputs=time_inputs,
                  timeout_s=30))

# ------------------------------------------------------------------------- ex07_ring_all_reduce (CPU, gloo)

EX_RING = "ex07_ring_all_reduce"
WORLD_SIZES = (2, 3, 5)
NOT_ALLOWED = "not allowed in this exercise"

# What the answer may not call while the check runs: torch.distributed's collectives ...
COLLECTIVES = ("all_reduce", "all_reduce_coalesced", "reduce", "all_gather", "all_gather_into_tensor",
               "_all_gather_base", "all_gather_coalesced", "all_gather_object", "reduce_scatter",
               "reduce_scatter_tensor", "_reduce_scatter_base", "broadcast", "broadcast_object_list", "all_to_all",
               "all_to_all_single", "gather", "gather_object", "scatter", "scatter_object_list")
# ... the methods of process groups and backends behind them ...
GROUP_METHODS = ("allreduce", "allreduce_coalesced", "reduce", "allgather", "allgather_coalesced",
                 "allgather_into_tensor_coalesced", "_allgather_base", "reduce_scatter",
                 "reduce_scatter_tensor_coalesced", "_reduce_scatter_base", "broadcast", "alltoall", "alltoall_base",
                 "gather", "scatter")
# ... and the functional collectives.
FUNCTIONAL = ("all_reduce", "all_reduce_inplace", "all_reduce_coalesced", "all_gather_tensor",
              "all_gather_tensor_autograd", "all_gather_into_tensor_coalesced", "reduce_scatter_tensor",
              "reduce_scatter_tensor_autograd", "reduce_scatter_tensor_coalesced", "all_to_all_single",
              "all_to_all_single_autograd", "broadcast", "permute_tensor")


def ring_inputs(seed: int | None = None) -> dict:
    """Per world size, a few tensors per rank of small integers (sums exact in float32 and float64).

    Numels: one the world size divides, two it does not (one large), and one smaller than the world size
    (some chunks empty) where the world size allows."""
    import torch

    seed = random.randrange(1_000_000) if seed is None else seed
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    worlds = []
    for n in WORLD_SIZES:
        numels = [n * rng.randint(2, 6), n * rng.randint(5, 40) + rng.randint(1, n - 1),
                  n * rng.randint(2000, 3000) + rng.randint(1, n - 1)]
        if n > 2:
            numels.append(rng.randint(1, n - 1))
        cases = []
        for i, numel in enumerate(numels):
            dtype = (torch.float32, torch.float64)[(i + n) % 2]
            values = torch.randint(-9, 10, (n, numel), generator=gen).to(dtype)
            cases.append({"numel": numel, "dtype": str(dtype).removeprefix("torch."), "values": values})
        worlds.append({"world_size": n, "cases": cases})
    return {"seed": seed, "worlds": worlds, "start_timeout_s": 120.0, "call_timeout_s": 15.0}


def _span(tensor: Any) -> tuple[int, int]:
    """The bytes a tensor can touch, as [start, end) addresses (empty for an empty tensor)."""
    if tensor.numel() == 0:
        return (0, 0)
    start = tensor.data_ptr()
    extent = sum((size - 1) * abs(stride) for size, stride in zip(tensor.shape, tensor.stride(), strict=True)) + 1
    return (start, start + extent * tensor.element_size())


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> bool:
    return a[0] < a[1] and b[0] < b[1] and a[0] < b[1] and b[0] < a[1]


class _Tracked:
    """A Work handed to the answer: in flight until its wait() returned or is_completed() said True."""

    def __init__(self, work: Any, entry: dict):
        self._work, self._entry = work, entry

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        out = self._work.wait(*args, **kwargs)
        self._entry["done"] = True
        return out

    def is_completed(self) -> bool:
        done = self._work.is_completed()
        if done:
            self._entry["done"] = True
        return done

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


_INHERITED = object()


class P2PWatch:
    """Inside one rank: collectives raise, point-to-point messages are logged, in-flight buffers are watched.

        with P2PWatch() as watch:
            answer(tensor)
            watch.sends, watch.recvs, watch.hazards
    """

    def __init__(self) -> None:
        self.sends: list[list] = []  # [peer, bytes]
        self.recvs: list[list] = []
        self.hazards: list[str] = []
        self.in_flight: list[dict] = []
        self.buffer: Any = None  # the tensor being reduced, to name offsets in it
        self._saved: list[tuple[Any, str, Any]] = []

    def begin(self, tensor: Any) -> None:
        self.sends, self.recvs, self.hazards, self.in_flight, self.buffer = [], [], [], [], tensor

    def _where(self, tensor: Any) -> str:
        span = _span(tensor)
        base = self.buffer
        if base is not None and base.numel() and tensor.numel() and tensor.dtype == base.dtype:
            start, end = _span(base)
            if start <= span[0] and span[1] <= end:
                size = base.element_size()
                return f"elements [{(span[0] - start) // size}, {(span[1] - start) // size}) of the tensor"
        return f"a buffer of {tensor.numel()} elements"

    def _post(self, kind: str, tensor: Any, peer: Any) -> dict:
        span = _span(tensor)
        for other in self.in_flight:
            if other["done"] or not _overlap(span, other["span"]):
                continue
            if kind == "recv" or other["kind"] == "recv":
                what = {("recv", "send"): "a receive into {a} while a send of {b} to rank {p} was still in flight",
                        ("send", "recv"): "a send of {a} while a receive into {b} from rank {p} was still in flight",
                        ("recv", "recv"): "a receive into {a} while a receive into {b} from rank {p} was still "
                                          "in flight"}[(kind, other["kind"])]
                if len(self.hazards) < 5:
                    self.hazards.append(what.format(a=self._where(tensor), b=other["where"], p=other["peer"]))
        entry = {"kind": kind, "span": span, "peer": peer, "where": self._where(tensor), "done": False}
        self.in_flight = [e for e in self.in_flight if not e["done"]] + [entry]
        return entry

    def _patch(self, owner: Any, name: str, new: Any) -> None:
        # Keep the raw attribute (a pybind method's descriptor, not the function getattr returns), or note that it
        # was inherited, so that __exit__ puts back exactly what was there.
        own = vars(owner)
        if name in own or hasattr(owner, name):
            self._saved.append((owner, name, own[name] if name in own else _INHERITED))
            setattr(owner, name, new)

    def __enter__(self) -> P2PWatch:
        import torch.distributed as dist
        import torch.distributed.distributed_c10d as c10d
        from torch._C import _distributed_c10d as C

        def forbid(name: str):
            def not_allowed(*args: Any, **kwargs: Any) -> Any:
                raise RuntimeError(f"{name} is {NOT_ALLOWED}: send and receive with point-to-point calls only "
                                   "(dist.send/recv, isend/irecv, batch_isend_irecv)")
            return not_allowed

        for name in COLLECTIVES:
            for module in (dist, c10d):
                if hasattr(module, name):
                    self._patch(module, name, forbid(f"torch.distributed.{name}"))
        classes = [C.ProcessGroup] + [getattr(C, k) for k in ("Backend", "ProcessGroupGloo") if hasattr(C, k)]
        for cls in classes:
            for name in GROUP_METHODS:
                if name in cls.__dict__:
                    self._patch(cls, name, forbid(f"{cls.__name__}.{name}"))
        with contextlib.suppress(ImportError):
            import torch.distributed._functional_collectives as funcol

            for name in FUNCTIONAL:
                if hasattr(funcol, name):
                    self._patch(funcol, name, forbid(f"torch.distributed._functional_collectives.{name}"))

        pg = C.ProcessGroup
        send, recv, recv_any = pg.send, pg.recv, getattr(pg, "recv_anysource", None)
        watch = self

        def tracked_send(group: Any, tensors: list, dst: int, tag: int = 0) -> Any:
            entries = [watch._post("send", t, dst) for t in tensors]
            watch.sends.extend([dst, t.numel() * t.element_size()] for t in tensors)
            return _Tracked(send(group, tensors, dst, tag), *entries[:1]) if len(entries) == 1 else send(
                group, tensors, dst, tag)

        def tracked_recv(group: Any, tensors: list, src: int, tag: int = 0) -> Any:
            entries = [watch._post("recv", t, src) for t in tensors]
            watch.recvs.extend([src, t.numel() * t.element_size()] for t in tensors)
            return _Tracked(recv(group, tensors, src, tag), *entries[:1]) if len(entries) == 1 else recv(
                group, tensors, src, tag)

        def tracked_recv_any(group: Any, tensors: list, tag: int = 0) -> Any:
            entries = [watch._post("recv", t, "any") for t in tensors]
            watch.recvs.extend(["any", t.numel() * t.element_size()] for t in tensors)
            return _Tracked(recv_any(group, tensors, tag), *entries[:1]) if len(entries) == 1 else recv_any(
                group, tensors, tag)

        self._patch(pg, "send", tracked_send)
        self._patch(pg, "recv", tracked_recv)
        if recv_any is not None:
            self._patch(pg, "recv_anysource", tracked_recv_any)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, old in reversed(self._saved):
            if old is _INHERITED:
                delattr(owner, name)
            else:
                setattr(owner, name, old)
        self._saved.clear()


def _describe(value: Any) -> str:
    import torch

    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {tuple(value.shape)}"
    return "None" if value is None else f"a {type(value).__qualname__}"


def rank_main(blob: bytes, case: dict) -> dict:
    """One rank of the check: unpickle the answer under the watch, call it on this rank's tensor, return plain data."""
    import cloudpickle
    import torch
    import torch.distributed as dist

    rank = dist.get_rank()
    with P2PWatch() as watch:
        answer = cloudpickle.loads(blob)  # after the patches: names it imported resolve to the guarded ones
        tensor = case["values"][rank].clone()
        watch.begin(tensor)
        returned = answer(tensor)
        return {"result": tensor.detach().clone(), "returned": _describe(returned),
                "returned_a_tensor": bool(isinstance(returned, torch.Tensor) and returned is not tensor),
                "sends": watch.sends, "recvs": watch.recvs, "hazards": watch.hazards}


def _tail(text: str, lines: int = 6) -> str:
    kept = [ln for ln in text.splitlines() if ln.strip()][-lines:]
    return ("; what the ranks printed last: " + " | ".join(kept))[:1500] if kept else ""


def ring_probe(answer: Any, inputs: dict) -> dict:
    """Run the answer on gloo ranks at each world size, one call per tensor, stopping at the first error or hang.

    The ranks' output is kept (not shown) and its tail goes into a failure's message."""
    import io

    from .. import launch
    from ..launch.pickling import dumps_function

    blob = dumps_function(answer)
    worlds = []
    for world in inputs["worlds"]:
        n = world["world_size"]
        record: dict[str, Any] = {"world_size": n, "outcome": "ok", "cases": []}
        output = io.StringIO()
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            pool = launch.Pool(n, backend="gloo", timeout=inputs["start_timeout_s"])  # a failure here is the check's
            try:
                for case in world["cases"]:
                    ranks = pool.run(rank_main, blob, case, timeout=inputs["call_timeout_s"])
                    record["cases"].append([ranks[r] for r in range(n)])
            except launch.WorkerTimeout:
                record["outcome"] = "timeout"
                record["message"] = f"ranks still running after {inputs['call_timeout_s']:g} s"
            except launch.WorkerError as err:
                record["outcome"] = "error"
                record["message"] = rank_error(err)
            finally:
                pool.close()
        if record["outcome"] != "ok":
            record["message"] += _tail(output.getvalue())
        worlds.append(record)
        if record["outcome"] != "ok" or not _judged_right(n, world["cases"], record["cases"]):
            break  # the judge reports this world's fault first; a larger world would only cost time
    return {"worlds": worlds}


def _judged_right(n: int, cases: list[dict], done: list) -> bool:
    """Whether the judge will pass these results at world size n (asked only to stop early)."""
    return all(passes(_case_verdict, n, case, ranks) for case, ranks in zip(cases, done, strict=True))


def _values_verdict(n: int, case: dict, ranks: list[dict]) -> None:
    import torch

    want = case["values"].sum(0)  # small integers: exact in float32 and float64
    where = f"at world size {n}, numel {case['numel']}, {case['dtype']}"
    for r, rank in enumerate(ranks):
        got = rank["result"]
        ok = type(got) is torch.Tensor and got.dtype == want.dtype and got.shape == want.shape
        expect(ok, EX_RING, f"the tensor to keep its dtype and shape {where}",
               f"rank {r}: {got.dtype if type(got) is torch.Tensor else type(got).__name__}, "
               f"{tuple(got.shape) if type(got) is torch.Tensor else ''}")
        wrong = (got != want).nonzero().flatten().tolist()
        if not wrong:
            continue
        first, mine = wrong[0], case["values"][r]
        untouched = bool(torch.equal(got, mine))
        hint = ("the sum must end up in `tensor` itself (in place); your function returned a new tensor instead"
                if rank["returned_a_tensor"] is True and untouched else
                "which chunk does each rank send and receive at step s of each phase, what happens to a received "
                "chunk, and where do the last numel % n elements go?")
        expect(False, EX_RING, f"every rank to hold the element-wise sum over the ranks {where}",
               f"rank {r}: {len(wrong)} of {case['numel']} elements wrong, e.g. element {first} is "
               f"{got[first].item():g} where the sum is {want[first].item():g} (this rank's own value: "
               f"{mine[first].item():g})", hint)


def _traffic_verdict(n: int, case: dict, ranks: list[dict]) -> None:
    itemsize = case["values"].element_size()
    chunk = -(-case["numel"] // n)
    limit = 2 * (n - 1) * chunk * itemsize
    for r, rank in enumerate(ranks):
        neighbours = {(r + 1) % n, (r - 1) % n}
        sends, recvs = rank["sends"], rank["recvs"]
        peers = sorted({p for p, _ in sends} | {p for p, _ in recvs}, key=str)
        expect(all(p in neighbours for p in peers), EX_RING,
               f"a ring: rank {r} exchanges messages only with its neighbours {sorted(neighbours)} at world size {n}",
               f"messages with ranks {peers}", "in a ring, whom does a rank send to and receive from?")
        sent = sum(b for _, b in sends)
        expect(sent <= limit, EX_RING,
               f"a ring's traffic: each rank sends at most 2(n-1) chunks of ceil(numel/n) elements ({limit} bytes "
               f"at world size {n}, numel {case['numel']}, {case['dtype']})", f"rank {r} sent {sent} bytes",
               "does each step send one chunk, or the whole tensor?")


def _case_verdict(n: int, case: dict, ranks: Any) -> None:
    expect(type(ranks) is list and len(ranks) == n and all(type(r) is dict for r in ranks), EX_RING,
           f"results from {n} ranks at world size {n}", type(ranks).__name__)
    for r, rank in enumerate(ranks):
        hazards = rank.get("hazards")
        expect(type(hazards) is list and not hazards, EX_RING,
               f"no buffer received into while a send still reads it (world size {n}, numel {case['numel']})",
               f"rank {r}: {hazards[0] if hazards else hazards}",
               "until a send's work is waited for, its data may not have left: where else could the incoming "
               "chunk go?")
    _values_verdict(n, case, ranks)
    _traffic_verdict(n, case, ranks)


def ring_judge(inputs: dict, data: dict) -> str:
    worlds = data.get("worlds")
    expect(type(worlds) is list and len(worlds) >= 1, EX_RING, "a run at each world size",
           type(worlds).__name__ if type(worlds) is not list else "none")
    for world, record in zip(inputs["worlds"], worlds, strict=False):
        n = world["world_size"]
        expect(type(record) is dict and record.get("world_size") == n, EX_RING, f"a run at world size {n}",
               record.get("world_size") if type(record) is dict else record)
        done = record.get("cases")
        expect(type(done) is list and len(done) <= len(world["cases"]), EX_RING, f"results at world size {n}",
               type(done).__name__)
        for case, ranks in zip(world["cases"], done, strict=False):  # what finished, before what went wrong
            _case_verdict(n, case, ranks)
        outcome, message = record.get("outcome"), str(record.get("message"))
        expect(outcome != "timeout", EX_RING,
               f"every rank to finish within {inputs['call_timeout_s']:g} s at world size {n}",
               f"{message}: the check stopped them",
               "which call does each rank block in first, and who is meant to match it? If every rank sends "
               "before it receives, who is receiving?")
        failing = world["cases"][len(done)] if len(done) < len(world["cases"]) else None
        case = f", numel {failing['numel']}, {failing['dtype']}" if failing else ""
        expect(outcome == "ok", EX_RING, f"ring_all_reduce to run without an error at world size {n}{case}", message,
               "only point-to-point calls are available here" if NOT_ALLOWED in message else
               "a receive must be exactly as large as the send it matches" if "size" in message else "")
        expect(len(done) == len(world["cases"]), EX_RING, f"{len(world['cases'])} results at world size {n}",
               len(done))
    expect(len(worlds) == len(inputs["worlds"]), EX_RING, f"runs at world sizes {list(WORLD_SIZES)}",
           [w.get("world_size") if type(w) is dict else w for w in worlds])
    n_cases = sum(len(w["cases"]) for w in inputs["worlds"])
    numels = sorted({c["numel"] for w in inputs["worlds"] for c in w["cases"]})
    return (f"world sizes {', '.join(str(n) for n in WORLD_SIZES)}: {n_cases} tensors of {numels[0]} to "
            f"{numels[-1]} elements summed exactly, point-to-point only, neighbours only")


register(Exercise(EX_RING, entry="ring_all_reduce", probe=ring_probe, judge=ring_judge, inputs=ring_inputs,
                  timeout_s=150))
