"""Two students on one GPU box (issue 37), their kernels started as the class's hub starts them: as each student's
own account, with the hub's kernel spec (every cell holds its kernel's GPUs: course_utils.gpu_lock), the hub's
server environment (hub_spawn.server_env) and CUDA_VISIBLE_DEVICES from the HUB_GPUS policy (hub_gpus.py). The
web side (login, proxy, spawner) is tests/test_hub.py's; this test is about what students' GPU work does to
each other:

1. one student runs lesson 02 alone: its verdicts are the reference;
2. both run lesson 02 at once with a GPU each (HUB_GPUS=each; on a one-GPU box round-robin puts both on it, and
   their cells take turns): each one's verdicts are the lone student's, and whoever waited was told who held
   the GPU;
3. HUB_GPUS=shared: while one student's timing cell runs, the other's NCCL launch waits for it, then runs.

The students' kernels take their locks in a folder of their own (COURSE_GPU_LOCK_DIR): meanwhile this test holds
every GPU's machine-wide lock (tests/conftest.py), so no other test times the GPUs under the students.
"""

from __future__ import annotations

import json
import os
import pwd
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from course_utils import gpu_lock
from tests.conftest import SESSION_ENV
from tests.test_hub import copy_repo, remove_accounts, students_python

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch" / "hub"))

from hub_gpus import check_policy, visible_for, write_kernel_spec  # noqa: E402
from hub_settings import from_env  # noqa: E402
from hub_spawn import server_env  # noqa: E402

LESSON = "02_cuda_streams.ipynb"
HOLD_S = 15  # how long student a's timing cell keeps the GPUs in part 3: far longer than a kernel's start
EXECUTE = """
import sys, nbformat
from nbclient import NotebookClient
nb = nbformat.read(sys.argv[1], as_version=4)
try:
    NotebookClient(nb, kernel_name="python3", timeout=600, resources={"metadata": {"path": sys.argv[3]}}).execute()
finally:
    nbformat.write(nb, sys.argv[2])
"""
TIMING = [  # student a's lesson in part 3: a timing cell that holds the GPU HOLD_S seconds
    "import time, torch",
    "open('timing-started', 'w').close()  # the test starts the other student now\n"
    "ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]\n"
    "start = time.time()\n"
    "ev[0].record()\n"
    "while time.time() - start < HOLD_S:\n"
    "    torch.cuda._sleep(10_000_000)\n"
    "    torch.cuda.synchronize()\n"
    "ev[1].record(); torch.cuda.synchronize()\n"
    "print(f'timed {ev[0].elapsed_time(ev[1]):.0f} ms; cell ended at', time.time())",
]
NCCL = [  # student b's lesson in part 3: one cell that launches NCCL ranks on the GPUs it sees
    "import time, torch, torch.distributed as dist\n"
    "from course_utils import launch\n"
    "began = time.time()\n\n"
    "def total():\n"
    "    t = torch.full((1,), float(dist.get_rank() + 1), device='cuda')\n"
    "    dist.all_reduce(t)\n"
    "    return t.item()\n\n"
    "n = min(2, torch.cuda.device_count())\n"
    "print('cell began at', began)\n"
    "print(f'all_reduce on {n} NCCL ranks:', sorted(launch.run(total, nproc=n, backend='nccl').values()))",
]


def verdicts(nb: dict) -> list[str]:
    """What the notebook concluded, without its numbers: each printed line with a "->" verdict, and each "on this
    machine: ..." line up to its first colon or semicolon; numbers become '#'."""
    found = []
    for cell in nb["cells"]:
        for out in cell.get("outputs", []):
            if out.get("name") != "stdout":
                continue
            for line in "".join(out["text"]).splitlines():
                if "->" in line:
                    found.append(line)
                elif m := re.match(r"on this machine: ([^:;]*)", line):
                    found.append(m[0])
    return [" ".join(re.sub(r"-?\d+(\.\d+)?", "#", line).split()) for line in found]


