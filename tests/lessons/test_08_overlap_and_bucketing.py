"""Lesson 08 (overlap and bucketing): the notebook's data-parallel versions on gloo ranks, both exercises'
judges on plain data, the exercises against the master's solutions and the wrong answers (all on the CPU),
the benchmark, and the facts the notebook's prose claims, checked on what it measured on two GPUs (live, or
its reference recording)."""

from __future__ import annotations

import ast
import functools
import json
import random
import re
from pathlib import Path

import pytest
import torch

from course_utils import checks, launch, reference
from course_utils.checks import overlap_and_bucketing as c08
from course_utils.grading import release
from tests.exercise_cells import execute_notebook, run_cells, run_in_process

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "08_overlap_and_bucketing.ipynb"
STEM = NOTEBOOK.stem
WRONG = ROOT / "tests" / "wrong_answers" / STEM
DP, SCHED = "ex08_bucketed_dp", "ex08_bucket_schedule"


@pytest.fixture(scope="module")
def notebook() -> dict:
    return json.loads(NOTEBOOK.read_text())


def code_cells(nb: dict) -> list[dict]:
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def cell(nb: dict, marker: str) -> str:
    """The source of the one code cell containing `marker` (cells are found by what they define: nbstripout
    renumbers ids)."""
    found = ["".join(c["source"]) for c in code_cells(nb) if marker in "".join(c["source"])]
    assert len(found) == 1, f"{len(found)} cells contain {marker!r}"
    return found[0]


def exercise_program(nb: dict, ex: str, wrong: str | None) -> list[str]:
    """Setup cells, the exercise's solution cell (with `wrong` in place of its blocks) and its check cell."""
    if wrong is not None:
        import nbformat

        nb = json.loads(nbformat.writes(release.substitute(nbformat.reads(json.dumps(nb), as_version=4),
                                                           {ex: wrong}, STEM)))
    cells = code_cells(nb)
    grade = [c["metadata"].get("nbgrader", {}).get("grade_id") for c in cells]
    setup = ["".join(c["source"]) for c in cells if "setup" in c["metadata"].get("tags", [])]
    return setup + ["".join(cells[grade.index(f"{ex}_solution")]["source"]), "".join(cells[grade.index(ex)]["source"])]


run_here = functools.partial(run_in_process, module="__lesson08__")


def wrong(ex: str) -> list[Path]:
    return sorted(WRONG.glob(f"{ex}*.py"))


# ------------------------------------------------------------------------------ the notebook's cells


def test_both_exercises_are_gradeable_on_a_cpu():
    for ex, entry in ((DP, "BucketedDP"), (SCHED, "bucket_schedule")):
        assert checks.exercise(ex).entry == entry and not checks.exercise(ex).needs_gpu


def test_the_student_versions_stub_keeps_the_class(notebook):
    setup = ["".join(c["source"]) for c in code_cells(notebook) if "setup" in c["metadata"].get("tags", [])]
    student = release.student_version(__import__("nbformat").reads(json.dumps(notebook), as_version=4), STEM)
    src = next(c.source for c in student.cells if c.get("metadata", {}).get("nbgrader", {}).get("grade_id")
               == f"{DP}_solution")
    ns: dict = {}
    exec(compile("\n".join(setup) + "\n" + src, "<student>", "exec"), ns)  # the class still defines ...
    with pytest.raises(NotImplementedError):  # ... and only using it says "not written yet"
        ns["BucketedDP"](torch.nn.Linear(2, 2), 1.0)


def test_no_solution_in_course_utils():
    for path in (ROOT / "course_utils").rglob("*.py"):
        text = path.read_text()
        assert "class BucketedDP" not in text and "def bucket_schedule" not in text, path


def test_measurements_go_through_the_recorder(notebook):
    src = "\n".join("".join(c["source"]) for c in code_cells(notebook))
    assert f'Recorder("{STEM}"' in src
    assert taken_keys(notebook) == {"nvlink", "nvlink_4_channels", "sockets"}
    runs = cell(notebook, "def study_with")
    assert "study_with(SOCKETS_ENV" in runs and "study_with(FEW_CHANNELS_ENV" in runs


