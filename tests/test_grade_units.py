"""The grader's parts that run no student code: regions, what a probe execs, GPU slots, reports, the CLI's errors."""

from __future__ import annotations

import csv
import threading
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from course_utils import grade, release
from course_utils.grading import assemble
from course_utils.grading import grade as grading
from course_utils.grading import grader as grader_module

pytestmark = pytest.mark.grading

MASTER = Path(__file__).parent / "fixtures" / "grading" / "99_fixture.ipynb"


def master_nb():
    return nbformat.read(MASTER, as_version=4)


@pytest.fixture(scope="module")
def master():
    return assemble.read_master(MASTER)


def by_id(master):
    return {ex.grade_id: ex for ex in master.exercises}


def test_master_exercises_know_their_solution_and_setup_cells(master):
    ex = by_id(master)
    assert [e.grade_id for e in master.exercises] == ["ex99_add", "ex99_mean", "ex99_gpu", "ex99_scale"]
    assert ex["ex99_add"].solutions == (3,) and ex["ex99_mean"].solutions == (7, 8)
    assert all(e.setup == (1,) for e in master.exercises)  # the one setup-tagged cell, before each solution


def test_regions_of_a_student_version_are_stubs(master):
    regs = assemble.regions(master, release.student_version(master_nb(), "fixture"))
    assert all(texts == ["    raise NotImplementedError()"] or texts == ["raise NotImplementedError()"]
               for texts in regs.values()), regs
    assert not any(assemble.attempted(ex, regs) for ex in master.exercises)


def test_regions_with_or_without_markers(master):
    solved = release.student_version(master_nb(), "fixture", completed={"ex99_mean"})  # markers gone
    regs = assemble.regions(master, solved)
    assert regs[7] == ["    return sum(xs)"] and regs[8] == ["    return total(xs) / len(xs)"]
    assert assemble.regions(master, master_nb())[3] == ["    return a + b"]  # the master itself, markers kept


def test_only_regions_come_from_the_submission(master):
    """Edited fixed lines, edited set-up and check cells, added cells: none of it reaches the probe."""
    sub = release.student_version(master_nb(), "fixture", completed={"ex99_add"})
    sub.cells[1].source = "def add(a, b):\n    return 5"  # the setup cell, edited
    sub.cells[3].source = sub.cells[3].source.replace("# the student's part sits inside the function",
                                                      "# my comment")
    sub.cells[4].source = "print('passed: ex99_add')"  # the check cell, edited
    sub.cells.insert(4, nbformat.v4.new_code_cell("add = lambda a, b: 5  # a cell the student added"))
    regs = assemble.regions(master, sub)
    assert regs[3] == ["    # my comment\n    return a + b"]  # the edited comment line is next to the block
    code = assemble.program(master, by_id(master)["ex99_add"], regs)
    assert [where for where, _ in code] == ["<99_fixture setup cell 1>", "<99_fixture solution cell 3>"]
    assert code[0][1] == master.source(1)
    assert code[1][1] == "def add(a, b):\n    # the student's part sits inside the function\n    # my comment\n" \
                         "    return a + b"
    text = "\n".join(src for _, src in code)
    assert "return 5" not in text and "lambda" not in text and "passed" not in text


def test_a_missing_solution_cell_is_not_attempted(master):
    sub = master_nb()
    del sub.cells[7]  # ex99_mean's first solution cell
    regs = assemble.regions(master, sub)
    assert regs[7] is None and assemble.attempted(by_id(master)["ex99_mean"], regs)  # its second cell is there
    code = assemble.program(master, by_id(master)["ex99_mean"], regs)
    assert "raise NotImplementedError()" in code[1][1] and "return total(xs) / len(xs)" in code[2][1]
    sub2 = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print('something else entirely')")])
    regs2 = assemble.regions(master, sub2)
    assert all(v is None for v in regs2.values())
    assert not any(assemble.attempted(ex, regs2) for ex in master.exercises)


def test_a_cell_found_by_its_id_when_its_metadata_is_gone(master):
    sub = master_nb()
    sub.cells[3].metadata = {}
    sub.cells[3].source = "def add(a, b):\n    # the student's part sits inside the function\n    return b + a"
    assert assemble.regions(master, sub)[3] == ["    return b + a"]


