"""Lesson 04 (async memcpy): the three exercises' judges on plain data, the CPU-gradeable exercises end to end
with their wrong answers, the prefetcher's CPU part, and on a GPU the prefetcher check against every wrong
answer and the notebook's own measuring functions against the claims the notebook makes."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from course_utils import checks, reference
from course_utils.checks import CheckFailed
from course_utils.checks import async_memcpy as c04
from course_utils.checks import async_memcpy_prefetcher as c04p
from tests.exercise_cells import exercise_cells, notebook_functions, run_cells

pytestmark = pytest.mark.gpu_timing  # on a GPU box every test here holds the GPU alone (conftest)
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "04_async_memcpy.ipynb"
WRONG = ROOT / "tests" / "wrong_answers" / "04_async_memcpy"
MiB = 1 << 20


def notebook() -> dict:
    return json.loads(NOTEBOOK.read_text())


def wrong_answers(ex: str) -> list[Path]:
    return sorted(WRONG.glob(f"{ex}*.py"))


def run_in_process(ex: str, replacement: str | None) -> None:
    """Setup cells, the solution (or a wrong answer) and the check cell, executed here in a fresh namespace.

    Quicker than a kernel per wrong answer; `test_exercises_end_to_end_in_a_kernel` runs the real thing."""
    ns: dict = {"__name__": "__lesson04__"}
    for src in exercise_cells(notebook(), ex, replacement):
        exec(compile(src, f"<{ex}>", "exec"), ns)


def judge_via_probe(ex_id: str, answer) -> str:
    """What the grader does: fresh inputs, the probe beside the answer, the judge on the plain data."""
    ex = checks.exercise(ex_id)
    inputs = checks.plain({**ex.inputs(), "gpu": torch.cuda.is_available()})
    data = checks.from_bytes(checks.to_bytes(ex.probe(answer, inputs)))
    return ex.judge(inputs, data)


# --------------------------------------------------------------------------------- ex04_copy_time


def _fit(sweep, t0_us=None, gbps=None):
    """A probe's data: every sweep fitted as (t0_us, gbps), the true numbers where not given."""
    return {"fits": [[sw["t0_us"] if t0_us is None else t0_us(sw), sw["gbps"] if gbps is None else gbps(sw)]
                     for sw in sweep], "types": ["float, float"] * len(sweep)}


def test_copy_time_judge_passes_the_model_and_names_each_mistake():
    ex = checks.exercise(c04.EX_COPY)
    inputs = ex.inputs()
    sweeps = inputs["sweeps"]
    assert [sw["kind"] for sw in sweeps] == ["narrow", "narrow", "wide", "wide"]
    assert sweeps[0]["times_ms"] == [c04._true_ms(sweeps[0], n) for n in sweeps[0]["sizes"]]  # one exact sweep
    assert "4 sweeps fitted" in ex.judge(inputs, _fit(sweeps))
    mistakes = {
        "bytes or in bits": dict(gbps=lambda sw: sw["gbps"] * 8),
        "10^9 or 2^30": dict(gbps=lambda sw: sw["gbps"] * 1e9 / 2**30),
        "GB/s, MB/s": dict(gbps=lambda sw: sw["gbps"] * 1e3),
        "µs or ms": dict(t0_us=lambda sw: sw["t0_us"] / 1e3),
        "µs or s?": dict(t0_us=lambda sw: sw["t0_us"] / 1e6),
        "which order": dict(t0_us=lambda sw: sw["gbps"], gbps=lambda sw: sw["t0_us"]),
        "tiny copy cost": dict(t0_us=lambda sw: 0.0),
        "smallest copy's time all fixed": dict(t0_us=lambda sw: sw["times_ms"][0] * 1e3),
        "largest copy's size over its time": dict(gbps=lambda sw: sw["sizes"][-1] / sw["times_ms"][-1] / 1e6),
    }
    for hint, wrong in mistakes.items():
        with pytest.raises(CheckFailed, match=re.escape(hint)):
            ex.judge(inputs, _fit(sweeps, **wrong))
    with pytest.raises(CheckFailed, match="return two numbers"):
        ex.judge(inputs, {"fits": [None] * 4, "types": ["Anything"] * 4})
    with pytest.raises(CheckFailed, match="4 fits"):
        ex.judge(inputs, {"fits": [[1.0, 1.0]], "types": ["float, float"]})


def test_copy_sweeps_are_drawn_so_that_each_kinds_wrong_method_misses_by_far():
    """A method can only pass by luck if some draw lets it: every noisy sweep is drawn so that the method its kind
    names (plain least squares on wide sweeps, one copy per term on narrow ones) misses by twice the tolerance."""
    import random

    rng = random.Random(0)
    for kind, (_, wrong) in c04.REACH.items():
        for _ in range(200):
            sw = c04._copy_sweep(rng, kind, c04.COPY_NOISE)
            assert c04._worst_miss(*wrong(sw["sizes"], sw["times_ms"]), sw)[0] > 2 * c04.COPY_TOL
            knee = sw["t0_us"] * 1e3 * sw["gbps"]  # bytes: the smallest copy's are 1/9 to 1/5 of its time
            assert knee / 8 < sw["sizes"][0] <= knee / 4, (sw["sizes"][0], knee)
            off = [abs(t / c04._true_ms(sw, n) - 1) for n, t in zip(sw["sizes"], sw["times_ms"], strict=True)]
            assert max(off) <= c04.COPY_NOISE


