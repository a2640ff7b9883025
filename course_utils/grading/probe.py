"""Run one exercise's probe in a throwaway process and bring back its result as bytes (grader side).

    server = ProbeServer(checks_modules)      # starts probe_server.py once (it loads torch and the checks)
    outcome = run_probe(server, program, "ex99_add", checks.to_bytes(inputs), cuda_visible_devices="",
                        timeout=60)
    outcome.status   # "ok" (outcome.data: plain data), "not attempted", "error", "timeout", "no result"
    server.close()

The probe's answer is decoded here with `checks.from_bytes` (torch's weights-only unpickler), so nothing the
student wrote runs in the grader. Whatever happens, the probe and everything it started are killed before
run_probe returns, and its throwaway folder is removed.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from itertools import count
from pathlib import Path
from typing import Any

from . import sandbox
from .probe_server import _LEN, CHECKS_MODULES_ENV, recv_exact

MAX_RESULT_BYTES = 64 << 20
MAX_FILE_BYTES = 256 << 20  # any file a probe writes (its stderr too), so a flood cannot fill the disk


class ProbeServerError(RuntimeError):
    """The probe server could not start or answer (a grader problem, not the student's)."""


@dataclass
class ProbeOutcome:
    status: str  # ok | not attempted | error | timeout | no result
    data: Any = None
    message: str = ""
    seconds: float = 0.0


class ProbeServer:
    """The process that forks probes (see probe_server.py); restarted if it dies."""

    def __init__(self, checks_modules: list[str] | tuple[str, ...] = (), start_timeout: float = 300):
        self.checks_modules = list(checks_modules)
        self.start_timeout = start_timeout
        self._lock = threading.Lock()  # one request on the socket at a time
        self._cond = threading.Condition()
        self._jobs = count()
        self.proc: subprocess.Popen | None = None
        self.info: dict = {}
        self._start()  # returns at once: the server loads torch while the grader does its own work

    # The reader thread fills these; guarded by _cond.
    def _reset_state(self) -> None:
        self._started: dict[int, tuple[str, Any]] = {}
        self._exited: dict[int, int] = {}
        self._ready = False
        self._dead = False

    def _start(self) -> None:
        self._reset_state()
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = dict(os.environ)
        env[CHECKS_MODULES_ENV] = os.pathsep.join(self.checks_modules)
        env["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # torch.cuda.is_available() at import must not init CUDA
        env.setdefault("MPLBACKEND", "Agg")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "course_utils.grading.probe_server", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                start_new_session=True)
        finally:
            theirs.close()
        self.sock = ours
        self._reader = threading.Thread(target=self._read, args=(ours,), daemon=True, name="probe-server-reader")
        self._reader.start()

    def wait_ready(self) -> dict:
        """Block until the server has loaded torch and the checks; returns its info (pid, errors, landlock)."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._ready or self._dead, self.start_timeout):
                self.close()
                raise ProbeServerError(f"the probe server did not start within {self.start_timeout:g} s")
            if self._dead:
                raise ProbeServerError("the probe server exited while starting (its error is on stderr above)")
            return self.info

    def _read(self, sock: socket.socket) -> None:
        while True:
            fds: list[int] = []
            try:
                head, fds, _, _ = socket.recv_fds(sock, _LEN.size, 1)
                if head and len(head) < _LEN.size:
                    head += recv_exact(sock, _LEN.size - len(head)) or b""
                body = recv_exact(sock, _LEN.unpack(head)[0]) if len(head) == _LEN.size else None
            except OSError:
                body = None
            with self._cond:
                if body is None:
                    self._dead = True
                    self._cond.notify_all()
                    return
                import pickle

                msg = pickle.loads(body)  # from our own server process, which runs no student code
                if msg[0] == "ready":
                    self.info, self._ready = msg[1], True
                    for err in self.info.get("errors", []):
                        print(f"grade: warning: the probe server could not import a checks module: {err}",
                              file=sys.stderr)
                    if self.info.get("cuda_initialized"):
                        print("grade: warning: CUDA was initialised in the probe server; GPU probes may fail",
                              file=sys.stderr)
                elif msg[0] in ("started", "failed"):
                    self._started[msg[1]] = (msg[0], msg[2], fds[0] if fds else None)
                    fds = []
                elif msg[0] == "exited":
                    self._exited[msg[1]] = msg[2]
                self._cond.notify_all()
            for fd in fds:  # attached to a message that does not carry one
                os.close(fd)

    @property
    def alive(self) -> bool:
        return not self._dead and self.proc is not None and self.proc.poll() is None

    def fork(self, request: dict, result_fd: int, timeout: float = 60) -> tuple[int, int | None]:
        """Ask for one probe process; returns its pid and a pidfd (None before Linux 5.3). The server gets a
        copy of `result_fd`."""
        with self._lock:
            if not self.alive:  # killed (a probe without Landlock's signal scope can do that) or crashed
                self.close()
                self._start()
            self.wait_ready()
            job = next(self._jobs)
            request = {**request, "job": job}
            import pickle

            body = pickle.dumps(request)
            try:
                socket.send_fds(self.sock, [b"R" + _LEN.pack(len(body))], [result_fd])
                self.sock.sendall(body)
            except OSError as e:
                raise ProbeServerError(f"cannot reach the probe server: {e}") from e
            with self._cond:
                if not self._cond.wait_for(lambda: job in self._started or self._dead, timeout):
                    raise ProbeServerError("the probe server did not start a probe in time")
                if job not in self._started:
                    raise ProbeServerError("the probe server died")
                kind, value, pidfd = self._started.pop(job)
            if kind == "failed":
                raise ProbeServerError(f"the probe server could not start a probe: {value}")
            return value, pidfd

    def wait_exit(self, pid: int, timeout: float) -> int | None:
        """The probe's exit code once the server has reaped it (None: not within `timeout`)."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exited or self._dead, timeout)
            return self._exited.pop(pid, None)


    def close(self) -> None:
        """Stop the server and every probe it forked."""
        proc, self.proc = self.proc, None
        if proc is not None:
            sandbox.kill_tree(proc.pid)
            proc.wait()
        try:
            self.sock.close()
        except Exception:  # already closed
            pass
        with self._cond:
            self._dead = True
            self._cond.notify_all()

    def __enter__(self) -> ProbeServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _read_result(fd: int, deadline: float) -> tuple[bytes | None, str]:
    """The framed result from the probe's pipe: (payload, "") or (None, why not)."""
    buf = bytearray()
    need = _LEN.size
    while len(buf) < need:
        left = deadline - time.monotonic()
        if left <= 0:
            return None, "timeout"
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            return None, "timeout"
        chunk = os.read(fd, min(1 << 20, need - len(buf)))
        if not chunk:
            return None, "eof"
        buf += chunk
        if need == _LEN.size and len(buf) == _LEN.size:
            (n,) = _LEN.unpack(bytes(buf))
            if n > MAX_RESULT_BYTES:
                return None, f"its result is larger than {MAX_RESULT_BYTES >> 20} MiB"
            need += n
    return bytes(buf[_LEN.size:]), ""


def _kill_probe(pid: int, pidfd: int | None) -> None:
    """Kill a probe and all it started. Through its pidfd: if it already ended, the server killed what it
    left (its pid may belong to someone else by now); else it is stopped first, which keeps its pid ours
    while its descendants are found and killed."""
    if pidfd is None:  # Linux < 5.3: the small risk of a reused pid
        sandbox.kill_tree(pid)
        return
    try:
        if select.select([pidfd], [], [], 0)[0]:
            return  # ended: readable pidfd
        signal.pidfd_send_signal(pidfd, signal.SIGSTOP)
        if not select.select([pidfd], [], [], 0)[0]:
            sandbox.kill_tree(pid)
        signal.pidfd_send_signal(pidfd, signal.SIGKILL)
    except ProcessLookupError:
        pass
    finally:
        os.close(pidfd)


def _stderr_tail(root: Path, n: int = 1500) -> str:
    try:
        with open(root / "stderr.log", "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode("utf-8", "replace").strip()
    except OSError:
        return ""


def run_probe(server: ProbeServer, program: list[tuple[str, str]], grade_id: str, inputs: bytes, *,
              cuda_visible_devices: str, timeout: float, landlock: bool = True,
              hide: list[str] | tuple[str, ...] = ()) -> ProbeOutcome:
    """Fork a probe for `grade_id`, wait at most `timeout` s for its result, kill it, decode the result.

    The probe may write only in its own folder (and /dev, /proc), and may not read beneath `hide` (landlock=False:
    no fence, for tests of what happens on kernels without Landlock)."""
    from course_utils import checks

    box = sandbox.Sandbox(prefix="course-probe-")
    read_fd, write_fd = os.pipe()
    pid = pidfd = None
    code = None
    try:
        request = {"grade_id": grade_id, "program": program, "inputs": inputs, "sandbox": str(box.root),
                   "cuda_visible_devices": cuda_visible_devices, "max_file_bytes": MAX_FILE_BYTES,
                   "landlock": landlock, "hide": list(hide)}
        try:
            pid, pidfd = server.fork(request, write_fd)
        finally:
            os.close(write_fd)
        t0 = time.monotonic()  # after the fork: a server still loading is not the probe's time
        raw, why = _read_result(read_fd, t0 + timeout)
        seconds = time.monotonic() - t0
    finally:
        os.close(read_fd)
        if pid is not None:
            _kill_probe(pid, pidfd)
            code = server.wait_exit(pid, 10)
        tail = _stderr_tail(box.root)
        box.close()
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
    except Exception as e:  # bytes that are not plain data: forged or truncated
        return ProbeOutcome("error", message=f"its result could not be read as plain data ({type(e).__name__})",
                            seconds=seconds)
    status = result.get("status") if type(result) is dict else None
    if status == "ok" and "data" in result:
        return ProbeOutcome("ok", data=result["data"], seconds=seconds)
    if status in ("not attempted", "error") and type(result.get("message")) is str:
        return ProbeOutcome(status, message=result["message"], seconds=seconds)
    return ProbeOutcome("error", message="its result is not in the expected form", seconds=seconds)
