"""The probe runner: a throwaway, fenced-in process per exercise, killed with everything it started.

These tests drive course_utils.grading.probe directly with the exercises of
tests/fixtures/grading/probe_checks.py (ex97_env reports what the probe sees, ex97_call calls the answer).
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from course_utils import checks
from course_utils.grading import sandbox
from course_utils.grading.probe import ProbeServer, run_probe

PROBE_CHECKS = Path(__file__).parent / "fixtures" / "grading" / "probe_checks.py"
INPUTS = checks.to_bytes({"gpu": False, "n": 3})


@pytest.fixture(scope="module")
def server():
    with ProbeServer([str(PROBE_CHECKS)]) as s:
        s.wait_ready()
        yield s


def probe(server, source: str, grade_id: str = "ex97_call", timeout: float = 20, cuda: str = "", **kw):
    return run_probe(server, [("<solution>", source)], grade_id, INPUTS, cuda_visible_devices=cuda,
                     timeout=timeout, **kw)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_probe_runs_in_a_throwaway_place_of_its_own(server, tmp_path):
    a = probe(server, "answer = 42", "ex97_env", cuda="3")
    b = probe(server, "answer = 'x'", "ex97_env")
    assert a.status == "ok" and b.status == "ok", (a, b)
    d = a.data
    root = Path(d["cwd"]).parent
    assert d["cwd"] != os.getcwd() and root.name.startswith("course-probe-")
    assert d["home"] == str(root / "home") and d["tmpdir"] == str(root / "tmp")
    assert d["ipythondir"] == str(root / "ipython")
    assert d["cuda_visible_devices"] == "3" and b.data["cuda_visible_devices"] == ""
    assert d["own_session"] is True
    assert d["inputs"] == {"gpu": False, "n": 3} and d["answer"] == 42 and b.data["answer"] == "x"
    assert Path(b.data["cwd"]).parent != root  # a fresh folder for every probe
    assert not root.exists()  # removed once the probe is done
    assert not alive(d["pid"])


@pytest.mark.skipif(sandbox.landlock_abi() < 1, reason="this Linux kernel has no Landlock")
def test_a_probe_cannot_write_outside_its_folder(server, tmp_path):
    target = tmp_path / "written_by_a_probe.txt"
    code = f"""
def f():
    open("here.txt", "w").write("fine")  # its own working directory
    try:
        open({str(target)!r}, "w").write("pwned")
    except PermissionError:
        return "denied"
    return "written"
"""
    out = probe(server, code)
    assert out.status == "ok" and out.data == {"out": "denied"}
    assert not target.exists()


@pytest.mark.skipif(sandbox.landlock_abi() < 1, reason="this Linux kernel has no Landlock")
def test_a_probe_may_write_its_own_proc_files_but_not_read_the_graders_memory(server):
    """CUDA's initialisation writes beneath /proc (a fenced probe without it failed every GPU exercise with
    error 304 on an H100): naming a thread writes /proc/self/task/TID/comm. Another process's memory stays out
    of reach: Landlock refuses ptrace-mode access to processes outside the sandbox."""
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
    try:
        open("/proc/{os.getpid()}/mem", "rb").read(1)
        seen["grader_mem"] = "read"
    except OSError as err:
        seen["grader_mem"] = type(err).__name__
    return seen
"""
    out = probe(server, code)
    assert out.status == "ok", out
    assert out.data["out"]["comm"] == "probe-worker"
    assert out.data["out"]["grader_mem"] == "PermissionError"


def test_infinite_loop_is_cut_off_at_the_time_limit(server):
    t0 = time.monotonic()
    out = probe(server, "def f():\n    while True:\n        pass", timeout=2)
    assert out.status == "timeout" and "time limit of 2 s" in out.message
    assert time.monotonic() - t0 < 10


