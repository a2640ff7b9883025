"""Lesson 10 (debugging distributed jobs): the notebook's conventions; every fault of the lesson's table on gloo
ranks, under the tools the table shows it with, against what the prose and the table say, with no worker left
behind; the three checks' judges on plain data; the masters' solutions and the wrong answers end to end on CPU.

The fault runs and the diagnose check's runs are made once per module (they start ranks: seconds each)."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import psutil
import pytest

from course_utils import checks
from course_utils.checks import CheckFailed
from course_utils.checks import debugging_distributed as c10
from tests.exercise_cells import notebook_functions
from tests.launch_helpers import children

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "10_debugging_distributed.ipynb"
WRONG = ROOT / "tests" / "wrong_answers" / NOTEBOOK.stem
EXERCISES = {c10.EX_DIAG: "diagnose", c10.EX_UNEVEN: "train_uneven", c10.EX_SKIP: "train_skip"}


def notebook() -> dict:
    return json.loads(NOTEBOOK.read_text())


def code_cells() -> list[dict]:
    return [c for c in notebook()["cells"] if c["cell_type"] == "code"]


def own_workers() -> list[int]:
    """The launcher's processes under this test process still alive: ranks (fresh workers, or forked by a fork
    server, whose command line they keep) and fork servers."""
    left = []
    for p in children(psutil.Process()):
        try:
            if any("course_utils.launch." in part for part in p.cmdline()):
                left.append(p.pid)
        except psutil.NoSuchProcess:
            pass
    return left


def wrong(stem: str) -> str:
    return (WRONG / f"{stem}.py").read_text()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fork_server", [True, False])
def test_what_counts_workers_left_sees_live_ranks(fork_server, monkeypatch):
    # the notebook's workers_left() and these tests' own_workers() must see ranks however they were started
    # (forked CPU ranks are the kernel's grandchildren), or every "nothing left running" above proves nothing
    from course_utils import launch
    from course_utils.launch import group

    monkeypatch.setattr(group, "use_fork_server", lambda gpus: fork_server)  # fresh: as GPU ranks start
    workers_left = notebook_functions(notebook(), "__lesson10__")["workers_left"]
    with launch.Pool(2, backend="gloo") as pool:
        assert set(pool.pids) <= set(own_workers()) and set(pool.pids) <= set(workers_left())
    assert own_workers() == [] and workers_left() == []


# ------------------------------------------------------------------------------- the notebook's conventions


def test_the_exercises_are_the_ones_the_tests_know():
    graded = {c["metadata"]["nbgrader"]["grade_id"] for c in code_cells()
              if c["metadata"].get("nbgrader", {}).get("grade")}
    assert graded == set(EXERCISES) and all(checks.exercise(ex).entry == e for ex, e in EXERCISES.items())


def test_the_notebook_goes_on_after_unsolved_exercises():
    # Cells after a check call none of the exercise's names unguarded (a stub raises NotImplementedError).
    cells = code_cells()
    after = False
    for c in cells:
        src = "".join(c["source"])
        if c["metadata"].get("nbgrader", {}).get("grade_id") == c10.EX_DIAG:
            after = True
            continue
        if after and "nbgrader" not in c["metadata"]:
            for entry in EXERCISES.values():
                if re.search(rf"\b{entry}\(", src):
                    assert "except NotImplementedError" in src, src


# ----------------------------------------------------------------------------- the fault matrix on gloo

RUNS = [(name, "timeout") for name in ("extra collective", "collective under rank 0", "shape mismatch",
                                        "type mismatch", "stalled rank", "crashed rank", "send/recv deadlock",
                                        "uneven data")]
RUNS += [("stalled rank", "stacks"), ("type mismatch", "stacks"), ("shape mismatch", "DETAIL"),
         ("type mismatch", "DETAIL"), ("collective under rank 0", "DETAIL"), ("stalled rank", "monitored_barrier"),
         ("uneven data", "monitored_barrier")]


@pytest.fixture(scope="module")
def nb():
    return notebook_functions(notebook(), "__lesson10__")


@pytest.fixture(scope="module")
def matrix(nb):
    """Every (fault, tool) the notebook runs, run here by the notebook's own run_fault."""
    assert sorted(nb["FAULTS"]) == sorted({name for name, _ in RUNS})
    t0 = time.perf_counter()
    out = {(name, tool): nb["run_fault"](name, tool) for name, tool in RUNS}
    out["seconds"] = time.perf_counter() - t0
    return out


