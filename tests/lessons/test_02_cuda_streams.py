"""Lesson 02 (CUDA streams): the judges on plain data, both exercises against the master's solutions and the
wrong answers (the CPU one here, the GPU one on a GPU), and the facts the notebook claims, checked on what
the notebook measured (live on a GPU, or its reference recording)."""

from __future__ import annotations

import contextlib
import functools
import io
import json
import random
import re
import time
from pathlib import Path

import pytest
import torch

from course_utils import checks, reference
from course_utils.checks import cuda_streams as c02
from tests.exercise_cells import execute_notebook, exercise_cells, run_cells, run_in_process

pytestmark = pytest.mark.gpu_timing  # on a GPU box every test here holds the GPU alone (conftest)
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "02_cuda_streams.ipynb"
STEM = NOTEBOOK.stem
WRONG = ROOT / "tests" / "wrong_answers" / STEM
PREDICT, SPLIT = "ex02_predict_makespan", "ex02_run_split"
HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(scope="module")
def notebook() -> dict:
    return json.loads(NOTEBOOK.read_text())


run_here = functools.partial(run_in_process, module="__lesson02__")


def wrong(ex: str) -> list[Path]:
    return sorted(WRONG.glob(f"{ex}*.py"))


# ------------------------------------------------------------------------------ the notebook's cells


def test_setup_cells_define_the_workload_class(notebook):
    setup = ["".join(c["source"]) for c in notebook["cells"]
             if c["cell_type"] == "code" and "setup" in c["metadata"].get("tags", [])]
    assert any("class SleepChains" in s for s in setup)  # lesson content, in the notebook


def test_no_claim_that_the_default_stream_hides_a_wait(notebook):
    src = "\n".join("".join(c["source"]) for c in notebook["cells"])
    assert not re.search(r"\bhid(e|es|ing)\b[^.]*\b(race|wait)", src, re.I)  # the default stream hides nothing