def test_number_conversion_keeps_only_real_numbers():
    import numpy as np

    assert c04._number(3) == 3.0 and type(c04._number(np.float32(0.5))) is float
    assert c04._number(torch.tensor(2.5)) == 2.5
    assert c04._number(True) is None and c04._number("1.0") is None and c04._number(float("nan")) is None
    assert c04._number(torch.ones(2)) is None

    class Anything(float):
        def __eq__(self, other):
            return True

        __hash__ = float.__hash__

    assert type(c04._number(Anything(0.0))) is float  # the judge compares a plain 0.0, not the subclass


# ------------------------------------------------------------------------------ ex04_overlap_makespan


def _makespan(n, c, k, s):
    return n * (c + k) if s == 1 else c + k + (n - 1) * max(c, k)


def test_makespan_judge_passes_the_model_and_names_each_mistake():
    ex = checks.exercise(c04.EX_MAKESPAN)
    inputs = ex.inputs()
    cases = inputs["cases"]
    two = [c for c in cases if c[3] == 2]
    assert any(c > k for _, c, k, _ in two) and any(k > c for _, c, k, _ in two) and any(n == 1 for n, *_ in two)
    assert "schedules" in ex.judge(inputs, {"values": [_makespan(*c) for c in cases], "types": ["float"] * len(cases)})
    mistakes = {
        "copy engine doing": lambda n, c, k, s: n * (c + k),
        "before the first chunk": lambda n, c, k, s: _makespan(n, c, k, 1) if s == 1 else n * max(c, k),
        "sets the pace": lambda n, c, k, s: _makespan(n, c, k, 1) if s == 1 else c + n * k,
        "on one stream": lambda n, c, k, s: _makespan(n, c, k, 2),
    }
    for hint, f in mistakes.items():
        with pytest.raises(CheckFailed, match=re.escape(hint)):
            ex.judge(inputs, {"values": [float(f(*c)) for c in cases], "types": ["float"] * len(cases)})


# --------------------------------------------------------------- CPU-gradeable exercises, end to end


@pytest.mark.parametrize("ex", [c04.EX_COPY, c04.EX_MAKESPAN])
def test_cpu_exercise_solution_passes(ex, capsys):
    run_in_process(ex, None)
    assert f"passed: {ex}" in capsys.readouterr().out


@pytest.mark.parametrize("path", wrong_answers(c04.EX_COPY) + wrong_answers(c04.EX_MAKESPAN), ids=lambda p: p.stem)
def test_cpu_exercise_wrong_answer_fails(path):
    ex = path.stem.split("__")[0]
    with pytest.raises(CheckFailed, match=rf"{ex}: expected (fit_copy on sweep \d|makespan_ms\([^)]+\))"):  # the case
        run_in_process(ex, path.read_text())


def test_every_exercise_has_wrong_answers_of_each_kind_the_issue_names():
    stems = {p.stem for p in WRONG.glob("*.py")}
    assert {f"ex04_copy_time{w}" for w in ("", "__gib", "__bits", "__no_latency", "__one_copy_each",
                                            "__smallest_is_t0")} <= stems
    assert {"ex04_overlap_makespan", "ex04_overlap_makespan__no_fill_drain"} <= stems  # ignores overlap
    assert {f"ex04_prefetcher__{w}" for w in ("synchronize", "host_waits_for_copy", "no_wait", "same_stream",
                                              "fake_copy_spans", "extra_copies", "equal_to_anything")} <= stems
    assert {f"ex04_losses_to_host{w}" for w in ("", "__synchronize_device", "__item_each")} <= stems  # early read


def test_exercises_end_to_end_in_a_kernel():
    """The real path once per exercise: a fresh kernel runs setup cells, solution and check cell."""
    nb = notebook()
    text, err = run_cells(exercise_cells(nb, c04.EX_COPY, (WRONG / "ex04_copy_time__gib.py").read_text()))
    assert err == "CheckFailed" and "2^30" in text, text
    text, err = run_cells(exercise_cells(nb, c04.EX_MAKESPAN, None))
    assert err is None and "passed: ex04_overlap_makespan" in text, text
    if not torch.cuda.is_available():
        text, err = run_cells(exercise_cells(nb, c04p.EX_PREFETCH, None))
        assert err is None and checks.CPU_PART_PASSED in text, text


# ------------------------------------------------------------------------ ex04_prefetcher, CPU part


def test_prefetcher_solution_passes_the_cpu_part(capsys, monkeypatch):
    monkeypatch.setattr(checks, "gpu_available", lambda: False)
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    run_in_process(c04p.EX_PREFETCH, None)
    out = capsys.readouterr().out
    assert checks.SKIP_MARKER in out and checks.CPU_PART_PASSED in out


