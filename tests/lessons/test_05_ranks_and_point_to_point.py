"""Lesson 05 (ranks and point-to-point): both exercises' judges on plain data, both exercises end to end on CPU
with the master's answers and every wrong answer, the notebook's own rank functions on gloo against the claims
the notebook makes, and on two or more GPUs the same functions under NCCL (marked multigpu)."""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from course_utils import checks, launch
from course_utils.checks import CheckFailed
from course_utils.checks import ranks_and_point_to_point as p2p
from tests.exercise_cells import _compiled_cell, exercise_cells, notebook_functions, run_cells

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "05_ranks_and_point_to_point.ipynb"
WRONG = ROOT / "tests" / "wrong_answers" / "05_ranks_and_point_to_point"
MiB = 1 << 20
NCCL_GPUS = torch.cuda.device_count() if torch.distributed.is_nccl_available() else 0


def notebook() -> dict:
    return json.loads(NOTEBOOK.read_text())


def wrong_answers(ex: str) -> list[Path]:
    return sorted(WRONG.glob(f"{ex}*.py"))


def run_in_process(ex: str, replacement: str | None) -> None:
    """Setup cells, the solution (or a wrong answer) and the check cell, executed here in a fresh namespace."""
    ns: dict = {"__name__": "__lesson05__"}
    for i, src in enumerate(exercise_cells(notebook(), ex, replacement)):
        exec(_compiled_cell(src, f"<{ex} cell {i}>"), ns)  # its lines readable, as in a kernel


# ------------------------------------------------------------------------------------ ex05_stuck_ranks


def test_the_notebook_zoo_is_the_one_the_check_uses():
    nb = notebook_functions(notebook(), "__lesson05__")
    for world in (2, 3, 4):
        for nbytes in (1024, 64 * MiB):
            mine = {k: [[[tuple(op) for op in step] for step in steps] for steps in v]
                    for k, v in nb["zoo_programs"](world, nbytes).items()}
            assert mine == p2p._ring_programs(world, nbytes)


def test_stuck_model_on_the_zoo():
    z = p2p._ring_programs(3, 1024)
    assert p2p._stuck(z["send/send"], 0) == [0, 1] and p2p._stuck(z["send/send"], 1024) == []
    assert p2p._stuck(z["recv/recv"], 1 << 30) == [0, 1]  # buffering cannot help a receive nobody sends to
    assert p2p._stuck(z["ring order"], 0) == [0, 1, 2] and p2p._stuck(z["ring order"], 1024) == []
    assert p2p._stuck(z["even/odd"], 0) == [] and p2p._stuck(z["batched"], 0) == []
    assert p2p._stuck(z["batched"], 0, in_order=True) == [0, 1, 2]


def test_stuck_judge_passes_the_model_and_names_each_mistake():
    ex = checks.exercise(p2p.EX_STUCK)
    inputs = ex.inputs()
    cases = inputs["cases"]
    assert any(p2p._stuck(c["programs"], c["eager_bytes"]) for c in cases)
    assert any(not p2p._stuck(c["programs"], c["eager_bytes"]) for c in cases)

    def answers(**mistake):
        return {"values": [p2p._stuck(c["programs"], c["eager_bytes"], **mistake) for c in cases],
                "types": ["list"] * len(cases)}

    assert "programs right" in ex.judge(inputs, answers())
    for mistake, hint in [({"eager": False}, "eager_bytes"), ({"in_order": True}, "posted together"),
                          ({"fifo": False}, "k-th send")]:
        with pytest.raises(CheckFailed, match=re.escape(hint)):
            ex.judge(inputs, answers(**mistake))
    with pytest.raises(CheckFailed, match="nobody sends"):
        ex.judge(inputs, {"values": [[] for _ in cases], "types": ["list"] * len(cases)})
    with pytest.raises(CheckFailed, match="return a list"):
        ex.judge(inputs, {"values": [None] * len(cases), "types": ["Anything"] * len(cases)})
    with pytest.raises(CheckFailed, match="answers"):
        ex.judge(inputs, {"values": [[]], "types": ["list"]})


def test_answers_become_plain_rank_lists():
    import numpy as np

    assert p2p._as_rank_list((2, 0, np.int64(1), 2)) == [0, 1, 2]
    assert p2p._as_rank_list({1, 0}) == [0, 1]
    for bad in (None, 3, "01", [0.0], [True], {0: 1}, [object()]):
        assert p2p._as_rank_list(bad) is None


