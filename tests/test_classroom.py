"""A class on one box (course_utils.classroom): collect, grade and return, end to end through the command.

Two students with workspaces made as `make lab` makes them (course_utils.workspace.sync), of the fixture lesson
(tests/fixtures/grading/99_fixture.ipynb): one solved it, one left the student version untouched; a third on the
roster has no workspace. As root, two real system users check that one cannot read the other's feedback.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import nbformat
import pytest

from course_utils import checks, release
from course_utils.classroom import main as classroom_main
from course_utils.grading.grader import executed_path
from course_utils.grading.report import PASSED, ExerciseResult, Grade, write_csv
from course_utils.workspace import sync

pytestmark = pytest.mark.grading

ROOT = Path(__file__).resolve().parents[1]
MASTERS = ROOT / "tests" / "fixtures" / "grading"
MASTER = MASTERS / "99_fixture.ipynb"
CHECKS_MODULE = MASTERS / "fixture_checks.py"
IDS = ["ex99_add", "ex99_mean", "ex99_gpu", "ex99_scale"]
POINTS = {"ex99_add": 2, "ex99_mean": 3, "ex99_gpu": 1, "ex99_scale": 2}
SOLVED, UNSOLVED, ABSENT = "cu_test_solved", "cu_test_unsolved", "cu_test_absent"  # not system users


def right(gid: str) -> str:
    """What a right answer to `gid` reports here (as in test_grade.py)."""
    if gid in ("ex99_add", "ex99_mean") or checks.gpu_available():
        return "passed"
    return "failed" if checks.require_gpu_mode() else "skipped"


def classroom(base: Path, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """The command, as the instructor runs it (from `base`)."""
    env = {k: v for k, v in os.environ.items() if k != "COURSE_CHECKS_MODULES"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "course_utils.classroom", *args], cwd=base, env=env,
                          capture_output=True, text=True, timeout=timeout)


def in_process(base: Path, *args: str) -> subprocess.CompletedProcess:
    """The same through main() in this process: a command's start-up costs seconds on a loaded 2-core machine."""
    out = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stdout(out):
        mp.chdir(base)
        rc = classroom_main(list(args))
    return subprocess.CompletedProcess(args, rc, out.getvalue(), "")


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.lstat().st_mode)


@pytest.fixture(scope="module")
def taught(tmp_path_factory):
    """Workspaces, a roster, and the three steps run once (collect twice: the second replaces the first); grade
    through the command, as an instructor runs it."""
    base = tmp_path_factory.mktemp("classroom")
    for user in (SOLVED, UNSOLVED):
        sync(MASTERS, base / "homes" / user / "workspace")
    solved = base / "homes" / SOLVED / "workspace" / "notebooks"
    m = nbformat.read(MASTER, as_version=4)
    (solved / MASTER.name).write_text(release.dumps(release.student_version(m, "fixture", completed=IDS)))
    (solved / "scratch.ipynb").write_text(release.dumps(m))  # not a lesson: not collected
    (solved / "98_theirs.ipynb").symlink_to(base / "homes" / UNSOLVED / "workspace" / "notebooks" / MASTER.name)
    os.mkfifo(solved / "97_pipe.ipynb")  # opening it to read would wait for a writer forever
    (base / "roster.txt").write_text(f"# section A\n{SOLVED}\n\n{UNSOLVED}  # late joiner\n{ABSENT}\n")
    common = ("--roster", "roster.txt", "--workspace-template", str(base / "homes" / "{user}" / "workspace"))
    runs = {"first collect": in_process(base, "collect", *common), "collect": in_process(base, "collect", *common)}
    runs["grade"] = classroom(base, "grade", *common, "--master-dir", str(MASTERS), "--checks-module",
                              str(CHECKS_MODULE), "-j", "2", "--timeout", "120", "--cell-timeout", "60")
    runs["return"] = in_process(base, "return", *common)
    return base, runs


