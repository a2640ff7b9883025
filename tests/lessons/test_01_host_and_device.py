"""Lesson 01 (host and device): the checks' judges on plain data, both exercises end to end with the
master's solutions and every wrong answer, the notebook's shape, its recording, and (on a GPU) the facts
its cells show, run from the notebook's own code."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import matplotlib
import pytest
import torch

from course_utils import checks, reference
from course_utils.checks import host_and_device as hd
from tests.exercise_cells import _compiled_cell, exercise_cells, run_cells

matplotlib.use("Agg")

pytestmark = pytest.mark.gpu_timing  # on a GPU box every test here holds the GPU alone (conftest)
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "01_host_and_device.ipynb"
STEM = NOTEBOOK.stem
WRONG = ROOT / "tests" / "wrong_answers" / STEM
HOST_MODEL, HIDDEN = "ex01_host_model", "ex01_hidden_syncs"
HAS_CUDA = torch.cuda.is_available()
# Wrong answers that only a GPU can catch: no host reads, but the host waits anyway.
GPU_ONLY = {"ex01_hidden_syncs__sync_each_step", "ex01_hidden_syncs__event_sync"}


@pytest.fixture(scope="module")
def notebook() -> dict:
    return json.loads(NOTEBOOK.read_text())


@pytest.fixture(autouse=True)
def _not_require_gpu(monkeypatch):
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)


# ============================================================================ ex01_host_model on plain data


def simulate(program):
    """The host/GPU model written another way: a list of kernel intervals, a read waits for the last end."""
    host, kernels, blocked = 0.0, [], 0.0
    for what, ms in program:
        if what == "gpu":
            start = max(host, kernels[-1][1] if kernels else 0.0)
            kernels.append((start, start + ms))
        elif what == "cpu":
            host += ms
        else:
            done = kernels[-1][1] if kernels else 0.0
            if done > host:
                blocked, host = blocked + done - host, done
    return host, (kernels[-1][1] if kernels else 0.0), blocked


def test_the_notebooks_program_by_hand():
    program = [("gpu", 30), ("cpu", 10), ("read", 0), ("gpu", 20), ("gpu", 20), ("cpu", 50), ("read", 0),
               ("gpu", 40), ("cpu", 5)]
    # host: read waits 30 - 10; kernels queue to 70; the host works past 70; the last kernel starts at 80.
    assert simulate(program) == (85.0, 120.0, 20.0)


def _host_model_inputs():
    ex = checks.exercise(HOST_MODEL)
    return checks.plain({**ex.inputs(), "gpu": False}), ex


def test_host_model_judge_passes_the_model_and_fails_each_wrong_number():
    inputs, ex = _host_model_inputs()
    results = [list(simulate(p)) for p in inputs["programs"]]
    assert "programs" in ex.judge(inputs, {"results": results, "problem": None})
    for k, name in enumerate(("host_done_ms", "gpu_done_ms", "blocked_ms")):
        bad = [list(r) for r in results]
        bad[5][k] += 1.0
        with pytest.raises(checks.CheckFailed, match=name):
            ex.judge(inputs, {"results": bad, "problem": None})
    with pytest.raises(checks.CheckFailed, match="three numbers"):
        ex.judge(inputs, {"results": [], "problem": "returned None"})
    with pytest.raises(checks.CheckFailed, match="results"):
        ex.judge(inputs, {"results": results[:-1], "problem": None})


def test_host_model_inputs_are_fresh_and_cover_the_corner_cases():
    a, _ = _host_model_inputs()
    b, _ = _host_model_inputs()
    assert a["programs"][:8] == b["programs"][:8] and a["programs"] != b["programs"]
    outs = [simulate(p) for p in a["programs"][:8]]
    assert any(o[2] == 0 and o[1] > 0 for o in outs)       # kernels, and no wait
    assert any(o[1] > o[0] for o in outs)                   # the GPU finishes after the host
    assert any(o[2] > 0 for o in outs)


def test_host_model_probe_keeps_numbers_only_and_hands_out_copies():
    inputs, ex = _host_model_inputs()
    seen = []

    def mutating(program):
        seen.append(list(program))
        program.clear() if isinstance(program, list) else None
        return simulate(seen[-1])

    data = ex.probe(mutating, inputs)
    assert data["problem"] is None and len(data["results"]) == len(inputs["programs"])
    assert all(type(v) is float for r in data["results"] for v in r)

    class Anything:
        def __eq__(self, other):
            return True

    data = ex.probe(lambda p: (Anything(), 0.0, 0.0), inputs)
    assert "three numbers" in data["problem"]
    assert ex.probe(lambda p: (True, 0.0, 0.0), inputs)["problem"]  # a bool is not a time


# ============================================================================ ex01_hidden_syncs on plain data


def _hidden_inputs(gpu=False):
    ex = checks.exercise(HIDDEN)
    return checks.plain({**ex.inputs(), "gpu": gpu}), ex


def _good_data(inputs):
    values, weights = hd._reference(inputs)
    return {"values": values, "problem": None, "graph_kept": False, "syncs": 0, "calls": [], "where": [],
            "weights": weights}


def test_hidden_syncs_judge_passes_the_reference_and_fails_each_fault():
    inputs, ex = _hidden_inputs()
    assert "no host reads" in ex.judge(inputs, _good_data(inputs))
    cases = {
        "loss": lambda d: d["values"][2].__setitem__(0, d["values"][2][0] * 1.01),
        "grad_norm": lambda d: d["values"][0].__setitem__(1, d["values"][0][1] + 0.1),
        "acc": lambda d: d["values"][3].__setitem__(2, d["values"][3][2] + 1 / 32),
        "same weights": lambda d: d["weights"][0].add_(1e-2),
        "no host reads": lambda d: d.update(syncs=4, calls=["Tensor.item"] * 4, where=["cell:7"] * 4),
        "log loss, grad_norm and acc": lambda d: d.update(problem="entry 0 is ['loss']"),
        "do not require grad": lambda d: d.update(graph_kept=True),
    }
    for expected, spoil in cases.items():
        data = _good_data(inputs)
        spoil(data)
        with pytest.raises(checks.CheckFailed, match=expected):
            ex.judge(inputs, data)


def test_hidden_syncs_judge_on_gpu_data_wants_the_host_ahead_in_the_best_repeat():
    inputs, ex = _hidden_inputs(gpu=True)
    data = _good_data(inputs)
    data["timing"] = [[95.0, 100.0], [12.0, 100.0], [99.0, 101.0]]
    assert "issued" in ex.judge(inputs, data)
    data["timing"] = [[95.0, 100.0], [60.0, 100.0]]
    with pytest.raises(checks.CheckFailed, match="at most 50%"):
        ex.judge(inputs, data)
    data = _good_data(inputs)  # across devices one sample's prediction may flip: 1/batch of accuracy
    data["timing"] = [[10.0, 100.0]]
    data["values"][1][2] += 1 / inputs["small"]["batch"]
    ex.judge(inputs, data)


def test_history_values_reads_tensors_and_numbers_and_names_what_is_wrong():
    t = torch.tensor
    vals, problem = hd._history_values([{"loss": t(1.5), "grad_norm": 2.0, "acc": t([0.25])}], 1)
    assert problem is None and vals == [[1.5, 2.0, 0.25]]
    assert "2 history entries" in hd._history_values([{}, {}], 1)[1]
    assert "keys" in hd._history_values([{"loss": t(1.0)}], 1)[1]
    assert "one-element tensor" in hd._history_values([{"loss": t([1.0, 2.0]), "grad_norm": 1, "acc": 1}], 1)[1]
    assert "one-element tensor" in hd._history_values([{"loss": True, "grad_norm": 1, "acc": 1}], 1)[1]


# ============================================================================ exercises end to end


def _wrong_answers(grade_id):
    return sorted(p for p in WRONG.glob(f"{grade_id}*.py") if p.stem.split("__")[0] == grade_id)


def _run_in_process(sources, capsys):
    """Execute the cells exercise_cells assembled, here (fast); return (printed text, CheckFailed or None)."""
    ns: dict = {}
    try:
        for i, src in enumerate(sources):
            exec(_compiled_cell(src, f"<cell {i}>"), ns)  # its lines readable, as in a kernel
    except checks.CheckFailed as err:
        return capsys.readouterr().out, err
    return capsys.readouterr().out, None


def test_every_exercise_has_wrong_answers_and_they_name_existing_exercises():
    assert len(_wrong_answers(HOST_MODEL)) >= 4 and len(_wrong_answers(HIDDEN)) >= 8
    stems = {p.stem.split("__")[0] for p in WRONG.glob("*.py")}
    assert stems == {HOST_MODEL, HIDDEN}


@pytest.mark.parametrize("path", _wrong_answers(HOST_MODEL) + [p for p in _wrong_answers(HIDDEN)
                                                             if p.stem not in GPU_ONLY], ids=lambda p: p.stem)
def test_wrong_answer_fails_its_check_on_any_machine(path, notebook, capsys):
    grade_id = path.stem.split("__")[0]
    text, err = _run_in_process(exercise_cells(notebook, grade_id, path.read_text()), capsys)
    assert err is not None, f"{path.name} passed:\n{text}"
    assert str(err).startswith(grade_id), err
    if path.stem in NAMES_THE_CASE:
        assert re.search(NAMES_THE_CASE[path.stem], str(err)), err


def test_the_exercise_draws_only_seeds_where_clipping_changes_the_update(notebook, capsys, monkeypatch):
    """Seed 40's gradients never pass max_norm=1.0, so without this an answer that does not clip passed (in CI)."""
    drawn: list[int] = []

    def draw(n: int) -> int:  # 40 and 151, then 7, on every call of _hidden_syncs_inputs
        drawn.append([40, 151, 7][len(drawn) % 3])
        return drawn[-1]

    monkeypatch.setattr(hd.random, "randrange", draw)
    assert hd._hidden_syncs_inputs()["seed"] == 7 and drawn == [40, 151, 7]
    no_clip = (WRONG / f"{HIDDEN}__no_clip.py").read_text()
    text, err = _run_in_process(exercise_cells(notebook, HIDDEN, no_clip), capsys)
    assert err is not None and "clipping before opt.step()" in str(err), text