@pytest.mark.parametrize("text, stub", [("raise NotImplementedError()", True), ("  # nothing yet\n", True),
                                        ("", True), ("    raise NotImplementedError()\n    # todo", True),
                                        ("return 1", False), ("raise NotImplementedError('x')", False)])
def test_is_stub(text, stub):
    assert assemble.is_stub(text) is stub


def test_feedback_notebook_is_the_master_with_regions(master):
    sub = release.student_version(master_nb(), "fixture", completed={"ex99_add"})
    sub.cells[4].source = "pass"
    nb = assemble.feedback_notebook(master, assemble.regions(master, sub))
    assert [c.source for c in nb.cells if c.cell_type == "markdown"] == \
        [c.source for c in master.nb.cells if c.cell_type == "markdown"]
    assert nb.cells[4].source == 'check("ex99_add", add)'
    assert nb.cells[3].source.endswith("    return a + b") and "raise NotImplementedError()" in nb.cells[7].source
    assert master.nb.cells[7].source.count("BEGIN SOLUTION") == 1  # the master in memory is untouched


# ---------------------------------------------------------------------------------------------- GPU slots


def _honest_data(grade_id: str, inputs: dict) -> dict:
    """What an honest probe of each fixture exercise returns on a GPU machine."""
    if grade_id == "ex99_add":
        return {"sums": [a + b for a, b in inputs["pairs"]]}
    if grade_id == "ex99_mean":
        return {"means": [sum(xs) / len(xs) for xs in inputs["lists"]]}
    if grade_id == "ex99_gpu":
        return {"tensor": True, "device": "cuda", "values": [0.0, 2.0, 4.0, 6.0]}
    return {"tensor": True, "device": "cuda", "values": [v * inputs["k"] for v in inputs["values"]]}


def _grade_six_copies_of_the_master(tmp_path: Path, gpus: tuple[str, ...]) -> list:
    """Six copies of the fixture master graded with -j 4 on `gpus` (with whatever run_probe is patched in)."""
    items = []
    for i in range(6):
        path = tmp_path / f"s{i}_99_fixture.ipynb"
        path.write_text(MASTER.read_text())
        items.append((path, MASTER))
    options = grading.Options(jobs=4, gpus=gpus, checks_modules=(str(MASTER.parent / "fixture_checks.py"),))
    with grading.Grader(options) as g:
        return list(g.grade_all(items))


def test_gpu_exercises_get_one_gpu_each_and_queue(monkeypatch, tmp_path):
    """6 submissions, 2 GPUs, -j 4: never two GPU probes on one GPU at once, both GPUs used, every GPU probe
    pinned to one GPU with inputs["gpu"] True; CPU exercises get no GPU at all."""
    from course_utils import checks
    from course_utils.grading.probe import ProbeOutcome

    lock, busy, overlap, seen, cpu_seen = threading.Lock(), set(), [], [], []

    def fake_probe(program, grade_id, inputs, *, gpus, timeout, **_):
        cuda_visible_devices = ",".join(gpus)
        inputs = checks.from_bytes(inputs)
        gpu_job = grade_id in ("ex99_gpu", "ex99_scale")
        with lock:
            if gpu_job:
                assert inputs["gpu"] is True
                if cuda_visible_devices in busy:
                    overlap.append(cuda_visible_devices)
                busy.add(cuda_visible_devices)
                seen.append(cuda_visible_devices)
            else:
                cpu_seen.append((cuda_visible_devices, inputs["gpu"]))
        time.sleep(0.05)
        with lock:
            busy.discard(cuda_visible_devices)
        return ProbeOutcome("ok", data=_honest_data(grade_id, inputs))

    monkeypatch.setattr(grader_module, "run_probe", fake_probe)
    grades = _grade_six_copies_of_the_master(tmp_path, gpus=("0", "1"))
    assert all(gr.total == 8 for gr in grades), [grade.format_table(gr) for gr in grades]
    assert overlap == [] and sorted(set(seen)) == ["0", "1"] and len(seen) == 12
    assert set(cpu_seen) == {("", False)}


def test_visible_gpus_follow_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert grading.visible_gpus() == ("2", "3")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert grading.visible_gpus() == ()


