"""The probe runner: a fresh Python per exercise, in bubblewrap as an unprivileged user, gone with all it started.

These tests drive course_utils.grading.probe directly with the exercises of
tests/fixtures/grading/probe_checks.py (ex97_env reports what the probe sees, ex97_call calls the answer).
They run as whoever runs the suite: root on CI (the probe then drops to uid 65534), a user elsewhere.
"""

from __future__ import annotations

import io
import os
import time
import uuid
import zipfile
from pathlib import Path

import pytest
import torch

from course_utils import checks
from course_utils.grading import sandbox
from course_utils.grading.checks_modules import import_checks_module
from course_utils.grading.probe import run_probe
from tests.launch_helpers import processes_with

pytestmark = pytest.mark.grading

ROOT = Path(__file__).resolve().parents[1]
PROBE_CHECKS = str(Path(__file__).parent / "fixtures" / "grading" / "probe_checks.py")
INPUTS = checks.to_bytes({"gpu": False, "n": 3})
import_checks_module(PROBE_CHECKS)


def probe(source: str, grade_id: str = "ex97_call", timeout: float = 20, **kw):
    return run_probe([("<solution>", source)], grade_id, INPUTS, checks_module=PROBE_CHECKS, timeout=timeout,
                     read_only=[PROBE_CHECKS], **kw)


def test_a_probe_runs_in_a_throwaway_place_of_its_own(monkeypatch):
    monkeypatch.setenv("JUPYTER_TOKEN", "the-instructors-token")  # a secret of ours: must not reach a probe
    a = probe("answer = 42", "ex97_env")
    b = probe("answer = 'x'", "ex97_env")
    assert a.status == "ok" and b.status == "ok", (a, b)
    d = a.data
    root = Path(d["cwd"]).parent
    assert d["cwd"] != os.getcwd() and root.name.startswith("course-probe-")
    assert d["home"] == str(root / "home") and d["tmpdir"] == str(root / "tmp")
    assert d["ipythondir"] == str(root / "ipython")
    assert d["cuda_visible_devices"] == ""  # no GPU given: CUDA shows none
    assert d["uid"] == (sandbox.SANDBOX_UID if os.geteuid() == 0 else os.getuid())
    # a fresh process (nothing of an earlier request in its memory), first in its own PID namespace
    assert d["pid"] == 2 and "course_utils.grading.probe_child" in d["cmdline"]
    assert "the-instructors-token" not in d["environ"] and "JUPYTER_TOKEN" not in d["environ"]
    assert d["inputs"] == {"gpu": False, "n": 3} and d["answer"] == 42 and b.data["answer"] == "x"
    assert Path(b.data["cwd"]).parent != root  # a fresh folder for every probe
    assert not root.exists()  # removed once the probe is done


def test_nothing_of_ours_is_in_reach(tmp_path):
    """The repository, the masters, a secret beside them: not mounted. Writes land nowhere outside the probe."""
    secret = tmp_path / "02_lesson.ipynb"
    secret.write_text("the solution")
    code = f"""
import os
def f():
    out = {{"root": sorted(os.listdir("/"))}}
    for name, path in (("secret", {str(secret)!r}), ("notebooks", {str(ROOT / "notebooks")!r}),
                       ("git", {str(ROOT / ".git")!r}), ("tests", {str(ROOT / "tests" / "conftest.py")!r})):
        out[name] = os.path.exists(path)
    try:
        open({str(tmp_path / "written.txt")!r}, "w").write("pwned")
        out["write"] = "written"
    except OSError as e:
        out["write"] = type(e).__name__
    open("here.txt", "w").write("fine")  # its own working directory
    return out
"""
    out = probe(code)
    assert out.status == "ok", out
    seen = out.data["out"]
    assert seen["secret"] is False and seen["notebooks"] is False and seen["git"] is False, seen
    assert seen["tests"] is False, seen
    assert seen["write"] != "written" and not (tmp_path / "written.txt").exists()