NAMES_THE_CASE = {  # main wrong answer -> the failing case (and the learner's line) its message must name
    HOST_MODEL: r"host_done_ms = 0 for program \[\('gpu', 5\.0\)\], saw 5",
    HIDDEN: r"\(count_syncs, 4 steps of the 64-wide MLP, batch 32, on (cpu|cuda)\), saw \d+ per step: .* in line "
            r"\d+ of your code: `history\.append",
}


@pytest.mark.parametrize("path", [WRONG / f"{s}.py" for s in sorted(GPU_ONLY)], ids=lambda p: p.stem)
def test_host_blocking_answers_pass_the_cpu_part(path, notebook, capsys, monkeypatch):
    """No host reads: only the timing part on a GPU catches them (test_gpu_wrong_answers_fail)."""
    monkeypatch.setattr(checks, "gpu_available", lambda: False)
    text, err = _run_in_process(exercise_cells(notebook, HIDDEN, path.read_text()), capsys)
    assert err is None and checks.CPU_PART_PASSED in text, (err, text)


@pytest.mark.parametrize("grade_id", [HOST_MODEL, HIDDEN])
def test_masters_solution_passes_in_a_fresh_kernel(grade_id, notebook):
    text, error = run_cells(exercise_cells(notebook, grade_id, None))
    assert error is None, text
    if grade_id == HIDDEN and not HAS_CUDA:
        assert checks.SKIP_MARKER in text and checks.CPU_PART_PASSED in text, text
    else:
        assert f"{checks.PASS_MARKER} {grade_id}" in text, text