def test_stuck_ranks_master_passes(capsys):
    run_in_process(p2p.EX_STUCK, None)
    assert f"passed: {p2p.EX_STUCK}" in capsys.readouterr().out


@pytest.mark.parametrize("path", wrong_answers(p2p.EX_STUCK), ids=lambda p: p.stem)
def test_stuck_ranks_wrong_answer_fails(path):
    with pytest.raises(CheckFailed, match=rf"{p2p.EX_STUCK}: expected stuck_ranks\(programs, eager_bytes=\d+\) for\n"
                                          r"    rank 0: "):  # the programs, rank by rank
        run_in_process(p2p.EX_STUCK, path.read_text())


# ---------------------------------------------------------------------------------- ex05_halo_exchange


def _good_halo_data(inputs: dict) -> dict:
    out = []
    for case in inputs["cases"]:
        blocks, w, n = case["blocks"], case["width"], case["world"]
        out.append({"status": "ok", "ranks": [{"left": blocks[(r - 1) % n][-w:], "right": blocks[(r + 1) % n][:w],
                                               "types": ["tensor", "tensor"], "block_unchanged": True}
                                              for r in range(n)]})
    return {"cases": out}


def test_halo_inputs_test_what_world_size_two_would_hide():
    inputs = checks.exercise(p2p.EX_HALO).inputs()
    assert [c["world"] for c in inputs["cases"]] == [3, 5]
    for c in inputs["cases"]:
        values = [v for b in c["blocks"] for v in b]
        assert len(set(values)) == len(values) and all(v == int(v) for v in values)  # distinct, exact
        assert all(len(b) >= c["width"] for b in c["blocks"]) and any(len(b) >= 2 * c["width"] + 1 for b in c["blocks"])


def test_the_halo_probe_stops_after_the_first_run_the_judge_fails():
    """A wrong answer costs one run's ranks (3), not both runs' (3 + 5); the judge fails it as on both runs."""
    ex = checks.exercise(p2p.EX_HALO)
    inputs = checks.plain(ex.inputs())
    good = _good_halo_data(inputs)["cases"]
    assert all(p2p._judged_right(c, g) for c, g in zip(inputs["cases"], good, strict=True))

    def halos_of_zeros(block, width):
        import torch

        return torch.zeros(width), torch.zeros(width)

    data = ex.probe(halos_of_zeros, inputs)
    assert len(data["cases"]) == 1 and data["cases"][0]["status"] == "ok", data
    with pytest.raises(CheckFailed, match="on 3 ranks"):
        ex.judge(inputs, data)


def test_halo_judge_on_plain_data():
    ex = checks.exercise(p2p.EX_HALO)
    inputs = ex.inputs()
    assert "3 and 5 ranks" in ex.judge(inputs, _good_halo_data(inputs))

    swapped = _good_halo_data(inputs)
    for r in swapped["cases"][0]["ranks"]:
        r["left"], r["right"] = r["right"], r["left"]
    if inputs["cases"][0]["width"] > 0:
        with pytest.raises(CheckFailed, match="swapped|which end|neighbours"):
            ex.judge(inputs, swapped)

    early = _good_halo_data(inputs)
    w = inputs["cases"][0]["width"]
    early["cases"][0]["ranks"][0]["left"] = [0.0] * w
    early["cases"][0]["ranks"][0]["right"] = [0.0] * w
    with pytest.raises(CheckFailed, match="before waiting"):
        ex.judge(inputs, early)

    changed = _good_halo_data(inputs)
    changed["cases"][1]["ranks"][2]["block_unchanged"] = False
    with pytest.raises(CheckFailed, match="own block"):
        ex.judge(inputs, changed)

    hung = {"cases": [{"status": "error", "message": "rank 1 failed first: RuntimeError: Timed out waiting 5000ms"}]}
    with pytest.raises(CheckFailed, match="to finish.*deadlock"):
        ex.judge(inputs, hung)
    refused = {"cases": [{"status": "error", "message": "RuntimeError: ex05_halo_exchange: dist.all_gather is not "
                                                        "available in this exercise; ..."}]}
    with pytest.raises(CheckFailed, match="not available"):
        ex.judge(inputs, refused)
    with pytest.raises(CheckFailed, match="2 runs"):
        ex.judge(inputs, {"cases": _good_halo_data(inputs)["cases"][:1]})
    with pytest.raises(CheckFailed, match="two 1-D tensors"):
        bad = _good_halo_data(inputs)
        bad["cases"][0]["ranks"][1] = {"left": None, "right": None, "types": ["NoneType"], "block_unchanged": True}
        ex.judge(inputs, bad)