def taken_keys(nb: dict) -> set[str]:
    src = "\n".join("".join(c["source"]) for c in code_cells(nb))
    return set(re.findall(r'rec\.take\("(\w+)"', src))


# ------------------------------------------------------------------------------ the versions, on gloo ranks


def definitions(nb: dict) -> dict:
    """The notebook's setup cells, then its functions, classes, imports and constants (no other cell's calls)."""
    ns: dict = {"__name__": "__lesson08__"}
    for c in code_cells(nb):
        if "setup" in c["metadata"].get("tags", []):  # parameters and imports: quick, plain, run whole
            exec(compile("".join(c["source"]), "<setup>", "exec"), ns)
            continue
        tree = ast.parse("".join(c["source"]))
        keep = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom))
                or (isinstance(n, ast.Assign) and all(isinstance(t, ast.Name) for t in n.targets)
                    and not any(isinstance(x, (ast.Call, ast.Name)) for x in ast.walk(n.value)))]
        exec(compile(ast.Module(body=keep, type_ignores=[]), "<notebook>", "exec"), ns)
    return ns


def backward_end(spans: list[dict], rank: int) -> float:
    return max(s["end_ms"] for s in spans if s["rank"] == rank and s["kind"] == "range" and s["name"] == "backward"
               and s["stream"] != "comm")


def first_allreduce(spans: list[dict], rank: int) -> float:
    forward = min(s["start_ms"] for s in spans if s["rank"] == rank and s["name"] == "forward")  # after the line-up
    starts = [s["start_ms"] for s in spans if s["rank"] == rank and s["kind"] == "comm" and s["stream"] != "host"
              and re.search("all_?reduce", s["name"].lower()) and s["start_ms"] >= forward]  # any stream: a
    return min(starts)  # blocking all_reduce runs on the caller's


def one_step(rank: int, spans: list[tuple]) -> dict:
    """run_strategy's result for one rank, with a timeline of (name, kind, stream, start, end) spans."""
    fields = ("name", "kind", "stream", "start_ms", "end_ms")
    return {"timeline": {"rank": rank, "host": "h", "mode": "kernels", "origin_ns": 0, "barrier_ms": None,
                         "spans": [dict(zip(fields, s, strict=True), rank=rank) for s in spans]}}


def test_step_numbers_count_communication_from_the_later_ranks_arrival(notebook):
    ns = definitions(notebook)

    def numbers(ranks):
        return ns["step_numbers"](ns["the_step"](ranks))

    ar = "ncclDevKernel_AllReduce_Sum_f32"
    rank0 = [("line up", "range", "default stream", -5.0, 0.0), (ar, "comm", "default stream", -5.0, -0.1),
             ("forward", "range", "default stream", 0.0, 1.0), ("gemm", "compute", "default stream", 0.0, 1.0),
             ("backward", "range", "default stream", 1.0, 4.0), ("gemm", "compute", "default stream", 1.0, 4.0),
             (ar, "comm", "comm", 2.0, 5.0),           # rank 1 starts its kernel at 3: 1 ms of waiting
             ("copy", "d2d", "default stream", 5.0, 5.5)]
    rank1 = [("forward", "range", "default stream", 0.5, 1.5), ("gemm", "compute", "default stream", 0.5, 3.0),
             (ar, "comm", "comm", 3.0, 5.0)]
    got = numbers([one_step(0, rank0), one_step(1, rank1)])
    # the line-up's all-reduce (before forward) is left out; compute 0-4 and 5-5.5; exposed: 4-5 of 3-5
    assert got == {"n": 1, "compute_ms": 4.5, "comm_ms": 3.0, "waiting_ms": [1.0, 0.0], "exposed_ms": 1.0,
                   "profiled_ms": 5.5}
    rank1[-1] = (ar, "comm", "comm", 4.5, 5.0)  # rank 1 arrives after rank 0's compute has ended
    late = numbers([one_step(0, rank0), one_step(1, rank1)])
    assert (late["waiting_ms"], late["exposed_ms"]) == ([2.5, 0.0], 0.5)
    rank0[6] = (ar, "comm", "comm", 4.8, 5.0)  # now rank 0 is the late one: rank 1 waits
    assert numbers([one_step(0, rank0), one_step(1, rank1)])["waiting_ms"] == [0.0, pytest.approx(0.3)]