def stderr_of(nb: dict) -> str:
    return "".join("".join(o["text"]) for c in nb["cells"] for o in c.get("outputs", []) if o.get("name") == "stderr")


def test_verdicts_keep_the_conclusions_and_mask_the_numbers():
    def out(text: str) -> dict:
        return {"cell_type": "code", "outputs": [{"output_type": "stream", "name": "stdout", "text": text}]}

    nb = {"cells": [out("two side streams  makespan 10.1 ms for 20.0 ms -> overlapped\nnoise 3.2\n"),
                    out("on this machine: replay ran a step 9.8x faster on the GPU: 1.5 us; more\n"),
                    {"cell_type": "markdown", "source": "-> not an output"}]}
    assert verdicts(nb) == ["two side streams makespan # ms for # ms -> overlapped",
                            "on this machine: replay ran a step #x faster on the GPU"]


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "the students' kernels run as their own accounts: run as root"
    missing = [t for t in ("useradd", "userdel") if not shutil.which(t)]
    return f"needs {', '.join(missing)} (Debian's passwd package)" if missing else None


class Box:
    """A GPU box with two student accounts, the hub's kernel spec and a copy of the repository they can read."""

    def __init__(self, tmp: Path, names: list[str]):
        self.tmp, self.names = tmp, names
        self.py = students_python(tmp)
        self.repo = copy_repo(tmp / "repo")
        self.locks = tmp / "locks"
        self.locks.mkdir(mode=0o777)
        os.chmod(self.locks, 0o1777)
        (tmp / "execute.py").write_text(EXECUTE)
        self.gpu_ids = gpu_lock.visible_gpus()
        self.jupyter = from_env({"COURSE_HUB_DIR": str(tmp / "hub")}).jupyter
        write_kernel_spec(self.jupyter, self.py)  # the hub's kernel spec, the same whatever the policy
        for p in (self.jupyter.parent, self.jupyter):
            os.chmod(p, 0o755)
        for name in names:
            subprocess.run(["useradd", "--create-home", "--user-group", name], check=True)
            os.chmod(pwd.getpwnam(name).pw_dir, 0o700)

    def settings(self, policy: str):
        s = from_env({"COURSE_HUB_REPO": str(self.repo), "COURSE_HUB_DIR": str(self.tmp / "hub"),
                      "COURSE_HUB_GPUS": policy, "COURSE_HUB_GPU_IDS": ",".join(self.gpu_ids)})
        assert not check_policy(policy, self.names, self.gpu_ids) and s.jupyter == self.jupyter
        return s

    def env(self, name: str, policy: str) -> dict[str, str]:
        """The environment the hub gives `name`'s server, plus what this box's Python needs (the GPU machines'
        packages come on PYTHONPATH) and NCCL's settings for the box."""
        account, s = pwd.getpwnam(name), self.settings(policy)
        env = {"HOME": account.pw_dir, "USER": name, "LOGNAME": name, **server_env(s),
               gpu_lock.LOCK_DIR_ENV: str(self.locks), SESSION_ENV: os.environ[SESSION_ENV]}
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(":") if p and Path(p).resolve() != ROOT]
        env["PYTHONPATH"] = ":".join([env["PYTHONPATH"], *extra])
        env.update({k: v for k, v in os.environ.items() if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM_"))})
        gpus = visible_for(policy, name, self.names, self.gpu_ids)
        if gpus is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpus
        return env

    def start(self, name: str, policy: str, cells: list[str] | None = None) -> tuple[subprocess.Popen, Path]:
        """`name` runs lesson 02 (or a notebook of `cells`) in their workspace, in the background."""
        account = pwd.getpwnam(name)
        folder = Path(account.pw_dir) / "workspace" / "notebooks"
        folder.mkdir(parents=True, exist_ok=True)
        src = folder / "lesson.ipynb"
        if cells is None:
            shutil.copy(self.repo / "notebooks" / LESSON, src)
        else:
            code = [{"cell_type": "code", "execution_count": None, "id": str(i), "metadata": {}, "outputs": [],
                     "source": (f"HOLD_S = {HOLD_S}\n" if i == 0 else "") + c} for i, c in enumerate(cells)]
            src.write_text(json.dumps({"cells": code, "metadata": {}, "nbformat": 4, "nbformat_minor": 5}))
        for p in (account.pw_dir + "/workspace", folder, src):
            os.chown(p, account.pw_uid, account.pw_gid)
        for old in folder.glob("timing-started"):
            old.unlink()
        out = folder / "executed.ipynb"
        out.unlink(missing_ok=True)
        proc = subprocess.Popen([self.py, str(self.tmp / "execute.py"), str(src), str(out), str(folder)],
                                cwd=folder, env=self.env(name, policy), user=account.pw_uid, group=account.pw_gid,
                                extra_groups=[], umask=0o077, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        return proc, out


def finished(proc: subprocess.Popen, out: Path, who: str) -> dict:
    log, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0 and out.exists(), f"{who}'s notebook failed:\n{log[-4000:]}"
    return json.loads(out.read_text())


def waited_for(nb: dict, holder: str) -> bool:
    """Whether a cell of `nb` waited for a GPU and was told that `holder`'s notebook cell held it."""
    return bool(re.search(rf"GPU \S+ is in use by {holder} \(pid \d+, a notebook cell of {holder}\) for \d+ s; "
                          r"waiting", stderr_of(nb)))


@pytest.fixture
def box():
    why = _why_not()
    if why:
        pytest.skip(why)
    tmp = Path(tempfile.mkdtemp(prefix="course-hubgpu-"))  # not under pytest's 0700 folder: students read the copy
    os.chmod(tmp, 0o755)
    names = [f"chg{os.getpid() % 10000}{s}" for s in "ab"]
    try:
        yield Box(tmp, names)
    finally:
        remove_accounts(names)
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.gpu
@pytest.mark.ranks
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_two_students_on_one_box_get_a_lone_students_verdicts_and_take_turns(box):
    a, b = box.names
    n = len(box.gpu_ids)
    policy = "each" if n >= 2 else "round-robin"

    # 1. a alone: the reference
    alone = verdicts(finished(*box.start(a, policy), a))
    assert len(alone) >= 5, alone

    # 2. both at once, a GPU each (or both on the one GPU, taking turns)
    runs = {name: box.start(name, policy) for name in (a, b)}
    done = {name: finished(*runs[name], name) for name in (a, b)}
    for name in (a, b):
        assert verdicts(done[name]) == alone, f"{name}'s verdicts with another student on the box ({policy})"
    waits = [waited_for(done[a], b), waited_for(done[b], a)]
    if n >= 2:
        assert not any(waits), "students on GPUs of their own waited for each other"
    else:
        assert any(waits), "two students timed the one GPU and neither waited for the other"

    # 3. shared GPUs: b's NCCL cell waits for a's timing cell, then runs
    timing, timing_out = box.start(a, "shared", TIMING)
    marker = timing_out.parent / "timing-started"
    deadline = time.monotonic() + 120
    while not marker.exists():
        assert timing.poll() is None and time.monotonic() < deadline, timing.communicate()[0][-3000:]
        time.sleep(0.2)
    nccl = box.start(b, "shared", NCCL)
    timed, launched = finished(timing, timing_out, a), finished(*nccl, b)
    ended = float(re.search(r"cell ended at ([\d.]+)", json.dumps(timed))[1])
    began = float(re.search(r"cell began at ([\d.]+)", json.dumps(launched))[1])
    assert waited_for(launched, a), stderr_of(launched)
    assert began >= ended, f"b's NCCL cell began {ended - began:.1f} s before a's timing cell ended"
    ranks = min(2, n)
    assert f"all_reduce on {ranks} NCCL ranks: {[ranks * (ranks + 1) / 2] * ranks}" in json.dumps(launched)