@pytest.mark.parametrize("grade_id", [HOST_MODEL, HIDDEN])
def test_main_wrong_answer_fails_in_a_fresh_kernel(grade_id, notebook):
    text, error = run_cells(exercise_cells(notebook, grade_id, (WRONG / f"{grade_id}.py").read_text()))
    assert error == "CheckFailed", text
    assert grade_id in text


def test_without_a_gpu_the_cpu_part_is_reported_and_require_gpu_fails(notebook, capsys, monkeypatch):
    monkeypatch.setattr(checks, "gpu_available", lambda: False)
    text, err = _run_in_process(exercise_cells(notebook, HIDDEN, None), capsys)
    assert err is None and checks.CPU_PART_PASSED in text
    monkeypatch.setenv("COURSE_REQUIRE_GPU", "1")
    text, err = _run_in_process(exercise_cells(notebook, HIDDEN, None), capsys)
    assert err is not None and "needs a GPU" in str(err)


# ============================================================================ the notebook


def _code_cells(nb):
    return [c for c in nb["cells"] if c["cell_type"] == "code"]


def test_notebook_code_is_in_the_notebook(notebook):
    cells = _code_cells(notebook)
    tags = [c["metadata"].get("tags", []) for c in cells]
    assert any("parameters" in t and "setup" in t for t in tags)
    code = "\n".join("".join(c["source"]) for c in cells)
    assert 'Recorder("01_host_and_device")' in code
    for shown in ("def launch_vs_finish", "def sync_stalls", "def timing_methods", "def run_faulty",
                  "def first_launches", "def slow_train_step", "CUDA_LAUNCH_BLOCKING", "CUDA_MODULE_LOADING",
                  "set_sync_debug_mode", "count_syncs()"):
        assert shown in code, shown