def test_the_notebook_runs_the_same_matrix():
    text = "".join("".join(c["source"]) for c in code_cells())
    for name, tool in RUNS[len(FAULT_NAMES):]:
        assert f'"{name}"' in text and f'"{tool}"' in text


FAULT_NAMES = [name for name, tool in RUNS if tool == "timeout"]


@pytest.mark.slow
def test_nothing_is_left_running_after_any_fault(matrix):
    for key, report in matrix.items():
        if key != "seconds":
            assert report["left"] == [], (key, report["left"])
    assert own_workers() == []
    # a bound for a hang, not a benchmark: a 2-core machine running the rest of the suite beside it took 143 s
    assert matrix["seconds"] < 300, matrix["seconds"]


@pytest.mark.slow
def test_group_timeout_column(matrix):
    def text(name):
        return matrix[name, "timeout"]["text"]

    gone = re.compile(r"Connection (closed|reset) by peer")  # gloo says either when the other side exited
    assert text("extra collective").startswith("rank 1 failed first")
    assert gone.search(text("extra collective")) and "rank 0: finished normally" in text("extra collective")
    under0 = text("collective under rank 0")
    assert under0.startswith("rank 0 failed first") and gone.search(under0)
    assert "rank 1: finished normally" in under0 and "rank 2: finished normally" in under0
    shape = text("shape mismatch")
    assert "SIGABRT" in shape and "Received data size doesn't match expected size" in shape, shape
    for name, op in (("type mismatch", "recv"), ("send/recv deadlock", "send")):
        assert re.search(rf"Timed out waiting 2000ms for {op} operation", text(name)), text(name)
        # Both ranks waited; the other one gave up too, or (its timeout a moment later, on a busy machine) saw the
        # first one exit.
        assert "also failed" in text(name) or "stopped waiting: its connection closed" in text(name), text(name)
    stalled = text("stalled rank")
    assert stalled.startswith("rank 0 failed first") and "Timed out waiting 2000ms" in stalled
    assert "rank 1: was still running and has been stopped" in stalled
    crashed = text("crashed rank")
    assert crashed.startswith("rank 1 failed first: ValueError: corrupt sample in batch 17")
    assert "rank 0: stopped waiting: its connection closed" in crashed
    uneven = text("uneven data")
    assert uneven.startswith("rank 0 failed first") and gone.search(uneven)
    assert "rank 1: finished normally" in uneven


@pytest.mark.slow
def test_stacks_column(matrix, nb):
    stalled = matrix["stalled rank", "stacks"]["text"]
    assert f"ranks 0, 1 were still running after the {nb['HANG_S']:g} s timeout" in stalled
    assert re.search(r"where rank 1 was.*\n.*in stalled_rank\n\s+time\.sleep\(NEVER_S\)", stalled), stalled
    assert re.search(r"where rank 0 was.*\n.*in stalled_rank\n\s+dist\.all_reduce\(x, group=g\)", stalled), stalled
    line = nb["summary"](matrix["type mismatch", "stacks"])
    assert line == ("hang, stopped by the launcher: rank 0 in `dist.all_reduce(x, group=g)`; "
                    "rank 1 in `dist.broadcast(x, src=0, group=g)`"), line


@pytest.mark.slow
def test_detail_column(matrix, nb):
    shape = matrix["shape mismatch", "DETAIL"]["text"]
    assert "Detected mismatch between collectives" in shape and "TensorShape=[4]" in shape
    assert "TensorShape=[5]" in shape
    line = nb["summary"](matrix["shape mismatch", "DETAIL"])
    assert ("rank 0 ALLREDUCE [4] vs rank 1 ALLREDUCE [5]" in line
            or "rank 1 ALLREDUCE [5] vs rank 0 ALLREDUCE [4]" in line), line
    kinds = matrix["type mismatch", "DETAIL"]["text"]
    assert "OpType=ALLREDUCE" in kinds and "OpType=BROADCAST" in kinds
    under0 = matrix["collective under rank 0", "DETAIL"]["text"]
    assert "Ranks 1, 2 failed to pass monitoredBarrier in 2000 ms" in under0, under0