KEEPS_RUNNING = """
import os, subprocess, sys
def f():
    child = subprocess.Popen(["sleep", "300"])
    detached = subprocess.Popen([sys.executable, "-c",
        "import os, subprocess, sys\\n"
        "if os.fork():\\n    os._exit(0)\\n"
        "os.setsid()\\n"
        "p = subprocess.Popen(['sleep', '301'])\\n"
        "print(os.getpid(), p.pid, flush=True)\\n"
        "p.wait()"], stdout=subprocess.PIPE, text=True)
    pids = [child.pid] + [int(x) for x in detached.stdout.readline().split()]
    open({marker!r}, "w").write(repr(pids))
    {end}
"""


@pytest.mark.parametrize("end", ["return pids", "while True:\n        pass"], ids=["answers", "times-out"])
def test_everything_a_probe_started_is_killed(server, tmp_path, end):
    """Children, and a double-forked, setsid'd grandchild (it escapes a process-group kill) are all gone."""
    marker = tmp_path / "pids.txt"
    # landlock=False: the marker file lives outside the probe's folder.
    out = probe(server, KEEPS_RUNNING.format(marker=str(marker), end=end), timeout=8, landlock=False)
    assert out.status == ("ok" if end == "return pids" else "timeout"), out
    pids = eval(marker.read_text())
    assert len(pids) == 3
    time.sleep(0.3)
    assert [p for p in pids if alive(p)] == []


RANKS_AFTER_A_PATCH = """
import os
import torch.distributed as dist
from course_utils import launch

def _patched(*args, **kwargs):
    raise RuntimeError("the solution's all_reduce")

dist.all_reduce = _patched  # what a solution could do to the ranks a check launches after it

def seen():
    import os
    import torch.distributed as dist

    with open(f"/proc/{os.getppid()}/cmdline", "rb") as fh:
        server = fh.read().replace(b"\\0", b" ").decode()
    return {"patched": dist.all_reduce.__name__ == "_patched", "server": server, "pid": os.getpid(),
            "server_pid": os.getppid()}

def f():
    return list(launch.run(seen, nproc=2, backend="gloo", timeout=60).values())
"""


def test_ranks_a_probe_launches_come_from_before_the_solution_ran(server):
    """Their fork server is forked by the probe's zygote (no fresh interpreter importing torch), from the probe
    as it was before the solution: a patch the solution made does not reach them. All are gone afterwards."""
    out = probe(server, RANKS_AFTER_A_PATCH, timeout=90)
    assert out.status == "ok", out
    ranks = out.data["out"]
    assert len(ranks) == 2
    for r in ranks:
        assert r["patched"] is False
        assert "course_utils.grading.probe_server" in r["server"], r["server"]  # a fork of the probe server's
    time.sleep(0.3)
    assert [p for r in ranks for p in (r["pid"], r["server_pid"]) if alive(p)] == []


def test_exit_after_printing_the_pass_line_is_no_result(server):
    out = probe(server, "import os\nprint('passed: ex97_call')\nos._exit(0)")
    assert out.status == "no result" and "exit code 0" in out.message


def test_output_flood_does_not_stop_the_probe(server):
    code = "import sys\ndef f():\n    for _ in range(50):\n        print('x' * 1_000_000)\n" \
           "        sys.stderr.write('y' * 1_000_000)\n    return 'done'"
    t0 = time.monotonic()
    out = probe(server, code)
    assert out.status == "ok" and out.data == {"out": "done"}
    assert time.monotonic() - t0 < 20


def test_results_must_be_plain_data(server):
    code = "class Anything:\n    def __eq__(self, other):\n        return True\ndef f():\n    return Anything()"
    out = probe(server, code)
    assert out.status == "error" and "not plain data" in out.message


def test_exceptions_come_back_as_the_end_of_their_traceback(server):
    out = probe(server, "def f():\n    return 1 / 0")
    assert out.status == "error" and "ZeroDivisionError" in out.message and "<solution>" in out.message
    nie = probe(server, "def f():\n    raise NotImplementedError()")
    assert nie.status == "not attempted"
    missing = probe(server, "g = 1")
    assert missing.status == "error" and "does not define `f`" in missing.message
    syntax = probe(server, "def f(:\n    pass")
    assert syntax.status == "error" and "SyntaxError" in syntax.message