def test_the_sweep_gives_each_cap_its_own_number_of_buckets(notebook):
    ns = definitions(notebook)
    # lesson 08's model in backward order: per block a bias of 4 KiB, a weight of 16 MiB, a bias of 16 KiB, ...
    grads = [(b, 0.0) for _ in range(12) for b in (4096, 16 * 2**20, 16384, 16 * 2**20)]
    caps = ns["sweep_caps_mb"](grads)
    assert [ns["bucket_count"](grads, c * 2**20) for c in caps] == [48, 24, 12, 8, 4, 2, 1]


def test_a_sweep_says_which_caps_make_the_same_buckets(notebook, capsys):
    """A sweep recorded with caps that make the same buckets (older caps) says their difference is noise."""
    import matplotlib

    matplotlib.use("Agg")
    ns = definitions(notebook)
    grads = [(b, 0.1 * i) for i, b in enumerate(b for _ in range(12) for b in (4096, 16 * 2**20, 16384, 16 * 2**20))]
    sw = {"caps_mb": [1.5, 6.0, 24.0], "buckets": [30.0, 28.0, 29.0], "ddp": [29.0, 28.5, 28.0]}
    ns["show_sweep"](sw, 20.0, grads, 0.05, 100.0, "t")
    out = capsys.readouterr().out
    assert "caps 1.5 and 6 MiB make the same 24 buckets: what separates their times is noise" in out, out
    ns["show_sweep"]({**sw, "caps_mb": ns["sweep_caps_mb"](grads)[:3]}, 20.0, grads, 0.05, 100.0, "t")
    assert "make the same" not in capsys.readouterr().out
    ns["plt"].close("all")


VERSIONS = ("each", "flat", "per_param", "buckets", "ddp")  # the notebook's data-parallel versions, in order


GROWTH = 1.5  # the notebook's: backward grows at least this much when the batch doubles (checked below)


def test_the_batch_is_picked_where_backward_outlasts_the_all_reduce_and_the_gpu_sets_the_pace(notebook):
    ns = definitions(notebook)
    assert ns["GROWTH"] == GROWTH
    pick = ns["pick_rows"]
    # host-bound at first (3.8 ms whatever the batch), then growing with it: 64 outlasts the all-reduce but
    # does not grow; 256 is the first to do both
    host_bound = {"64": 3.8, "128": 3.9, "256": 6.2, "512": 12.0}
    assert pick({"allreduce_ms": 1.4, "backward_ms": host_bound}) == 256
    assert ns["picks"](1.4, host_bound) == ["256", "512"]
    # growing but shorter than the all-reduce until 512
    assert pick({"allreduce_ms": 10.0, "backward_ms": host_bound}) == 512
    # neither condition met anywhere: the largest tried
    assert pick({"allreduce_ms": 50.0, "backward_ms": host_bound}) == 512
    # the first size is never picked: nothing to compare its growth with
    assert pick({"allreduce_ms": 1.0, "backward_ms": {"8": 5.0, "16": 6.0}}) == 16




def strategy(ns: dict, key: str):
    if key == "buckets":
        return ns["bucketed"](ns["BUCKET_CAP_MB"])
    return ns[{"each": "each_gradient", "flat": "one_flat", "per_param": "per_parameter", "ddp": "torch_ddp"}[key]]