@pytest.mark.slow
def test_monitored_barrier_column(matrix, nb):
    for name in ("stalled rank", "uneven data"):
        report = matrix[name, "monitored_barrier"]
        assert "Ranks 1 failed to pass monitoredBarrier in 2000 ms" in report["text"], report["text"]
        assert "at `dist.monitored_barrier(" in nb["summary"](report)


@pytest.mark.slow
def test_the_table_shows_every_run(matrix, nb, capsys):
    reports = {k: v for k, v in matrix.items() if k != "seconds"}
    nb["fault_table"](reports)
    out = capsys.readouterr().out
    for name in nb["FAULTS"]:
        assert name in out
    assert out.count("hang, stopped by the launcher") == 2
    assert out.count("failed to pass monitoredBarrier") == 3


# ------------------------------------------------------------------------------------------ ex10_diagnose


@pytest.fixture(scope="module")
def diag_inputs():
    inputs = c10.diagnose_inputs()
    assert own_workers() == []
    return inputs


def judge_answer(inputs: dict, answer, separate_process: bool = False) -> str:
    """probe then judge, as check() does; separate_process: the answer runs without the check's memory, as in the
    grader's probe process."""
    ex = checks.exercise(c10.EX_DIAG)
    saved = dict(c10._TRUTH)
    if separate_process:
        c10._TRUTH.clear()
    try:
        data = checks.from_bytes(checks.to_bytes(ex.probe(answer, checks.plain(inputs))))
    finally:
        c10._TRUTH.update(saved)
    return ex.judge(inputs, data)


def test_programs_put_the_fault_where_the_truth_says():
    import random

    for seed in range(40):
        rng = random.Random(seed)
        for fault in c10.FAULTS:
            source, line = c10.write_program(fault, rng)
            compile(source, "<p>", "exec")
            at = source.splitlines()[line - 1].strip()
            want = {"crash": ("raise", "label =", "ratio ="), "stall": ("time.sleep",),
                    "shape mismatch": ("dist.",), "extra collective": ("dist.",)}[fault]
            assert at.startswith(want), (fault, at)
            if fault == "extra collective":
                assert source.splitlines()[line - 2].strip() == "if rank == culprit:"


@pytest.mark.slow
def test_diagnose_runs_are_fresh_and_cover_every_fault(diag_inputs):
    truth = c10._TRUTH[diag_inputs["token"]]
    assert sorted(t[1] for t in truth) == sorted(c10.FAULTS)
    assert sorted(diag_inputs) == ["reports", "token"] and len(diag_inputs["reports"]) == 4
    for report, (rank, fault, line) in zip(diag_inputs["reports"], truth, strict=True):
        assert f"line {line}, in train_step" in report, (fault, report)
        if fault == "stall":
            assert "were still running" in report and "time.sleep" in report
        if fault == "extra collective":
            assert re.match(rf"rank {rank} was still running", report), report
        if fault == "crash":
            assert report.startswith(f"rank {rank} failed first")
        if fault == "shape mismatch":
            assert "Detected mismatch between collectives" in report


@pytest.mark.slow
def test_diagnose_master_passes(diag_inputs, nb):
    assert "4 fresh faulty runs diagnosed" in judge_answer(diag_inputs, nb["diagnose"])


@pytest.mark.slow
@pytest.mark.parametrize("stem, message", [
    ("ex10_diagnose", r"for the report\n(    .*\n)+  the diagnosis \(\d, 'extra collective', \d+\), saw"),
    ("ex10_diagnose__hard_coded", "the diagnosis"),
    ("ex10_diagnose__launcher_frame", "where the culprit stopped"),
])
def test_diagnose_wrong_answers_fail(diag_inputs, stem, message):
    answer = notebook_functions(notebook(), "__lesson10__", replace={c10.EX_DIAG: wrong(stem)})["diagnose"]
    with pytest.raises(CheckFailed, match=message):
        judge_answer(diag_inputs, answer)