def test_collect_copies_each_students_lessons_read_only_with_a_manifest(taught):
    base, runs = taught
    assert runs["first collect"].returncode == 0, runs["first collect"].stdout
    out = runs["collect"].stdout
    assert runs["collect"].returncode == 0 and "replaced the previous collection" in out, out
    subs = base / "submissions"
    manifest = json.loads((subs / "manifest.json").read_text())
    assert list(manifest["students"]) == [SOLVED, UNSOLVED, ABSENT]
    for user in (SOLVED, UNSOLVED):
        source = base / "homes" / user / "workspace" / "notebooks" / MASTER.name
        copy = subs / user / MASTER.name
        record = manifest["students"][user]["notebooks"][MASTER.name]
        assert record["source"] == str(source) and record["sha256"] == sha256(source) == sha256(copy)
        assert record["mtime"] == datetime.fromtimestamp(source.stat().st_mtime, timezone.utc).isoformat()
        assert mode(copy) == 0o444 and mode(subs / user) == 0o555
        if os.geteuid() != 0:  # root writes whatever the mode
            with pytest.raises(PermissionError):
                copy.open("a")
    assert mode(subs) == 0o700  # everyone's work: the instructor's eyes only
    assert sorted(os.listdir(subs / SOLVED)) == [MASTER.name]  # no scratch.ipynb, no link to another's work
    skipped = manifest["students"][SOLVED]["skipped"]
    assert skipped == {"97_pipe.ipynb": "not a regular file of at most 50 MiB", "98_theirs.ipynb": "a link, not a file"}
    absent = manifest["students"][ABSENT]
    assert absent["notebooks"] == {} and absent["status"].startswith("no workspace"), absent
    assert f"{ABSENT}: no workspace" in out and "2 of 3 students collected" in out


def test_grade_scores_the_class_into_grades(taught):
    base, runs = taught
    assert runs["grade"].returncode == 0, runs["grade"].stdout[-3000:] + runs["grade"].stderr[-3000:]
    rows = {r["student"]: r for r in csv.DictReader((base / "grades" / "scores.csv").open())}
    assert sorted(rows) == sorted([SOLVED, UNSOLVED])
    assert (base / "grades" / "grades.xml").is_file() and mode(base / "grades") == 0o700
    assert len(list((base / "grades" / "executed").glob("*.ipynb"))) == 2


def test_return_puts_each_students_scores_and_feedback_in_their_workspace(taught):
    base, runs = taught
    out = runs["return"].stdout
    assert runs["return"].returncode == 1, out  # the absent student got nothing
    assert f"{ABSENT}: no grades" in out
    expected = {SOLVED: sum(POINTS[i] for i in IDS if right(i) == PASSED), UNSOLVED: 0}
    manifest = json.loads((base / "submissions" / "manifest.json").read_text())
    for user, total in expected.items():
        ws = base / "homes" / user / "workspace"
        feedback = ws / "notebooks" / "feedback"
        assert f"{user}: returned 1 score rows and 1 feedback notebooks to {feedback}" in out, out
        rows = list(csv.DictReader((feedback / "scores.csv").open()))
        assert [(r["student"], float(r["total"]), float(r["max"])) for r in rows] == [(user, total, 8)]
        assert f"{MASTER.name}: {total} of 8 points" in (feedback / "scores.md").read_text()
        executed = nbformat.read(feedback / MASTER.name, as_version=4)
        assert any(c.get("outputs") for c in executed.cells if c.cell_type == "code")  # ran, for them to read
        assert mode(feedback) == 0o700
        assert {p.name: mode(p) for p in feedback.iterdir()} == dict.fromkeys(
            ["scores.csv", "scores.md", MASTER.name], 0o600)
        # their own notebook is as they left it
        assert sha256(ws / "notebooks" / MASTER.name) == manifest["students"][user]["notebooks"][MASTER.name]["sha256"]
    assert not (base / "homes" / ABSENT).exists()


