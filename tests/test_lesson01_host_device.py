"""Lesson 01 (host and device): measurement helpers, the exercise check against right and wrong steps,
the reference recording, and the notebook's exercise cells run with the solution and the wrong answer."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib
import pytest
import torch
import torch.nn.functional as F

from course_utils import checks, reference
from course_utils import host_device as hd
from course_utils.checks.host_device import check_hidden_syncs
from course_utils.timeline import Timeline
from tests.exercise_cells import exercise_cells, run_cells

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "01_host_and_device.ipynb"
EX = "ex01_hidden_syncs"
HAS_CUDA = torch.cuda.is_available()


# ------------------------------------------------------------------------------ step functions


def fast_step(model, opt, x, y, history):  # the solution
    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    acc = (out.argmax(dim=1) == y).float().mean()
    history.append({"loss": loss.detach(), "grad_norm": grad_norm, "acc": acc})


def half_fixed_step(model, opt, x, y, history):  # still reads the norm
    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    opt.step()
    history.append({"loss": loss.detach(), "grad_norm": float(grad_norm), "acc": (out.argmax(1) == y).float().mean()})


def printing_step(model, opt, x, y, history):  # no .item(), but prints the loss tensor
    fast_step(model, opt, x, y, history)
    print(f"loss {history[-1]['loss']:.3f}")


def branching_step(model, opt, x, y, history):  # skips bad steps with `if`: bool(tensor) reads the value
    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)
    if torch.isfinite(grad_norm):
        opt.step()
    history.append({"loss": loss.detach(), "grad_norm": grad_norm, "acc": (out.argmax(1) == y).float().mean()})


def no_clip_step(model, opt, x, y, history):  # no syncs, but forgets the clipping: different weights
    opt.zero_grad(set_to_none=True)
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()]))
    opt.step()
    history.append({"loss": loss.detach(), "grad_norm": grad_norm, "acc": (out.argmax(1) == y).float().mean()})


def wrong_keys_step(model, opt, x, y, history):
    fast_step(model, opt, x, y, history)
    history[-1] = {"loss": history[-1]["loss"]}


# ------------------------------------------------------------------------------ the check


def test_solution_passes_or_skips_on_cpu(capsys, monkeypatch):
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    check_hidden_syncs(fast_step)
    out = capsys.readouterr().out
    assert (checks.PASS_MARKER if HAS_CUDA else checks.SKIP_MARKER) in out


@pytest.mark.parametrize("step", [hd.slow_train_step, half_fixed_step, printing_step, branching_step,
                                  hd.bare_train_step, no_clip_step, wrong_keys_step])
def test_wrong_steps_fail_everywhere(step, monkeypatch):
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    with pytest.raises(checks.CheckFailed, match=EX):
        check_hidden_syncs(step)


def test_failure_message_names_the_reads(monkeypatch):
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    with pytest.raises(checks.CheckFailed) as err:
        check_hidden_syncs(half_fixed_step)
    assert "expected no host reads" in str(err.value) and "__float__" in str(err.value)


def test_without_a_gpu_the_check_skips_or_fails_under_require_gpu(monkeypatch, capsys):
    """Pretend there is no GPU (so this runs on GPU machines too): skip normally, fail under COURSE_REQUIRE_GPU=1."""
    monkeypatch.setattr(checks, "gpu_available", lambda: False)
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    check_hidden_syncs(fast_step)
    assert checks.SKIP_MARKER in capsys.readouterr().out
    monkeypatch.setenv("COURSE_REQUIRE_GPU", "1")
    with pytest.raises(checks.CheckFailed, match="needs a GPU"):
        check_hidden_syncs(fast_step)


@pytest.mark.gpu
def test_gpu_timing_part_catches_a_sync_the_reads_counter_cannot_see(monkeypatch):
    """torch.nonzero syncs inside C++ (no Python host read): only the GPU part of the check sees it."""
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)

    def nonzero_step(model, opt, x, y, history):
        fast_step(model, opt, x, y, history)
        torch.nonzero(y)  # data-dependent shape: the host waits for the GPU

    with pytest.raises(checks.CheckFailed, match="syncs per step"):
        check_hidden_syncs(nonzero_step)


# ------------------------------------------------------------------------------ helpers


def test_count_host_reads_counts_each_kind_once_and_restores_tensor():
    before = {name: torch.Tensor.__dict__.get(name) for name in hd.HOST_READS}
    t = torch.arange(4.0)
    with hd.count_host_reads() as reads:
        t.sum().item()
        float(t[0])
        str(t)
        f"{t.sum():.1f}"
        t.tolist()
        bool(t[1] > 0)
        _ = t * 2, t.shape, t.sum()  # no reads
    assert reads.calls == ["item", "__float__", "__repr__", "__format__", "tolist", "__bool__"]
    assert reads.count == 6
    assert {name: torch.Tensor.__dict__.get(name) for name in hd.HOST_READS} == before
    with hd.count_host_reads() as none:
        t * 3
    assert none.count == 0


def test_training_helpers_on_cpu():
    p = hd.make_train_problem("cpu", 16, 8)
    q = hd.make_train_problem("cpu", 16, 8)
    assert all(torch.equal(a, b) for a, b in zip(p.model.parameters(), q.model.parameters(), strict=True))
    out = hd.run_steps(fast_step, p, 3)
    assert len(out["history"]) == 3 and out["total_ms"] >= out["issue_ms"] >= 0
    floats = hd.history_as_floats(out["history"])
    assert set(floats[0]) == {"loss", "grad_norm", "acc"} and all(isinstance(v, float) for v in floats[0].values())
    slow = hd.history_as_floats(hd.run_steps(hd.slow_train_step, q, 3)["history"])
    assert all(a == pytest.approx(b) for a, b in zip(slow, floats, strict=True))
    costs = hd.train_step_costs(hd.slow_train_step, "cpu", 16, 8, 2)
    assert costs["syncs_per_step"] == 4  # item, __float__, cpu, tolist


def test_cpu_measurements_have_the_documented_shape():
    launch = hd.launch_vs_finish("cpu", 64, n=2, repeats=1)
    assert launch["work_done_ms"] >= launch["calls_return_ms"] > 0
    timing = hd.timing_methods("cpu", 64, n=2, repeats=1)
    assert timing["cuda_events_ms"] is None and timing["perf_counter_synced_ms"] > 0
    spans = hd.async_launch_timeline("cpu", 64, n=3)
    kinds = {(s["kind"], s["stream"]) for s in spans}
    assert kinds == {("compute", "cpu work"), ("host", "host")}
    assert [s["name"] for s in spans][-1] == "torch.cuda.synchronize()"
    assert len(spans) == 7
    costs = hd.creation_costs("cpu", 1024, repeats=1)
    assert costs["randn_on_device_ms"] > 0 and costs["randn_then_to_ms"] > 0


def test_gpu_only_helpers_say_so_without_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        hd.sync_stalls()
    with pytest.raises(RuntimeError, match="needs CUDA"):
        with hd.count_syncs():
            pass


@pytest.mark.gpu
def test_sync_stalls_on_gpu():
    data = hd.sync_stalls(busy_ms=10.0)
    rows = {r["call"]: r for r in data["rows"]}
    for call in ("t[0].item()", "t.cpu()", "t.tolist()", "print(t)", "torch.cuda.synchronize()"):
        assert rows[call]["host_ms"] > 5.0, (call, rows[call])
    for call in ("t.shape", "t * 2", "t.sum()"):
        assert rows[call]["host_ms"] < 2.0, (call, rows[call])
        assert rows[call]["syncs"] == 0
    assert rows["t[0].item()"]["syncs"] >= 1


@pytest.mark.gpu
def test_gpu_launch_returns_before_the_work():
    launch = hd.launch_vs_finish("cuda", 2048, n=8)
    assert launch["work_done_ms"] > 3 * launch["calls_return_ms"]
    t = hd.timing_methods("cuda", 2048, n=8)
    assert t["cuda_events_ms"] == pytest.approx(t["perf_counter_synced_ms"], rel=0.5)
    assert t["perf_counter_no_sync_ms"] < 0.5 * t["cuda_events_ms"]


# ------------------------------------------------------------------------------ the recording


def test_reference_recording_is_complete_and_plots():
    if "01_host_device" not in reference.available():
        pytest.skip("no reference recording 01_host_device yet: make it on a GPU with "
                    "python benchmarks/record_references.py 01_host_device")
    rec = reference.load("01_host_device")
    assert rec.provenance.get("gpu") and rec.provenance.get("torch") and rec.provenance.get("date")
    assert "recorded on" in rec.label()
    for key in ("launch", "timeline", "stalls", "timing", "creation", "train_slow", "train_bare"):
        assert key in rec.data, key
    assert [r["call"] for r in rec.data["stalls"]["rows"]] == list(hd.SYNC_POINTS)
    import matplotlib.pyplot as plt

    for fig in (Timeline.from_spans(rec.data["timeline"]).plot(title="t"), hd.plot_sync_stalls(rec.data["stalls"]),
                Timeline.from_spans(rec.data["stalls"]["spans"]).plot(title="s"),
                hd.plot_train_costs({"a": rec.data["train_slow"], "b": rec.data["train_bare"]})):
        plt.close(fig)


def test_recording_is_registered():
    assert hd.RECORDINGS == {"01_host_device": hd.record_lesson01}


# ------------------------------------------------------------------------------ the notebook's exercise


@pytest.fixture(scope="module")
def notebook() -> dict:
    return json.loads(NOTEBOOK.read_text())


def test_notebook_exercise_metadata(notebook):
    cells = [c for c in notebook["cells"] if c["cell_type"] == "code"]
    meta = {c["metadata"].get("nbgrader", {}).get("grade_id"): c["metadata"]["nbgrader"]
            for c in cells if "nbgrader" in c["metadata"]}
    assert meta[EX]["grade"] is True and meta[EX]["points"] > 0 and meta[EX]["locked"] is True
    assert meta[f"{EX}_solution"]["solution"] is True
    assert any("parameters" in c["metadata"].get("tags", []) for c in cells)


def test_notebook_exercise_with_solution(notebook):
    text, error = run_cells(exercise_cells(notebook, EX, None))
    assert error is None, text
    assert (checks.PASS_MARKER if HAS_CUDA else checks.SKIP_MARKER) in text


def test_notebook_exercise_with_wrong_answer(notebook):
    wrong = (ROOT / "tests" / "wrong_answers" / NOTEBOOK.stem / f"{EX}.py").read_text()
    text, error = run_cells(exercise_cells(notebook, EX, wrong))
    assert error == "CheckFailed", text
    assert EX in text


# ------------------------------------------------------------------------------ live, recorded, or neither


def test_live_or_recorded_reads_a_recording_and_says_where_from(tmp_path):
    reference.save("01_demo", {"launch": {"calls_return_ms": 1.0}}, directory=tmp_path)
    data, label = hd.live_or_recorded("01_demo", "launch", lambda: pytest.fail("measured"), live=False,
                                      directory=tmp_path)
    assert data == {"calls_return_ms": 1.0} and label.startswith("recorded on")
    with pytest.raises(KeyError, match="has no 'stalls'"):
        hd.live_or_recorded("01_demo", "stalls", lambda: None, live=False, directory=tmp_path)


def test_live_or_recorded_without_a_recording_goes_on_and_says_how_to_make_it(tmp_path):
    data, label = hd.live_or_recorded("01_nothing", "launch", lambda: pytest.fail("measured"), live=False,
                                      directory=tmp_path)
    assert data is None
    assert "no reference recording '01_nothing'" in label and "record_references.py 01_nothing" in label


def test_plots_draw_cpu_measurements():
    import matplotlib.pyplot as plt

    costs = {"slow": hd.train_step_costs(hd.slow_train_step, "cpu", 16, 8, 2),
             "bare": hd.train_step_costs(hd.bare_train_step, "cpu", 16, 8, 2)}
    stalls = {"busy_ms": 1.0, "rows": [{"call": c, "host_ms": 0.5, "syncs": 0} for c in hd.SYNC_POINTS]}
    for fig in (Timeline.from_spans(hd.async_launch_timeline("cpu", 32, 2)).plot(title="t"),
                hd.plot_train_costs(costs), hd.plot_sync_stalls(stalls)):
        assert fig.axes
        plt.close(fig)


@pytest.mark.gpu
def test_count_syncs_ignores_the_prototype_notice_in_a_fresh_process():
    """The first set_sync_debug_mode() of a process warns that the mode is a prototype: not a sync."""
    import subprocess
    import sys

    code = (
        "import torch; from course_utils.host_device import count_syncs\n"
        "t = torch.ones(4, device='cuda'); torch.cuda.synchronize()\n"
        "with count_syncs() as a: t.shape\n"
        "with count_syncs() as b: t.sum().item()\n"
        "print(a.count, b.count)\n"
    )
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["0", "1"]