def _child_program(nb, name):
    """A child-process program the notebook keeps in a string (FAULTY, FIRST_LAUNCH), placeholder unfilled."""
    ns: dict = {}
    src = next("".join(c["source"]) for c in _code_cells(nb) if "".join(c["source"]).startswith(f"{name} = "))
    exec(compile(src.split("\n\n\ndef ")[0], name, "exec"), ns)
    compile(ns[name].replace("CYCLES", "1000"), name, "exec")
    return ns[name]


def test_child_programs_warm_up_before_what_they_show(notebook):
    faulty = _child_program(notebook, "FAULTY")
    # Every kernel of the faulty part runs once on valid rows before it: a first launch would wait for the GPU
    # (lazy loading), and the error would surface at `scaled = rows * 2` instead of at the read.
    order = [faulty.index(s) for s in ("valid = torch.tensor([3, 7, 99]", "(table[valid] * 2).sum().item()",
                                       "torch.cuda._sleep(CYCLES)", "rows = table[ids]", "scaled = rows * 2")]
    assert order == sorted(order), order
    first = _child_program(notebook, "FIRST_LAUNCH")
    # mul runs nowhere before the timed launch; the sleep kernel is loaded while the GPU is idle
    assert first.count("torch.mul(") == 1 and "x *" not in first and "mul" not in first.split("for launch")[0]
    order = [first.index(s) for s in ("torch.cuda._sleep(1000)", "torch.cuda.synchronize()", "for launch",
                                      "torch.cuda._sleep(CYCLES)", "t0 = time.perf_counter()", "torch.mul(")]
    assert order == sorted(order), order


RECORDED_KEYS = ("launch", "timeline", "stalls", "debug_error", "first_launch", "program", "timing", "async_error",
                 "creation_parts", "train_loader", "train_fast_loader")