FORGE = """
import os, pickle, stat, struct
# A pickle that would run a shell command if the grader unpickled it with plain pickle.
evil = b"cos\\nsystem\\n(S'touch {target}'\\ntR."
for fd in range(3, 64):
    try:
        if stat.S_ISFIFO(os.fstat(fd).st_mode):
            os.write(fd, struct.pack(">Q", len(evil)) + evil)
    except OSError:
        pass
os._exit(0)
"""


def test_forged_result_bytes_run_nothing_in_the_grader(server, tmp_path):
    """The student finds the result pipe and writes a malicious pickle: the weights-only loader refuses it."""
    target = tmp_path / "pwned"
    out = probe(server, FORGE.format(target=target))
    assert out.status == "error" and "could not be read as plain data" in out.message
    assert not target.exists()


def test_the_server_survives_or_comes_back_when_a_probe_kills_it(server):
    out = probe(server, "import os, signal\ndef f():\n    os.kill(os.getppid(), signal.SIGKILL)\n    return 1")
    assert out.status in ("ok", "error", "no result")  # denied (Landlock scope) or done: the probe's business
    again = probe(server, "def f():\n    return 7")
    assert again.status == "ok" and again.data == {"out": 7}


def test_kill_tree_stops_a_fork_loop(tmp_path):
    import subprocess
    import sys

    code = "import os, time\nwhile True:\n    if os.fork() == 0:\n        time.sleep(30)\n        os._exit(0)\n" \
           "    time.sleep(0.01)"
    proc = subprocess.Popen([sys.executable, "-c", f"import os\nos.setsid()\n{code}"])
    time.sleep(1.0)
    below = sandbox.descendants(proc.pid)
    assert below
    sandbox.kill_tree(proc.pid)
    proc.wait(5)
    time.sleep(0.2)
    assert [p for p in below + sandbox.descendants(proc.pid) if alive(p)] == []
    assert proc.returncode == -signal.SIGKILL


def test_file_guard_puts_files_back(tmp_path):
    (tmp_path / "pkg").mkdir()
    keep = tmp_path / "pkg" / "a.py"
    keep.write_text("A = 1\n")
    gone = tmp_path / "pkg" / "b.py"
    gone.write_text("B = 2\n")
    startup = tmp_path / "startup"  # does not exist yet: files that appear in it are removed
    guard = sandbox.FileGuard([tmp_path / "pkg", startup])
    assert guard.restore() == []
    keep.write_text("A = 666\n")
    gone.unlink()
    (tmp_path / "pkg" / "new.py").write_text("x")
    startup.mkdir()
    (startup / "00-pwn.py").write_text("x")
    wrong = guard.restore()
    assert sorted(w.split()[0] for w in wrong) == ["changed", "created", "created", "deleted"]
    assert keep.read_text() == "A = 1\n" and gone.read_text() == "B = 2\n"
    assert not (tmp_path / "pkg" / "new.py").exists() and not (startup / "00-pwn.py").exists()


@pytest.mark.skipif(sandbox.landlock_abi() < 1, reason="this Linux kernel has no Landlock")
def test_hidden_files_cannot_be_read_but_their_neighbours_can(server, tmp_path):
    (tmp_path / "masters").mkdir()
    secret = tmp_path / "masters" / "02_lesson.ipynb"
    secret.write_text("the solution")
    beside = tmp_path / "masters" / "notes.txt"
    beside.write_text("not secret")
    link = tmp_path / "link_to_secret"
    link.symlink_to(secret)
    code = f"""
import os
def f():
    out = {{"listing": sorted(os.listdir({str(secret.parent)!r}))}}
    for name, path in (("secret", {str(secret)!r}), ("beside", {str(beside)!r}), ("link", {str(link)!r})):
        try:
            out[name] = open(path).read()
        except PermissionError:
            out[name] = "denied"
    return out
"""
    got = run_probe(server, [("<solution>", code)], "ex97_call", INPUTS, cuda_visible_devices="", timeout=20,
                    hide=[str(secret)])
    assert got.status == "ok", got
    assert got.data["out"] == {"listing": ["02_lesson.ipynb", "notes.txt"], "secret": "denied",
                               "beside": "not secret", "link": "denied"}