def test_halo_exchange_master_passes(capsys):
    t0 = time.perf_counter()
    run_in_process(p2p.EX_HALO, None)
    assert f"passed: {p2p.EX_HALO}" in capsys.readouterr().out
    assert time.perf_counter() - t0 < 60


@pytest.mark.parametrize("stem, message", [
    ("ex05_halo_exchange", r"to finish on \d ranks, width \d, blocks of \[[\d, ]+\] float32 values, saw it hung "
                           r"until the timeout .*\nrank \d: .*in line \d+ of your code: `dist\.send\("),  # deadlock
    ("ex05_halo_exchange__wrong_tag", "hung until the timeout"),     # gloo matches tags
    ("ex05_halo_exchange__swapped", "swapped|which end"),
    ("ex05_halo_exchange__wrong_peer", "swapped"),
    ("ex05_halo_exchange__off_by_one_slice", "halo"),
    ("ex05_halo_exchange__neighbours_two_away", "halo"),
    ("ex05_halo_exchange__no_wait", "before waiting"),
    ("ex05_halo_exchange__all_gather", "not available in this exercise"),
    ("ex05_halo_exchange__into_block", "own block"),
])
def test_halo_exchange_wrong_answer_fails(stem, message):
    t0 = time.perf_counter()
    with pytest.raises(CheckFailed, match=message):
        run_in_process(p2p.EX_HALO, (WRONG / f"{stem}.py").read_text())
    assert time.perf_counter() - t0 < 60  # a deadlock ends at the group's timeout, not the launcher's


def test_every_wrong_answer_file_is_tested():
    stems = {p.stem for p in WRONG.glob("*.py")}
    tested = {"ex05_halo_exchange", "ex05_halo_exchange__wrong_tag", "ex05_halo_exchange__swapped",
              "ex05_halo_exchange__wrong_peer", "ex05_halo_exchange__off_by_one_slice",
              "ex05_halo_exchange__neighbours_two_away", "ex05_halo_exchange__no_wait",
              "ex05_halo_exchange__all_gather", "ex05_halo_exchange__into_block"}
    assert {s for s in stems if s.startswith("ex05_halo")} == tested
    assert {"ex05_stuck_ranks", "ex05_stuck_ranks__ops_in_order", "ex05_stuck_ranks__no_fifo"} <= stems


def test_exercises_end_to_end_in_a_kernel():
    """The real path once per exercise: a fresh kernel runs setup cells, solution and check cell."""
    nb = notebook()
    text, err = run_cells(exercise_cells(nb, p2p.EX_STUCK, (WRONG / "ex05_stuck_ranks.py").read_text()))
    assert err == "CheckFailed" and "eager_bytes" in text, text
    text, err = run_cells(exercise_cells(nb, p2p.EX_HALO, None))
    assert err is None and f"passed: {p2p.EX_HALO}" in text, text


# ---------------------------------------------------------------------- the notebook's functions on gloo


@pytest.fixture(scope="module")
def nb():
    return notebook_functions(notebook(), "__lesson05__")


@pytest.fixture(scope="module")
def gloo_pool():
    with launch.Pool(2, backend="gloo") as pool:
        yield pool


def test_gloo_send_and_wait_hold_the_host_isend_does_not(nb, gloo_pool):
    delay = 200
    rows = {r["call"]: r for r in gloo_pool.run(nb["wait_semantics"], delay, 1 << 16)[0]}
    assert rows["send"]["held_ms"] > 0.8 * delay
    assert rows["isend"]["held_ms"] < 0.25 * delay and rows["isend"]["completed"] is False
    assert rows["isend + wait()"]["held_ms"] > 0.8 * delay and rows["isend + wait()"]["completed"] is True
    assert rows["isend + wait(timeout)"]["held_ms"] > 0.8 * delay
    assert all(r["done_ms"] > 0.8 * delay for r in rows.values())


def test_gloo_touching_buffers_before_wait(nb, gloo_pool):
    got = gloo_pool.run(nb["touch_before_wait"], 200, 1 << 16)[1]
    values = list(got.values())
    assert values == [2.0, 0.0, 3.0]  # the send read x after fill_; y empty before wait, full after
    assert nb["race_verdict"](values[0]) == "the fill_ changed x before the send read it"