@pytest.fixture(scope="module")
def gloo_pair(notebook):
    """The notebook's definitions and two gloo ranks, kept for the module (a timing may be measured again)."""
    ns = definitions(notebook)
    with launch.Pool(2, backend="gloo", timeout=300) as pool:
        yield ns, pool


def run_version(gloo_pair, key: str) -> dict:
    ns, pool = gloo_pair
    return pool.run(ns["run_strategy"], strategy(ns, key), 16, steps=1, warmup=0, timeout=300)


@pytest.fixture(scope="module")
def versions_on_gloo(gloo_pair):
    ns, pool = gloo_pair
    out = {"sizes": pool.run(ns["size_up"], [8, 16, 32], timeout=300)}
    for key in VERSIONS:
        out[key] = run_version(gloo_pair, key)
    return out


def test_ranks_agree_on_the_sizes(versions_on_gloo):
    a, b = versions_on_gloo["sizes"][0], versions_on_gloo["sizes"][1]
    assert a == b  # the slower rank's times on both: both stop sizing up at the same batch (else: a hang)


@pytest.mark.parametrize("key", VERSIONS)
def test_every_version_gives_the_full_batch_gradients(versions_on_gloo, key):
    for rank, r in versions_on_gloo[key].items():
        assert r["same_start"] is True, (key, rank)
        assert r["max_rel_err"] < 1e-5, (key, rank, r["max_rel_err"])


def starts_during_backward(result: dict) -> bool:
    spans = result[0]["timeline"]["spans"]
    return first_allreduce(spans, 0) < backward_end(spans, 0)


@pytest.mark.parametrize("key,during", [("each", False), ("flat", False), ("per_param", True), ("buckets", True),
                                        ("ddp", True)])
def test_which_versions_start_communication_during_backward(versions_on_gloo, gloo_pair, key, during):
    seen = [starts_during_backward(versions_on_gloo[key])]
    # A timing on a busy 2-core machine: a hook queues its all-reduce during backward, but gloo's thread may get
    # the CPU only after backward has ended. So the best of three runs; the
    # versions that all-reduce after backward cannot start early however the threads are scheduled.
    while during and not any(seen) and len(seen) < 3:
        seen.append(starts_during_backward(run_version(gloo_pair, key)))
    assert any(seen) is during, (key, seen)


# ------------------------------------------------------------------------------ ex08_bucket_schedule (CPU)


def test_schedule_model_on_hand_worked_cases():
    grads = [(100_000, 1.0), (100_000, 2.0), (100_000, 3.0), (100_000, 4.0)]
    assert c08.model_schedule(grads, 200_000, 0.02, 10.0) == [(2, 2.0, pytest.approx(2.04)),
                                                                (2, 4.0, pytest.approx(4.04))]
    comm_bound = c08.model_schedule([(4_000_000, 0.1), (4_000_000, 0.2)], 1, 0.05, 10.0)
    assert comm_bound == [(1, 0.1, pytest.approx(0.55)), (1, pytest.approx(0.55), pytest.approx(1.0))]
    assert c08.model_schedule([(300_000, 1.0), (300_000, 2.0), (100_000, 3.0)], 500_000, 0.03, 25.0)[1][0] == 1


def test_master_schedule_agrees_with_the_model(notebook):
    ns: dict = {}
    exec(exercise_program(notebook, SCHED, None)[-2], ns)
    rng = random.Random(8)
    for _ in range(500):
        case = c08.random_schedule(rng)
        got, want = ns["bucket_schedule"](*case), c08.model_schedule(*case)
        assert [x for b in got for x in b] == pytest.approx([x for b in want for x in b])


def test_schedule_inputs_are_fresh_and_plain():
    a, b = c08.schedule_inputs(), c08.schedule_inputs()
    assert a != b and len(a["cases"]) == len(c08.FIXED_SCHEDULES) + 6
    assert checks.plain(a) == checks.plain(checks.plain(a))