def test_recording_if_made_holds_what_the_notebook_shows():
    if STEM not in reference.available():
        pytest.skip(f"no reference recording {STEM} yet (made by benchmarks/record_references.py {STEM})")
    rec = reference.load(STEM)
    assert rec.provenance.get("gpu") and rec.provenance.get("torch") and "recorded on" in rec.label()
    assert set(RECORDED_KEYS) <= set(rec.data), sorted(rec.data)
    default, blocking = rec.data["async_error"]
    assert default["raised"].endswith("at: print(total.item())"), default
    assert blocking["raised"].endswith("at: rows = table[ids]"), blocking
    rows = {r["call"]: r for r in rec.data["stalls"]["rows"]}
    assert rows["t[0].item()"]["syncs"] == 1 and rows["t * 2"]["syncs"] == 0
    assert rec.data["train_loader"]["slow_train_step"]["syncs_per_step"] == 3
    lazy, eager = rec.data["first_launch"]
    assert lazy["first_ms"] > 0.7 * lazy["busy_ms"] and eager["first_ms"] < 0.25 * eager["busy_ms"], (lazy, eager)
    if 'x_cpu.to("cuda", non_blocking=True)' in rows:  # a wait inside the CUDA driver: no counter sees it
        assert rows['x_cpu.to("cuda", non_blocking=True)']["syncs"] == 0


def _recorded(key):
    if STEM not in reference.available():
        pytest.skip(f"no reference recording {STEM} yet (made by benchmarks/record_references.py {STEM})")
    rec = reference.load(STEM)
    if key not in rec.data:
        pytest.skip(f"the recording {STEM} has no {key!r} yet: it comes with the next recording on a GPU "
                    f"(benchmarks/record_references.py {STEM})")
    return rec.data[key]


def _notebook_functions(nb, marker, until):
    """The definitions of the code cell that contains `marker`, up to the line starting with `until` (no run)."""
    src = next(s for s in ("".join(c["source"]) for c in _code_cells(nb)) if marker in s)
    ns: dict = {"rec": reference.Recorder(STEM, live=False)}  # verdicts name where their numbers come from
    exec(compile(src.split("\n" + until)[0], marker, "exec"), ns)
    return ns


def _assert_overlap_pays(verdict, fixed):
    """The printed verdict of section 7: the step without syncs is faster, and each step nearer its prediction."""
    m = re.search(r"took (\d+) ms against (\d+) ms for slow_train_step, ([\d.]+)x faster", verdict)
    assert m and float(m[3]) >= 1.3, verdict  # H200: 125 ms against 201 ms with 10 ms of loading per step
    assert f"slow_train_step is nearer host + GPU, {fixed} nearer max(host, GPU)" in verdict, verdict


def test_recorded_training_loop_pays_for_removing_its_syncs(notebook):
    costs = _recorded("train_loader")
    ns = _notebook_functions(notebook, "def train_costs", "costs = rec.take(")
    assert costs["slow_train_step"]["syncs_per_step"] == 3 and costs["no logging"]["syncs_per_step"] == 0
    # without loading, the syncs cost little: the GPU is the bottleneck either way (H200: 120 ms against 115)
    assert costs["slow_alone"]["total_ms"] < 1.2 * costs["gpu_alone"]["total_ms"], costs
    _assert_overlap_pays(ns["train_verdict"](costs, "no logging"), "no logging")
    fast = _recorded("train_fast_loader")
    assert fast["syncs_per_step"] == 0
    _assert_overlap_pays(ns["train_verdict"]({**costs, "fast_train_step": fast}, "fast_train_step"),
                         "fast_train_step")


def test_recorded_creation_is_mostly_drawing_on_the_cpu(notebook):
    r = _recorded("creation_parts")
    ns = _notebook_functions(notebook, "def creation_costs", "show_creation(")
    # drawing takes ten times the copy or more
    assert "most of it was drawing the numbers on the CPU" in ns["creation_verdict"](r), r
    assert r["on_device_ms"] < 0.1 * r["draw_ms"], r


# ============================================================================ GPU: the notebook's own cells