@pytest.mark.parametrize("stem, message", [
    ("ex04_prefetcher", r"data right with device='cpu', 6 batches of 1,000 float32 values, saw wrong data in "
                        r"batches \["),                         # one buffer: batch i overwritten by batch i+1
    ("ex04_prefetcher__no_read_ahead", "taken ahead"),
    ("ex04_prefetcher__equal_to_anything", "torch.Tensor"),
])
def test_prefetcher_wrong_answers_fail_the_cpu_part(stem, message, monkeypatch):
    monkeypatch.setattr(checks, "gpu_available", lambda: False)
    with pytest.raises(CheckFailed, match=message):
        run_in_process(c04p.EX_PREFETCH, (WRONG / f"{stem}.py").read_text())


def test_prefetcher_cpu_run_fails_when_a_gpu_is_required(monkeypatch):
    monkeypatch.setattr(checks, "gpu_available", lambda: False)
    monkeypatch.setenv("COURSE_REQUIRE_GPU", "1")
    with pytest.raises(CheckFailed, match="needs a GPU"):
        run_in_process(c04p.EX_PREFETCH, None)


# ------------------------------------------------------------------------ ex04_losses_to_host


def _losses_data(inputs, **gpu_over) -> dict:
    """What the probe of a right answer returns, with the GPU run's fields overridden."""
    want = c04._loss_values(inputs["seed"], inputs["n"])
    cpu = {"values": list(want), "type": "float"}
    if not inputs["gpu"]:
        return {"cpu": cpu}
    return {"cpu": cpu, "gpu": {"values": list(want), "type": "float", "host_ms": 52.0, "side_done": False, "waits": 1,
                                  **gpu_over}}


def test_losses_judge_passes_one_wait_and_names_each_mistake():
    ex = checks.exercise(c04.EX_LOSSES)
    inputs = {**ex.inputs(), "gpu": True}
    assert "1 sync counted" in ex.judge(inputs, _losses_data(inputs))
    assert "0 syncs counted" in ex.judge(inputs, _losses_data(inputs, waits=0))  # an event's wait is not counted
    stale = [v + 1.0 for v in c04._loss_values(inputs["seed"] + 1, inputs["n"])]
    mistakes = {
        "read a copy before it arrived": {"values": stale},
        "at most one wait": {"waits": inputs["n"]},
        "whole device": {"host_ms": 301.0},
        "the other stream's work done": {"side_done": True},  # a faked clock does not hide a device-wide wait
        "list of 8 Python floats": {"values": None, "type": "a Tensor"},
    }
    for hint, over in mistakes.items():
        with pytest.raises(CheckFailed, match=re.escape(hint)):
            ex.judge(inputs, _losses_data(inputs, **over))
    cpu_inputs = {**inputs, "gpu": False}
    detail = ex.judge(cpu_inputs, _losses_data(cpu_inputs))
    assert "not checked without a GPU" in detail and "stale" in detail
    with pytest.raises(CheckFailed, match=r"losses_to_host\(losses\)\[0\] == .* CPU tensors, saw 0.0"):
        ex.judge(cpu_inputs, {"cpu": {"values": [0.0] * inputs["n"], "type": "float"}})


def test_losses_solution_passes_the_cpu_part(capsys, monkeypatch):
    monkeypatch.setattr(checks, "gpu_available", lambda: False)
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    run_in_process(c04.EX_LOSSES, None)
    out = capsys.readouterr().out
    assert checks.SKIP_MARKER in out and checks.CPU_PART_PASSED in out


LOSSES_CPU_WRONG = {
    "ex04_losses_to_host__returns_tensors": "to return a list of 8 Python floats for 8 losses as 0-d float32 CPU "
                                            "tensors, saw Tensor, 8 items",
    "ex04_losses_to_host__float_equal_to_anything": r"losses_to_host\(losses\)\[0\] == .*, saw 0.0",
}


@pytest.mark.parametrize("path", wrong_answers(c04.EX_LOSSES), ids=lambda p: p.stem)
def test_losses_wrong_answers_on_cpu(path, capsys, monkeypatch):
    """Those that fail on CPU tensors fail the CPU part, naming the case; the others pass it, said to be partial."""
    monkeypatch.setattr(checks, "gpu_available", lambda: False)
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    if path.stem in LOSSES_CPU_WRONG:
        with pytest.raises(CheckFailed, match=LOSSES_CPU_WRONG[path.stem]):
            run_in_process(c04.EX_LOSSES, path.read_text())
    else:  # an early read, a device-wide wait, a wait per loss: right values on a CPU, caught on a GPU
        run_in_process(c04.EX_LOSSES, path.read_text())
        assert checks.CPU_PART_PASSED in capsys.readouterr().out


# --------------------------------------------------------------- the prefetcher's judge on plain data


def _small_gpu_inputs(**over) -> dict:
    """The prefetcher's inputs with GPU-sized batches shrunk, so the judge's expectations are cheap here."""
    inputs = {**checks.exercise(c04p.EX_PREFETCH).inputs(), "gpu": True, "gpu_numel": 500, "gpu_idx": [0, 7, 499]}
    return {**inputs, **over}


def _span(kind, stream, a, b, name="k"):
    return {"name": name, "kind": kind, "rank": 0, "stream": stream, "start_ms": float(a), "end_ms": float(b)}