def test_schedule_judge_on_plain_data():
    inputs = checks.plain({**c08.schedule_inputs(seed=3), "gpu": False})
    right = [[list(b) for b in c08.model_schedule([tuple(g) for g in c["grads"]], c["cap_bytes"], c["alpha_ms"],
                                                  c["gbps"])] for c in inputs["cases"]]
    assert "all as the model predicts" in c08.schedule_judge(inputs, {"schedules": right})
    late = [[[n, a + 0.5, b + 0.5] for n, a, b in s] for s in right]
    with pytest.raises(checks.CheckFailed, match="to start at"):
        c08.schedule_judge(inputs, {"schedules": late})
    longer = [[[n, a, b + 0.5] for n, a, b in s] for s in right]
    with pytest.raises(checks.CheckFailed, match="to end at"):
        c08.schedule_judge(inputs, {"schedules": longer})
    with pytest.raises(checks.CheckFailed, match="buckets for"):
        c08.schedule_judge(inputs, {"schedules": [s[:-1] if len(s) > 1 else s + s for s in right]})
    with pytest.raises(checks.CheckFailed, match="one schedule per case"):
        c08.schedule_judge(inputs, {"schedules": right[:-1]})
    with pytest.raises(checks.CheckFailed, match="a list of"):
        c08.schedule_judge(inputs, {"schedules": ["a numpy.ndarray, not a list"] + right[1:]})


def test_schedule_probe_keeps_numbers_and_describes_the_rest():
    inputs = {"cases": [{"grads": [[10, 1.0]], "cap_bytes": 1.0, "alpha_ms": 0.1, "gbps": 1.0}] * 3}
    answers = iter([[(1, 0.5, 1.5)], [(True, 0.5, 1.5)], 7])
    data = c08.schedule_probe(lambda *a: next(answers), inputs)
    assert data["schedules"][0] == [[1, 0.5, 1.5]]
    assert type(data["schedules"][1][0]) is str  # a bool is not a count
    assert "not a list" in data["schedules"][2]


def test_schedule_master_passes_in_a_fresh_kernel(notebook):
    text, error = run_cells(exercise_program(notebook, SCHED, None))
    assert error is None and checks.PASS_MARKER in text, text


@pytest.mark.parametrize("path", wrong(SCHED), ids=lambda p: p.stem)
def test_schedule_wrong_answers_fail(notebook, path):
    text, error = run_here(exercise_program(notebook, SCHED, path.read_text()))
    assert error == "CheckFailed", text
    assert re.search(r" for grads=\[\(.*\], cap_bytes=[\d,]+, alpha_ms=[\d.]+, gbps=[\d.]+", text), text  # the case


def test_schedule_wrong_answers_cover_the_usual_mistakes():
    names = {p.stem.split("__")[-1] for p in wrong(SCHED)}
    assert {SCHED, "parallel_allreduces", "no_alpha", "drops_last_bucket", "starts_at_first_grad",
            "equal_to_anything"} <= names


# ------------------------------------------------------------------------------ ex08_bucketed_dp: the model


def test_check_net_has_the_traps():
    model = c08.build_model(1)
    assert model.head.weight is model.embed.weight
    names = [n for n, _ in model.named_parameters()]
    assert "head.weight" not in names and names.count("embed.weight") == 1  # one Parameter, listed once
    assert not any(p.requires_grad for p in model.frozen.parameters())
    grads = c08._expected_grads(model, 1, 2, {"use_branch": False})
    by_name = dict(zip(names, grads, strict=True))
    assert by_name["branch.weight"] is None and by_name["frozen.weight"] is None
    assert by_name["embed.weight"] is not None


def test_bucket_counts_and_the_order_matters():
    model = c08.build_model(1)
    counts = [len(c08.expected_buckets(model, c["cap_mb"] * c08.MIB)) for c in c08.dp_inputs(1)["cases"]]
    assert counts == [8, 3, 1, 8]
    forward = []  # buckets made in forward order instead: a different count at the smallest cap
    size, n = 0, 0
    for p in (p for p in model.parameters() if p.requires_grad):
        size, n = size + p.numel() * 4, n + 1
        if size >= 0.001 * c08.MIB:
            forward.append(n)
            size, n = 0, 0
    assert len(forward) + (1 if n else 0) != 8