def _cells_defining(nb, starts):
    """The setup cells, then for each string the code cell that contains it (ids get renumbered; names stay)."""
    code = ["".join(c["source"]) for c in _code_cells(nb)]
    setup = ["".join(c["source"]) for c in _code_cells(nb) if "setup" in c["metadata"].get("tags", [])]
    picked = []
    for start in starts:
        found = [src for src in code if start in src]
        assert len(found) == 1, f"{len(found)} code cells contain {start!r}"
        picked.append(found[0])
    return setup + picked


def _run_notebook_cells(nb, starts) -> dict:
    """Run the notebook's setup cells and the cells that define `starts`, here (on a GPU they measure live)."""
    import matplotlib.pyplot as plt

    ns: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as out:
        for i, src in enumerate(_cells_defining(nb, starts)):
            exec(compile(src, f"<notebook cell {i}>", "exec"), ns)
    plt.close("all")
    print(out.getvalue())
    return ns


@pytest.mark.gpu
def test_gpu_launch_returns_before_the_work_and_events_agree_with_synced_timing(notebook):
    ns = _run_notebook_cells(notebook, ["def launch_vs_finish", "def timing_methods"])
    launch = ns["launch_vs_finish"](torch.device("cuda"), 4096, 8)
    assert launch["work_done_ms"] > 3 * launch["calls_return_ms"], launch
    timing = ns["timing_methods"](torch.device("cuda"), 4096, 8)
    assert timing["events_ms"] == pytest.approx(timing["synced_ms"], rel=0.2), timing
    assert timing["no_sync_ms"] < 0.5 * timing["events_ms"], timing


@pytest.mark.gpu
def test_gpu_sync_points_wait_and_are_counted(notebook):
    ns = _run_notebook_cells(notebook, ["SYNC_POINTS = {", "def sync_stalls"])
    data = ns["stalls"]
    rows = {r["call"]: r for r in data["rows"]}
    for call in ("t[0].item()", "float(t[0])", "print(t)", "t.cpu()", "t.tolist()", "if t.sum() > 0:",
                 "torch.nonzero(t)", "torch.cuda.synchronize()", 'x_cpu.to("cuda")',
                 'x_cpu.to("cuda", non_blocking=True)'):  # H200: the 16 MiB pageable copy waited 22 ms of 20
        assert rows[call]["host_ms"] > 0.5 * data["busy_ms"], rows[call]
    for call in ("t.shape", "t * 2", "t.sum()"):
        assert rows[call]["host_ms"] < 2.0 and rows[call]["syncs"] == 0, rows[call]
    for call in ("t[0].item()", "print(t)", "t.cpu()", "t.tolist()", "torch.nonzero(t)", 'x_cpu.to("cuda")'):
        assert rows[call]["syncs"] == 1, rows[call]
    assert rows["print(t)"]["debug_syncs"] > 1
    assert rows["torch.cuda.synchronize()"]["syncs"] == 0 and rows["torch.cuda.synchronize()"]["debug_syncs"] == 0
    pageable = rows['x_cpu.to("cuda", non_blocking=True)']  # the driver's wait: neither counter sees it
    assert pageable["syncs"] == 0 and pageable["debug_syncs"] == 0, pageable


@pytest.mark.gpu
def test_gpu_first_launch_of_a_kernel_waits_for_the_gpu_unless_eager(notebook):
    ns = _run_notebook_cells(notebook, ["def first_launches"])
    lazy, eager = ns["launches"]
    print(lazy, eager, sep="\n")
    busy = lazy["busy_ms"]
    assert lazy["loading"] == "LAZY" and eager["loading"] == "EAGER"
    assert lazy["first_ms"] > 0.7 * busy and lazy["second_ms"] < 0.1 * busy, lazy  # H100: 50.1 ms of 50, 0.08 ms
    assert eager["first_ms"] < 0.25 * busy and eager["second_ms"] < 0.1 * busy, eager  # H100: 0.2 ms


