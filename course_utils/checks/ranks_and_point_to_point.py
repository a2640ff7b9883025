"""Checks for lesson 05 (ranks and point-to-point).

ex05_stuck_ranks    `stuck_ranks(programs, eager_bytes)`: which ranks never finish a program of blocking and
                    batched send/recv steps, on the course's model of a send (buffered up to `eager_bytes`,
                    else it waits for its receive). CPU.
ex05_halo_exchange  `halo_exchange(block, width)`: each rank of a ring gets the last `width` values of its left
                    neighbour's block and the first `width` of its right neighbour's. CPU: the probe runs the
                    answer on gloo ranks at world sizes 3 and 5 (with 2 ranks left and right neighbour are the
                    same rank, and most neighbour mistakes hide).

The halo probe starts real ranks with `course_utils.launch.run` and gives them blocks the judge made. It
re-creates each rank's default process group with a timeout of a few seconds, so an answer that deadlocks
fails fast with gloo's own timeout error instead of hanging, and it makes the collectives unavailable (the
exercise is about point-to-point calls). Rank 0 calls the answer first and the others `stagger_s` later:
an answer that reads its receive buffers before waiting returns on rank 0 before any neighbour has sent.
Each rank hands back its halos as plain lists; the judge compares them with halos it computes itself.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from typing import Any

from . import Exercise, expect, passes, rank_error, register

EX_STUCK = "ex05_stuck_ranks"
EX_HALO = "ex05_halo_exchange"

KiB, MiB = 1 << 10, 1 << 20
HALO_WORLDS = (3, 5)
LAUNCH_TIMEOUT_S = 90.0  # per world size: a backstop; a deadlock ends earlier, at the group's own timeout
COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "all_to_all",
               "all_to_all_single", "broadcast", "broadcast_object_list", "gather", "gather_object", "reduce",
               "reduce_scatter", "reduce_scatter_tensor", "scatter", "scatter_object_list")


# ------------------------------------------------------------------------------- ex05_stuck_ranks (CPU)


def _ring_programs(world: int, nbytes: int) -> dict[str, list]:
    """The lesson's deadlock zoo as programs (the notebook builds the same ones): rank -> steps -> ops."""
    def right(r):
        return (r + 1) % world

    def left(r):
        return (r - 1) % world

    def pair(r, first, then):
        return [] if r > 1 else [[(first, 1 - r, nbytes)], [(then, 1 - r, nbytes)]]

    return {
        "send/send": [pair(r, "send", "recv") for r in range(world)],
        "recv/recv": [pair(r, "recv", "send") for r in range(world)],
        "ring order": [[[("send", right(r), nbytes)], [("recv", left(r), nbytes)]] for r in range(world)],
        "even/odd": [[[("send", right(r), nbytes)], [("recv", left(r), nbytes)]][:: 1 if r % 2 == 0 else -1]
                     for r in range(world)],
        "batched": [[[("send", right(r), nbytes), ("recv", left(r), nbytes)]] for r in range(world)],
    }


def _random_programs(rng: random.Random) -> list:
    world = rng.randint(2, 5)
    sizes = (512, 4 * KiB, 1 * MiB)
    programs = []
    for r in range(world):
        steps = []
        for _ in range(rng.randint(0, 3)):
            ops = []
            for _ in range(rng.choice((1, 1, 2, 3))):
                peer = rng.choice([p for p in range(world) if p != r])
                ops.append((rng.choice(("send", "recv")), peer, rng.choice(sizes)))
            steps.append(ops)
        programs.append(steps)
    return programs


