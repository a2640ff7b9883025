"""Lesson 06 (collectives): the notebook's conventions, both exercises' judges on plain data, the probes against
the master's solutions and every wrong answer (both exercises are gradeable on CPU), bench kept out of reach while
a probe runs, and the facts the notebook states about NCCL, checked on what it measured (live on two GPUs or more,
or its reference recording)."""

from __future__ import annotations

import functools
import json
import random
import re
from pathlib import Path

import pytest

from course_utils import bench, checks, launch, reference
from course_utils.checks import collectives as c06
from tests.exercise_cells import execute_notebook, exercise_cells, notebook_function, run_cells, run_in_process

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "06_collectives.ipynb"
STEM = NOTEBOOK.stem
WRONG = ROOT / "tests" / "wrong_answers" / STEM
BUSBW, TIME = "ex06_busbw", "ex06_time_collective"


@pytest.fixture(scope="module")
def notebook() -> dict:
    return json.loads(NOTEBOOK.read_text())


run_here = functools.partial(run_in_process, module="__lesson06__")


def answer_function(notebook: dict, ex: str, replacement: str | None, name: str):
    """The function a solution cell (or a wrong answer in its place) defines, after the setup cells."""
    ns: dict = {"__name__": "__lesson06__"}
    for src in exercise_cells(notebook, ex, replacement)[:-1]:
        exec(compile(src, "<cell>", "exec"), ns)
    return ns[name]


def wrong(ex: str) -> list[Path]:
    return sorted(WRONG.glob(f"{ex}*.py"))


def code(nb: dict) -> str:
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")


# ------------------------------------------------------------------------------------------ the notebook


def test_both_exercises_are_gradeable_on_a_cpu():
    for ex, entry in ((BUSBW, "busbw_gbps"), (TIME, "time_collective")):
        assert checks.exercise(ex).entry == entry and checks.exercise(ex).needs_gpu is False


def test_every_collective_is_run_and_drawn_in_the_notebook(notebook):
    src = code(notebook)
    for call in ("dist.broadcast(", "dist.scatter(", "dist.gather(", "dist.reduce(", "dist.all_reduce(",
                 "all_gather_into_tensor(out, x)", "reduce_scatter_tensor(out, x)", "dist.all_to_all_single(",
                 "dist.barrier()", "async_op=True", ".is_completed()", ".wait()"):
        assert call in src, call
    assert src.count("show(pool.run(") >= 7 and "Timeline.merge" in src
    assert src.count("launch.Pool(") == 1  # one pool shared by the cells
    assert f'Recorder("{STEM}"' in src and "%load_ext course_utils" in src and "%%ranks" in src
    for old in ("host_device", "streams", "events", "copies"):
        assert not re.search(rf"\bcourse_utils\.{old}\b|from course_utils import [^\n]*\b{old}\b", src), old


def test_nothing_the_notebook_prints_before_the_exercises_hands_over_the_factors(notebook):
    """The busbw table and the factors appear after ex06_busbw's check cell, not before it."""
    cells = ["".join(c["source"]) for c in notebook["cells"]]
    check_at = next(i for i, s in enumerate(cells) if s.strip() == f'check("{BUSBW}", busbw_gbps)')
    before = "\n".join(cells[:check_at])
    assert "bus_factor" not in before and "format_nccl_table" not in before and "bench.sweep" not in before


# ------------------------------------------------------------------------------------------ ex06_busbw


def test_the_check_model_and_bench_agree_on_every_collective():
    """Two implementations, written apart: the check's model (from tensor sizes) and bench (from S)."""
    rng = random.Random(6)
    for _ in range(400):
        op, n = rng.choice(bench.COLLECTIVES), rng.choice((2, 3, 4, 5, 8))
        ins, outs, size = bench.collective_counts(op, 4 * rng.randint(16, 1 << 24), n)
        seconds = rng.uniform(1e-5, 1.0)
        want = size / seconds / 1e9 * bench.bus_factor(op, n)
        assert c06.model_busbw(op, 4 * ins, 4 * outs, seconds, n) == pytest.approx(want, rel=1e-12), op


def test_busbw_inputs_are_fresh_plain_and_hold_every_fixed_case():
    a, b = c06.busbw_inputs(), c06.busbw_inputs()
    fixed = [c06._case(*c) for c in c06.FIXED_CASES]
    assert all(c in a["cases"] for c in fixed) and a != b
    assert {c[0] for c in a["cases"]} == set(c06.OPS)
    assert checks.plain(a) == a