def test_a_probe_cannot_change_the_kernels_settings():
    """As root, a probe once wrote /proc/sys/kernel/core_pattern (a pipe into its own script, run as root by the
    kernel outside any sandbox). It runs as an unprivileged uid now: the write is refused."""
    before = Path("/proc/sys/kernel/core_pattern").read_text()
    code = """
def f():
    try:
        with open("/proc/sys/kernel/core_pattern", "w") as fh:
            fh.write("|/bin/sh -c true")
        return "written"
    except OSError as e:
        return type(e).__name__
"""
    try:
        out = probe(code)
    finally:
        if Path("/proc/sys/kernel/core_pattern").read_text() != before and os.geteuid() == 0:
            Path("/proc/sys/kernel/core_pattern").write_text(before)
    assert out.status == "ok" and out.data["out"] != "written", out
    assert Path("/proc/sys/kernel/core_pattern").read_text() == before


def test_a_probe_may_write_its_own_proc_files_but_sees_no_other_process():
    """CUDA's initialisation writes beneath /proc/self; naming a thread writes /proc/self/task/TID/comm. The
    grader and other probes are in another PID namespace: not there to read or signal."""
    code = f"""
import os, threading
def f():
    seen = {{}}
    def named():
        with open(f"/proc/self/task/{{threading.get_native_id()}}/comm", "w") as comm:
            comm.write("probe-worker")
        seen["comm"] = open(f"/proc/self/task/{{threading.get_native_id()}}/comm").read().strip()
    t = threading.Thread(target=named)
    t.start()
    t.join()
    seen["pids"] = sorted(int(p) for p in os.listdir("/proc") if p.isdigit())
    seen["grader"] = os.path.exists("/proc/{os.getpid()}/environ") and {os.getpid()} not in (1, 2)
    return seen
"""
    out = probe(code)
    assert out.status == "ok", out
    assert out.data["out"]["comm"] == "probe-worker"
    assert out.data["out"]["pids"] == [1, 2]  # bubblewrap's init and the probe
    assert out.data["out"]["grader"] is False


def test_infinite_loop_is_cut_off_at_the_time_limit():
    t0 = time.monotonic()
    out = probe("def f():\n    while True:\n        pass", timeout=2)
    assert out.status == "timeout" and "time limit of 2 s" in out.message
    assert time.monotonic() - t0 < 30


KEEPS_RUNNING = """
import os, subprocess, sys
def f():
    subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)  # {marker}"])
    subprocess.Popen([sys.executable, "-c",
        "import os, subprocess, sys, time\\n"
        "if os.fork():\\n    os._exit(0)\\n"
        "os.setsid()\\n"
        "time.sleep(301)  # {marker}"])
    import time
    while sum("{marker}" in open(f"/proc/{{p}}/cmdline").read() for p in os.listdir("/proc") if p.isdigit()) < 2:
        time.sleep(0.05)
    {end}
"""


@pytest.mark.parametrize("end", ["return 1", "while True:\n        pass", "os._exit(0)"],
                         ids=["answers", "times-out", "exits"])
def test_everything_a_probe_started_is_killed(end):
    """A child, and a double-forked, setsid'd grandchild (one left running would hold its ports and break later
    students' rendezvous) are gone when run_probe returns, however the probe ended."""
    marker = f"left-behind-{uuid.uuid4().hex}"
    out = probe(KEEPS_RUNNING.format(marker=marker, end=end), timeout=15)
    assert out.status == {"return 1": "ok", "os._exit(0)": "no result"}.get(end, "timeout"), out
    assert processes_with(marker) == []


RANKS_AFTER_A_PATCH = """
import torch.distributed as dist
from course_utils import launch

def _patched(*args, **kwargs):
    raise RuntimeError("the solution's all_reduce")

dist.all_reduce = _patched  # what a solution could do to the ranks a check launches after it

def seen():
    import torch.distributed as dist

    t = __import__("torch").ones(1)
    dist.all_reduce(t)
    return {"patched": dist.all_reduce.__name__ == "_patched", "sum": t.item()}

def f():
    return list(launch.run(seen, nproc=2, backend="gloo", timeout=60).values())
"""


def test_ranks_a_probe_launches_run_on_its_own_loopback():
    """CPU ranks start inside the sandbox (own network namespace: its loopback only) from a fresh interpreter,
    so a patch the solution made does not reach them."""
    out = probe(RANKS_AFTER_A_PATCH, timeout=90)
    assert out.status == "ok", out
    assert out.data["out"] == [{"patched": False, "sum": 2.0}] * 2