def _stuck_inputs() -> dict:
    rng = random.Random()
    small, large = 1 * KiB, 64 * MiB
    cases = []
    for world in (3, 4):
        for nbytes in (small, large):
            for programs in _ring_programs(world, nbytes).values():
                cases.append({"programs": programs, "eager_bytes": 0})
                cases.append({"programs": programs, "eager_bytes": 64 * KiB})
    cases += [
        # two messages on one pair, received in order: the second receive has no second send
        {"programs": [[[("send", 1, 8)]], [[("recv", 0, 8)], [("recv", 0, 8)]]], "eager_bytes": 0},
        # a send nobody receives: buffered (eager) it finishes, otherwise it waits for ever
        {"programs": [[[("send", 1, 8)]], []], "eager_bytes": 0},
        {"programs": [[[("send", 1, 8)]], []], "eager_bytes": 8},
        # only rank 0 is stuck; ranks 1 and 2 finish
        {"programs": [[[("recv", 2, 8)]], [[("send", 2, 8)]], [[("recv", 1, 8)]]], "eager_bytes": 0},
        # a stuck rank holds up a rank that waits for it later
        {"programs": [[[("recv", 1, 8)]], [[("recv", 2, 8)], [("send", 2, 8)]], [[("send", 1, 8)], [("recv", 1, 8)]]],
         "eager_bytes": 0},
        # posted together, a send and a receive do not wait for each other (a batch)
        {"programs": [[[("send", 1, 4 * KiB), ("recv", 1, 4 * KiB)]], [[("send", 0, 4 * KiB), ("recv", 0, 4 * KiB)]]],
         "eager_bytes": 0},
    ]
    for _ in range(12):  # random programs: about half of them leave some rank stuck
        cases.append({"programs": _random_programs(rng), "eager_bytes": rng.choice((0, 0, 4 * KiB, 2 * MiB))})
    for c in cases:
        c["programs"] = [[[list(op) for op in step] for step in steps] for steps in c["programs"]]
    return {"cases": cases}


def _as_rank_list(x: Any) -> list[int] | None:
    """The answer as a sorted list of distinct plain ints, or None when it is not a collection of integers."""
    import numbers

    if isinstance(x, (str, bytes, dict)) or not hasattr(x, "__iter__"):
        return None
    try:
        items = list(x)
    except Exception:
        return None
    if not all(isinstance(v, numbers.Integral) and not isinstance(v, bool) for v in items):
        return None
    return sorted({int(v) for v in items})


def _stuck_probe(answer: Callable, inputs: dict) -> dict:
    values, types = [], []
    for case in inputs["cases"]:
        programs = [[[tuple(op) for op in step] for step in steps] for steps in case["programs"]]
        out = answer(programs, case["eager_bytes"])
        values.append(_as_rank_list(out))
        types.append(type(out).__name__)
    return {"values": values, "types": types}


def _finished(programs: list, eager_bytes: int, in_order: bool = False, fifo: bool = True,
              eager: bool = True) -> list[bool]:
    """Run the course's model to its end; which ranks got through all their steps.

    The keyword arguments switch on the mistakes the hints name (a judge's tool, not the exercise's answer)."""
    world = len(programs)
    step = [0] * world  # the step each rank is in (== len(steps) when done)
    done_ops = [set() for _ in range(world)]  # ops of the current step that completed

    def posted(a: int, b: int, kind: str) -> int:
        """How many sends a->b (kind 'send', counted at a) or receives on b from a ('recv', at b) are posted."""
        who, peer = (a, b) if kind == "send" else (b, a)
        n = 0
        for s, ops in enumerate(programs[who]):
            if s > step[who]:
                break
            for i, (k, p, _) in enumerate(ops):
                if s == step[who] and in_order and i > 0 and i - 1 not in done_ops[who]:
                    break
                n += k == kind and p == peer
        return n

    def index(who: int, i: int) -> int:
        """1-based position of op i of `who`'s current step among its messages with the same peer and kind."""
        kind, peer, _ = programs[who][step[who]][i]
        n = sum(1 for s in range(step[who]) for (k, p, _) in programs[who][s] if k == kind and p == peer)
        return n + sum(1 for (k, p, _) in programs[who][step[who]][: i + 1] if k == kind and p == peer)

    progress = True
    while progress:
        progress = False
        for r in range(world):
            if step[r] >= len(programs[r]):
                continue
            ops = programs[r][step[r]]
            for i, (kind, peer, nbytes) in enumerate(ops):
                if i in done_ops[r] or (in_order and i > 0 and i - 1 not in done_ops[r]):
                    continue
                k = index(r, i) if fifo else 1
                if kind == "send":
                    ok = (eager and nbytes <= eager_bytes) or posted(r, peer, "recv") >= k
                else:
                    ok = posted(peer, r, "send") >= k
                if ok:
                    done_ops[r].add(i)
                    progress = True
            if len(done_ops[r]) == len(ops):
                step[r] += 1
                done_ops[r] = set()
                progress = True
    return [step[r] >= len(programs[r]) for r in range(world)]