def _pipelined(n, c=1.0, k=2.0):
    """Spans of an ideal double-buffered run: copies back to back under the previous batch's compute."""
    spans = []
    for i in range(n):
        spans.append(_span("h2d", "stream 7", i * k, i * k + c, "Memcpy HtoD (Pinned -> Device)"))
        spans.append(_span("compute", c04p.COMPUTE_ROW, c + i * k, c + (i + 1) * k, "spin_kernel"))
    return spans


def _serial(n, c=1.0, k=2.0):
    spans, t = [], 0.0
    for _ in range(n):
        spans.append(_span("h2d", c04p.COMPUTE_ROW, t, t + c, "Memcpy HtoD (Pinned -> Device)"))
        spans.append(_span("compute", c04p.COMPUTE_ROW, t + c, t + c + k, "spin_kernel"))
        t += c + k
    return spans


def _runs(inputs, spans=None, host_ms=1.0, corrupt=None):
    """What a correct prefetcher's probe would return, built from the judge's own expectations."""
    n, runs = inputs["n_batches"], []
    for j, kind in enumerate(c04p._schedule(inputs)):
        numel, idx = (inputs["cpu_numel"], inputs["cpu_idx"]) if kind == "cpu" else \
            (inputs["gpu_numel"], inputs["gpu_idx"])
        sums, samples = c04p._expected(inputs["seed"] + j, n, numel, idx)
        run = {"kind": kind, "taken": [min(i + 2, n) for i in range(n)], "problems": [], "sums": sums,
               "samples": samples}
        if kind == "overlap":
            run["spans"] = spans if spans is not None else _pipelined(n)
        if kind == "host":
            run["host_ms"] = host_ms
        runs.append(run)
    if corrupt:
        corrupt(runs)
    return {"runs": runs, "copy_ms": 1.0, "compute_ms": 2.0, "step_ms": 2.0}


def test_copy_hidden_from_spans():
    n = 6
    hidden, _ = c04p.copy_hidden(_pipelined(n), n)
    assert hidden == pytest.approx((n - 1) / n)
    hidden, _ = c04p.copy_hidden(_serial(n), n)
    assert hidden == pytest.approx(0.0)
    # Kernels on other streams, and ranges named like copies, change nothing.
    extra = _serial(n) + [_span("compute", "stream 9", 0, 30), _span("range", "stream 9", 0, 30, "Memcpy HtoD")]
    assert c04p.copy_hidden(extra, n)[0] == pytest.approx(0.0)
    # Extra real copies are seen, not counted as hidden.
    more = _serial(n) + [_span("h2d", "stream 9", i * 3.0 + 1, i * 3.0 + 2) for i in range(n)]
    hidden, note = c04p.copy_hidden(more, n)
    assert hidden is None and "12 host-to-device copies" in note
    assert c04p.copy_hidden([s for s in _pipelined(n) if s["kind"] == "h2d"], n)[0] is None
    # Kernels an answer adds to the compute stream while the copies run would fill the compute row: capped at
    # the probe's own compute time, they cannot pass for hidden copies.
    faked = _serial(n) + [_span("compute", c04p.COMPUTE_ROW, i * 3.0, i * 3.0 + 1) for i in range(n)]
    assert c04p.copy_hidden(faked, n)[0] == pytest.approx(1.0)
    assert c04p.copy_hidden(faked, n, compute_cap_ms=1.1 * n * 2.0)[0] == pytest.approx(0.2)


def test_prefetcher_judge_on_plain_data():
    ex = checks.exercise(c04p.EX_PREFETCH)
    inputs = _small_gpu_inputs()
    assert "83% of the copy time hidden" in ex.judge(inputs, _runs(inputs))
    cpu_inputs = {**inputs, "gpu": False}
    assert "device='cpu'" in ex.judge(cpu_inputs, _runs(cpu_inputs))
    fails = {
        "hidden under compute": _runs(inputs, spans=_serial(6)),
        "hidden under compute ": _runs(inputs, spans=_serial(6) + [_span("compute", c04p.COMPUTE_ROW, i * 3.0,
                                                                         i * 3.0 + 1) for i in range(6)]),
        "compute time per batch": {**_runs(inputs), "step_ms": None},
        "host-to-device copies": _runs(inputs, spans=_serial(6) + [_span("h2d", "s", 0, 1)] * 6),
        "queued on the GPU": _runs(inputs, host_ms=100.0),
        "data right": _runs(inputs, corrupt=lambda runs: runs[1]["sums"].__setitem__(2, 0.0)),
        "taken ahead": _runs(inputs, corrupt=lambda runs: runs[0].__setitem__("taken", list(range(1, 7)))),
        "torch.Tensor": _runs(inputs, corrupt=lambda runs: runs[2]["problems"].append("batch 0 came out as a X")),
        "batches out": _runs(inputs, corrupt=lambda runs: [r[k].pop() for r in runs[:1] for k in ("sums", "samples")]),
        "probe's runs": _runs(inputs, corrupt=lambda runs: runs.pop()),
    }
    for message, data in fails.items():
        with pytest.raises(CheckFailed, match=re.escape(message.strip())):
            ex.judge(inputs, data)


def test_prefetcher_judge_recomputes_the_data_from_the_seed():
    ex = checks.exercise(c04p.EX_PREFETCH)
    inputs = _small_gpu_inputs()
    data = _runs(inputs)
    with pytest.raises(CheckFailed, match="data right"):
        ex.judge({**inputs, "seed": inputs["seed"] + 1}, data)  # the probe's numbers fit another seed only


