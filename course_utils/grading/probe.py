"""Run one exercise's probe in a sandboxed process of its own and bring back its result as bytes (grader side).

    outcome = run_probe(program, "ex99_add", checks.to_bytes(inputs),
                        checks_module="course_utils.checks.ring_allreduce", gpus=[], timeout=60)
    outcome.status   # "ok" (outcome.data: plain data), "not attempted", "error", "timeout", "no result"

Each probe is a fresh Python (probe_child.py) in bubblewrap (sandbox.py): nothing of an earlier request is in
its memory, and nothing it starts outlives it. Its answer is decoded here with `checks.from_bytes` (torch's
weights-only unpickler, after a check of the decoded size), so nothing the student wrote runs in the grader.
Whatever happens, the probe and everything it started are killed before run_probe returns, and its throwaway
folder is removed.
"""

from __future__ import annotations

import os
import pickle
import select
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import sandbox
from .probe_child import LEN, READY

MAX_RESULT_BYTES = 64 << 20
MAX_FILE_BYTES = 256 << 20  # any file a probe writes (its stderr too), so a flood cannot fill the disk
START_TIMEOUT = 300  # seconds for a probe's Python to start and import torch (a loaded machine is slow)


@dataclass
class ProbeOutcome:
    status: str  # ok | not attempted | error | timeout | no result
    data: Any = None
    message: str = ""
    seconds: float = 0.0


def _read(fd: int, n: int, deadline: float) -> tuple[bytes | None, str]:
    """Exactly n bytes from fd before `deadline`: (bytes, "") or (None, "timeout" | "eof")."""
    buf = bytearray()
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            return None, "timeout"
        chunk = os.read(fd, min(1 << 20, n - len(buf)))
        if not chunk:
            return None, "eof"
        buf += chunk
    return bytes(buf), ""


def _read_result(fd: int, deadline: float) -> tuple[bytes | None, str]:
    """The framed result: (payload, "") or (None, why not)."""
    head, why = _read(fd, LEN.size, deadline)
    if head is None:
        return None, why
    (n,) = LEN.unpack(head)
    if n > MAX_RESULT_BYTES:
        return None, f"its result is larger than {MAX_RESULT_BYTES >> 20} MiB"
    return _read(fd, n, deadline)


def _stderr_tail(path: Path, n: int = 1500) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def _start(box: sandbox.Sandbox, request: dict, write_fd: int, gpus: list[str], read_only: list[str],
           sandboxed: bool, stderr) -> subprocess.Popen:
    argv = [sys.executable, "-m", "course_utils.grading.probe_child", str(write_fd)]
    if sandboxed:
        environ = sandbox.env(box, ",".join(str(i) for i in range(len(gpus))))
        cmd, env = sandbox.command(box, argv, gpus=gpus, read_only=read_only, environ=environ), \
            {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
    else:  # --no-sandbox, for trusted work: the same process and environment, in our own namespaces
        cmd, env = argv, sandbox.env(box, ",".join(gpus))
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=stderr, env=env,
                            cwd=box.work, pass_fds=(write_fd,), start_new_session=True)
    try:
        proc.stdin.write(pickle.dumps(request))
        proc.stdin.close()
    except OSError:  # it died at once; its stderr says why
        pass
    return proc


def _kill(proc: subprocess.Popen) -> None:
    """The probe's process and, through --die-with-parent and its PID namespace, all it started."""
    if proc.poll() is None:  # not reaped yet, so its pid is still ours to signal
        sandbox.stop(proc.pid)
    proc.wait()


def run_probe(program: list[tuple[str, str]], grade_id: str, inputs: bytes, *, checks_module: str,
              gpus: list[str] = (), timeout: float, read_only: list[str] = (),
              sandboxed: bool = True) -> ProbeOutcome:
    """Start a probe for `grade_id` (its check registered by `checks_module`, a dotted name or a .py file) with
    `gpus` (ids as gpu_lock hands them out), wait at most `timeout` s for its result once it has started, kill
    it, decode the result. `read_only`: more files to mount (checks modules given by file)."""
    from course_utils import checks

    box = sandbox.Sandbox(prefix="course-probe-")
    read_fd, write_fd = os.pipe()
    request = {"grade_id": grade_id, "program": program, "inputs": inputs, "checks_module": checks_module,
               "max_file_bytes": MAX_FILE_BYTES}
    proc = raw = None
    seconds, code, why = 0.0, None, ""
    try:
        with open(box.root / "stderr.log", "wb") as err:
            proc = _start(box, request, write_fd, list(gpus), list(read_only), sandboxed, err)
        os.close(write_fd)
        write_fd = -1
        ready, why = _read(read_fd, len(READY), time.monotonic() + START_TIMEOUT)
        t0 = time.monotonic()
        if ready == READY:
            raw, why = _read_result(read_fd, t0 + timeout)
        elif ready is not None:
            why = "it did not start as a probe does"
        seconds = time.monotonic() - t0
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
        if proc is not None:
            if raw is None and why == "eof":  # it ended by itself: its exit code says how
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    pass
            _kill(proc)
            code = proc.returncode
        tail = _stderr_tail(box.root / "stderr.log")
        box.close()
    return _outcome(raw, why, code, tail, timeout, seconds, checks)


def _outcome(raw: bytes | None, why: str, code: int | None, tail: str, timeout: float, seconds: float,
             checks) -> ProbeOutcome:
    if raw is None:
        if why == "timeout":
            return ProbeOutcome("timeout", message=f"it ran past its time limit of {timeout:.3g} s and was stopped",
                                seconds=seconds)
        how = f"exit code {code}" if code is not None and code >= 0 else f"signal {-code}" if code else "unknown"
        msg = f"the process ended without a result ({how})" if why == "eof" else why
        return ProbeOutcome("no result", message=msg + (f"; its stderr ended with: {tail[-600:]}" if tail else ""),
                            seconds=seconds)
    try:
        result = checks.from_bytes(raw)
    except Exception as e:  # bytes that are not plain data: forged, truncated or too large once decoded
        return ProbeOutcome("error", message=f"its result could not be read as plain data ({type(e).__name__}: "
                            f"{str(e)[:200]})", seconds=seconds)
    status = result.get("status") if type(result) is dict else None
    if status == "ok" and "data" in result:
        return ProbeOutcome("ok", data=result["data"], seconds=seconds)
    if status in ("not attempted", "error") and type(result.get("message")) is str:
        return ProbeOutcome(status, message=result["message"], seconds=seconds)
    return ProbeOutcome("error", message="its result is not in the expected form", seconds=seconds)
