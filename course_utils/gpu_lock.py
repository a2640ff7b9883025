"""Turns on the GPUs, machine-wide: whoever times a GPU holds it alone, across processes and users.

Kernels of two processes on one GPU share it, so a timing taken while another process runs kernels
shows concurrency (or its absence) that is not the code's. The grader takes a GPU's lock for each
GPU check it runs and for each feedback run; the course's test suite takes every GPU's lock for a test
that times the GPU. Locks are `flock`s on one file per GPU id in `lock_dir()`, taken in sorted order
(so two holders of several GPUs never wait for each other in a circle), and the kernel drops them
when their holder dies, however it dies.

A process that holds the locks sets COURSE_GPU_LOCKS_HELD=1 for its children, which then take none:
a test that runs the grader would otherwise wait for itself.

A holder writes who it is into the lock file (user, pid, since when, what for), so that someone who has to wait
(a student on a shared box) is told who holds the GPU and for how long, instead of stalling in silence. The files
are open to every user (mode 0666 whatever the umask): a lock another user cannot open is a lock nobody can wait on.

GPU ids are CUDA_VISIBLE_DEVICES entries as `visible_gpus()` gives them (CUDA's numbering unless the
variable names UUIDs): processes that agree on CUDA_DEVICE_ORDER agree on what an id means.
"""

from __future__ import annotations

import contextlib
import fcntl
import getpass
import json
import os
import re
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

LOCK_DIR_ENV = "COURSE_GPU_LOCK_DIR"
HELD_ENV = "COURSE_GPU_LOCKS_HELD"


def visible_gpus() -> tuple[str, ...]:
    """The GPU ids this process may use: CUDA_VISIBLE_DEVICES's entries if set, else 0..count-1."""
    env = os.environ.get("CUDA_VISIBLE_DEVICES")
    if env is not None:
        return tuple(t.strip() for t in env.split(",") if t.strip() and not t.strip().startswith("-"))
    if sys.platform.startswith("linux") and not Path("/dev/nvidiactl").exists():
        return ()  # no NVIDIA driver: no need to import torch to know
    import torch

    return tuple(str(i) for i in range(torch.cuda.device_count()))  # NVML first: no CUDA context here


def lock_dir() -> Path:
    """Where the lock files live, made if missing: $COURSE_GPU_LOCK_DIR, else a folder in the system's temporary
    folder, open to every user of the machine (sticky, like /tmp itself)."""
    folder = Path(os.environ.get(LOCK_DIR_ENV) or Path(tempfile.gettempdir()) / "course_utils-gpu-locks")
    if not folder.is_dir():
        folder.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(OSError):
            os.chmod(folder, 0o1777)
    return folder


@dataclass
class Turn:
    """GPU locks held until `release()`."""

    ids: tuple[str, ...]
    _files: list[int] = field(default_factory=list)

    def release(self) -> None:
        for fd in reversed(self._files):
            os.close(fd)  # closing the descriptor drops its flock
        self._files.clear()


def _open(folder: Path, gpu: str) -> int:
    """The lock file of `gpu`, made readable and writable by every user if this process created it."""
    path = folder / f"gpu-{re.sub(r'[^A-Za-z0-9_.-]', '_', gpu)}.lock"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    with contextlib.suppress(OSError):  # only the file's owner may; the owner made it so already
        os.fchmod(fd, 0o666)
    return fd


def _whoami() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # a uid with no name (a container, the grader's sandbox)
        return f"uid {os.getuid()}"


def holder(fd: int) -> str:
    """Who holds the lock file `fd`, as its holder wrote it: "alice (pid 4242, lesson 02) for 35 s"."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        for_s = time.time() - float(record["since"])
        what = f", {record['what']}" if record.get("what") else ""
        return f"{record['user']} (pid {record['pid']}{what}) for {for_s:.0f} s"
    except (ValueError, KeyError, TypeError, OSError):
        return "a process that has not said who it is yet"


def take(ids: Iterable[str], what: str = "") -> Turn:
    """Wait until every GPU in `ids` is free machine-wide, and hold them (a no-op under COURSE_GPU_LOCKS_HELD=1).
    `what` says what the GPUs are held for, to whoever waits; a wait is announced on stderr with the holder."""
    ids = tuple(sorted(set(ids)))
    turn = Turn(ids)
    if not ids or os.environ.get(HELD_ENV) == "1":
        return turn
    folder = lock_dir()
    try:
        for gpu in ids:
            fd = _open(folder, gpu)
            turn._files.append(fd)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                print(f"[gpu_lock] GPU {gpu} is in use by {holder(fd)}; waiting for it to be free ...",
                      file=sys.stderr, flush=True)
                fcntl.flock(fd, fcntl.LOCK_EX)
            record = {"user": _whoami(), "pid": os.getpid(), "since": time.time(), "what": what}
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode(), 0)
    except BaseException:
        turn.release()
        raise
    return turn


@contextlib.contextmanager
def holding(ids: Iterable[str], what: str = "") -> Iterator[Turn]:
    """Hold the GPUs in `ids` for the block; children started inside take no locks of their own."""
    turn = take(ids, what)
    before = os.environ.get(HELD_ENV)
    os.environ[HELD_ENV] = "1"
    try:
        yield turn
    finally:
        if before is None:
            os.environ.pop(HELD_ENV, None)
        else:
            os.environ[HELD_ENV] = before
        turn.release()


# ------------------------------------------------------------------------------------- turns for a notebook's cells

def load_ipython_extension(ipython: Any) -> None:
    """`%load_ext course_utils.gpu_lock` (or a kernel started with `--ext=course_utils.gpu_lock`, as the class's
    hub starts students' kernels): every cell holds this kernel's GPUs while it runs, so on a shared box no other
    student's timing cell, NCCL launch or grader runs on them meanwhile; a cell that has to wait says who holds them.
    Ranks a cell launches take no locks of their own (they run inside its turn)."""
    turns = _CellTurns(ipython)
    ipython.events.register("pre_run_cell", turns.before)
    ipython.events.register("post_run_cell", turns.after)
    ipython.user_ns.setdefault("_gpu_turns", turns)  # so `unload` finds it


def unload_ipython_extension(ipython: Any) -> None:
    turns = ipython.user_ns.pop("_gpu_turns", None)
    if turns is not None:
        turns.after()
        ipython.events.unregister("pre_run_cell", turns.before)
        ipython.events.unregister("post_run_cell", turns.after)


@dataclass
class _CellTurns:
    ipython: Any
    _held: contextlib.ExitStack | None = None

    def before(self, info: Any = None) -> None:
        if self._held is None:
            stack = contextlib.ExitStack()
            stack.enter_context(holding(visible_gpus(), f"a notebook cell of {_whoami()}"))
            self._held = stack

    def after(self, result: Any = None) -> None:
        held, self._held = self._held, None
        if held is not None:
            held.close()