def test_busbw_judge_on_plain_data():
    inputs = checks.plain({**c06.busbw_inputs(seed=3), "gpu": False})
    right = [c06.model_busbw(*c) for c in inputs["cases"]]
    assert "as nccl-tests defines busbw" in c06.busbw_judge(inputs, {"values": right})
    with pytest.raises(checks.CheckFailed, match="busbw .* GB/s for"):
        c06.busbw_judge(inputs, {"values": [v * 1.01 for v in right]})
    with pytest.raises(checks.CheckFailed, match="one value per case"):
        c06.busbw_judge(inputs, {"values": right[:-1]})
    with pytest.raises(checks.CheckFailed, match="a number of GB/s"):
        c06.busbw_judge(inputs, {"values": ["a Whatever, not a number"] + right[1:]})
    with pytest.raises(checks.CheckFailed, match="compute busbw itself"):
        c06.busbw_judge(inputs, {"error": "course_utils.bench.bus_factor is not allowed in this exercise"})


def test_bench_is_unavailable_inside_a_probe_and_back_afterwards():
    from course_utils.bench import bus_factor  # bound before the probe, as a solution cell could

    inputs = c06.busbw_inputs(seed=1)

    def early_bound(op, ins, outs, seconds, n):
        return max(ins, outs) / seconds / 1e9 * bus_factor(op, n)

    def late_import(op, ins, outs, seconds, n):
        from course_utils import bench as b

        return max(ins, outs) / seconds / 1e9 * b.bus_factor(op, n)

    for answer in (early_bound, late_import):
        data = c06.busbw_probe(answer, inputs)
        assert c06.NOT_ALLOWED in data["error"] and "bus_factor" in data["error"]
    assert bench.bus_factor("all_reduce", 4) == 1.5 and bus_factor("broadcast", 3) == 1.0  # restored
    with pytest.raises(ZeroDivisionError):  # other errors pass through, and bench is restored after them too
        with c06.tools_unavailable():
            raise ZeroDivisionError("inside")
    assert bench.fit_alpha_beta.__code__.co_name == "fit_alpha_beta"
    swapped = {f.__name__ for f in c06._functions_of(bench)}
    assert {"bus_factor", "measure_collective", "sweep", "time_calls", "collective_call", "time_us"} <= swapped


def test_busbw_master_solution_passes_in_a_fresh_kernel(notebook, monkeypatch):
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    text, error = run_cells(exercise_cells(notebook, BUSBW, None))
    assert error is None and checks.PASS_MARKER in text, text


@pytest.mark.parametrize("path", wrong(BUSBW), ids=lambda p: p.stem)
def test_busbw_wrong_answers_fail(notebook, path):
    text, error = run_here(exercise_cells(notebook, BUSBW, path.read_text()))
    assert error == "CheckFailed", text
    if "uses_" in path.stem:
        assert "not allowed in this exercise" in text, text
    else:
        assert re.search(r"GB/s for \w+ on \d+ ranks, input [\d.]+ \w+, output", text), text  # the case


def test_busbw_wrong_answers_cover_the_brief():
    names = {p.stem.split("__")[-1] for p in wrong(BUSBW)}
    assert {BUSBW, "input_as_size", "output_as_size", "allreduce_factor_everywhere", "no_factor", "uses_bench",
            "equal_to_anything", "float_equal_to_anything"} <= names


# ------------------------------------------------------------------------------------------ ex06_time_collective

TIME_INPUTS = {**c06.time_inputs(seed=5), "gpu": False}


def fake_rank(value=0.004, launches=None, before=(0.004, 0.0042, 0.0039), after=(0.0041, 0.004, 0.0043),
              runs=2, error=None):
    launches = TIME_INPUTS["warmup"] + TIME_INPUTS["iters"] if launches is None else launches
    values = value if isinstance(value, list) else [value] * runs
    return {"runs": [{"value": v, "error": error, "launches": launches} for v in values],
            "before_s": list(before), "after_s": list(after)}


def time_judge(*ranks: dict) -> str:
    return c06.time_judge(TIME_INPUTS, {"ranks": list(ranks)})


def test_time_judge_passes_a_good_measurement_and_takes_the_best_run():
    assert "ms per call, each the same on both ranks" in time_judge(fake_rank(), fake_rank())
    assert time_judge(fake_rank([0.05, 0.005]), fake_rank([0.05, 0.005]))  # one noisy run of two