# ---------------------------------------------------------------------------------------------- reports


def test_find_master_by_name(tmp_path):
    for name in ("02_cuda_streams.ipynb", "03_cuda_events.ipynb", "03_cuda_events_extra.ipynb"):
        (tmp_path / name).write_text("{}")
    sub = Path("alice") / "02_cuda_streams.ipynb"
    assert grade.find_master(sub, tmp_path).name == "02_cuda_streams.ipynb"
    assert grade.find_master(Path("bob_02_cuda_streams (1).ipynb"), tmp_path).name == "02_cuda_streams.ipynb"
    assert grade.find_master(Path("x_03_cuda_events_extra.ipynb"), tmp_path).name == "03_cuda_events_extra.ipynb"
    with pytest.raises(grade.GradeError, match="cannot tell which master"):
        grade.find_master(Path("homework.ipynb"), tmp_path)
    with pytest.raises(grade.GradeError, match="no master notebooks"):
        grade.find_master(sub, tmp_path / "empty")


def _grades():
    a = grade.Grade("class/alice/99_fixture.ipynb", "notebooks/99_fixture.ipynb", [
        grade.ExerciseResult("ex99_add", 2, 2, "passed"),
        grade.ExerciseResult("ex99_mean", 3, 0, "failed", "ex99_mean: expected mean 2.5, saw 2.0"),
        grade.ExerciseResult("ex99_gpu", 1, 0, "skipped", "needs a GPU"),
    ], seconds=3.0)
    b = grade.Grade("class/bob/99_fixture.ipynb", "notebooks/99_fixture.ipynb", [
        grade.ExerciseResult("ex99_add", 2, 0, "not attempted", "the solution is still `raise NotImplementedError()`"),
        grade.ExerciseResult("ex99_mean", 3, 3, "passed"),
        grade.ExerciseResult("ex99_gpu", 1, 0, "skipped", "needs a GPU"),
    ], seconds=2.0, stopped="cannot read the submission")
    return [a, b]


def test_csv_has_a_row_per_submission_and_a_column_per_exercise(tmp_path):
    path = tmp_path / "scores.csv"
    grade.write_csv(_grades(), path)
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == ["student", "submission", "master", "ex99_add", "ex99_mean", "ex99_gpu", "total", "max",
                             "notes"]
    assert [(r["student"], r["ex99_add"], r["ex99_mean"], r["total"], r["max"]) for r in rows] == [
        ("alice", "2", "0", "2", "6"), ("bob", "0", "3", "3", "6")]
    assert rows[0]["submission"] == "class/alice/99_fixture.ipynb"
    # what did not pass, and why
    assert "ex99_gpu: skipped (needs a GPU)" in rows[0]["notes"]
    assert "ex99_mean: failed (ex99_mean: expected mean 2.5, saw 2.0)" in rows[0]["notes"]
    assert rows[1]["notes"].startswith("cannot read the submission")


def test_junit_reports_each_exercise(tmp_path):
    path = tmp_path / "grades.xml"
    grade.write_junit(_grades(), path)
    root = ET.parse(path).getroot()
    suites = root.findall("testsuite")
    assert [s.get("name") for s in suites] == ["class/alice/99_fixture.ipynb", "class/bob/99_fixture.ipynb"]
    assert (suites[0].get("tests"), suites[0].get("failures"), suites[0].get("skipped")) == ("3", "1", "1")
    cases = {c.get("name"): c for c in suites[0].findall("testcase")}
    assert cases["ex99_add"].find("failure") is None and cases["ex99_add"].find("skipped") is None
    assert cases["ex99_mean"].find("failure").get("message") == "ex99_mean: expected mean 2.5, saw 2.0"
    assert cases["ex99_gpu"].find("skipped") is not None
    bob = {c.get("name"): c for c in suites[1].findall("testcase")}
    assert bob["ex99_add"].find("failure").get("type") == "not attempted"


def test_table_shows_scores_and_total():
    text = grade.format_table(_grades()[0])
    assert "ex99_mean" in text and "0/3" in text and "expected mean 2.5" in text
    assert "total" in text and "2/6" in text and "1 points skipped" in text