def test_late_copy_detector_recognises_host_to_gpu_copies_only():
    T, x = torch.Tensor, torch.ones(3)
    assert c04p._copies_to_cuda(T.to, (x, "cuda"), {})
    assert c04p._copies_to_cuda(T.to, (x,), {"device": torch.device("cuda", 0), "non_blocking": True})
    assert c04p._copies_to_cuda(T.cuda, (x,), {})
    assert not c04p._copies_to_cuda(T.to, (x, torch.float16), {})
    assert not c04p._copies_to_cuda(T.to, (x, "cpu"), {})
    assert not c04p._copies_to_cuda(T.add, (x, x), {})


# ---------------------------------------------------------------------------------- the notebook itself


def test_notebook_code_is_in_the_notebook_and_recorded_keys_are_unique():
    nb = notebook()
    src = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    assert "course_utils.copies" not in src and "import copies" not in src and "from course_utils import copies" \
        not in src
    keys = re.findall(r'rec\.take\("([a-z_]+)"', src)
    assert len(keys) == len(set(keys)) >= 10, keys
    checks_cells = ["".join(c["source"]) for c in nb["cells"] if c.get("metadata", {}).get("nbgrader", {}).get("grade")]
    assert checks_cells == ['check("ex04_copy_time", fit_copy)', 'check("ex04_losses_to_host", losses_to_host)',
                            'check("ex04_overlap_makespan", makespan_ms)', 'check("ex04_prefetcher", prefetch)']


def test_recording_has_every_measurement_the_notebook_takes():
    path = reference.DATA_DIR / "04_async_memcpy.json"
    if not path.exists():
        pytest.skip("no recording of 04_async_memcpy yet: python benchmarks/record_references.py 04_async_memcpy")
    rec = reference.load("04_async_memcpy")
    src = "\n".join("".join(c["source"]) for c in notebook()["cells"] if c["cell_type"] == "code")
    assert rec.provenance.get("gpu") and rec.provenance.get("date")
    missing = set(re.findall(r'rec\.take\("([a-z_]+)"', src)) - set(rec.data)
    assert not missing, f"the recording lacks {sorted(missing)}: python benchmarks/record_references.py " \
                        "04_async_memcpy on a GPU"




def recorded(key: str):
    rec = reference.load("04_async_memcpy")
    if key not in rec.data:
        pytest.skip(f"{key} is not recorded yet: python benchmarks/record_references.py 04_async_memcpy on a GPU")
    return rec.data


def test_notebook_functions_can_be_read_without_a_gpu():
    ns = notebook_functions(notebook(), "__lesson04__", "copy_sweep", "blocking_copy_wait", "read_too_early",
                            "change_source_in_flight", "many_copies", "nonblocking_on_one_stream",
                            "copy_engine_facts", "copies_at_once", "pin_cost", "copy_then_compute",
                            "prefetcher_timeline", "stack", "to_cpu_too_early", "staging_cpu_copy", "pageable_fall",
                            "per_stream_pools", tools=True, solutions=False)
    cases = {"a": [_span("compute", "s", 5, 6), _span("range", "s", 0, 9)], "b": [_span("h2d", "t", 2, 3)]}
    stacked = ns["stack"](cases)
    assert [(s["stream"], s["start_ms"]) for s in stacked] == [("a: s", 0.0), ("b: t", 0.0)]


def with_masters_fit(ns: dict) -> dict:
    """ns with the master's fit_copy (a solution cell, which notebook_functions leaves out) defined in it."""
    cell = next(c for c in notebook()["cells"]
                if c["metadata"].get("nbgrader", {}).get("grade_id") == f"{c04.EX_COPY}_solution")
    exec(compile("".join(cell["source"]), "<fit_copy>", "exec"), ns)
    return ns


def test_the_copy_model_is_fitted_from_the_whole_sweep_not_one_point():
    ns = with_masters_fit(notebook_functions(notebook(), "__lesson04__", "fit_copy_model", tools=True,
                                             solutions=False))
    t0_us, rate = 9.0, 50.0  # GB/s
    sizes = [1 << k for k in range(10, 29, 2)]
    results = [{"op": "h2d pinned", "size_bytes": n, "time_ms": (t0_us + n / rate / 1e3) / 1e3,
                "algbw_gbps": 0.0} for n in sizes]
    issue = [{"op": "h2d pinned", "size_bytes": n, "issue_us": 4.0} for n in sizes]
    fit = ns["fit_copy_model"]({"results": results, "issue": issue})
    assert fit["t0_us"] == pytest.approx(t0_us, rel=1e-6) and fit["rate_gbps"] == pytest.approx(rate, rel=1e-6)
    assert fit["issue_us"] == 4.0


@pytest.mark.parametrize("second_start, way", [(10.0, "one after the other"), (0.5, "at once")])
def test_two_copies_are_told_apart_as_queued_or_sharing(second_start, way):
    ns = notebook_functions(notebook(), "__lesson04__", "how_they_ran", tools=True, solutions=False)
    copies = [_span("h2d", "stream 1", 0.0, 10.0), _span("h2d", "stream 2", second_start, second_start + 10.0)]
    assert ns["how_they_ran"](copies)[0] == way