def test_race_verdict_says_who_got_to_x_first(nb):
    assert nb["race_verdict"](1.0) == "the send read x before the fill_ changed it"
    assert nb["race_verdict"](2.0) == "the fill_ changed x before the send read it"
    assert "a mix arrived" in nb["race_verdict"](1.5)


def test_gloo_basics(nb, gloo_pool):
    out = gloo_pool.run(nb["hello_p2p"])
    assert "[0.0, 1.0, 2.0, 3.0]" in out[1] and "returned 0" in out[1]
    tags = gloo_pool.run(nb["any_source_and_tags"], 1.0)
    assert "from rank 0" in tags[1]["recv without src"]
    assert all("no match" in tags[r]["tag 7 -> tag 8"] for r in (0, 1))
    shift = gloo_pool.run(nb["ring_shift"], 4)[1]
    assert shift.startswith("rank 1 received 0") and "(2 operations, 2 Work(s)" in shift  # one per operation
    rows = launch.run(nb["first_calls"], 256, nproc=2, backend="gloo")
    assert [len(v) for v in rows.values()] == [1, 1] and len(rows[0][0]["call_ms"]) == 3


def test_gloo_zoo_outcomes_and_time(nb):
    t0 = time.perf_counter()
    ranks = nb["by_rank"](launch.run(nb["run_zoo"], {"small": 1024, "large": 4 * MiB}, 1.0, nproc=3, backend="gloo"))
    elapsed = time.perf_counter() - t0
    stuck = nb["stuck_by_case"](ranks)
    for size in ("small", "large"):  # gloo: every send waits for its receive, at any size
        assert stuck[("send/send", size)] == [0, 1] and stuck[("recv/recv", size)] == [0, 1]
        assert stuck[("ring order", size)] == [0, 1, 2]
        assert stuck[("even/odd", size)] == [] and stuck[("batched", size)] == []
        for name, programs in nb["zoo_programs"](3, 1024).items():
            assert stuck[(name, size)] == p2p._stuck(programs, 0)
    assert elapsed < 45, elapsed


def test_a_hang_ends_at_the_timeout_with_every_stack_and_leaves_nothing(nb):
    pool = launch.Pool(2, backend="gloo")
    pids = pool.pids
    t0 = time.perf_counter()
    with pytest.raises(launch.WorkerTimeout) as err:
        pool.run(nb["ring_send_first"], 256, timeout=3)
    assert time.perf_counter() - t0 < 10
    text = str(err.value)
    for r in (0, 1):  # every rank's stack, down to the send it is stuck in
        assert re.search(rf"where rank {r} was.*in ring_send_first.*in send\n", text, re.S), text
    assert pool.closed
    time.sleep(0.2)
    for pid in pids:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_halo_demo_runs_the_master_on_two_gloo_ranks_too(nb):
    # With two ranks both neighbours are one rank: the master's posting order keeps the halos apart.
    out = launch.run(nb["halo_demo"], nb["halo_exchange"], 2, nproc=2, backend="gloo")
    assert out[0] == "rank 0: [13.0, 14.0] | [0.0, 1.0, 2.0, 3.0, 4.0] | [10.0, 11.0]", out
    assert out[1] == "rank 1: [3.0, 4.0] | [10.0, 11.0, 12.0, 13.0, 14.0] | [0.0, 1.0]", out


# -------------------------------------------------------------------------------- NCCL (two GPUs or more)


@pytest.fixture(scope="module")
def nccl_pool():
    with launch.Pool(2, backend="nccl") as pool:
        yield pool