def test_long_messages_are_cut_in_the_table_unless_verbose():
    g = _grades()[0]
    g.exercises[1].message = "ex99_mean: " + "the whole story " * 40 + "THE END"
    assert "THE END" not in grade.format_table(g) and "--verbose shows all" in grade.format_table(g)
    assert "THE END" in grade.format_table(g, verbose=True)


def test_messages_are_made_safe_for_reports():
    text = grader_module._clean("a\x00b\x1bc\n" + "x" * 5000)
    assert "\x00" not in text and "\x1b" not in text and len(text) < 4100


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    assert grade.main([str(tmp_path / "missing.ipynb")]) == 2
    assert "no such file" in capsys.readouterr().err
    sub = tmp_path / "homework.ipynb"
    sub.write_text("{}")
    assert grade.main([str(sub), "--master-dir", str(MASTER.parent)]) == 2
    assert "cannot tell which master" in capsys.readouterr().err


def test_grade_answers_helper_grades_through_the_grader():
    from tests.exercise_cells import grade_answers

    wrong = (Path(__file__).parent / "fixtures" / "wrong_answers" / "99_fixture" / "ex99_add.py").read_text()
    with grading.Grader(grading.Options(checks_modules=(str(MASTER.parent / "fixture_checks.py"),))) as g:
        got = grade_answers(MASTER, {"ex99_add": wrong, "ex99_mean": None}, grader=g).by_id()
    assert got["ex99_add"].status == "failed" and "saw -1" in got["ex99_add"].message
    assert got["ex99_mean"].status == "passed"


def test_gpu_pool_hands_out_whole_gpus(tmp_path, monkeypatch):
    monkeypatch.setenv("COURSE_GPU_LOCK_DIR", str(tmp_path))  # not the machine's locks: a GPU test may hold them
    pool = grader_module.GpuPool(("0", "1", "2"))
    a = pool.take(2)
    assert a == "0,1"
    got = []
    waiter = threading.Thread(target=lambda: got.append(pool.take(2)))
    waiter.start()
    time.sleep(0.2)
    assert got == []  # one GPU free: a two-GPU job waits
    pool.give(a)
    waiter.join(5)
    assert len(got[0].split(",")) == 2 and set(got[0].split(",")) <= {"0", "1", "2"}


def test_inputs_once_are_built_once_per_run_and_each_submission_gets_its_own_copy(monkeypatch, tmp_path):
    """An exercise whose inputs cost real runs (lesson 10's fault reports) declares inputs_once: 6 submissions
    graded with -j 4 cause one inputs() call, every probe gets equal inputs, and what one judge does to its copy
    reaches no other. An exercise without the flag gets fresh inputs per submission."""
    import dataclasses

    from course_utils import checks
    from course_utils.grading.probe import ProbeOutcome

    real_exercise = checks.exercise
    calls, received = {"ex99_add": 0, "ex99_mean": 0}, []

    def counted(ex):
        def inputs():
            calls[ex.grade_id] += 1
            time.sleep(0.1)  # long enough for the other jobs to ask meanwhile
            return ex.inputs()
        return inputs

    def judge_that_spoils(inputs, data):
        received.append(repr(inputs["pairs"]))
        inputs["pairs"].clear()  # a judge that changes its inputs must not change the next submission's
        return "ok"

    def exercise(grade_id):
        ex = real_exercise(grade_id)
        if grade_id == "ex99_add":
            return dataclasses.replace(ex, inputs=counted(ex), judge=judge_that_spoils, inputs_once=True)
        if grade_id == "ex99_mean":
            return dataclasses.replace(ex, inputs=counted(ex))
        return ex

    def fake_probe(program, grade_id, inputs, **_):
        return ProbeOutcome("ok", data=_honest_data(grade_id, checks.from_bytes(inputs)))

    monkeypatch.setattr(checks, "exercise", exercise)
    monkeypatch.setattr(grader_module, "run_probe", fake_probe)
    grades = _grade_six_copies_of_the_master(tmp_path, gpus=())
    assert all(gr.by_id()["ex99_add"].status == "passed" for gr in grades)
    assert calls == {"ex99_add": 1, "ex99_mean": 6}
    assert len(received) == 6 and len(set(received)) == 1 and received[0] != "[]"