def check_copy_facts(data: dict) -> list[str]:
    """What the prose says of the sweep and of two copies, on one run's data (live or recorded)."""
    ns = with_masters_fit(notebook_functions(notebook(), "__lesson04__", "fit_copy_model", "how_they_ran",
                                             tools=True, solutions=False))
    sweep, ca = data["sweep"], data["copies_at_once"]
    fit = ns["fit_copy_model"](sweep)
    link = sweep["link"]["gbps"]
    assert 0 < fit["t0_us"] < 50, fit  # microseconds of GPU time per copy
    assert 0.75 * link < fit["rate_gbps"] < link, (fit, link)  # pinned copies: near the line, under it
    alone = next(s["end_ms"] - s["start_ms"] for s in ca["one h2d"] if s["kind"] == "h2d")
    two = [s for s in ca["two h2d"] if s["kind"] == "h2d"]
    together = max(s["end_ms"] for s in two) - min(s["start_ms"] for s in two)
    assert together > 1.7 * alone  # two copies one way: no more bytes per second than one alone
    pageable = data["read_too_early"]
    assert 0.8 <= pageable["pageable"]["call_ms"] / pageable["busy_ms"] <= 1.5  # it waited for the stream
    return [f"t0 {fit['t0_us']:.1f} µs, rate {fit['rate_gbps']:.1f} of {link:.1f} GB/s, issue {fit['issue_us']:.1f}"
            f" µs; two h2d {ns['how_they_ran'](two)[0]}"]


def test_the_recording_shows_the_copy_facts():
    rec = reference.load("04_async_memcpy")
    if "issue" not in rec.data["sweep"]:
        pytest.skip("the recording predates the per-copy sweep: python benchmarks/record_references.py 04")
    print(check_copy_facts(rec.data))


# ---------------------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_prefetcher_solution_passes_on_gpu():
    ns = {"torch": torch}
    sol = "".join(next(c for c in notebook()["cells"]
                       if c["metadata"].get("nbgrader", {}).get("grade_id") == "ex04_prefetcher_solution")["source"])
    exec(sol, ns)
    detail = judge_via_probe(c04p.EX_PREFETCH, ns["prefetch"])
    print(detail)
    assert "hidden" in detail


GPU_WRONG = {
    "ex04_prefetcher": "data right",
    "ex04_prefetcher__no_read_ahead": "taken ahead",
    "ex04_prefetcher__equal_to_anything": "torch.Tensor",
    "ex04_prefetcher__no_wait": "data right",
    "ex04_prefetcher__same_stream": "hidden under compute",
    "ex04_prefetcher__synchronize": "hidden under compute",  # no overlap left; the host waits too
    "ex04_prefetcher__host_waits_for_copy": "queued on the GPU",  # overlaps, but the host waits
    "ex04_prefetcher__fake_copy_spans": "hidden under compute",
    "ex04_prefetcher__extra_copies": "host-to-device copies",
}


def test_gpu_wrong_answer_table_covers_every_file():
    assert set(GPU_WRONG) == {p.stem for p in wrong_answers(c04p.EX_PREFETCH)}


def fails_on_gpu(exercise: str, entry: str, stem: str, message: str) -> None:
    """The wrong answer `stem`, run in the lesson's cells, fails `exercise`'s check with `message` in it."""
    ns: dict = {"__name__": "__lesson04__"}
    for src in exercise_cells(notebook(), exercise, (WRONG / f"{stem}.py").read_text())[:-1]:
        exec(src, ns)
    with pytest.raises(CheckFailed, match=re.escape(message)) as err:
        judge_via_probe(exercise, ns[entry])
    print(f"{stem}: {err.value}")


@pytest.mark.gpu
@pytest.mark.parametrize("stem", sorted(GPU_WRONG))
def test_prefetcher_wrong_answers_fail_on_gpu(stem):
    fails_on_gpu(c04p.EX_PREFETCH, "prefetch", stem, GPU_WRONG[stem])


@pytest.mark.gpu
def test_losses_solution_passes_on_gpu():
    ns = {"torch": torch}
    sol = "".join(next(c for c in notebook()["cells"] if c["metadata"].get("nbgrader", {}).get("grade_id")
                       == "ex04_losses_to_host_solution")["source"])
    exec(sol, ns)
    detail = judge_via_probe(c04.EX_LOSSES, ns["losses_to_host"])
    print(detail)
    assert "right on CPU and on the GPU" in detail


LOSSES_GPU_WRONG = {
    "ex04_losses_to_host": "did the host read a copy before it arrived",
    "ex04_losses_to_host__synchronize_device": "whole device",
    "ex04_losses_to_host__item_each": "at most one wait",
    "ex04_losses_to_host__returns_tensors": "Python floats",
    "ex04_losses_to_host__float_equal_to_anything": "CPU tensors, saw 0.0",
}


def test_losses_gpu_wrong_answer_table_covers_every_file():
    assert set(LOSSES_GPU_WRONG) == {p.stem for p in wrong_answers(c04.EX_LOSSES)}


