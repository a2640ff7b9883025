"""The grader on a GPU machine: probes use CUDA in a fresh process pinned to one GPU, and a class of real-lesson
submissions graded with -j 4 gives exactly the honest ones their points (GPU timing checks included)."""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import nbformat
import pytest

from course_utils import checks, release
from course_utils.grading import assemble
from course_utils.grading.checks_modules import import_checks_module
from course_utils.grading.probe import run_probe

ROOT = Path(__file__).resolve().parents[1]
FIXTURE_DIR = ROOT / "tests" / "fixtures" / "grading"
sys.path.insert(0, str(FIXTURE_DIR))
import attacks  # noqa: E402  (tests/fixtures/grading/attacks.py)

sys.path.remove(str(FIXTURE_DIR))
pytestmark = [pytest.mark.gpu, pytest.mark.grading]


def test_a_probe_uses_cuda_on_the_gpu_it_is_given_and_sees_no_other():
    """Only the given GPU's device node is mounted: inside, CUDA sees one GPU (number 0), the one we named."""
    import torch

    last = torch.cuda.device_count() - 1
    module = str(FIXTURE_DIR / "probe_checks.py")
    import_checks_module(module)
    out = run_probe([("<solution>", "answer = 1")], "ex97_cuda", checks.to_bytes({"gpu": True}),
                    checks_module=module, gpus=[str(last)], timeout=120, read_only=[module])
    assert out.status == "ok", out
    assert out.data["devices"] == 1 and out.data["visible"] == "0"
    assert out.data["values"] == [0.0, 2.0, 4.0, 6.0]
    assert out.data["uuid"] == str(torch.cuda.get_device_properties(last).uuid)
    assert out.data["nodes"] == sorted(n for n in out.data["nodes"] if n.startswith("nvidia"))
    assert len([n for n in out.data["nodes"] if n[len("nvidia"):].isdigit()]) == 1, out.data["nodes"]


def _gpu_lessons() -> list[Path]:
    found = []
    for path in sorted(ROOT.glob("notebooks/*.ipynb")):
        master = assemble.read_master(path)
        try:
            if any(checks.exercise(ex.grade_id).needs_gpu for ex in master.exercises):
                found.append(path)
        except KeyError:
            continue
    return found


def _class_lessons() -> list[Path]:
    """The lesson whose class is graded: 02 (its stream-split check times overlap, what sharing a GPU would spoil).
    One class shows -j 4's GPU turns; every GPU lesson's master is graded with its GPU checks in
    test_exercises_solutions, and each class's GPU probes wait their turn, so each lesson more costs minutes of
    the suite's serialised GPU time."""
    return [p for p in _gpu_lessons() if p.stem == "02_cuda_streams"] or _gpu_lessons()[:1]


def test_the_class_lesson_has_a_gpu_exercise():
    assert [p.stem for p in _class_lessons()] == ["02_cuda_streams"]


@pytest.mark.slow
@pytest.mark.parametrize("lesson", _class_lessons(), ids=lambda p: p.stem)
def test_a_class_graded_with_four_jobs_gives_exactly_the_honest_ones_their_points(lesson, tmp_path):
    master = assemble.read_master(lesson)
    entries = {ex.grade_id: checks.exercise(ex.grade_id).entry for ex in master.exercises}
    flags = {}
    for ex in master.exercises:
        flags[ex.grade_id] = []
        for i in ex.solutions:
            lines = master.source(i).split("\n")
            blocks = release.solution_blocks(master.source(i), "m")
            flags[ex.grade_id] += [lines[b] != lines[b].lstrip() for b, _ in blocks]
    nb = nbformat.read(lesson, as_version=4)
    subs = {f"honest{i}": nb for i in range(3)}
    for name in ("shadow_check", "patch_timers", "equal_to_anything"):
        answers = attacks.attack_answers(master, flags, entries, attacks.ATTACKS[name], {})
        subs[name] = release.substitute(nb, answers, lesson.stem)
    subs["unsolved"] = release.student_version(nb, lesson.stem)
    for who, sub in subs.items():
        (tmp_path / "class" / who).mkdir(parents=True)
        (tmp_path / "class" / who / lesson.name).write_text(release.dumps(sub))
    env = {k: v for k, v in os.environ.items() if k != "COURSE_CHECKS_MODULES"}
    proc = subprocess.run([sys.executable, "-m", "course_utils.grade", "class", "--master-dir", str(lesson.parent),
                           "-j", "4", "--junit", "grades.xml"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=1800)
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stderr[-3000:]
    scores = {}
    for suite in ET.parse(tmp_path / "grades.xml").getroot().findall("testsuite"):
        props = {p.get("name"): p.get("value") for p in suite.find("properties")}
        scores[Path(suite.get("name")).parent.name] = (float(props["score"]), float(props["max"]))
    for who, (score, top) in scores.items():
        assert score == (top if who.startswith("honest") else 0), (who, score, top, proc.stdout[-6000:])