def test_every_measurement_goes_through_the_recorder(notebook):
    src = "\n".join("".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code")
    assert f'Recorder("{STEM}")' in src
    assert len(taken_keys(notebook)) >= 10


def taken_keys(nb: dict) -> set[str]:
    src = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    return set(re.findall(r'rec\.take\("(\w+)"', src))


# ------------------------------------------------------------------------------ ex02_predict_makespan (CPU)


def test_model_on_hand_worked_schedules():
    assert c02.model_makespan([]) == 0.0
    assert c02.model_makespan([("sleep", "main", 3.0), ("sleep", "s1", 5.0), ("sleep", "main", 4.0)]) == 7.0
    # fork/join: s1 after main's 4 ms, main's last kernel after s1 (4 + 6), then 1 ms
    assert c02.model_makespan(c02.FIXED_SCHEDULES[1]) == 11.0
    # a wait queued before any work covers nothing
    assert c02.model_makespan([("wait", "s1", "main"), ("sleep", "main", 5.0), ("sleep", "s1", 5.0)]) == 5.0
    # waits pass on: main waited for s1, which had waited for s2's 5 ms
    assert c02.model_makespan(c02.FIXED_SCHEDULES[3]) == 6.0
    with pytest.raises(ValueError, match="unknown operation"):
        c02.model_makespan([("launch", "main", 1.0)])


def test_master_solution_agrees_with_the_model_on_many_schedules(notebook):
    ns: dict = {}
    exec(exercise_cells(notebook, PREDICT, None)[-2], ns)  # the solution cell
    rng = random.Random(2)
    for _ in range(500):
        schedule = c02.random_schedule(rng)
        assert ns["predict_makespan"](list(schedule)) == pytest.approx(c02.model_makespan(schedule))


def test_inputs_are_fresh_and_hold_every_fixed_schedule():
    a, b = c02.predict_inputs(), c02.predict_inputs()
    fixed = [list(s) for s in c02.FIXED_SCHEDULES]
    assert all(s in a["schedules"] for s in fixed)
    assert len(a["schedules"]) > len(fixed) and a != b  # random ones too, new each time (seeds differ)
    assert checks.plain(a) == checks.plain(checks.plain(a))  # plain data, as the grader ships it


def test_predict_judge_on_plain_data():
    inputs = checks.plain({**c02.predict_inputs(seed=7), "gpu": False})
    right = [c02.model_makespan(s) for s in inputs["schedules"]]
    assert "all as the model predicts" in c02.predict_judge(inputs, {"predictions": right})
    with pytest.raises(checks.CheckFailed, match="a makespan of"):
        c02.predict_judge(inputs, {"predictions": [x + 1.0 for x in right]})
    with pytest.raises(checks.CheckFailed, match="one prediction per schedule"):
        c02.predict_judge(inputs, {"predictions": right[:-1]})
    with pytest.raises(checks.CheckFailed, match="a number of milliseconds"):
        c02.predict_judge(inputs, {"predictions": ["a Whatever, not a number"] + right[1:]})
    with pytest.raises(checks.CheckFailed, match="a number of milliseconds"):
        c02.predict_judge(inputs, {"predictions": [float("nan")] + right[1:]})


def test_predict_probe_keeps_numbers_and_describes_the_rest():
    inputs = {"schedules": [[["sleep", "main", 1.0]], [["sleep", "main", 2.0]]]}
    seen = []

    def answer(schedule):
        seen.append(schedule)
        schedule.append(("sleep", "main", 99.0))  # a mutating answer spoils nothing
        return 3 if len(seen) == 1 else True

    data = c02.predict_probe(answer, inputs)
    assert data["predictions"][0] == 3.0 and type(data["predictions"][0]) is float
    assert "not a number" in data["predictions"][1]  # a bool is not a makespan
    assert seen[0][0] == ("sleep", "main", 1.0) and inputs["schedules"][0] == [["sleep", "main", 1.0]]


def test_predict_master_solution_passes_in_a_fresh_kernel(notebook, monkeypatch):
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    text, error = run_cells(exercise_cells(notebook, PREDICT, None))
    assert error is None and checks.PASS_MARKER in text, text


def test_predict_main_wrong_answer_fails_in_a_fresh_kernel(notebook):
    text, error = run_cells(exercise_cells(notebook, PREDICT, (WRONG / f"{PREDICT}.py").read_text()))
    assert error == "CheckFailed" and "a makespan of" in text, text
    assert re.search(r"a makespan of [\d.]+ ms for schedule \[(sleep|\w+ waits for) ", text), text  # names the schedule


@pytest.mark.parametrize("path", wrong(PREDICT), ids=lambda p: p.stem)
def test_predict_wrong_answers_fail(notebook, path):
    text, error = run_here(exercise_cells(notebook, PREDICT, path.read_text()))
    assert error == "CheckFailed", text
    assert re.search(r"(a makespan of [\d.]+ ms|a number of milliseconds) for schedule \[", text), text


def test_predict_wrong_answers_cover_the_brief():
    names = {p.stem.split("__")[-1] for p in wrong(PREDICT)}
    assert {PREDICT, "ignores_waits", "waits_for_later_work", "waits_not_passed_on", "equal_to_anything"} <= names


# ------------------------------------------------------------------------------ ex02_run_split: the judge

SPLIT_INPUTS = c02.split_inputs()


def fake_run(n_streams: int = 3, *, start: float | None = None, parallel_steps: bool = False, step: float = 4.0,
             n_steps: int | None = None, seen: list | None = None, final: list | None = None, host_ms: float = 0.3,
             still_running: bool = True, extra_long: bool = False) -> dict:
    """One probe run as plain data: the head start on the current stream, then the chains' sleep kernels."""
    n, k, head = SPLIT_INPUTS["n_chains"], SPLIT_INPUTS["steps_per_chain"], SPLIT_INPUTS["head_start_ms"]
    t0 = head + 0.01 if start is None else start
    spins = [["stream 7", 0.0, head]]
    free = {}
    for c in range(n):
        row = f"stream {13 + c % n_streams}"
        for i in range(k if n_steps is None else n_steps):
            begin = t0 if parallel_steps else free.get(row, t0)
            spins.append([row if not parallel_steps else f"stream {100 + c * k + i}", begin, begin + step])
            free[row] = begin + step + 0.005
    if extra_long:
        spins.append(["stream 13", t0, t0 + head])
    spins.append(["stream 7", -0.5, -0.499])  # a one-cycle sleep (a timeline's stream probe): not a step
    want = [float(k)] * n
    return {"spins": spins, "seen": want if seen is None else seen, "final": want if final is None else final,
            "host_ms": host_ms, "head_still_running": still_running}


def judge(*runs: dict) -> str:
    return c02.split_judge(SPLIT_INPUTS, {"runs": list(runs)})


def test_split_judge_passes_three_overlapped_chains():
    detail = judge(fake_run(), fake_run(host_ms=30.0, still_running=True), fake_run())
    assert "3 streams" in detail and "3.00x" in detail


def test_split_judge_takes_the_best_run_for_timing_verdicts():
    blocked_once = fake_run(host_ms=55.0, still_running=False)
    assert "x" in judge(blocked_once, fake_run(), fake_run())
    assert "x" in judge(fake_run(1), fake_run(3), fake_run(1))


@pytest.mark.parametrize("runs, words", [
    ([fake_run(1)] * 3, "the chains to overlap"),                               # one side stream
    ([fake_run(2)] * 3, "the chains to overlap"),                               # 3 chains on 2 streams: 1.5x
    ([fake_run(host_ms=60.0, still_running=False)] * 3, "return while the GPU"),  # synchronize() inside
    ([fake_run(host_ms=5.0, still_running=False)] * 3, "return while the GPU"),   # host clock fooled, GPU not
    ([fake_run(start=0.01)] * 3, "no step to start before"),                    # no input-side wait
    ([fake_run(), fake_run(seen=[0.0, 0.0, 0.0]), fake_run()], "right after run_split returned"),  # no output wait
    ([fake_run(parallel_steps=True)] * 3, "one after another"),                 # steps of a chain at once
    ([fake_run(step=0.4)] * 3, "each step's sleep"),                            # shortened sleeps
    ([fake_run(n_steps=2)] * 3, "step kernels"),                                # dropped steps
    ([fake_run(extra_long=True)] * 3, "head start"),                            # an extra long kernel
    ([fake_run(final=[4.0, 4.0, 3.0])] * 3, "once the GPU had finished"),       # a lost update
    ([fake_run()] * 2, "measured runs"),
])
def test_split_judge_fails(runs, words):
    with pytest.raises(checks.CheckFailed, match=words) as err:
        judge(*runs)
    if words != "measured runs":  # every other verdict names the workload (and which run, where runs differ)
        assert re.search(r"\(((run \d of 3: )?3 chains of 4 steps of 4 ms after a 40 ms head start)", str(err.value))


def test_split_judge_refuses_what_is_not_plain_runs():
    with pytest.raises(checks.CheckFailed, match="measured runs"):
        c02.split_judge(SPLIT_INPUTS, {"runs": "ok"})
    with pytest.raises(checks.CheckFailed, match="measured runs"):
        c02.split_judge(SPLIT_INPUTS, {})


def test_split_skips_without_a_gpu_and_fails_when_one_is_required(monkeypatch, capsys):
    monkeypatch.setattr(checks, "gpu_available", lambda: False)  # the CPU behaviour, on any machine
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    checks.check(SPLIT, lambda chains: None)
    assert checks.SKIP_MARKER in capsys.readouterr().out
    monkeypatch.setenv("COURSE_REQUIRE_GPU", "1")
    with pytest.raises(checks.CheckFailed, match="needs a GPU"):
        checks.check(SPLIT, lambda chains: None)


def test_split_master_solution_in_a_fresh_kernel(notebook, monkeypatch):
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    text, error = run_cells(exercise_cells(notebook, SPLIT, None))
    assert error is None, text
    assert (checks.PASS_MARKER if HAS_CUDA else checks.SKIP_MARKER) in text, text


# ------------------------------------------------------------------------------ ex02_run_split on the GPU

SPLIT_WRONG = {  # wrong answer -> what the check must say about it
    SPLIT: "the chains to overlap.*3 chains of 4 steps",            # one side stream (and the case)
    f"{SPLIT}__changes_workload_class": "the chains to overlap",     # fake: the notebook's class sleeps less
    f"{SPLIT}__sleeps_less": "each step's sleep",                    # fake: the steps rebuilt with shorter sleeps
    f"{SPLIT}__drops_steps": "step kernels",
    f"{SPLIT}__no_input_wait": "no step to start before",
    f"{SPLIT}__no_output_wait": "right after run_split returned",
    f"{SPLIT}__steps_in_parallel": "one after another",
    f"{SPLIT}__synchronize_between_stages": "return while the GPU",  # host-blocking
}


def test_every_split_wrong_answer_has_an_expected_verdict():
    assert {p.stem for p in wrong(SPLIT)} == set(SPLIT_WRONG)


@pytest.mark.gpu
def test_split_master_solution_passes_here(notebook):
    text, error = run_here(exercise_cells(notebook, SPLIT, None))
    assert error is None and checks.PASS_MARKER in text, text
    print(f"\n[{SPLIT}] {text.strip()}")


@pytest.mark.gpu
@pytest.mark.parametrize("stem", sorted(SPLIT_WRONG))
def test_split_wrong_answers_fail_on_the_gpu(notebook, stem):
    text, error = run_here(exercise_cells(notebook, SPLIT, (WRONG / f"{stem}.py").read_text()))
    assert error == "CheckFailed", text
    assert re.search(SPLIT_WRONG[stem], text), text
    print(f"\n[{stem}] {text.strip()[:300]}")


# ------------------------------------------------------------------------------ the facts, as measured


def _kernels(spans):
    return [s for s in spans if s["kind"] == "compute"]


def _makespan(spans):
    ks = _kernels(spans)
    return max(s["end_ms"] for s in ks) - min(s["start_ms"] for s in ks)


def _busy(spans):
    return sum(s["end_ms"] - s["start_ms"] for s in _kernels(spans))


def _two_at_once(spans):
    edges = sorted([(s["start_ms"], 1) for s in _kernels(spans)] + [(s["end_ms"], -1) for s in _kernels(spans)])
    total, running, last = 0.0, 0, 0.0
    for t, step in edges:
        total += (t - last) if running >= 2 else 0.0
        running, last = running + step, t
    return total


def check_facts(d: dict) -> list[str]:
    """Every claim the notebook's prose makes about its measurements, on the measurements; returns a summary."""
    out = []
    assert d["cycles_per_ms"] > 1e5
    f = d["first_side_stream"]
    assert f["query_at_once"] is False and f["query_after_sync"] is True and f["y_ok"] is True, f
    assert f["sync_ms"] > 0.5 * f["sleep_ms"], f  # synchronize() held the host for the side stream's sleep
    sleep = {n: _makespan(s) for n, s in d["sleep"].items()}
    one_kernel = _busy(d["sleep"]["1"]) / len(_kernels(d["sleep"]["1"]))
    assert sleep["1"] == pytest.approx(_busy(d["sleep"]["1"]), rel=0.05)  # one stream: one after another
    assert sleep["1"] / sleep["2"] > 1.6 and sleep["2"] / sleep["4"] > 1.5, sleep
    out.append(f"sleep makespans {sleep} (kernels of {one_kernel:.2f} ms)")
    pairs = {name: _makespan(s) / _busy(s) for name, s in d["default_stream"].items()}
    assert pairs["two side streams"] < 0.75 and pairs["default + side stream"] < 0.75, pairs
    assert pairs["default + blocking stream"] > 0.9, pairs
    out.append(f"makespan / kernel time by pairing {pairs}")
    ks = _kernels(d["handoff"]["spans"])
    producer = next(k["stream"] for k in ks if "spin" in k["name"])
    produced = max(k["end_ms"] for k in ks if k["stream"] == producer)
    consumed = min(k["start_ms"] for k in ks if k["stream"] != producer)
    assert consumed >= produced - 0.01 and d["handoff"]["y_ok"] is True
    assert d["handoff"]["wait_host_us"] < 5000
    out.append(f"hand-off gap {consumed - produced:.3f} ms, wait_stream {d['handoff']['wait_host_us']:.0f} us")
    ran = [tuple(op) for op in d["schedule"]["schedule"]]
    model, measured = c02.model_makespan(ran), _makespan(d["schedule"]["spans"])
    assert measured == pytest.approx(model, rel=0.08, abs=0.3), (model, measured)
    out.append(f"schedule: model {model:.2f} ms, measured {measured:.2f} ms")
    mm1, mm2, ev = _makespan(d["matmul"]["1"]), _makespan(d["matmul"]["2"]), d["matmul"]["2, events mode"]
    assert mm1 / mm2 < 1.2 and _two_at_once(d["matmul"]["2"]) < 0.1 * mm2, (mm1, mm2)
    gemms = [k for k in _kernels(d["matmul"]["2"]) if not k["name"].startswith("Memset")]  # not the tiny memsets
    assert len(gemms) == len(_kernels(ev)), (len(gemms), len(_kernels(ev)))  # one matmul kernel per event span
    per_kernel, per_span = _busy(gemms) / len(gemms), _busy(ev) / len(_kernels(ev))
    assert per_span > 1.3 * per_kernel and _two_at_once(ev) > 0.3 * _makespan(ev), (per_kernel, per_span)
    out.append(f"matmuls 1 vs 2 streams {mm1:.2f} / {mm2:.2f} ms, two at once {_two_at_once(d['matmul']['2']):.2f}; "
               f"event spans {per_span:.2f} ms for kernels of {per_kernel:.2f}, two at once {_two_at_once(ev):.2f}")
    t1, t2 = d["tiny"]["1"], d["tiny"]["2"]
    if t1["gpu_ms"] <= 1.15 * t1["host_launch_ms"]:  # launch-bound here: with two streams too, and the GPU
        assert t2["gpu_ms"] <= 1.15 * t2["host_launch_ms"], (t1, t2)  # done sooner only as the host launched sooner
        gpu, host = t1["gpu_ms"] / t2["gpu_ms"], t1["host_launch_ms"] / t2["host_launch_ms"]
        assert gpu == pytest.approx(host, rel=0.15), (t1, t2)
    out.append(f"tiny ops {t1} / {t2}, {d['tiny']['host_us_per_op']:.1f} us per op")
    assert len(_kernels(d["tiny_picture"])) >= 200
    if "stream_switch" in d:  # absent from a dict of the live cells that do not measure it
        sw = d["stream_switch"]
        extra = sw["with each op"] - sw["bare"]
        assert extra > sw["bare"], sw  # the verdict: the switch costs more than the launch (H100 and H200: ~2x)
        assert sw["one with"] - sw["bare"] < 0.25 * extra, sw  # one `with` around the loop costs next to nothing
        out.append(f"host us per op: {sw}")
    if "graph" in d:
        g = d["graph"]
        assert g["same_as_eager"] is True, g
        assert g["eager"]["gpu_us"] > 1.5 * g["graph"]["gpu_us"], g  # the verdict: replay ran a step faster
        assert g["eager"]["host_us"] > 10 * g["graph"]["host_us"], g
        out.append(f"graph: eager {g['eager']}, replay {g['graph']}")
    one, split = d["one_stream"], d["split"]
    assert one["seen"] == one["want"] and split["seen"] == split["want"], (one["seen"], split["seen"])
    assert _makespan(one["spans"]) == pytest.approx(_busy(one["spans"]), rel=0.05)
    assert _makespan(split["spans"]) < 0.6 * _makespan(one["spans"])
    out.append(f"chains: one stream {_makespan(one['spans']):.1f} ms, split {_makespan(split['spans']):.1f} ms")
    return out


def test_recording_holds_every_key_and_shows_the_facts(notebook):
    if STEM not in reference.available():
        pytest.skip(f"no reference recording {STEM!r} yet: make it on a GPU with "
                    f"python benchmarks/record_references.py {STEM}")
    rec = reference.load(STEM)
    assert rec.provenance.get("gpu") and rec.provenance.get("torch") and rec.provenance.get("date")
    assert taken_keys(notebook) <= set(rec.data), taken_keys(notebook) - set(rec.data)
    check_facts(rec.data)


# ------------------------------------------------------------------------------ verdicts the cells print

SWITCH, GRAPH = 'rec.take("stream_switch"', 'rec.take("graph"'


def printed(notebook, marker: str, directory: Path | None = None) -> str:
    """What the notebook's cell holding `marker` prints from a recording (the course's, or one in `directory`),
    run here as on a CPU: the recorder never measures."""
    cells = ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
    ns: dict = {"time": time}
    exec(next(c for c in cells if "HAS_CUDA = " in c), ns)  # the sizes
    ns["rec"] = reference.Recorder(STEM, live=False, directory=directory)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(next(c for c in cells if marker in c), ns)
    return out.getvalue()


@pytest.mark.parametrize("us, verdict", [
    ({"bare": 14.3, "with each op": 40.1, "one with": 14.6}, "the stream switch costs more than the launch itself"),
    ({"bare": 10.0, "with each op": 14.0, "one with": 10.1}, "the stream switch adds a large share to each launch"),
    ({"bare": 10.0, "with each op": 10.8, "one with": 10.0}, "the stream switch is cheap next to the launch"),
])
def test_stream_switch_cell_prints_the_verdict_of_its_numbers(notebook, tmp_path, us, verdict):
    reference.save(STEM, {"stream_switch": us}, directory=tmp_path)
    text = printed(notebook, SWITCH, tmp_path)
    here = reference.Recorder(STEM, live=False, directory=tmp_path).here  # "in the recording (...)"
    assert f"{here}: {verdict}: a `with` per op adds {us['with each op'] - us['bare']:.1f} µs" in text, text


@pytest.mark.parametrize("eager, graph, verdict", [
    ({"host_us": 5700.0, "gpu_us": 5710.0}, {"host_us": 14.0, "gpu_us": 820.0},
     "replay ran a step 7.0x faster on the GPU: without Python between the kernels, the GPU spent 2.0 µs per kernel"),
    ({"host_us": 900.0, "gpu_us": 3000.0}, {"host_us": 14.0, "gpu_us": 2950.0},
     "replay ran a step no faster on the GPU: the eager loop was not launch-bound here"),
])
def test_graph_cell_prints_the_verdict_of_its_numbers(notebook, tmp_path, eager, graph, verdict):
    reference.save(STEM, {"graph": {"ops": 400, "same_as_eager": True, "eager": eager, "graph": graph}},
                   directory=tmp_path)
    text = printed(notebook, GRAPH, tmp_path)
    here = reference.Recorder(STEM, live=False, directory=tmp_path).here
    assert f"{here}: {verdict}; the host spent" in text and "eager loop's result: True" in text, text


def test_new_cells_say_so_when_the_recording_lacks_them(notebook, tmp_path):
    reference.save(STEM, {"tiny": {}}, directory=tmp_path)
    assert "no recording of this yet" in printed(notebook, SWITCH, tmp_path)
    assert "no recording of this yet" in printed(notebook, GRAPH, tmp_path)


@pytest.mark.parametrize("marker, verdict", [
    (SWITCH, "the stream switch costs more than the launch itself"),
    (GRAPH, "replay ran a step "),
])
def test_recorded_verdicts(notebook, marker, verdict):
    key = re.search(r'"(\w+)"', marker).group(1)
    if STEM not in reference.available() or key not in reference.load(STEM).data:
        pytest.skip(f"the recording has no {key!r} yet: make it on a GPU with "
                    f"python benchmarks/record_references.py {STEM}")
    text = printed(notebook, marker)
    here = reference.Recorder(STEM, live=False).here
    assert here.startswith("in the recording (NVIDIA"), here
    assert f"{here}: {verdict}" in text and "no faster" not in text, text


@pytest.mark.gpu
def test_the_notebook_on_gpus_shows_the_facts(tmp_path):
    """Execute the notebook as benchmarks/record_references.py does, then check every fact on what it measured."""
    execute_notebook(NOTEBOOK, tmp_path, timeout=600)
    data = json.loads((tmp_path / f"{STEM}.json").read_text())["data"]
    assert taken_keys(json.loads(NOTEBOOK.read_text())) <= set(data)
    print("\n" + "\n".join(check_facts(data)))