# ------------------------------------------------------------------------------ ex08_bucketed_dp: the judge


def perfect_data(inputs: dict) -> dict:
    """What the probe returns for a right answer, made here without launching anything."""
    seed = inputs["seed"]
    model = c08.build_model(seed)
    start = [p.detach().clone() for p in model.parameters()]
    cases = []
    for case in inputs["cases"]:
        n_buckets = len(c08.expected_buckets(model, case["cap_mb"] * c08.MIB))
        steps = []
        for step, spec in enumerate(case["steps"]):
            grads = c08._expected_grads(model, seed, step, spec)
            steps.append({"grads": grads, "comm": [[5.0 + i, 300.0] for i in range(n_buckets)],
                          "backward_ms": 1.0, "backward_end_ms": 160.0, "finish_end_ms": 460.0,
                          "marks": {"middle": [3.0, 153.0]} if case.get("paused") else {}})
        cases.append({"start": start, "steps": steps})
    return {"ranks": [cases, cases]}


DP_INPUTS = checks.plain({**c08.dp_inputs(seed=11), "gpu": False})


def edit(data: dict, rank: int, case: int, fn) -> dict:
    import copy

    data = copy.deepcopy(data)
    data["ranks"][rank] = copy.deepcopy(data["ranks"][rank])
    fn(data["ranks"][rank][case])
    return data


def test_dp_judge_passes_the_right_data():
    assert "match one process on the full batch" in c08.dp_judge(DP_INPUTS, perfect_data(DP_INPUTS))


def _scale_grads(c, factor, step=0):
    c["steps"][step]["grads"] = [None if g is None else g * factor for g in c["steps"][step]["grads"]]


def _set_frozen_grad(c):
    names = [n for n, _ in c08.build_model(1).named_parameters()]
    g = c["steps"][0]["grads"]
    g[names.index("frozen.weight")] = torch.zeros(c08.WIDTH, c08.WIDTH)


def _branch_grad_on_unused_step(c):
    names = [n for n, _ in c08.build_model(1).named_parameters()]
    c["steps"][2]["grads"][names.index("branch.weight")] = torch.ones(c08.WIDTH, c08.WIDTH)


def _other_start(c):
    c["start"] = [p.detach().clone() for p in c08.build_model(999).parameters()]


@pytest.mark.parametrize("rank,case,fn,words", [
    (1, 0, _other_start, "start from rank 0's parameters"),                       # no broadcast
    (0, 0, lambda c: _scale_grads(c, 2.0), "about 2x the right one"),             # no division
    (1, 1, lambda c: _scale_grads(c, 0.5), "about 0.5x the right one"),           # divided twice
    (0, 2, lambda c: _scale_grads(c, 1.5, step=1), "previous step"),              # state left from step 0
    (0, 0, _set_frozen_grad, "frozen parameter"),
    (0, 1, _branch_grad_on_unused_step, "did not use"),
    (0, 0, lambda c: c["steps"][1]["comm"].append([9.0, 10.0]), "all-reduces in step 1"),
    (0, 3, lambda c: [s.update(marks={"middle": [310.0, 460.0]}) for s in c["steps"]], "held 309 ms"),
    (0, 3, lambda c: [s.update(comm=[[200.0 + i, 300.0] for i in range(len(s["comm"]))]) for s in c["steps"]],
     "start during backward"),
    (0, 0, lambda c: c["steps"][0]["grads"].pop(), "gradients from rank 0"),
])
def test_dp_judge_fails(rank, case, fn, words):
    with pytest.raises(checks.CheckFailed, match=re.escape(words)):
        c08.dp_judge(DP_INPUTS, edit(perfect_data(DP_INPUTS), rank, case, fn))