def test_shared_memory_is_private_to_each_probe():
    """/dev/shm was shared, writable and persistent: a channel between probes. Now each has its own."""
    name = f"course-{uuid.uuid4().hex}"
    wrote = probe(f"def f():\n    open('/dev/shm/{name}', 'w').write('from an earlier probe')\n    return 1")
    read = probe(f"import os\ndef f():\n    return os.path.exists('/dev/shm/{name}')")
    assert wrote.status == "ok" and read.status == "ok" and read.data == {"out": False}
    assert not Path(f"/dev/shm/{name}").exists()


def test_exit_after_printing_the_pass_line_is_no_result():
    out = probe("import os\nprint('passed: ex97_call')\nos._exit(0)")
    assert out.status == "no result" and "exit code 0" in out.message


def test_output_flood_does_not_stop_the_probe():
    code = "import sys\ndef f():\n    for _ in range(50):\n        print('x' * 1_000_000)\n" \
           "        sys.stderr.write('y' * 1_000_000)\n    return 'done'"
    out = probe(code)
    assert out.status == "ok" and out.data == {"out": "done"}


def test_results_must_be_plain_data():
    code = "class Anything:\n    def __eq__(self, other):\n        return True\ndef f():\n    return Anything()"
    out = probe(code)
    assert out.status == "error" and "not plain data" in out.message


def test_exceptions_come_back_as_the_end_of_their_traceback():
    out = probe("def f():\n    return 1 / 0")
    assert out.status == "error" and "ZeroDivisionError" in out.message and "<solution>" in out.message
    nie = probe("def f():\n    raise NotImplementedError()")
    assert nie.status == "not attempted"
    missing = probe("g = 1")
    assert missing.status == "error" and "does not define `f`" in missing.message
    syntax = probe("def f(:\n    pass")
    assert syntax.status == "error" and "SyntaxError" in syntax.message


FORGE = """
import os, stat, struct
def f():
    frame = {frame!r}
    for fd in range(3, 64):
        try:
            if stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, struct.pack(">Q", len(frame)) + frame)
        except OSError:
            pass
    os._exit(0)
"""


def test_forged_result_bytes_run_nothing_in_the_grader(tmp_path):
    """The student finds the result pipe and writes a malicious pickle: it is refused unread."""
    target = tmp_path / "pwned"
    evil = f"cos\nsystem\n(S'touch {target}'\ntR.".encode()  # plain pickle would run a shell command
    out = probe(FORGE.format(frame=evil))
    assert out.status == "error" and "could not be read as plain data" in out.message
    assert not target.exists()


def deflated(obj) -> bytes:
    """A torch.save archive of `obj` with its records deflate-compressed (torch.load accepts it)."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    src, out = zipfile.ZipFile(io.BytesIO(buf.getvalue())), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info))
    return out.getvalue()


def test_a_decompression_bomb_is_refused_before_it_is_decoded():
    """A deflated record decodes to far more than its bytes on the pipe (here under 1 MB for 200 MB), and it would
    decode in the grader's memory: the archive is checked before torch.load sees it."""
    bomb = deflated({"status": "ok", "data": torch.zeros(50_000_000)})  # 200 MB once decoded
    assert len(bomb) < 1 << 20
    with pytest.raises(ValueError, match="compressed"):
        checks.from_bytes(bomb)
    out = probe(FORGE.format(frame=bomb))
    assert out.status == "error" and "compressed" in out.message, out


def test_a_result_that_names_one_storage_many_times_is_refused():
    """A small archive whose pickle names one 4 MiB tensor 10,000 times would be 40 GiB of copies here."""
    big = torch.zeros(1 << 20)
    raw = checks.to_bytes({"x": 1})
    buf = io.BytesIO()
    torch.save([big] * 10_000, buf)  # torch.save keeps one storage; the views are cheap
    assert len(buf.getvalue()) < 8 << 20 and len(raw) > 0
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="larger than"):
        checks.from_bytes(buf.getvalue())
    assert time.monotonic() - t0 < 10
