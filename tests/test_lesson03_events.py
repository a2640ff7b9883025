"""Lesson 03 (CUDA events): the exercise check against the solution and wrong answers, and the demos."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from course_utils import checks, events, reference
from course_utils.checks import events as check03
from course_utils.timeline import Timeline

ROOT = Path(__file__).resolve().parents[1]
NOTEBOOK = ROOT / "notebooks" / "03_cuda_events.ipynb"
WRONG = ROOT / "tests" / "wrong_answers" / "03_cuda_events"
EX = "ex03_fix_pipeline"
MARKERS = re.compile(r"### BEGIN SOLUTION.*?### END SOLUTION\n?", re.S)


def solution_source(notebook: Path, ex: str, replacement: str | None = None) -> str:
    """The exercise's solution cell, or the cell with `replacement` in place of the marked part."""
    nb = json.loads(notebook.read_text())
    for cell in nb["cells"]:
        if cell["metadata"].get("nbgrader", {}).get("grade_id") == f"{ex}_solution":
            src = "".join(cell["source"])
            assert MARKERS.search(src), f"{ex}: solution markers missing"
            return src if replacement is None else MARKERS.sub(lambda _: replacement, src)
    raise AssertionError(f"no solution cell for {ex} in {notebook.name}")


def load(src: str, name: str):
    ns = {"torch": torch, "events": events}
    exec(compile(src, name, "exec"), ns)
    return ns["fixed_pipeline"]


def wrong_answers() -> list[Path]:
    return sorted(WRONG.glob(f"{EX}*.py"))


def test_exercise_cells_follow_the_convention():
    nb = json.loads(NOTEBOOK.read_text())
    meta = [c["metadata"].get("nbgrader") for c in nb["cells"] if c["metadata"].get("nbgrader")]
    assert meta[0] == {"solution": True, "grade": False, "locked": False, "grade_id": f"{EX}_solution",
                       "schema_version": 3}
    assert meta[1]["grade_id"] == EX and meta[1]["grade"] and meta[1]["locked"] and meta[1]["points"] > 0
    assert any("parameters" in c["metadata"].get("tags", []) for c in nb["cells"])
    assert wrong_answers(), "no wrong answer for the exercise"


def test_judge_passes_correct_overlapped():
    check03.judge_pipeline(0, 12, 1.8, 2)


@pytest.mark.parametrize("wrong_runs, conc, rows, words", [
    (3, 1.8, 2, "correct results"),     # overlapped but racy
    (0, 1.0, 2, "overlapping"),         # correct but serial (one stream, or a synchronize per chunk)
    (0, 1.0, 1, "two streams"),         # everything on one row
])
def test_judge_fails_wrong_facts(wrong_runs, conc, rows, words):
    with pytest.raises(checks.CheckFailed, match=words):
        check03.judge_pipeline(wrong_runs, 12, conc, rows)


def _spans(overlapped: bool) -> list[dict]:
    out = []
    for i in range(4):
        p0 = 5.0 * i if overlapped else 10.0 * i
        c0 = p0 + 5.0
        out.append({"name": f"produce {i}", "kind": "compute", "rank": 0, "stream": "producer",
                    "start_ms": p0, "end_ms": p0 + 5})
        out.append({"name": f"consume {i}", "kind": "compute", "rank": 0, "stream": "consumer",
                    "start_ms": c0, "end_ms": c0 + 5})
    return out


def test_concurrency_from_timeline_stats():
    over = check03.concurrency(Timeline.from_spans(_spans(True)).stats())
    serial = check03.concurrency(Timeline.from_spans(_spans(False)).stats())
    assert over == pytest.approx(40 / 25)
    assert serial == pytest.approx(1.0)
    assert over >= check03.MIN_CONCURRENCY > serial


def test_check_skips_without_gpu_and_fails_when_gpu_required(capsys, monkeypatch):
    fn = load(solution_source(NOTEBOOK, EX), "solution")
    monkeypatch.setattr(checks, "gpu_available", lambda: False)  # the CPU behaviour, on any machine
    monkeypatch.delenv("COURSE_REQUIRE_GPU", raising=False)
    check03.check_fixed_pipeline(fn)
    assert checks.SKIP_MARKER in capsys.readouterr().out
    monkeypatch.setenv("COURSE_REQUIRE_GPU", "1")
    with pytest.raises(checks.CheckFailed, match="needs a GPU"):
        check03.check_fixed_pipeline(fn)


def test_sanitizer_report_starts_at_the_report():
    out = "Traceback ...\nnoise\nCSAN detected a possible data race on tensor with data pointer 1\nAccess by stream 2"
    assert events.sanitizer_report(out).startswith("CSAN detected")
    assert events.sanitizer_report("no report here").endswith("no report here")


def test_reference_recording_has_provenance_and_every_part():
    rec = reference.load("03_events")
    assert rec.provenance.get("gpu") and rec.provenance.get("date") and "recorded on" in rec.label()
    assert {"cycles_per_ms", "basics", "spans_wait", "spans_no_wait", "race", "sanitizer", "reuse",
            "pipeline"} <= set(rec.data)
    Timeline.from_spans(rec.data["pipeline"]["spans"]).stats()


@pytest.mark.gpu
def test_check_passes_the_solution():
    check03.check_fixed_pipeline(load(solution_source(NOTEBOOK, EX), "solution"))


@pytest.mark.gpu
@pytest.mark.parametrize("path", wrong_answers(), ids=lambda p: p.stem)
def test_check_fails_wrong_answers(path):
    fn = load(solution_source(NOTEBOOK, EX, path.read_text()), path.name)
    with pytest.raises(checks.CheckFailed):
        check03.check_fixed_pipeline(fn)


@pytest.mark.gpu
def test_race_reproduced_and_fixed_by_the_wait():
    assert events.race_trials(10, wait=False)["wrong"] >= 8
    assert events.race_trials(10, wait=True)["wrong"] == 0


@pytest.mark.gpu
def test_elapsed_time_matches_the_sleep():
    b = events.event_basics(sleep=10.0)
    assert b["query_before"] is False and b["query_after"] is True
    assert 8.0 < b["elapsed_ms"] < 13.0


@pytest.mark.gpu
def test_record_stream_prevents_early_reuse():
    without, with_rs = events.reuse_demo(False), events.reuse_demo(True)
    assert without["reused_address"] and not without["correct"]
    assert not with_rs["reused_address"] and with_rs["correct"]


@pytest.mark.gpu
def test_sanitizer_catches_the_race():
    r = events.run_sanitizer()
    assert r["detected"], r["report"]
    assert "with the wait: no report" in r["stdout"]