@pytest.mark.gpu
@pytest.mark.parametrize("stem", sorted(LOSSES_GPU_WRONG))
def test_losses_wrong_answers_fail_on_gpu(stem):
    fails_on_gpu(c04.EX_LOSSES, "losses_to_host", stem, LOSSES_GPU_WRONG[stem])


@pytest.mark.gpu
def test_late_copy_batches_delay_the_copy_on_its_own_stream():
    (late,) = c04p.late_copy_batches([torch.ones(1 << 20).pin_memory()], delay_ms=5.0)
    dst = torch.empty(1 << 20, device="cuda")
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(side):
        start.record()
        dst.copy_(late, non_blocking=True)
        end.record()
    torch.cuda.synchronize()
    assert type(dst) is torch.Tensor  # results stay plain tensors
    assert start.elapsed_time(end) >= 4.0  # the 5 ms sleep went onto the copy's stream first
    assert torch.equal(dst.cpu(), torch.ones(1 << 20))


@pytest.mark.gpu
def test_notebook_claims_on_copies_and_waiting():
    """What the notebook's prose says about blocking, stale reads, sources in flight and one wait."""
    ns = notebook_functions(notebook(), "__lesson04__", "blocking_copy_wait", "read_too_early",
                            "change_source_in_flight", "many_copies", "nonblocking_host_time", "copy_sweep",
                            tools=True, solutions=False)
    bw = ns["blocking_copy_wait"](busy_ms=50.0)
    print(bw)
    h = bw["host_ms"]
    assert h["busy on the copy's stream, blocking copy"] >= 40.0
    assert h["busy on another stream, blocking copy"] < 10.0
    assert h["busy on the copy's stream, non_blocking from pinned"] < 5.0
    st = ns["read_too_early"]()
    print(st)
    assert st["pinned"]["early"] == 0.0 and st["pinned"]["after_wait"] == 1.0
    assert st["pageable"]["early"] == 1.0 and st["pageable"]["call_ms"] >= 15.0
    cs = ns["change_source_in_flight"]()
    print(cs)
    assert cs["pinned"]["got_new"] == 1.0 and cs["pageable"]["got_new"] == 0.0
    assert cs["pageable"]["call_ms"] > 0.5 * cs["busy_ms"], cs  # the summary's hidden stream sync
    mc = ns["many_copies"]()
    print(mc)
    assert mc["all_arrived"]
    assert mc["one by one, blocking"]["host_waits"] == mc["n_copies"]
    assert mc["non_blocking, one wait"]["host_waits"] == 0
    assert mc["non_blocking, one wait"]["issue_ms"] < 0.5 * mc["one by one, blocking"]["total_ms"]
    nb = ns["nonblocking_host_time"](64 * MiB)
    print(nb)
    assert nb["pinned"]["returned_ms"] < 0.5 * nb["pageable"]["returned_ms"]
    sweep = ns["copy_sweep"]([1 << 10, 1 << 16, 1 << 22, 1 << 26])
    ca = notebook_functions(notebook(), "__lesson04__", "copies_at_once", tools=True,
                            solutions=False)["copies_at_once"](64 * MiB)
    print(check_copy_facts({"sweep": sweep, "copies_at_once": ca, "read_too_early": st}))


@pytest.mark.gpu
def test_notebook_claims_on_streams_engines_and_pinning():
    """Same-stream copies wait for the kernel before them; a side stream's don't; pinning cold allocates."""
    ns = notebook_functions(notebook(), "__lesson04__", "nonblocking_on_one_stream", "copy_engine_facts",
                            "copies_at_once", "pin_cost", "copy_then_compute", tools=True, solutions=False)
    od = ns["nonblocking_on_one_stream"]()
    for where, after in (("same stream", True), ("side stream", False)):
        spans = od[where]["spans"]
        copy = min((s for s in spans if s["kind"] == "h2d"), key=lambda s: s["start_ms"])
        busy_end = max(s["end_ms"] for s in spans if s["kind"] == "compute")
        print(where, od[where]["host_ms"], copy["start_ms"] - busy_end)
        assert (copy["start_ms"] >= busy_end - 0.05) is after
        assert od[where]["host_ms"] < 0.5 * od["busy_ms"]
    ef = ns["copy_engine_facts"]()
    print(ef)
    assert isinstance(ef["async_engine_count"], int) and ef["async_engine_count"] >= 1
    ca = ns["copies_at_once"](64 * MiB)
    for name in ("one h2d", "two h2d", "h2d + d2h"):
        copies = [s for s in ca[name] if s["kind"] in ("h2d", "d2h")]
        print(name, [(s["kind"], round(s["start_ms"], 3), round(s["end_ms"], 3)) for s in copies])
        assert len(copies) == (1 if name == "one h2d" else 2)
    pc = ns["pin_cost"](64 * MiB)
    print(pc)
    if pc["new_allocations_cold"] is not None:
        assert pc["new_allocations_cold"] == 3 and pc["new_allocations_cached"] == 0
    assert pc["pin_cached_ms"] < pc["pin_cold_ms"]
    ov = ns["copy_then_compute"]()
    from course_utils.timeline import Timeline

    one, two = (Timeline.from_spans(ov[f"{s} stream"]).stats() for s in (1, 2))
    print(one.makespan_ms, one.copy_compute_overlap, two.makespan_ms, two.copy_compute_overlap)
    assert two.makespan_ms < 0.8 * one.makespan_ms and (two.copy_compute_overlap or 0) > 0.5