def test_dp_judge_reports_a_probe_error_and_malformed_data():
    with pytest.raises(checks.CheckFailed, match="rank 1 failed"):
        c08.dp_judge(DP_INPUTS, {"error": "rank 1 failed: RuntimeError: boom"})
    with pytest.raises(checks.CheckFailed, match="results from 2 ranks"):
        c08.dp_judge(DP_INPUTS, {"ranks": "ok"})
    with pytest.raises(checks.CheckFailed, match="results from 2 ranks"):
        c08.dp_judge(DP_INPUTS, {})


# ------------------------------------------------------------------------------ ex08_bucketed_dp end to end


def test_dp_master_passes(notebook):
    text, error = run_here(exercise_program(notebook, DP, None))
    assert error is None and checks.PASS_MARKER in text, text


DP_WRONG = {  # wrong answer -> what the check must say about it
    DP: r"300 ms pause \(bucket_cap_mb=0\.001 on 2 gloo ranks\), saw rank 0 held",  # waits inside the hook
    f"{DP}__no_broadcast": "start from rank 0's parameters",
    f"{DP}__no_division": "about 2x the right one",
    f"{DP}__divide_twice": "about 0.5x the right one",
    f"{DP}__no_reset": "previous step",
    f"{DP}__launch_in_finish": "start during backward",
    f"{DP}__hooks_every_module": "`embed.weight`",                 # the tied weight, hooked twice
    f"{DP}__frozen_in_buckets": "doesn't require gradient",
    f"{DP}__unused_not_launched": "hook never fires",
    f"{DP}__forward_order": "all-reduces",
    f"{DP}__one_per_parameter": "all-reduces",
}


def test_every_dp_wrong_answer_has_an_expected_verdict():
    assert {p.stem for p in wrong(DP)} == set(DP_WRONG)


@pytest.mark.parametrize("stem", sorted(DP_WRONG))
def test_dp_wrong_answers_fail(notebook, stem):
    text, error = run_here(exercise_program(notebook, DP, (WRONG / f"{stem}.py").read_text()))
    assert error == "CheckFailed", text
    assert re.search(DP_WRONG[stem], text), text


def test_dp_probe_says_not_attempted_for_the_stub():
    class Stub:
        def __init__(self, module, bucket_cap_mb=25.0):
            raise NotImplementedError()

    Stub.__module__ = "__lesson08__"  # shipped by value, as a notebook's class is
    with pytest.raises(NotImplementedError):
        c08.dp_probe(Stub, checks.plain({**c08.dp_inputs(seed=2), "gpu": False}))


# ------------------------------------------------------------------------------ the benchmark


def _benchmark():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bucketing_vs_ddp", ROOT / "benchmarks" / "bucketing_vs_ddp.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_benchmark_picks_the_batch_by_the_lessons_rule():
    text = "\n".join("".join(c["source"]) for c in code_cells(json.loads(NOTEBOOK.read_text())))
    assert float(re.search(r"^GROWTH = ([0-9.]+)", text, re.M).group(1)) == _benchmark().GROWTH


def test_benchmark_runs_on_gloo():
    bench = _benchmark()
    out = bench.main(["--cpu", "--rows", "16", "--rounds", "2", "--steps", "2"])
    assert out["max_rel_diff"] < 1e-5 and out["ratio"] > 0 and out["rows"] == 16


@pytest.mark.multigpu
def test_bucketing_vs_ddp_benchmark_runs_on_two_gpus():
    """The goal (BucketedDP within 5% of DDP's step time on 2xH200) is shown by the benchmark's printed ratio,
    measured in one run, not asserted by a timed test; here: the same gradients, and a ratio measured."""
    bench = _benchmark()
    out = bench.main([])
    print(f"\n[bucketing_vs_ddp] {out}")
    assert out["max_rel_diff"] < 1e-3
    assert out["ratio"] > 0 and out["ddp_ms"] > 0, out


# ------------------------------------------------------------------------------ the facts, as measured


def _step(ranks):
    return max(min(r["step_ms"]) for r in ranks)  # the notebook's step time: the slower rank's fastest step