@pytest.mark.gpu
def test_gpu_program_runs_as_the_model_predicts(notebook):
    ns = _run_notebook_cells(notebook, ["def host_model", "def run_program"])
    m, want = ns["measured"], simulate(ns["PROGRAM"])
    got = (m["host_done_ms"], m["gpu_done_ms"], m["blocked_ms"])
    for g, w in zip(got, want, strict=True):
        # gpu_sleep is calibrated to a few percent; launches, sleeps and reads cost a little host time.
        assert 0.97 * w - 1.0 <= g <= 1.03 * w + 5.0, (got, want)


@pytest.mark.gpu
def test_gpu_kernel_error_surfaces_at_the_next_sync_unless_launch_blocking(notebook):
    ns = _run_notebook_cells(notebook, ["def run_faulty"])
    default, blocking = ns["runs"]
    assert default["raised"].endswith("at: print(total.item())"), default
    assert blocking["raised"].endswith("at: rows = table[ids]"), blocking
    assert "device-side assert" in default["message"], default
    assert all(r["after"].startswith("a new CUDA call raises") for r in (default, blocking)), (default, blocking)


@pytest.mark.gpu
def test_gpu_hidden_syncs_keep_the_host_waiting(notebook):
    ns = _run_notebook_cells(notebook, ["def make_problem", "def train_costs", "def fast_train_step"])
    costs = ns["costs"]
    slow, bare, alone = costs["slow_train_step"], costs["no logging"], costs["gpu_alone"]
    fast = ns["train_costs"](ns["fast_train_step"], **ns["GPU_TRAIN"], loader_ms=ns["LOADER_MS"])
    assert slow["syncs_per_step"] == 3 and bare["syncs_per_step"] == 0 and fast["syncs_per_step"] == 0
    assert slow["issue_ms"] > 0.8 * slow["total_ms"], slow
    assert alone["issue_ms"] < 0.5 * alone["total_ms"], alone  # no loader: the host runs far ahead
    assert costs["slow_alone"]["total_ms"] < 1.2 * alone["total_ms"], costs  # ...yet that gains little
    _assert_overlap_pays(ns["train_verdict"](costs, "no logging"), "no logging")
    _assert_overlap_pays(ns["train_verdict"]({**costs, "fast_train_step": fast}, "fast_train_step"),
                         "fast_train_step")


@pytest.mark.gpu
def test_gpu_creation_through_the_cpu_is_mostly_drawing(notebook):
    ns = _run_notebook_cells(notebook, ["def sync(", "def creation_costs"])
    r = ns["creation_costs"](torch.device("cuda"), ns["NUMEL"])
    assert "most of it was drawing the numbers on the CPU" in ns["creation_verdict"](r), r


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_ONLY) + [HIDDEN], ids=str)
def test_gpu_wrong_answers_fail(name, notebook, capsys):
    text, err = _run_in_process(exercise_cells(notebook, HIDDEN, (WRONG / f"{name}.py").read_text()), capsys)
    print(text, err)
    assert err is not None and str(err).startswith(HIDDEN), text


@pytest.mark.gpu
def test_gpu_solution_passes_with_the_host_ahead(notebook, capsys):
    text, err = _run_in_process(exercise_cells(notebook, HIDDEN, None), capsys)
    print(text)
    assert err is None and f"{checks.PASS_MARKER} {HIDDEN}" in text, (err, text)


def test_the_cpu_tensor_sync_tables_count_the_same_on_any_machine(notebook):
    """The sync-point table and the training step's count use CPU tensors; count_syncs counts those only with
    cpu_as_device=True, which is its default only without a GPU (on the H100 both printed 0 syncs)."""
    cells = ["".join(c["source"]) for c in notebook["cells"] if c["cell_type"] == "code"]
    for marker in ("SYNC_POINTS = {", 'slow_train_step on this CPU'):
        src = next(s for s in cells if marker in s)
        assert "count_syncs(cpu_as_device=True)" in src and "count_syncs()" not in src, marker