@pytest.mark.multigpu
def test_nccl_wait_makes_the_stream_wait_not_the_host(nb, nccl_pool):
    delay = 200
    rows = {r["call"]: r for r in nccl_pool.run(nb["wait_semantics"], delay, 256 * MiB // 4)[0]}  # as the notebook
    assert rows["send"]["held_ms"] < 0.25 * delay, rows
    assert rows["isend"]["held_ms"] < 0.25 * delay and rows["isend"]["completed"] is False, rows
    assert rows["isend + wait()"]["held_ms"] < 0.25 * delay and rows["isend + wait()"]["completed"] is False, rows
    assert rows["isend + wait(timeout)"]["held_ms"] > 0.8 * delay, rows  # wait(timeout) holds the host
    assert all(r["done_ms"] > 0.8 * delay for r in rows.values()), rows


@pytest.mark.multigpu
def test_nccl_touching_buffers_and_basics(nb, nccl_pool):
    got = list(nccl_pool.run(nb["touch_before_wait"], 200, MiB // 4)[1].values())
    assert got[1] == 0.0 and got[2] == 3.0, got  # read before wait: the old zeros; after wait: the message
    assert 1.0 <= got[0] <= 2.0, got  # the send raced with fill_: either value, or a mix
    out = nccl_pool.run(nb["hello_p2p"])
    assert "[0.0, 1.0, 2.0, 3.0]" in out[1]
    tags = nccl_pool.run(nb["any_source_and_tags"], 3.0)
    assert "from rank" not in tags[1]["recv without src"]  # NCCL has no any-source receive
    assert all("matched" in tags[r]["tag 7 -> tag 8"] for r in (0, 1)), tags  # NCCL ignores tags
    shift = nccl_pool.run(nb["ring_shift"], 4)[1]
    assert shift.startswith("rank 1 received 0") and "(2 operations, 1 Work(s)" in shift  # one for the batch


@pytest.mark.multigpu
def test_nccl_first_call_is_slow_without_device_id(nb):
    ranks = nb["by_rank"](launch.run(nb["first_calls"], 256, nproc=2, backend="nccl"))
    for rows in ranks:
        lazy, eager = rows
        assert "device_id" in eager["variant"] and "device_id" not in lazy["variant"]
        assert lazy["call_ms"][0] > 5 * max(lazy["call_ms"][1:]), rows   # the first call built the communicator
        assert eager["call_ms"][0] < lazy["call_ms"][0], rows
        assert eager["init_ms"] > lazy["init_ms"], rows                  # ... which device_id moved into init
        assert eager["call_ms"][0] > 5 * max(eager["call_ms"][1:]), rows  # "slow either way" (the prose)


@pytest.mark.multigpu
def test_nccl_zoo_runs_every_case_and_agrees_with_the_model_somewhere(nb):
    world = min(NCCL_GPUS, 3)
    sizes = {"small": 1024, "large": 256 * MiB}
    t0 = time.perf_counter()
    ranks = nb["by_rank"](launch.run(nb["run_zoo"], sizes, 3.0, nproc=world, backend="nccl", timeout=300))
    elapsed = time.perf_counter() - t0
    stuck = nb["stuck_by_case"](ranks)
    print(json.dumps({f"{k[0]} {k[1]}": v for k, v in stuck.items()}), f"{elapsed:.1f} s")
    for size in sizes:
        assert stuck[("recv/recv", size)] == [0, 1]
        assert stuck[("even/odd", size)] == [] and stuck[("batched", size)] == []
    hows = {row["how"] for rows in ranks for row in rows if row["stuck"]}
    assert not any("host was still inside" in h for h in hows), hows  # NCCL never held the host
    models = [{(name, size): p2p._stuck(progs, eager) for size, n in sizes.items()
               for name, progs in nb["zoo_programs"](world, n).items()} for eager in (0, 1024, 128 * MiB, 256 * MiB)]
    assert stuck in models, stuck  # some eager_bytes reproduces the measured column
    assert elapsed < 120, elapsed


@pytest.mark.multigpu
def test_nccl_halo_and_gpu_to_gpu(nb, nccl_pool):
    out = nccl_pool.run(nb["halo_demo"], nb["halo_exchange"], 2)
    assert out[0] == "rank 0: [13.0, 14.0] | [0.0, 1.0, 2.0, 3.0, 4.0] | [10.0, 11.0]", out
    g2g = nb["gpu_to_gpu"]([1 * MiB, 256 * MiB])
    results = g2g["results"]
    assert {r["op"] for r in results} == {"dst.copy_(src)", 'src.to("cuda:1")', "NCCL send/recv"}
    big = max(r["algbw_gbps"] for r in results if r["op"] == "NCCL send/recv" and r["size_bytes"] == 256 * MiB)
    print(g2g["link"], f"NCCL send/recv 256 MiB: {big:.0f} GB/s")
    if g2g["link"]["gbps"]:
        assert 0.3 * g2g["link"]["gbps"] < big <= 1.05 * g2g["link"]["gbps"], (big, g2g["link"])