def _stuck(programs: list, eager_bytes: int, **mistake: bool) -> list[int]:
    return [r for r, ok in enumerate(_finished(programs, eager_bytes, **mistake)) if not ok]


def _describe(programs: list) -> str:
    lines = []
    for r, steps in enumerate(programs):
        text = " ; ".join("[" + ", ".join(f"{k} {'to' if k == 'send' else 'from'} {p} ({n} B)" for k, p, n in s) + "]"
                          for s in steps)
        lines.append(f"rank {r}: {text or '(nothing)'}")
    return "\n    ".join(lines)


def _stuck_hint(programs: list, eager_bytes: int, got: list[int]) -> str:
    suspects = [
        (_stuck(programs, eager_bytes, eager=False), "does a send of at most eager_bytes bytes wait for its receive?"),
        (_stuck(programs, eager_bytes, in_order=True),
         "the ops of one step are posted together: does a send in a step wait for the receive next to it?"),
        (_stuck(programs, eager_bytes, fifo=False),
         "the k-th send from a to b matches the k-th receive on b from a: do you count messages per pair?"),
        (list(range(len(programs))), "is every rank stuck, or only those that wait for a partner who never comes?"),
        ([], "can a receive finish when nobody sends to it?"),
    ]
    for value, hint in suspects:
        if got == value:
            return hint
    return "step through the ranks again and again, completing what can complete, until nothing changes"


def _stuck_judge(inputs: dict, data: dict) -> str:
    cases = inputs["cases"]
    values = data.get("values")
    expect(type(values) is list and len(values) == len(cases), EX_STUCK, f"{len(cases)} answers", values)
    types = data.get("types", [""] * len(cases))
    stuck_somewhere = 0
    for case, got, typ in zip(cases, values, types, strict=False):
        programs = [[[tuple(op) for op in step] for step in steps] for steps in case["programs"]]
        want = _stuck(programs, case["eager_bytes"])
        stuck_somewhere += bool(want)
        call = f"stuck_ranks(programs, eager_bytes={case['eager_bytes']}) for\n    {_describe(programs)}\n"
        expect(got is not None, EX_STUCK, f"{call}to return a list of ranks", f"a value of type {typ}",
               hint="return a list of ints, e.g. [] or [0, 1]")
        expect(got == want, EX_STUCK, f"{call}to be {want}", got, hint=_stuck_hint(programs, case["eager_bytes"], got))
    return f"{len(cases)} programs right, {stuck_somewhere} of them with stuck ranks"


register(Exercise(EX_STUCK, entry="stuck_ranks", probe=_stuck_probe, judge=_stuck_judge, inputs=_stuck_inputs))


# ------------------------------------------------------------------------------ ex05_halo_exchange (CPU)


def _halo_inputs() -> dict:
    rng = random.Random()
    cases = []
    for world in HALO_WORLDS:
        width = rng.randint(1, 3)
        lengths = [width + rng.randint(0, 5) for _ in range(world)]
        lengths[rng.randrange(world)] = 2 * width + 1  # at least one block longer than its two halos together
        values = rng.sample(range(-9999, 10000), sum(lengths))  # distinct integers: exact in float32
        blocks, at = [], 0
        for n in lengths:
            blocks.append([float(v) for v in values[at:at + n]])
            at += n
        cases.append({"world": world, "width": width, "blocks": blocks})
    return {"cases": cases, "stagger_s": 0.5, "op_timeout_s": 5.0}


