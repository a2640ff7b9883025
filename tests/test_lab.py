"""`make lab`: the student's workspace (student versions, git-ignored, never overwritten), JupyterLab on
127.0.0.1 with a token, and a printed URL that works even when the port was taken; `make lab-instructor`
serves the masters."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import psutil
import pytest

from course_utils.grading.release import BEGIN, STUB
from course_utils.workspace import LINKS, lesson_name, reset, sync

pytestmark = pytest.mark.ranks

ROOT = Path(__file__).resolve().parents[1]
MASTERS = ROOT / "notebooks"
LESSONS = sorted(p.name for p in MASTERS.glob("*.ipynb"))
URL = re.compile(r"^Course lab: (http://127\.0\.0\.1:(\d+))/lab\?token=([0-9a-f]+)$")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


# ---- the workspace (no server needed) ----

def test_workspace_holds_student_versions_and_links(tmp_path):
    ws = tmp_path / "ws"
    assert sync(MASTERS, ws) == dict.fromkeys(LESSONS, "created")
    for name in LESSONS:
        text = (ws / "notebooks" / name).read_text()
        assert BEGIN not in text and "END SOLUTION" not in text, name
    assert STUB in (ws / "notebooks" / "02_cuda_streams.ipynb").read_text()
    nb = nbformat.read(ws / "notebooks" / "02_cuda_streams.ipynb", as_version=4)
    assert all(not c.get("outputs") for c in nb.cells if c.cell_type == "code")
    # lessons run scripts from ../launch and ../benchmarks, as they do from notebooks/ in the repository
    for name in LINKS:
        assert (ws / name).resolve() == (ROOT / name).resolve()
    assert (ws / "notebooks" / ".." / "launch" / "train_ddp.py").is_file()


def test_workspace_keeps_the_students_work_adds_new_lessons_and_resets_one(tmp_path):
    ws = tmp_path / "ws"
    sync(MASTERS, ws)
    mine = ws / "notebooks" / "02_cuda_streams.ipynb"
    mine.write_text(mine.read_text().replace(STUB, "return 42.0", 1))
    work = mine.read_text()
    (ws / "notebooks" / "03_cuda_events.ipynb").unlink()  # as if lesson 03 were new since the last start
    done = sync(MASTERS, ws)
    assert done["03_cuda_events.ipynb"] == "created"
    assert done["02_cuda_streams.ipynb"] == "kept" and mine.read_text() == work
    # reset: a fresh student version; the old one kept aside
    fresh, backup = reset("02", MASTERS, ws)
    assert fresh == mine and "return 42.0" not in mine.read_text() and STUB in mine.read_text()
    assert backup is not None and backup.parent == ws / "backups" and backup.read_text() == work
    assert lesson_name("02_cuda_streams.ipynb", MASTERS) == "02_cuda_streams.ipynb"
    with pytest.raises(ValueError, match="names no lesson"):
        lesson_name("99", MASTERS)


def test_reset_command_and_gitignore(tmp_path):
    ws = tmp_path / "ws"
    make = ["make", "-s", "reset-notebook", f"LAB_WORKSPACE={ws}", f"PY={sys.executable}"]
    out = subprocess.run([*make, "NB=00_start_here"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "reset " in out.stdout and (ws / "notebooks" / "00_start_here.ipynb").is_file()
    bad = subprocess.run(make, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert bad.returncode != 0 and "usage: make reset-notebook NB=" in bad.stderr
    # the default workspace is not tracked by git
    ignored = subprocess.run(["git", "check-ignore", "-q", "workspace/notebooks/02_cuda_streams.ipynb"], cwd=ROOT)
    assert ignored.returncode == 0


# ---- the server ----

class Lab:
    """`make TARGET` running in its own process group; stopped (and checked gone) by close()."""

    def __init__(self, target: str, port: int, workspace: Path):
        self.proc = subprocess.Popen(
            ["make", "-s", target, f"LAB_PORT={port}", f"PY={sys.executable}", f"LAB_WORKSPACE={workspace}"],
            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        )
        self.seen: list[str] = []

    def url(self, timeout: float = 90) -> tuple[str, int, str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            self.seen.append(line)
            m = URL.match(line.strip())
            if m:
                return m.group(1), int(m.group(2)), m.group(3)
        raise AssertionError("no 'Course lab: URL' line:\n" + "".join(self.seen))

    def close(self) -> None:
        """End the whole process group and wait until every member is gone: `make` exits at SIGTERM while the
        Jupyter server below it may still be closing its socket, and until it has, it still accepts connections."""
        os.killpg(self.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        while _group_alive(self.proc.pid):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.poll()  # reap make; the server, its grandchild, is reaped by whoever it is reparented to
            time.sleep(0.05)
        self.proc.wait()
        self.proc.stdout.close()


def _group_alive(pgid: int) -> bool:
    """Whether any live (not zombie) process is left in process group `pgid`."""
    for p in psutil.process_iter(["status"]):
        try:
            if os.getpgid(p.pid) == pgid and p.info["status"] != psutil.STATUS_ZOMBIE:
                return True
        except (ProcessLookupError, psutil.Error):
            continue
    return False


@pytest.mark.timeout(150)
def test_make_lab_serves_the_workspace_at_the_printed_url_even_when_the_port_is_taken(tmp_path):
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed in this interpreter")
    busy = socket.create_server(("127.0.0.1", 0))  # something else listens on the port asked for
    port = busy.getsockname()[1]
    lab = Lab("lab", port, tmp_path / "ws")
    try:
        base, got_port, token = lab.url()
        assert got_port != port  # Jupyter moved on; the printed URL says where
        # printed once the server answers: no waiting for the socket needed
        assert _get(f"{base}/api/contents")[0] == 403
        assert _get(f"{base}/api/contents?token=wrong{token}")[0] == 403
        status, body = _get(f"{base}/api/contents?token={token}")
        assert status == 200
        assert sorted(item["name"] for item in json.loads(body)["content"]) == LESSONS  # the workspace, nothing else
        status, body = _get(f"{base}/api/contents/02_cuda_streams.ipynb?token={token}")
        assert status == 200 and BEGIN not in body.decode() and STUB in body.decode()
        assert status == 200 and _get(f"{base}/lab?token={token}")[0] == 200
        # only one URL in the output: Jupyter's own start-up lines (token hidden) are not shown
        assert len(re.findall(r"http://", "".join(lab.seen))) == 1, "".join(lab.seen)
        # bound to loopback only: the machine's other addresses refuse the connection
        other = socket.gethostbyname(socket.gethostname())
        if not other.startswith("127."):
            with pytest.raises(OSError):
                socket.create_connection((other, got_port), timeout=2).close()
    finally:
        lab.close()
        busy.close()
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", got_port), timeout=2).close()


@pytest.mark.timeout(150)
def test_make_lab_instructor_serves_the_masters(tmp_path):
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed in this interpreter")
    lab = Lab("lab-instructor", _free_port(), tmp_path / "ws")
    try:
        base, _, token = lab.url()
        status, body = _get(f"{base}/api/contents/02_cuda_streams.ipynb?token={token}")
        assert status == 200 and BEGIN in body.decode()
        assert "Instructor lab" in "".join(lab.seen)
    finally:
        lab.close()
    assert not (tmp_path / "ws").exists()  # the instructor's lab makes no workspace


# ---- Run All on the student's own, unsolved, lessons: tests/test_browser.py runs each one in the lab itself ----


def test_outside_the_lab_an_unsolved_check_still_raises(monkeypatch):
    """The self-check (nbmake) and anything else outside the lab keep the strict behaviour."""
    from course_utils import checks
    from course_utils.grading.checks_modules import import_checks_module

    import_checks_module(str(ROOT / "tests" / "fixtures" / "grading" / "fixture_checks.py"))

    def add(a, b):
        raise NotImplementedError()

    monkeypatch.delenv(checks.LAB_ENV, raising=False)
    with pytest.raises(NotImplementedError):
        checks.check("ex99_add", add)
    monkeypatch.setenv(checks.LAB_ENV, "1")
    checks.check("ex99_add", add)  # says so, and returns


def test_the_lab_sets_its_mode():
    assert "export COURSE_LAB=1" in (ROOT / "launch" / "start_lab.sh").read_text()