@pytest.mark.slow
def test_diagnose_reading_the_checks_memory_earns_nothing(diag_inputs):
    answer = notebook_functions(notebook(), "__lesson10__",
                                replace={c10.EX_DIAG: wrong("ex10_diagnose__reads_the_check")})["diagnose"]
    judge_answer(diag_inputs, answer)  # in one process (a notebook) it finds the answers ...
    with pytest.raises(CheckFailed, match=c10.EX_DIAG):  # ... not where the grader runs it
        judge_answer(diag_inputs, answer, separate_process=True)


def test_diagnose_judge_on_plain_data():
    ex = checks.exercise(c10.EX_DIAG)
    c10._TRUTH["t"] = [[1, "stall", 9], [0, "crash", 7]]
    inputs = {"reports": ["r1", "r2"], "token": "t"}
    assert "2 fresh faulty runs" in ex.judge(inputs, {"diagnoses": [[1, "stall", 9], [0, "crash", 7]], "types": []})
    with pytest.raises(CheckFailed, match="not in a collective|outside"):
        ex.judge(inputs, {"diagnoses": [[1, "extra collective", 9], [0, "crash", 7]], "types": []})
    with pytest.raises(CheckFailed, match="odd one out"):
        ex.judge(inputs, {"diagnoses": [[0, "stall", 9], [0, "crash", 7]], "types": []})
    with pytest.raises(CheckFailed, match="one of"):
        ex.judge(inputs, {"diagnoses": [[1, "hang", 9], [0, "crash", 7]], "types": []})
    with pytest.raises(CheckFailed, match="an int, a str, an int"):
        ex.judge(inputs, {"diagnoses": [None, [0, "crash", 7]], "types": ["Anything", "tuple"]})
    with pytest.raises(CheckFailed, match="unknown token"):
        ex.judge({"reports": ["r1"], "token": "forged"}, {"diagnoses": [[1, "stall", 9]], "types": []})
    assert c10._as_diagnosis((1, "stall", 9)) == [1, "stall", 9]
    for bad in ((True, "stall", 9), (1, "stall", 9.0), [1, "stall"], "1 stall 9", None):
        assert c10._as_diagnosis(bad) is None
    del c10._TRUTH["t"]


# ------------------------------------------------------------------------------ ex10_fix_uneven / _skip


def run_loop(ex: str, answer) -> str:
    exercise = checks.exercise(ex)
    inputs = checks.plain({**exercise.inputs(), "gpu": False})
    data = checks.from_bytes(checks.to_bytes(exercise.probe(answer, inputs)))
    try:
        return exercise.judge(inputs, data)
    finally:
        assert own_workers() == []


def test_loop_reference_stops_and_skips_together():
    inputs = c10.loop_inputs(1)
    w_short, steps, skipped = c10.loop_reference(inputs, [2, 5], [[], []])
    assert steps == 2 and skipped == []
    w_long, _, _ = c10.loop_reference(inputs, [3, 5], [[], []])
    assert any(not bool((a == b).all()) for a, b in zip(w_short, w_long, strict=True))
    w, steps, skipped = c10.loop_reference(inputs, [6, 6], [[4], [1]])
    assert steps == 6 and skipped == [1, 4]
    assert all(bool(p.isfinite().all()) for p in w)


@pytest.mark.slow
@pytest.mark.parametrize("ex, entry", [(c10.EX_UNEVEN, "train_uneven"), (c10.EX_SKIP, "train_skip")])
def test_loop_masters_pass(nb, ex, entry):
    t0 = time.perf_counter()
    assert "weights as data-parallel SGD" in run_loop(ex, nb[entry])
    assert time.perf_counter() - t0 < 60