def test_stacked_runs_are_plotted_without_stats():
    """Runs stacked on one axis (each from 0 ms) never ran together: stats over them would report overlap that
    never happened ("compute on 2+ streams at once: 100%" for runs that were one after another)."""
    cells = ["".join(c["source"]) for c in notebook()["cells"] if c["cell_type"] == "code"]
    plots = [src[m.start():m.start() + 300] for src in cells for m in re.finditer(r"stack\((\{|runs\))", src)]
    assert len(plots) == 2
    assert all(".plot(" in p and "show_stats=False" in p for p in plots), plots


def test_pageable_fall_compares_small_and_large_copies_with_the_cpu_copy():
    ns = notebook_functions(notebook(), "__lesson04__", "pageable_fall", tools=True, solutions=False)
    sizes = [MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB]
    h2d = dict(zip(sizes, [13.9, 11.0, 9.1, 6.5, 7.8], strict=True))
    results = [{"op": "h2d pageable", "size_bytes": n, "algbw_gbps": v} for n, v in h2d.items()]
    results += [{"op": "d2h pageable", "size_bytes": n, "algbw_gbps": 12.5} for n in sizes]
    staged = {"gbps": {str(n): 20.0 if n <= 4 * MiB else 10.0 for n in sizes}}
    fall, big = ns["pageable_fall"]({"results": results}, staged)
    assert big == 256 * MiB
    assert fall["h2d pageable"] == (13.9, 7.8) and fall["d2h pageable"] == (12.5, 12.5)
    assert fall["CPU copy into pinned (1 thread)"] == (20.0, 10.0)


@pytest.mark.parametrize("h2d, cpu, l3, says", [
    ((13.9, 12.0), (20.0, 10.0), 300 * MiB, "did not slow down much"),
    ((12.5, 6.5), (15.3, 5.2), 300 * MiB, "slower than the whole pageable copy (6.5 GB/s)"),  # the H200's numbers
    ((12.5, 6.5), (8.0, 7.5), 300 * MiB, "but the CPU's own copy into pinned memory did not (1.1x)"),
    ((12.5, 6.5), (30.0, 10.0), 300 * MiB, "source and destination, 512 MiB, outgrow the last-level cache"),
    ((12.5, 6.5), (30.0, 10.0), 1024 * MiB, "although source and destination fit in the last-level cache"),
])
def test_the_fall_verdict_reads_the_rates(h2d, cpu, l3, says):
    fall_verdict = notebook_functions(notebook(), "__lesson04__", "pageable_fall", tools=True,
                                      solutions=False)["fall_verdict"]
    verdict = fall_verdict(
        {"h2d pageable": h2d, "d2h pageable": (12.5, 12.5), "CPU copy into pinned (1 thread)": cpu}, 256 * MiB, l3)
    assert says in verdict, verdict


def test_the_recording_shows_to_cpu_non_blocking_is_pinned_and_stale_before_the_sync():
    tc = recorded("to_cpu_too_early")["to_cpu_too_early"]
    assert tc["pinned"] is True and tc["early"] < 1.0 and tc["after_sync"] == 1.0, tc
    assert tc["early_done"] is False and 42.0 not in tc["early_first"], tc  # read while the copy was still queued


def test_the_recording_shows_a_pageable_non_blocking_copy_waiting_for_the_stream():
    cs = recorded("source_in_flight")["source_in_flight"]
    assert cs["pageable"]["call_ms"] > 0.5 * cs["busy_ms"] and cs["pinned"]["call_ms"] < 1.0, cs


def test_the_recording_shows_per_stream_pools():
    steps = recorded("per_stream_pools")["per_stream_pools"]["steps"]
    x, freed, y, z = steps
    assert freed["allocated_mib"] < x["allocated_mib"] and freed["reserved_mib"] == x["reserved_mib"], steps
    assert y["ptr"] != x["ptr"] and z["ptr"] == x["ptr"], steps  # B gets a new block; A gets x's back


@pytest.mark.gpu
def test_notebook_claims_on_to_cpu_the_allocator_and_staging():
    """.to("cpu", non_blocking=True) is pinned and stale before the sync; blocks go back to their stream's pool."""
    ns = notebook_functions(notebook(), "__lesson04__", "to_cpu_too_early", "per_stream_pools", "staging_cpu_copy",
                            tools=True, solutions=False)
    tc = ns["to_cpu_too_early"]()
    print(tc)
    assert tc["pinned"] is True and tc["early"] < 1.0 and tc["after_sync"] == 1.0
    assert tc["early_done"] is False and 42.0 not in tc["early_first"], tc
    x, freed, y, z = ns["per_stream_pools"]()["steps"]
    print(x, freed, y, z, sep="\n")
    assert freed["allocated_mib"] < x["allocated_mib"] and freed["reserved_mib"] == x["reserved_mib"]
    assert y["ptr"] != x["ptr"] and z["ptr"] == x["ptr"]
    staged = ns["staging_cpu_copy"]([MiB, 64 * MiB])
    print(staged)
    assert all(v > 0 for v in staged["gbps"].values())