def test_bad_input_says_what_was_wrong_and_what_to_do(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # in this process: each command's start-up costs seconds on a loaded machine

    def error(*args: str) -> str:
        capsys.readouterr()
        try:
            rc = classroom_main(list(args))
        except SystemExit as e:  # argparse's own errors
            rc = e.code
        assert rc == 2, capsys.readouterr()
        return capsys.readouterr().err

    assert "roster roster.txt not found: write one student username per line" in error("collect")
    (tmp_path / "empty.txt").write_text("# nobody yet\n\n")
    assert "names no students" in error("collect", "--roster", "empty.txt")
    (tmp_path / "bad.txt").write_text("alice\n../bob\nalice\n")
    assert "bad.txt:2: '../bob' is not a username" in error("return", "--roster", "bad.txt")
    (tmp_path / "twice.txt").write_text("alice\nalice  # again\n")
    assert "twice.txt:2: alice is listed twice" in error("collect", "--roster", "twice.txt")
    assert "unrecognized arguments: --rooster" in error("collect", "--rooster", "x")
    (tmp_path / "roster.txt").write_text("alice\n")
    assert "must contain {user}" in error("collect", "--workspace-template", "/home/alice")
    assert "run `grade` first" in error("return")
    assert "run `collect` first" in error("grade", "--master-dir", str(MASTERS))
    (tmp_path / "submissions" / "alice").mkdir(parents=True)
    shutil.copy(MASTER, tmp_path / "submissions" / "alice")
    assert "no master notebooks in" in error("grade", "--master-dir", str(tmp_path / "nowhere"))
    # the grader itself refuses (here: no bubblewrap on the PATH): its reason, then ours
    monkeypatch.setenv("PATH", str(tmp_path))
    err = error("grade", "--master-dir", str(MASTERS))
    assert "grade: error:" in err and "bubblewrap" in err, err
    assert "the grader failed" in err and "left as it was" in err and not (tmp_path / "grades").exists(), err


# ---- real system users (root only)


@pytest.fixture
def two_users():
    """Two system users with homes in a temp folder open to all (so only the feedback folder's mode protects it);
    removed afterwards with their homes."""
    if os.geteuid() != 0:
        pytest.skip("needs root to create system users (useradd)")
    if not (shutil.which("useradd") and shutil.which("userdel") and shutil.which("runuser")):
        pytest.skip("useradd, userdel or runuser is not installed")
    top = Path(tempfile.mkdtemp(prefix="cu-classroom-"))
    top.chmod(0o755)
    names = [f"cu_a_{os.getpid()}", f"cu_b_{os.getpid()}"]
    made = []
    try:
        for name in names:
            subprocess.run(["useradd", "--create-home", "--home-dir", str(top / name), "--user-group",
                            "--shell", "/bin/sh", name], check=True, capture_output=True, timeout=60)
            made.append(name)
            (top / name).chmod(0o755)
        yield top, names
    finally:
        for name in made:
            subprocess.run(["userdel", "-r", name], capture_output=True, timeout=60)
        shutil.rmtree(top, ignore_errors=True)


def _as(user: str, *cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(["runuser", "-u", user, "--", *cmd], capture_output=True, text=True, timeout=60)


def test_real_students_cannot_read_each_others_feedback(two_users, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)  # the steps run in this process: seconds saved on a loaded machine
    top, (a, b) = two_users
    for user in (a, b):
        ws = top / user / "workspace"
        sync(MASTERS, ws)
        account = pwd.getpwnam(user)
        for path in [ws, *ws.rglob("*")]:
            os.chown(path, account.pw_uid, account.pw_gid, follow_symlinks=False)
        (ws / "notebooks").chmod(0o755)
    (tmp_path / "roster.txt").write_text(f"{a}\n{b}\n")
    common = ("--roster", "roster.txt", "--workspace-template", str(top / "{user}" / "workspace"))
    assert classroom_main(["collect", *common]) == 0
    assert "2 of 2 students collected" in capsys.readouterr().out
    # grades as `grade` leaves them (the grader's CSV and a feedback notebook per submission), without grading
    grades = tmp_path / "grades"
    made = [Grade(str(tmp_path / "submissions" / u / MASTER.name), str(MASTER),
                  [ExerciseResult("ex99_add", 2, 2 if u == a else 0, PASSED)]) for u in (a, b)]
    (grades / "executed").mkdir(parents=True)
    write_csv(made, grades / "scores.csv")
    for g in made:
        executed_path(grades / "executed", g.submission).write_text(release.dumps(nbformat.read(MASTER, 4)))
    assert classroom_main(["return", *common]) == 0, capsys.readouterr()
    for user in (a, b):
        feedback = top / user / "workspace" / "notebooks" / "feedback"
        account = pwd.getpwnam(user)
        assert all((p.stat().st_uid, p.stat().st_gid) == (account.pw_uid, account.pw_gid)
                   for p in [feedback, *feedback.iterdir()])
        assert mode(feedback) == 0o700
        assert _as(user, "cat", str(feedback / "scores.md")).returncode == 0
    theirs = _as(a, "cat", str(top / b / "workspace" / "notebooks" / "feedback" / "scores.md"))
    assert theirs.returncode != 0 and "Permission denied" in theirs.stderr, theirs
    assert _as(a, "ls", str(top / b / "workspace" / "notebooks" / "feedback")).returncode != 0
    # b points their feedback folder at a's: nothing of b's is written there, and a's stays a's
    shutil.rmtree(top / b / "workspace" / "notebooks" / "feedback")
    os.symlink(top / a / "workspace" / "notebooks" / "feedback", top / b / "workspace" / "notebooks" / "feedback")
    assert classroom_main(["return", *common]) == 1
    assert f"{b}: not returned" in capsys.readouterr().out
    assert "2 of 2" in (top / a / "workspace" / "notebooks" / "feedback" / "scores.md").read_text()
    assert (top / a / "workspace" / "notebooks" / "feedback").stat().st_uid == pwd.getpwnam(a).pw_uid
    # b's workspace made a link to a's: not collected as b's work
    shutil.rmtree(top / b / "workspace")
    os.symlink(top / a / "workspace", top / b / "workspace")
    assert classroom_main(["collect", *common]) == 0
    out = capsys.readouterr().out
    assert f"{b}: not collected: " in out and "1 of 2 students collected" in out, out
