"""What the hub does before starting a user's server: the folder it serves, and a student's workspace.

A student's server serves ~/WORKSPACE/notebooks (default ~/workspace), their own copies of the lessons,
made from the released student versions by `course_utils.workspace sync --released`, run as the student (so
every file is theirs, and nothing the student placed in their home can make root write elsewhere). New lessons are
added at each start; a lesson already there is never overwritten. An instructor's (admin's) server serves the
masters in notebooks/, as `make lab-instructor` does.
"""

from __future__ import annotations

import asyncio
import os
import pwd
import sys
from pathlib import Path

from hub_gpus import visible_for
from hub_settings import Settings

from course_utils.roster import read_roster

SYNC_TIMEOUT = 120  # s; making a workspace takes a second or two, more on a loaded 2-core machine


def server_env(settings: Settings) -> dict[str, str]:
    """Variables for every user's server and kernels (besides HOME, USER, SHELL, set by the spawner)."""
    # COURSE_LAB: an unsolved exercise's check says "not attempted yet" and Run All goes on, as in `make lab`.
    # PYTHONPATH: kernels import this repository's course_utils even when the environment was installed from
    # another checkout (an editable install points at the checkout that installed it).
    # PATH: `python` in a lab terminal is the course's Python (the hub's PATH is root's, e.g. pyenv's shims).
    # JUPYTER_PATH: the kernel spec that loads the GPU turns (hub_gpus.py). CUDA_DEVICE_ORDER: GPU k is the same
    # GPU for every process (nvidia-smi's order), so everyone's locks name the same GPUs.
    path = f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/local/bin:/usr/bin:/bin')}"
    return {"COURSE_LAB": "1", "PYTHONPATH": str(settings.repo), "PATH": path,
            "JUPYTER_PATH": str(settings.jupyter), "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def sync_command(settings: Settings, workspace: Path) -> list[str]:
    """The command that makes or completes a student's workspace from the released lessons."""
    return [sys.executable, "-m", "course_utils.workspace", "--masters", str(settings.release), "--workspace",
            str(workspace), "--released", "--repo", str(settings.repo), "sync"]


async def make_workspace(settings: Settings, name: str) -> Path:
    """Make or complete `name`'s workspace, as that user; returns the folder their server serves."""
    try:
        account = pwd.getpwnam(name)
    except KeyError as e:
        raise RuntimeError(f"{name} has no system account on this machine (make students)") from e
    workspace = Path(account.pw_dir) / settings.workspace
    env = {"HOME": account.pw_dir, "USER": name, **server_env(settings)}
    proc = await asyncio.create_subprocess_exec(
        *sync_command(settings, workspace), cwd=account.pw_dir, env=env, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, user=account.pw_uid,
        group=account.pw_gid, extra_groups=os.getgrouplist(name, account.pw_gid), umask=0o077)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), SYNC_TIMEOUT)
    except asyncio.TimeoutError:
        proc.kill()
        raise RuntimeError(f"{name}'s workspace was not made within {SYNC_TIMEOUT} s") from None
    if proc.returncode:
        raise RuntimeError(f"{name}'s workspace could not be made: {out.decode(errors='replace').strip()}")
    return workspace / "notebooks"


def pre_spawn_hook(settings: Settings):
    """The hook for c.Spawner.pre_spawn_hook: sets the served folder, making a student's workspace first."""

    students = read_roster(settings.roster, required=False)  # as the hub read it at its start

    async def hook(spawner) -> None:
        if settings.spawner == "slurm":
            # batchspawner fills its job script with the options of the server's start, which a student may send
            # (POST /hub/api/users/NAME/server {"gres": "gpu:8"}): the course offers none, so none reach the job.
            spawner.user_options = {}
        # On a cluster Slurm gives each job its GPUs (--gres) and sets CUDA_VISIBLE_DEVICES: HUB_GPUS is the box's.
        gpus = None if settings.spawner == "slurm" else visible_for(settings.gpus, spawner.user.name, students,
                                                                        settings.gpu_ids)
        if gpus is not None:
            spawner.environment = {**spawner.environment, "CUDA_VISIBLE_DEVICES": gpus}
            spawner.log.info("%s's server sees GPU %s (HUB_GPUS=%s)", spawner.user.name, gpus, settings.gpus)
        if spawner.user.admin:
            spawner.notebook_dir = str(settings.repo / "notebooks")
        else:
            spawner.notebook_dir = str(await make_workspace(settings, spawner.user.name))
            # `make -C REPO check` in the student's terminal: their workspace, scored against the masters without
            # their solutions (the masters themselves are closed to students)
            spawner.environment = {**spawner.environment, "LAB_WORKSPACE": str(Path(spawner.notebook_dir).parent),
                                   "MASTER_DIR": str(settings.grading)}
        spawner.log.info("%s's server serves %s", spawner.user.name, spawner.notebook_dir)

    return hook
