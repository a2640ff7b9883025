"""Looking at and stopping child processes without ever signalling a pid that may have been reused.

A child's pid stays reserved until its parent reaps it (wait). So: check for exit with WNOWAIT (which
leaves the child a zombie, its pid still ours), signal only children not yet reaped, and reap last.
"""

from __future__ import annotations

import os
import signal
import subprocess


def exit_code(proc: subprocess.Popen) -> int | None:
    """The child's exit code (negative: killed by that signal) without reaping it; None while it runs."""
    if proc.returncode is not None:
        return proc.returncode
    if not isinstance(proc, subprocess.Popen):  # a rank of a fork server (forkserver.py): the server knows
        return proc.poll()
    try:
        return pid_exit_code(proc.pid)
    except ChildProcessError:  # reaped elsewhere (cannot happen for our own Popen objects; be safe)
        return proc.poll()
    except AttributeError:  # no waitid on this platform: poll reaps, and signalling stops once it has
        return proc.poll()


def pid_exit_code(pid: int) -> int | None:
    """Child pid's exit code without reaping it (negative: killed by that signal); None while it runs."""
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
    if info is None:
        return None
    return info.si_status if info.si_code == os.CLD_EXITED else -info.si_status


def kill_group(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
    """Signal the process group proc leads (start_new_session=True), only while proc is not reaped."""
    if proc.returncode is not None:
        return  # reaped: its pid (and so its group id) may belong to someone else now
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def children(pid: int) -> list[int]:
    """The direct children of pid (Linux /proc). Only meaningful while pid cannot reap them (stopped)."""
    found: list[int] = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                found += [int(c) for c in f.read().split()]
        return found
    except OSError:
        pass
    for entry in (e for e in os.listdir("/proc") if e.isdigit()) if os.path.isdir("/proc") else ():
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return found