@pytest.mark.parametrize("ranks, words", [
    ([fake_rank(0.00005)] * 2, r"all_reduce of \d+ floats on 2 gloo ranks .*: at least"),  # the launches only
    ([fake_rank(0.1)] * 2, "at most"),                                         # the set-up timed
    ([fake_rank(4.0)] * 2, "at most"),                                         # milliseconds
    ([fake_rank(launches=TIME_INPUTS["iters"])] * 2, "calls of launch"),       # no warm-up
    ([fake_rank(0.004), fake_rank(0.0041)], "the same number on every rank"),  # no average over ranks
    ([fake_rank("a Whatever, not a number")] * 2, "positive number of seconds"),
    ([fake_rank(float("nan"))] * 2, "positive number of seconds"),
    ([fake_rank(error="course_utils.bench.measure_collective is not allowed in this exercise")] * 2,
     "measure by itself"),
    ([fake_rank()], "a result from each of 2 ranks"),
    ([fake_rank(runs=1)] * 2, "2 runs"),
])
def test_time_judge_fails(ranks, words):
    with pytest.raises(checks.CheckFailed, match=words):
        time_judge(*ranks)


def test_time_judge_reports_a_probe_error():
    with pytest.raises(checks.CheckFailed, match="without an error"):
        c06.time_judge(TIME_INPUTS, {"error": "WorkerTimeout: ranks 0, 1 were still running"})


TIME_WRONG = {  # wrong answer -> what the check must say about it
    TIME: r"all_reduce of \d+ floats on 2 gloo ranks .*had every timed collective finished",
    f"{TIME}__no_warmup": "calls of launch",
    f"{TIME}__warmup_inside_the_clock": "what did your clock see",
    f"{TIME}__own_rank_only": "the same number on every rank",
    f"{TIME}__milliseconds": "what did your clock see",
    f"{TIME}__uses_bench": "not allowed in this exercise",
    f"{TIME}__made_up": "calls of launch",
    f"{TIME}__equal_to_anything": "positive number of seconds",
}


def test_every_time_wrong_answer_has_an_expected_verdict():
    assert {p.stem for p in wrong(TIME)} == set(TIME_WRONG)


@pytest.fixture(scope="module")
def pool():
    with launch.Pool(2, backend="gloo") as p:
        yield p


@pytest.mark.slow
@pytest.mark.parametrize("stem", sorted(TIME_WRONG))
def test_time_wrong_answers_fail_on_gloo_ranks(notebook, pool, stem):
    """Each wrong answer through the probe's own rank code (on a shared pool: no cold start per answer)."""
    answer = answer_function(notebook, TIME, (WRONG / f"{stem}.py").read_text(), "time_collective")
    inputs = {**c06.time_inputs(), "gpu": False}
    data = {"ranks": [r for _, r in sorted(pool.run(c06._time_rank, answer, inputs, timeout=120).items())]}
    with pytest.raises(checks.CheckFailed, match=TIME_WRONG[stem]) as err:
        c06.time_judge(inputs, checks.from_bytes(checks.to_bytes(data)))
    print(f"\n[{stem}] {str(err.value)[:300]}")


@pytest.mark.slow
def test_time_master_solution_on_gloo_ranks(notebook, pool):
    answer = answer_function(notebook, TIME, None, "time_collective")
    inputs = {**c06.time_inputs(), "gpu": False}
    data = {"ranks": [r for _, r in sorted(pool.run(c06._time_rank, answer, inputs, timeout=120).items())]}
    print("\n" + c06.time_judge(inputs, data))


@pytest.mark.slow
def test_time_master_passes_and_main_wrong_answer_fails_in_a_fresh_kernel(notebook, monkeypatch):
    """End to end, as in the notebook: check() starts its own ranks through course_utils.launch."""
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    text, error = run_cells(exercise_cells(notebook, TIME, None))
    assert error is None and checks.PASS_MARKER in text, text
    text, error = run_cells(exercise_cells(notebook, TIME, (WRONG / f"{TIME}.py").read_text()))
    assert error == "CheckFailed" and re.search(TIME_WRONG[TIME], text), text


@pytest.mark.slow
def test_the_grader_runs_both_probes(tmp_path):
    """The grader's sandboxed probe process starts gloo ranks too: master full marks, bench-delegating answers 0."""
    from tests.exercise_cells import grade_answers

    graded = grade_answers(NOTEBOOK, {})
    assert {e.grade_id: e.status for e in graded.exercises} == {BUSBW: "passed", TIME: "passed"}, graded
    bad = grade_answers(NOTEBOOK, {BUSBW: (WRONG / f"{BUSBW}__uses_bench.py").read_text(),
                                   TIME: (WRONG / f"{TIME}__uses_bench.py").read_text()})
    assert {e.grade_id: e.status for e in bad.exercises} == {BUSBW: "failed", TIME: "failed"}, bad


# ------------------------------------------------------------------------------------------ the facts, as measured


