"""Lesson 00 (start here): the 'Seeing time' section's cells, run from the notebook's own code in this
process: the warm-up finding prints a verdict that agrees with its own numbers, the profiler table names the
ops the cell ran, the trace is valid JSON written outside the repository, the nsys cell says when nsys is
missing, and the prose says what Timeline records with."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shutil
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")

pytestmark = pytest.mark.gpu_timing  # on a GPU the first cell times the GPU (and holds it alone)
ROOT = Path(__file__).resolve().parents[2]
NOTEBOOK = ROOT / "notebooks" / "00_start_here.ipynb"
NB = json.loads(NOTEBOOK.read_text())


def section() -> list[dict]:
    """The cells of 'Seeing time', up to the next top-level heading."""
    cells = NB["cells"]
    start = next(i for i, c in enumerate(cells) if "".join(c["source"]).startswith("## Seeing time"))
    end = next(i for i in range(start + 1, len(cells)) if "".join(cells[i]["source"]).startswith("## "))
    return cells[start:end]


def code_cell(words: str) -> str:
    found = ["".join(c["source"]) for c in section() if c["cell_type"] == "code" and words in "".join(c["source"])]
    assert len(found) == 1, f"{len(found)} code cells in 'Seeing time' say {words!r}"
    return found[0]


def prose() -> str:
    return "\n".join("".join(c["source"]) for c in section() if c["cell_type"] == "markdown")


def run(source: str, ns: dict) -> str:
    """Run one cell's code in namespace ns (shared by the cells, as in a kernel); return what it printed."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "<00_start_here cell>", "exec"), ns)
    return out.getvalue()


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    """The section's first cells, run once: the warm-up finding, the profiler, the trace export."""
    ns: dict = {}
    outs = {"warm_up": run(code_cell("first_calls ="), ns), "table": run(code_cell("with profile("), ns),
            "trace": run(code_cell("export_chrome_trace("), ns)}
    yield ns, outs
    shutil.rmtree(ns["trace_dir"], ignore_errors=True)


# ------------------------------------------------------------------ the first finding: warm-up
def test_warm_up_verdicts_follow_the_printed_numbers(ran):
    _, outs = ran
    lines = outs["warm_up"].splitlines()
    numbers = [ln for ln in lines if "first call" in ln]
    verdicts = [ln for ln in lines if "on this machine:" in ln]
    assert [ln.split(":")[0] for ln in numbers] == ["matmul", "copy to host"] and len(verdicts) == 2
    for ln, verdict in zip(numbers, verdicts, strict=True):
        first, rest = (float(v) for v in re.findall(r"([\d.]+) ms", ln))
        set_up = first > 3 * rest and first - rest > 1.0
        assert ("a one-time set-up" in verdict) == set_up, (ln, verdict)
        assert ("no set-up worth seeing" in verdict) == (not set_up), (ln, verdict)


def test_the_later_cells_run_after_the_warm_up():
    cells = [c for c in section() if c["cell_type"] == "code"]
    first = next(i for i, c in enumerate(cells) if "first_calls =" in "".join(c["source"]))
    later = [i for i, c in enumerate(cells) if re.search(r"with (profile\(|tl\.capture\(\))", "".join(c["source"]))]
    assert later and all(i > first for i in later)
    assert "run the work once before you time it" in prose()


# ------------------------------------------------------------------ torch.profiler by hand
def test_profiler_table_names_the_ops_the_cell_ran(ran):
    _, outs = ran
    table = outs["table"]
    assert "aten::mm" in table and "aten::copy_" in table and "# of Calls" in table
    calls = re.search(r"aten::mm\s.*\s(\d+)\s*$", table, re.M)
    assert calls and int(calls.group(1)) == 3, "three steps, three products"
    import torch

    if torch.cuda.is_available():
        assert "Memcpy DtoH" in table and "CUDA total" in table
    else:
        assert "CPU ops only" in table and "CUDA" not in table


def test_profiler_call_is_written_in_the_cell():
    src = code_cell("with profile(")
    assert "ProfilerActivity.CPU" in src and "ProfilerActivity.CUDA" in src and "torch.cuda.is_available()" in src
    assert re.search(r"key_averages\(\)\.table\(sort_by=.*row_limit=", src)


def test_trace_is_chrome_json_outside_the_repository(ran):
    ns, outs = ran
    path = Path(ns["trace_path"])
    assert path.is_file() and not path.resolve().is_relative_to(ROOT.resolve())
    trace = json.loads(path.read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "aten::mm" in names
    assert str(path) in outs["trace"] and "https://ui.perfetto.dev" in outs["trace"]


def test_no_cell_writes_a_trace_into_the_repository():
    for c in section():
        src = "".join(c["source"])
        if c["cell_type"] == "code" and re.search(r"export_chrome_trace|to_chrome_trace|--output", src):
            assert "trace_dir" in src, src[:80]
    assert 'tempfile.mkdtemp(prefix="course-00-")' in code_cell("export_chrome_trace(")


def test_nsys_command_is_shown_and_the_cell_says_when_nsys_is_missing(ran, monkeypatch):
    assert re.search(r"^nsys profile --trace=cuda,nvtx,osrt .*python my_script\.py$", prose(), re.M)
    ns, _ = ran
    monkeypatch.setattr(shutil, "which", lambda name, *a, **k: None)
    out = run(code_cell('shutil.which("nsys")'), dict(ns))
    assert out.startswith("nsys is not installed on this machine")


# ------------------------------------------------------------------ Timeline: the same profiler, drawn
def test_from_profiler_draws_the_learners_trace(ran):
    import torch

    from course_utils.timeline import from_profiler

    ns, _ = ran
    run(code_cell("from_profiler(trace_path)"), dict(ns))
    matplotlib.pyplot.close("all")
    spans = from_profiler(ns["trace_path"])
    if torch.cuda.is_available():  # the GPU's work: the copies at least
        assert sum(s.kind == "d2h" for s in spans) == 3
    else:  # the top-level CPU ops, as computation on the host row
        assert [s.name for s in spans].count("aten::matmul") == 3 and {s.stream for s in spans} == {"host"}


def test_prose_says_what_timeline_records_with():
    text = prose()
    assert "torch.profiler.profile(activities=[CPU, CUDA])" in text and "record_function" in text
    assert "host clock" in text and "CUDA events" in text


def test_timeline_cells_record_the_warmed_up_steps(ran):
    ns, _ = ran
    ns = dict(ns)
    run(code_cell("from_profiler(trace_path)"), ns)
    run(code_cell("with tl.capture():"), ns)
    matplotlib.pyplot.close("all")
    names = {s.name for s in ns["tl"].spans()}
    assert {"matmul 0", "to host 2", "done"} <= names
    out = run(code_cell("timeline_path ="), ns)
    assert "trace events" in out and not Path(ns["timeline_path"]).resolve().is_relative_to(ROOT.resolve())