@pytest.mark.slow
@pytest.mark.parametrize("ex, stem, message", [
    (c10.EX_UNEVEN, "ex10_fix_uneven",
     r"the loop to finish on 2 ranks holding different numbers of batches \(2 to 6\), saw .*all ranks call the same"),
    (c10.EX_UNEVEN, "ex10_fix_uneven__max_steps", "the loop to finish"),
    (c10.EX_UNEVEN, "ex10_fix_uneven__local_only", "stops after the shortest|averaged over the ranks"),
    (c10.EX_SKIP, "ex10_fix_skip", "the loop to finish|ANY rank.s loss"),  # one bad batch each: may not hang
    (c10.EX_SKIP, "ex10_fix_skip__own_steps_only", "ANY rank's loss"),
    (c10.EX_SKIP, "ex10_fix_skip__min_flag", "ANY rank's loss"),
])
def test_loop_wrong_answers_fail(ex, stem, message):
    entry = EXERCISES[ex]
    answer = notebook_functions(notebook(), "__lesson10__", replace={ex: wrong(stem)})[entry]
    t0 = time.perf_counter()
    with pytest.raises(CheckFailed, match=re.compile(message, re.S)):
        run_loop(ex, answer)
    assert time.perf_counter() - t0 < 60  # a hang ends at the group's few seconds, not the launcher's backstop


def test_loop_judge_on_plain_data():
    import torch

    ex = checks.exercise(c10.EX_UNEVEN)
    inputs = c10.loop_inputs(3)
    weights, steps, _ = c10.loop_reference(inputs, [4, 3], [[], []])
    good = {"ranks": [{"n": n, "bad": [], "value": steps, "type": "int", "weights": weights} for n in (4, 3)]}
    assert "all stopped after 3" in ex.judge(inputs, good)
    summed = {"ranks": [dict(r, weights=[w * 2 for w in weights]) for r in good["ranks"]]}
    with pytest.raises(CheckFailed, match="averaged over the ranks"):
        ex.judge(inputs, summed)
    with pytest.raises(CheckFailed, match="to return 3"):
        ex.judge(inputs, {"ranks": [dict(r, value=None, type="Anything") for r in good["ranks"]]})
    with pytest.raises(CheckFailed, match="to finish"):
        ex.judge(inputs, {"error": "rank 1 failed: RuntimeError: Timed out waiting 3000ms"})
    skip = checks.exercise(c10.EX_SKIP)
    weights, _, skipped = c10.loop_reference(inputs, [6, 6], [[2], [5]])
    ranks = [{"n": 6, "bad": b, "value": skipped, "type": "list", "weights": weights} for b in ([2], [5])]
    assert "skipped [2, 5]" in skip.judge(inputs, {"ranks": ranks})
    with pytest.raises(CheckFailed, match="ANY rank"):
        skip.judge(inputs, {"ranks": [dict(r, value=r["bad"]) for r in ranks]})
    assert type(weights[0]) is torch.Tensor


def test_every_wrong_answer_file_is_known():
    stems = {p.stem for p in WRONG.glob("*.py")}
    assert {s.split("__")[0] for s in stems} == set(EXERCISES)
    assert {"ex10_diagnose__hard_coded", "ex10_diagnose__reads_the_check", "ex10_diagnose__hangs",
            "ex10_fix_uneven__reads_the_check", "ex10_fix_skip__reads_the_check"} <= stems


# ------------------------------------------------------------------------------ section 8: the NCCL tools

STEM = NOTEBOOK.stem
GPU_KEYS = ("device", "nccl_debug", "flight_recorder")