def check_facts(d: dict) -> list[str]:
    """What the notebook says about NCCL, on what it measured; returns a summary."""
    out = []
    a = d["async_nccl"]
    assert a["backend"] == "nccl" and a["sum_ok"] is True, a
    assert a["done_after_call"] is False, a  # the call returned before the collective finished
    assert a["wait_ms"] < a["sync_ms"], a  # wait() did not hold the host until the GPU was done; synchronize did
    assert a["done_after_sync"] is True, a
    out.append(f"async 256 MiB: call {a['call_ms']:.3f} ms, wait {a['wait_ms']:.3f} ms, sync {a['sync_ms']:.3f} ms")
    s = d["sweep_nccl"]
    rs = [bench.BenchResult.from_dict(r) for r in s["results"]]
    assert {r.op for r in rs} >= {"all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all"}
    limit = max(s["limits"].values()) if s["limits"] else None
    for op in {r.op for r in rs}:
        mine = sorted((r for r in rs if r.op == op and r.mode == "back_to_back"), key=lambda r: r.size_bytes)
        assert mine[-1].busbw_gbps > 10 * mine[0].busbw_gbps, op  # latency-bound at 1 KiB, not at the top
        if limit:
            assert mine[-1].busbw_gbps <= 1.02 * limit, (op, mine[-1].busbw_gbps, limit)
        out.append(f"{op} {bench.human_bytes(mine[-1].size_bytes)}: busbw {mine[-1].busbw_gbps:.1f} GB/s "
                   f"(limit {limit})")
    fit = bench.fit_alpha_beta(rs, op="all_reduce")
    assert 0 < fit.alpha_us < 1000 and fit.beta_gbps > 10, fit
    out.append(f"fit: alpha {fit.alpha_us:.1f} us, beta {fit.beta_gbps:.1f} GB/s, bus {fit.bus_gbps:.1f} GB/s")
    return out


def taken_keys(nb: dict) -> set[str]:
    return set(re.findall(r'rec\.take\("(\w+)"', code(nb)))


def test_recording_holds_every_key_and_shows_the_facts(notebook):
    if STEM not in reference.available():
        pytest.skip(f"no reference recording {STEM!r} yet: make it on a machine with 2+ GPUs with "
                    f"python benchmarks/record_references.py {STEM}")
    rec = reference.load(STEM)
    assert rec.provenance.get("gpu") and rec.provenance.get("gpu_count", 0) >= 2
    assert taken_keys(notebook) <= set(rec.data), taken_keys(notebook) - set(rec.data)
    check_facts(rec.data)


@pytest.mark.gpu
@pytest.mark.multigpu
def test_the_notebook_on_gpus_shows_the_facts(tmp_path):
    """Execute the notebook as benchmarks/record_references.py does (NCCL on every GPU), then check its facts."""
    execute_notebook(NOTEBOOK, tmp_path, timeout=600)
    data = json.loads((tmp_path / f"{STEM}.json").read_text())["data"]
    assert taken_keys(json.loads(NOTEBOOK.read_text())) <= set(data)
    print("\n" + "\n".join(check_facts(data)))


def fit_functions(nb: dict) -> dict:
    """Section 7's show_fit and alpha_verdict with what they use (the lesson's setup cells start a pool)."""
    import matplotlib.pyplot as plt
    import numpy as np

    ns = {"bench": bench, "plt": plt, "np": np}
    for name in ("alpha_verdict", "show_fit"):
        notebook_function(nb, name, ns)
    return ns


def test_the_fit_names_both_alphas_on_the_recording(notebook, capsys):
    """Section 7 fits calls queued back to back and calls each waited for, and says what the second adds."""
    import matplotlib

    matplotlib.use("Agg")
    if STEM not in reference.available():
        pytest.skip(f"no reference recording {STEM!r} yet")
    ns = fit_functions(notebook)
    rs = [bench.BenchResult.from_dict(d) for d in reference.load(STEM).data["sweep_nccl"]["results"]]
    fit = ns["show_fit"](rs, "recorded")
    out = capsys.readouterr().out
    lone = bench.fit_alpha_beta(rs, op="all_reduce", mode="blocking")
    assert fit.mode == "back_to_back" and f"each call waited for: t = {lone.alpha_us:.1f} µs" in out, out
    assert ns["alpha_verdict"](fit.alpha_us, lone.alpha_us) in out
    ns["plt"].close("all")


def test_alpha_verdict(notebook):
    verdict = fit_functions(notebook)["alpha_verdict"]
    assert verdict(38.0, 52.5).startswith("a lone call cost 14.5 µs more than one queued behind others")
    assert verdict(40.0, 39.0).startswith("a lone call cost no more")