def _short_timeout_group(timeout_s: float) -> None:
    """Replace this rank's default process group by one whose operations time out after `timeout_s`.

    gloo fixes a group's timeout when it connects, so the probe connects a new group: rank 0 hosts a fresh
    store, the old group tells everyone its port, and every rank joins."""
    from datetime import timedelta

    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    store = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False) if rank == 0 else None
    port = [store.port if store is not None else None]
    dist.broadcast_object_list(port, src=0)
    if store is None:
        store = dist.TCPStore("127.0.0.1", port[0], world, is_master=False)
    dist.destroy_process_group()
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timedelta(seconds=timeout_s))


def _forbid_collectives() -> None:
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def make(name: str):
        def refuse(*args, **kwargs):
            raise RuntimeError(f"{EX_HALO}: dist.{name} is not available in this exercise; exchange the halos with "
                               "point-to-point calls (isend/irecv, batch_isend_irecv)")
        return refuse

    for name in COLLECTIVES:
        for module in (dist, c10d):
            if hasattr(module, name):
                setattr(module, name, make(name))


def _halo_values(t: Any) -> tuple[list[float] | None, str]:
    import torch

    if not isinstance(t, torch.Tensor):
        return None, type(t).__name__
    if t.is_complex() or t.dim() != 1:
        return None, f"a tensor of shape {tuple(t.shape)} and dtype {t.dtype}"
    return [float(v) for v in t.detach().cpu().double().tolist()], "tensor"


def _halo_rank(answer: Callable, blocks: list, width: int, stagger_s: float, op_timeout_s: float) -> dict:
    """One rank of the probe (runs in a launched worker)."""
    import torch
    import torch.distributed as dist

    _short_timeout_group(op_timeout_s)
    _forbid_collectives()
    rank = dist.get_rank()
    block = torch.tensor(blocks[rank], dtype=torch.float32)
    original = block.clone()
    if rank != 0:
        time.sleep(stagger_s)  # rank 0 goes first: its neighbours send only stagger_s later
    got = answer(block, width)
    # Read the halos the moment the answer returns, as the caller of halo_exchange would.
    if isinstance(got, (tuple, list)) and len(got) == 2:
        (left, lt), (right, rt) = _halo_values(got[0]), _halo_values(got[1])
        out = {"left": left, "right": right, "types": [lt, rt]}
    else:
        out = {"left": None, "right": None, "types": [type(got).__name__]}
    out["block_unchanged"] = bool(torch.equal(block, original))
    dist.barrier()  # every rank has returned from the answer (so every message is posted) ...
    time.sleep(0.2)  # ... and has landed before any rank leaves
    return out


def _halo_probe(answer: Callable, inputs: dict) -> dict:
    from course_utils import launch

    out = []
    for case in inputs["cases"]:
        world = case["world"]
        try:
            ranks = launch.run(_halo_rank, answer, case["blocks"], case["width"], inputs["stagger_s"],
                               inputs["op_timeout_s"], nproc=world, backend="gloo", timeout=LAUNCH_TIMEOUT_S)
            out.append({"status": "ok", "ranks": [ranks[r] for r in range(world)]})
        except launch.WorkerTimeout as err:
            out.append({"status": "timeout", "message": str(err)[-3000:]})
        except launch.WorkerError as err:
            out.append({"status": "error", "message": rank_error(err)})
        if out[-1]["status"] != "ok" or not _judged_right(case, out[-1]):
            break  # the judge reports the first failure; the next world size would only cost time
    return {"cases": out}


def _judged_right(case: dict, res: dict) -> bool:
    """Whether the judge will pass this run (asked only to stop early)."""
    return passes(_halo_case_verdict, case, res)


_HANG_WORDS = ("Timed out", "timed out", "Connection closed", "Connection reset")