def test_without_bubblewrap_grading_refuses_and_says_how_to_install_it(tmp_path):
    """Where bwrap is missing, students' code is not run unconfined by default: the command stops with exit 2 and
    says what to install, or that --no-sandbox is for trusted work. With --no-sandbox it grades."""
    import os
    import subprocess
    import sys

    sub = tmp_path / "99_fixture.ipynb"
    sub.write_text(release.dumps(nbformat.read(MASTER, as_version=4)))
    env = {**os.environ, "PATH": str(tmp_path / "no-tools-here"), "CUDA_VISIBLE_DEVICES": ""}
    env.pop("COURSE_REQUIRE_GPU", None)
    cmd = [sys.executable, "-m", "course_utils.grade", str(sub), "--master-dir", str(MASTER.parent),
           "--checks-module", str(MASTER.parent / "fixture_checks.py")]
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "bubblewrap" in refused.stderr and "apt-get install bubblewrap" in refused.stderr
    assert "--no-sandbox" in refused.stderr
    trusted = subprocess.run(cmd + ["--no-sandbox"], env=env, capture_output=True, text=True, timeout=300)
    assert trusted.returncode == 0, trusted.stdout[-2000:] + trusted.stderr[-2000:]
    assert "ex99_add" in trusted.stdout and "passed" in trusted.stdout


def test_an_error_in_the_learners_code_names_their_line_not_the_checkers():
    """A check cell whose answer raises shows one CheckFailed: the exercise, the error, and the learner's own
    line, without the checker's frames (the raw traceback ran through checks/ for 30 lines)."""
    import linecache

    from course_utils import checks
    from course_utils.grading.checks_modules import import_checks_module

    import_checks_module(str(MASTER.parent / "fixture_checks.py"))
    cell = "/tmp/ipykernel_0/cell_7.py"  # where ipykernel files a cell's code
    src = "def add(a, b):\n    pair = (a,)\n    return pair[b]\n"
    linecache.cache[cell] = (len(src), None, src.splitlines(True), cell)
    ns: dict = {}
    exec(compile(src, cell, "exec"), ns)
    with pytest.raises(checks.CheckFailed) as info:
        checks.check("ex99_add", ns["add"])
    msg = str(info.value)
    assert msg.startswith("ex99_add: your code raised IndexError: tuple index out of range"), msg
    assert "line 3 of your code: `return pair[b]`" in msg
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_ranks_error_names_the_learners_line_and_hides_the_launchers_and_the_checkers_frames():
    import linecache

    from course_utils import checks
    from course_utils.launch.errors import WorkerError

    ours = str(Path(checks.__file__).parent / "ring_allreduce.py")
    cell = "/tmp/ipykernel_0/cell_9.py"
    src = "def ring(t):\n    chunks = t.chunk(3)\n    return chunks[2]\n"
    linecache.cache[cell] = (len(src), None, src.splitlines(True), cell)
    with_source = (f'Traceback (most recent call last):\n  File "{ours}", line 331, in rank_main\n'
                   f'    returned = answer(tensor)\n  File "{cell}", line 3, in ring\n    return chunks[2]\n'
                   "IndexError: tuple index out of range\n")
    err = WorkerError(2, "IndexError", "tuple index out of range", with_source, {0: "stopped"})
    assert checks.rank_error(err) == \
        "rank 2: IndexError: tuple index out of range, in line 3 of your code: `return chunks[2]`"
    # a rank's traceback without the cell's lines: the source comes from this process's linecache
    without = with_source.replace("    return chunks[2]\n", "")
    assert checks.rank_error(WorkerError(2, "IndexError", "x", without, {})).endswith("`return chunks[2]`")
    # and where nothing is known of the cell, its line number and function still are
    gone = without.replace(cell, "/tmp/ipykernel_0/gone.py")
    assert checks.rank_error(WorkerError(2, "IndexError", "x", gone, {})).endswith("in line 3 of your ring")
    only_ours = f'Traceback (most recent call last):\n  File "{ours}", line 331, in rank_main\n    x\nKeyError: 1\n'
    assert checks.rank_error(WorkerError(0, "KeyError", "1", only_ours, {})) == "rank 0: KeyError: 1"