def check_gpu_facts(data: dict) -> list[str]:
    """What section 8's prose says of each tool, on one run's data (live, or a recording); returns a summary."""
    device = data["device"]  # one "node" of one GPU per rank: rank 1 is on the second node
    assert len(device) == 2 and device[0].startswith("rank 0 (node 0, LOCAL_RANK 0): cuda:0 worked"), device
    assert device[1].startswith("rank 1 (node 1, LOCAL_RANK 0): ") and "worked" not in device[1], device
    lines = data["nccl_debug"]  # NCCL's own report: its version, the transports, the rings and trees it built
    for said in ("NCCL version", " via ", "Channel 00", "Tree 0 ", "Init COMPLETE"):
        assert any(said in line for line in lines), (said, lines)
    assert len(lines) <= 20, lines  # a few lines of each kind, not dozens of channels
    fr = data["flight_recorder"]
    # rank 0's all-reduce timed out and the launcher stopped it; rank 1 may still be asleep then too, when the ranks
    # took long to start ("ranks 0, 1 were still running", seen on a loaded 4-GPU box)
    still = re.match(r"ranks? ([\d, ]+) (?:was|were) still running", fr["ended"])
    assert still and "0" in still.group(1).replace(" ", "").split(","), fr
    assert any(f.startswith("fr_rank_0") for f in fr["files"]), fr  # ... and it dumped its buffer
    text = "\n".join(fr["analysis"])
    # fr_trace reports the collective that not every rank joined, and who is missing from it
    assert re.search(r"all_?reduce", text, re.I) and re.search(r"missing[^\n]*\b1\b", text, re.I), text
    return [device[1], next(line for line in lines if "NCCL version" in line), fr["ended"],
            next(line for line in fr["analysis"] if re.search(r"missing", line, re.I))]


def test_the_notebook_records_every_gpu_tool():
    text = "".join("".join(c["source"]) for c in code_cells())
    assert set(re.findall(r'rec\.take\("(\w+)"', text)) == set(GPU_KEYS)


def test_recording_shows_the_gpu_facts():
    from course_utils import reference

    if STEM not in reference.available():
        pytest.skip(f"no reference recording {STEM!r} yet: make it on two GPUs with "
                    f"python benchmarks/record_references.py {STEM}")
    rec = reference.load(STEM)
    assert rec.provenance.get("gpu_count", 0) >= 2 and set(GPU_KEYS) <= set(rec.data)
    print("\n".join(check_gpu_facts(rec.data)))


@pytest.mark.parametrize("ended, right", [
    ("rank 0 was still running after the 30 s timeout, so every worker was stopped.", True),
    ("ranks 0, 1 were still running after the 30 s timeout, so every worker was stopped.", True),
    ("rank 1 was still running after the 30 s timeout, so every worker was stopped.", False),
    ("ranks 10, 11 were still running after the 30 s timeout, so every worker was stopped.", False),
    ("every rank finished", False),
])
def test_gpu_facts_ask_that_rank_0_never_finished(ended, right):
    """The recorded facts with only the flight recorder's ending changed: rank 0 must be among the stopped ranks."""
    from course_utils import reference

    if STEM not in reference.available():
        pytest.skip("no reference recording yet")
    data = {**reference.load(STEM).data}
    data["flight_recorder"] = {**data["flight_recorder"], "ended": ended}
    if right:
        check_gpu_facts(data)
    else:
        with pytest.raises(AssertionError):
            check_gpu_facts(data)


@pytest.mark.parametrize("ended, who", [
    ("rank 0 was still running after the 30 s timeout, so every worker was stopped.", "the launcher"),
    ("ranks 0, 1 were still running after the 30 s timeout, so every worker was stopped.", "the launcher"),
    ("rank 0 failed first: died with SIGABRT", "rank 0 itself"),
    ("rank 1 failed first: RuntimeError: boom", "not rank 0's watchdog"),
])
def test_the_flight_recorder_cell_says_who_ended_rank_0(nb, ended, who):
    """The prose after it explains both endings; the cell prints which one this run had."""
    assert nb["who_ended"](ended).startswith(who)


@pytest.mark.multigpu
def test_the_gpu_tools_live_show_the_facts(nb):
    """Section 8's three runs, live on two GPUs, by the notebook's own functions (no worker left behind)."""
    from course_utils import launch

    device = list(launch.run(nb["global_rank_as_device"], 1, nproc=2, backend="gloo", gpus=True,
                             timeout=nb["BACKSTOP_S"]).values())
    data = {"device": device, "nccl_debug": nb["nccl_debug_lines"](), "flight_recorder": nb["flight_recorder"]()}
    print("\n" + "\n".join(check_gpu_facts(data)))
    assert nb["who_ended"](data["flight_recorder"]["ended"]).startswith("the launcher")  # the prose's finding
    assert own_workers() == []