def _halo_failure(case: dict, res: dict) -> None:
    msg = res.get("message") or ""
    world = case["world"]
    where = f"on {world} ranks, width {case['width']}, blocks of {[len(b) for b in case['blocks']]} float32 values"
    if res.get("status") == "timeout" or any(w in msg for w in _HANG_WORDS):
        expect(False, EX_HALO, f"the halo exchange to finish {where}",
               "it hung until the timeout (a deadlock?):\n" + msg,
               hint="does every rank first post a blocking send, or wait for a message nobody sends (peer, tag)? "
                    "What does isend/irecv or batch_isend_irecv change?")
    first = next((line for line in msg.splitlines() if "not available in this exercise" in line), None)
    expect(False, EX_HALO, f"the halo exchange to run {where}", "an error:\n" + msg,
           hint=first or "read the traceback of the rank that failed first")


def _halo_hint(blocks: list, r: int, width: int, side: str, got: list[float]) -> str:
    world = len(blocks)
    lft, rgt = blocks[(r - 1) % world], blocks[(r + 1) % world]
    if side == "left" and got == rgt[:width]:
        return "left and right swapped? Rank r's left halo comes from rank r-1 and is the END of its block"
    if side == "right" and got == lft[-width:]:
        return "left and right swapped? Rank r's right halo comes from rank r+1 and is the START of its block"
    if side == "left" and got == lft[:width]:
        return "which end of the left neighbour's block touches yours?"
    if side == "right" and got == rgt[-width:]:
        return "which end of the right neighbour's block touches yours?"
    others = [blocks[(r + d) % world] for d in (2, -2)]
    if any(got in (b[:width], b[-width:]) for b in others):
        return "which ranks are your neighbours on a ring of dist.get_world_size() ranks?"
    if r == 0:
        return ("rank 0 calls halo_exchange before its neighbours send: did it read its receive buffers before "
                "waiting for the receives to complete?")
    return "which values does each rank send, and where does each received message go?"


def _halo_judge(inputs: dict, data: dict) -> str:
    cases = inputs["cases"]
    results = data.get("cases")
    expect(type(results) is list and 1 <= len(results) <= len(cases), EX_HALO, f"{len(cases)} runs", results)
    for case, res in zip(cases, results, strict=False):
        _halo_case_verdict(case, res)
    expect(len(results) == len(cases), EX_HALO, f"{len(cases)} runs", len(results))
    sizes = " and ".join(str(c["world"]) for c in cases)
    return f"halos right on {sizes} ranks, without deadlock"


def _halo_case_verdict(case: dict, res: Any) -> None:
    """The judge on one run: raises CheckFailed at its first fault."""
    world, width, blocks = case["world"], case["width"], case["blocks"]
    expect(type(res) is dict, EX_HALO, "a result per run", res)
    if res.get("status") != "ok":
        _halo_failure(case, res)
    ranks = res.get("ranks")
    expect(type(ranks) is list and len(ranks) == world, EX_HALO, f"{world} ranks' results", ranks)
    for r, got in enumerate(ranks):
        where = f"on {world} ranks, width {width}, rank {r}"
        expect(type(got) is dict and got.get("left") is not None and got.get("right") is not None, EX_HALO,
               f"{where}: halo_exchange to return (left, right), two 1-D tensors",
               ", ".join(got.get("types", [])) if type(got) is dict else got)
        # First: an answer that receives into its own block also garbles its halos when the two ends overlap,
        # in an order that depends on which message lands first; the block is the cause to report.
        expect(got.get("block_unchanged") is True, EX_HALO, f"{where}: the rank's own block left as it was",
               "it was changed", hint="receive into new tensors, not into the block you are sending from")
        for side, want in (("left", blocks[(r - 1) % world][-width:]), ("right", blocks[(r + 1) % world][:width])):
            have = got[side]
            expect(type(have) is list and len(have) == width, EX_HALO,
                   f"{where}: the {side} halo to hold {width} values", have)
            expect(all(math.isfinite(v) for v in have) and have == want, EX_HALO,
                   f"{where}: {side} halo {want}", have, hint=_halo_hint(blocks, r, width, side, have))


register(Exercise(EX_HALO, entry="halo_exchange", probe=_halo_probe, judge=_halo_judge, inputs=_halo_inputs,
                  timeout_s=240.0))