def check_facts(d: dict, link: str, ns: dict) -> list[str]:
    """Every claim the notebook's prose makes about a two-GPU run, on that run's data; returns a summary."""
    out = []
    sizes, rows = d["sizes"][0], d["rows"]
    tried = list(sizes["backward_ms"].items())
    fits = [r for (r, ms), (_, before) in zip(tried[1:], tried[:-1], strict=True)
            if ms >= sizes["allreduce_ms"] and ms >= GROWTH * before]  # the prose's two conditions
    assert fits[:1] == [str(rows)] or (not fits and str(rows) == tried[-1][0]), (rows, sizes)
    out.append(f"{link}: {rows} rows, backward {sizes['backward_ms'][str(rows)]:.2f} ms, all-reduce "
               f"{sizes['allreduce_ms']:.2f} ms")
    for key in ("each", "flat", "per_param", "buckets", "ddp"):
        for r in d[key]:
            assert r["same_start"] is True and r["max_rel_err"] < 1e-3, (key, r["max_rel_err"])
        spans = d[key][0]["timeline"]["spans"]
        during = first_allreduce(spans, 0) < backward_end(spans, 0)
        assert during is (key in ("per_param", "buckets", "ddp")), key
    base = _step(d["local"])
    added = {k: _step(d[k]) - base for k in ("each", "flat", "per_param", "buckets", "ddp")}
    out.append(f"{link}: ms added to {base:.2f} ms: " + ", ".join(f"{k} {v:.2f}" for k, v in added.items()))
    nums = {k: ns["step_numbers"](ns["the_step"](d[k])) for k in ("local", "flat", "buckets", "ddp")}
    said = ns["verdict"](d, nums)
    out.append(f"{link}: {said}")
    if link != "nvlink":  # the prose: overlap hides part of the communication on the slower links
        assert added["buckets"] < 0.9 * added["each"] and added["buckets"] < 0.9 * added["flat"], added
        assert said.count("overlap paid") == 2, said
    out.append(f"{link}: BucketedDP / DDP = {_step(d['buckets']) / _step(d['ddp']):.3f}")  # the benchmark's goal
    if "blocks" in d:  # one thread block per channel
        assert link != "nvlink_4_channels" or d["blocks"]["blocks"] <= 4, d["blocks"]
    assert d["sweep"]["buckets"] and d["sweep"]["ddp"] and len(d["fit"]["ms"]) == len(d["fit"]["sizes"])
    return out


def test_recording_holds_every_key_and_shows_the_facts(notebook):
    if STEM not in reference.available():
        pytest.skip(f"no reference recording {STEM!r} yet: make it on two GPUs with "
                    f"python benchmarks/record_references.py {STEM}")
    rec = reference.load(STEM)
    assert rec.provenance.get("gpu") and rec.provenance.get("gpu_count", 0) >= 2
    # A run stopped early (record_references.py --keep-partial) keeps the keys it finished: "nvlink" first,
    # "sockets" (a second study over TCP) last; the notebook says which key a recording lacks.
    assert "nvlink" in rec.data and set(rec.data) <= taken_keys(notebook)
    ns = definitions(notebook)
    for link in ("nvlink", "nvlink_4_channels", "sockets"):
        if link in rec.data:
            print("\n".join(check_facts(rec.data[link], link, ns)))


@pytest.mark.multigpu
def test_the_notebook_on_gpus_shows_the_facts(tmp_path):
    """Execute the notebook as benchmarks/record_references.py does, then check every fact on what it measured."""
    execute_notebook(NOTEBOOK, tmp_path, timeout=900)
    data = json.loads((tmp_path / f"{STEM}.json").read_text())["data"]
    assert taken_keys(json.loads(NOTEBOOK.read_text())) <= set(data)
    ns = definitions(json.loads(NOTEBOOK.read_text()))
    print("\n" + "\n".join(line for link in ("nvlink", "nvlink_4_channels", "sockets")
                            for line in check_facts(data[link], link, ns)))
