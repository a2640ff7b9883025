"""Run code on N worker processes with torchrun's environment, from a notebook cell.

    run(fn, *args, nproc=2)     one job: fresh workers, every rank's return value, nothing left behind
    Pool(nproc)                 workers and their process group kept alive across cells (%%ranks)
    run_code(source, nproc=2)   a cell's source on fresh workers (what %%torchrun does)
    run_cli(source, nproc=2)    the same cell through the real torchrun CLI (%%torchrun --cli)

How it avoids the usual pains (issue 3):
- Workers are fresh interpreters (`python -m course_utils._worker`), never forks, so CUDA state in the
  notebook cannot break them, and the notebook itself never initialises CUDA or a process group.
- The function travels by cloudpickle: one defined in the notebook is pickled by value.
- The parent hosts the rendezvous TCPStore on a socket it bound to 127.0.0.1:0 (an atomic free port),
  as torchrun's agent hosts its store; two notebooks launching at once cannot collide.
- One select() loop on the calling thread prints every rank's output live, prefixed by rank, so it
  lands in the executing cell, and collects results, errors and exits as they happen.
- Each worker leads its own session (killpg reaches whatever it started) and dies with the parent.
  A failure, a timeout or Ctrl-C stops every worker; no process, port or temporary file survives.
"""

from __future__ import annotations

import atexit
import os
import pickle
import re
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterable
from typing import Any

BACKENDS = ("auto", "nccl", "gloo")
_GRACE_AFTER_ERROR = 1.0  # seconds the other ranks get to report after one fails, before they are stopped
_EXIT_WAIT = 5.0  # seconds workers get to exit on their own once their work is done
_HEADER = struct.Struct(">Q")  # same framing as _worker.py
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _pythonpath() -> str:
    """PYTHONPATH for children: enough to import course_utils from a checkout, without ever putting
    site-packages ahead of the standard library (where PYTHONPATH entries go)."""
    import site

    installed = set(site.getsitepackages()) | {site.getusersitepackages()}
    parts = [] if _PACKAGE_PARENT in installed else [_PACKAGE_PARENT]
    return os.pathsep.join(parts + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))


class LaunchError(RuntimeError):
    """A launch went wrong: bad arguments are ValueError/TypeError, this is everything after."""


class WorkerError(LaunchError):
    """A rank failed. `rank` failed first; `traceback` is its remote traceback; `others` says, per rank,
    what happened to the rest; `exception` is the original exception when it could be sent back."""

    def __init__(self, rank: int, exc_type: str, message: str, traceback: str, others: dict[int, str],
                 exception: BaseException | None = None):
        self.rank, self.exc_type, self.traceback = rank, exc_type, traceback
        self.others, self.exception = others, exception
        self.stopped: list[int] = []  # ranks still running when it failed (then stopped)
        summary = f"{exc_type}: {message}" if message else exc_type
        lines = [f"rank {rank} failed first: {summary}", "", f"--- traceback from rank {rank} ---", traceback.rstrip()]
        if others:
            lines += ["", "--- the other ranks ---"] + [f"rank {r}: {s}" for r, s in sorted(others.items())]
        super().__init__("\n".join(lines))


class WorkerTimeout(LaunchError, TimeoutError):
    """The job ran past its timeout. `running` lists the ranks still running (all now stopped);
    `last_output` holds the last line each rank printed."""

    def __init__(self, timeout: float, running: list[int], last_output: dict[int, str]):
        self.timeout, self.running, self.last_output = timeout, running, last_output
        lines = [f"ranks {', '.join(map(str, running))} were still running after the {timeout:g} s timeout, "
                 "so every worker was stopped.",
                 "A hang like this is usually mismatched collectives or send/recv (one rank waits for a partner "
                 "that never comes); if the work is just slow, pass a larger timeout.",
                 "Last thing each rank printed:"]
        lines += [f"  rank {r}: {last_output.get(r) or '(nothing)'}" for r in sorted(last_output)]
        super().__init__("\n".join(lines))


def _add_note(err: BaseException, note: str) -> None:
    err.args = (f"{err.args[0]}\n\n{note}",) if err.args else (note,)


# ---- arguments and backend ---------------------------------------------------------------------------

_said: set[str] = set()


def _say_once(message: str) -> None:
    if message not in _said:
        _said.add(message)
        print(f"course_utils.launch: {message}", flush=True)


def _check_nproc(nproc: Any) -> int:
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"nproc must be a positive integer (the number of ranks), got {nproc!r}")
    return nproc


def _check_timeout(timeout: Any) -> float | None:
    if timeout is None:
        return None
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout must be a positive number of seconds (or None for no limit), got {timeout!r}")
    return float(timeout)


def _check_ranks(ranks: Iterable[int] | None, nproc: int) -> frozenset[int] | None:
    if ranks is None:
        return None
    chosen = frozenset(ranks)
    bad = sorted(r for r in chosen if not isinstance(r, int) or not 0 <= r < nproc)
    if bad:
        raise ValueError(f"ranks to show must be between 0 and {nproc - 1} (nproc={nproc}), got {bad}")
    return chosen


def pick_backend(backend: str = "auto", nproc: int = 2) -> str:
    """'auto' -> 'nccl' when there is one CUDA GPU per rank, else 'gloo' (saying so once).

    Counts GPUs with torch.cuda.device_count(), which asks NVML when it can, so the notebook's process
    does not create a CUDA context.
    """
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; choose one of {', '.join(map(repr, BACKENDS))}")
    nproc = _check_nproc(nproc)
    import torch
    import torch.distributed as dist

    gpus = torch.cuda.device_count()
    if backend == "gloo":
        return "gloo"
    if backend == "nccl":
        if gpus < nproc or not dist.is_nccl_available():
            why = "this PyTorch build has no NCCL" if not dist.is_nccl_available() else (
                f"nproc={nproc} ranks but this machine has {gpus} CUDA GPU{'s' if gpus != 1 else ''}")
            raise ValueError(f"backend='nccl' needs one CUDA GPU per rank: {why}. "
                             "Use backend='gloo' (CPU) or 'auto', or lower nproc.")
        return "nccl"
    if gpus >= nproc and dist.is_nccl_available():
        return "nccl"
    if gpus == 0:
        _say_once("no CUDA GPU here, so ranks run on the CPU with the gloo backend.")
    else:
        _say_once(f"{nproc} ranks but {gpus} GPU{'s' if gpus != 1 else ''} (NCCL needs one per rank), "
                  "so ranks run on the CPU with the gloo backend.")
    return "gloo"


def _pickle_call(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """Pickle fn(*args, **kwargs) for the workers, or say exactly which part cannot travel."""
    import cloudpickle

    if not callable(fn):
        raise TypeError(f"fn must be callable (a function to run on every rank), got {type(fn).__name__}")
    try:
        return cloudpickle.dumps(("fn", fn, args, kwargs, _cell_sources(fn)))
    except Exception as exc:
        parts = [("fn", fn)] + [(f"argument {i}", a) for i, a in enumerate(args)]
        parts += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
        culprit = "the call"
        for name, obj in parts:
            try:
                cloudpickle.dumps(obj)
            except Exception:
                culprit = name
                break
        raise TypeError(f"{culprit} cannot be sent to the workers ({type(exc).__name__}: {exc}). Everything travels "
                        "by cloudpickle: pass plain data (numbers, lists, tensors), and create things like open "
                        "files, locks or sockets inside fn.") from exc


def _cell_sources(fn: Callable) -> dict[str, list[str]]:
    """The notebook cell that defined fn (IPython keeps it in linecache), so worker tracebacks show code."""
    import linecache

    filename = getattr(getattr(fn, "__code__", None), "co_filename", "")
    entry = linecache.cache.get(filename)
    if not filename or entry is None or os.path.exists(filename):  # real files the workers can read themselves
        return {}
    return {filename: list(entry[2])}


# ---- output -------------------------------------------------------------------------------------------

_COLOURS = (34, 32, 35, 36, 33, 31, 94, 92, 95, 96, 93, 91)  # ANSI: blue, green, magenta, cyan, yellow, red, ...


def _use_colour() -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return _in_jupyter_kernel() or sys.stdout.isatty()


def _in_jupyter_kernel() -> bool:
    """True inside a Jupyter kernel (which renders ANSI colour), not merely when ipykernel was imported."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def _prefix(rank: int, width: int, colour: bool) -> str:
    text = f"[rank {rank:>{width}}]"
    return f"\033[{_COLOURS[rank % len(_COLOURS)]}m{text}\033[0m " if colour else f"{text} "


def _signal_name(code: int) -> str:
    try:
        return f" ({signal.Signals(-code).name})" if code < 0 else ""
    except ValueError:
        return ""


# ---- the worker group ---------------------------------------------------------------------------------


def _loopback_interface() -> str | None:
    try:
        return next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None)
    except OSError:
        return None


class _Rank:
    """One worker process and the parent's ends of its pipes."""

    def __init__(self, rank: int, proc: subprocess.Popen, cmd_fd: int, res_fd: int):
        self.rank, self.proc, self.cmd_fd, self.res_fd = rank, proc, cmd_fd, res_fd
        self.out_fd, self.err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        self.partial = {self.out_fd: b"", self.err_fd: b"", res_fd: b""}
        self.pending = b""  # command bytes not yet written
        self.close_after_write = False
        self.last_line = ""
        self.ready = False


class _Group:
    """N workers, the store they rendezvous on, and the select() loop that serves them."""

    def __init__(self, nproc: int, backend: str, ranks: frozenset[int] | None = None):
        import torch.distributed as dist

        if os.name != "posix":  # process groups, pass_fds and killpg are POSIX
            raise LaunchError("course_utils.launch needs Linux or macOS; on Windows use WSL2")

        self.nproc, self.backend, self.show = nproc, backend, ranks
        self.colour, self.width = _use_colour(), len(str(nproc - 1))
        self.seq = 0
        self.ranks: list[_Rank] = []
        self.sel = selectors.DefaultSelector()
        # Bind 127.0.0.1:0 ourselves and hand the socket to the store: the port is free by construction
        # and nothing listens beyond loopback. The store owns the fd from here on.
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(128)
        self.port = sock.getsockname()[1]
        self.store = dist.TCPStore("127.0.0.1", self.port, world_size=nproc + 1, is_master=True,
                                   wait_for_workers=False, master_listen_fd=sock.detach(), use_libuv=True)
        try:
            env = self._environment()
            for rank in range(nproc):
                self._spawn(rank, env)
        except BaseException:
            self.kill()
            raise

    def _environment(self) -> dict[str, str]:
        n = str(self.nproc)
        env = dict(os.environ)
        env.update({
            # torchrun's contract, as torch.distributed.elastic's LocalElasticAgent sets it
            "WORLD_SIZE": n, "LOCAL_WORLD_SIZE": n, "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default", "ROLE_WORLD_SIZE": n, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(self.port),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": f"course-{uuid.uuid4().hex[:12]}",
            "TORCHELASTIC_USE_AGENT_STORE": "True",  # workers join the store we host, as under torchrun's agent
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
            # ours
            "PYTHONUNBUFFERED": "1",  # live output
            "PYTHONPATH": _pythonpath(),
            "COURSE_LAUNCH_PARENT": str(os.getpid()),
            # PR_SET_PDEATHSIG follows the launching *thread*; only the main thread lives as long as the process.
            "COURSE_LAUNCH_PDEATHSIG": "1" if threading.current_thread() is threading.main_thread() else "0",
            "COURSE_LAUNCH_BACKEND": self.backend,
            "COURSE_LAUNCH_SYSPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)),
        })
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default too: N ranks must not oversubscribe the cores
        loopback = _loopback_interface()
        if self.backend == "gloo" and loopback:
            env.setdefault("GLOO_SOCKET_IFNAME", loopback)  # gloo must not pick an interface that goes nowhere
        return env

    def _spawn(self, rank: int, env: dict[str, str]) -> None:
        cmd_r, cmd_w = os.pipe()
        res_r, res_w = os.pipe()
        try:
            env = dict(env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank),
                       COURSE_LAUNCH_CMD_FD=str(cmd_r), COURSE_LAUNCH_RESULT_FD=str(res_w))
            proc = subprocess.Popen([sys.executable, "-m", "course_utils._worker"], env=env, pass_fds=(cmd_r, res_w),
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    start_new_session=True)
        except BaseException:
            for fd in (cmd_r, cmd_w, res_r, res_w):
                os.close(fd)
            raise
        os.close(cmd_r)
        os.close(res_w)
        r = _Rank(rank, proc, cmd_w, res_r)
        self.ranks.append(r)
        for fd in (r.out_fd, r.err_fd, r.res_fd):
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ, r)
        os.set_blocking(cmd_w, False)

    # -- sending -------------------------------------------------------------------------------------

    def send(self, payload: bytes, close: bool = False) -> int:
        """Queue one call for every rank; close=True closes the command pipes after it (one-shot jobs)."""
        self.seq += 1
        body = pickle.dumps(("call", self.seq, payload), protocol=pickle.HIGHEST_PROTOCOL)
        frame = _HEADER.pack(len(body)) + body
        for r in self.ranks:
            if r.cmd_fd is None:
                continue
            r.pending += frame
            r.close_after_write = close
            self._write_some(r)
            if r.cmd_fd is not None and r.pending:
                self.sel.register(r.cmd_fd, selectors.EVENT_WRITE, r)
        return self.seq

    def _write_some(self, r: _Rank) -> None:
        try:
            while r.pending:
                r.pending = r.pending[os.write(r.cmd_fd, r.pending):]
        except BlockingIOError:
            return  # pipe full: the select loop finishes the write
        except BrokenPipeError:
            r.pending = b""  # the worker is gone; its exit is noticed by the loop
        if r.close_after_write or not r.pending:
            if r.cmd_fd in self.sel.get_map():
                self.sel.unregister(r.cmd_fd)
            if r.close_after_write:
                os.close(r.cmd_fd)
                r.cmd_fd = None

    # -- receiving -----------------------------------------------------------------------------------

    def pump(self, timeout: float) -> list[tuple[_Rank, tuple]]:
        """Wait up to `timeout` s, print whatever output arrived, and return the messages that arrived."""
        messages: list[tuple[_Rank, tuple]] = []
        if not self.sel.get_map():
            time.sleep(timeout)
            return messages
        for key, events in self.sel.select(timeout):
            r = key.data
            if events & selectors.EVENT_WRITE:
                self._write_some(r)
            else:
                self._read_some(r, key.fd, messages)
        sys.stdout.flush()
        return messages

    def drain(self, r: _Rank) -> list[tuple[_Rank, tuple]]:
        """Read everything rank r has written so far (its process may have exited)."""
        messages: list[tuple[_Rank, tuple]] = []
        for fd in (r.out_fd, r.err_fd, r.res_fd):
            while fd in self.sel.get_map() and self._read_some(r, fd, messages):
                pass
        sys.stdout.flush()
        return messages

    def _read_some(self, r: _Rank, fd: int, messages: list) -> bool:
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not data:  # EOF: the worker closed it (or died)
            self.sel.unregister(fd)
            if fd == r.res_fd:
                os.close(fd)
            elif r.partial[fd]:
                self._print(r, fd, r.partial[fd])
            r.partial[fd] = b""
            return False
        buf = r.partial[fd] + data
        if fd == r.res_fd:
            while len(buf) >= _HEADER.size:
                (n,) = _HEADER.unpack_from(buf)
                if len(buf) < _HEADER.size + n:
                    break
                messages.append((r, pickle.loads(buf[_HEADER.size:_HEADER.size + n])))
                buf = buf[_HEADER.size + n:]
        else:
            *lines, buf = buf.split(b"\n")
            for line in lines:
                self._print(r, fd, line)
        r.partial[fd] = buf
        return True

    def _print(self, r: _Rank, fd: int, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        if line.strip():
            r.last_line = line
        if self.show is None or r.rank in self.show:
            stream = sys.stdout if fd == r.out_fd else sys.stderr
            print(_prefix(r.rank, self.width, self.colour) + line, file=stream)

    def flush_partial_lines(self) -> None:
        for r in self.ranks:
            for fd in (r.out_fd, r.err_fd):
                if r.partial[fd]:
                    self._print(r, fd, r.partial[fd])
                    r.partial[fd] = b""
        sys.stdout.flush()

    # -- waiting -------------------------------------------------------------------------------------

    def wait(self, seq: int | None, deadline: float | None, timeout: float | None) -> dict[int, Any]:
        """Wait until every rank has answered call `seq` (seq=None: until every rank is ready).

        Returns {rank: value}. Raises WorkerError once a rank fails (after giving the others a moment to
        report), WorkerTimeout at the deadline. Stopping the workers is the caller's job.
        """
        __tracebackhide__ = True  # IPython and pytest skip this frame: the remote traceback is the story
        import cloudpickle

        waiting = set(range(self.nproc))
        results: dict[int, Any] = {}
        failures: dict[int, dict] = {}  # rank -> error info (from the worker, or made here)
        give_up_at = None

        def handle(batch):
            for r, msg in batch:
                kind = msg[0]
                if kind == "ready":
                    r.ready = True
                    if seq is None:
                        waiting.discard(r.rank)
                elif msg[1] is None or msg[1] == seq:  # None: it failed while starting
                    if kind == "error":
                        failures[r.rank] = msg[2]
                    else:
                        try:
                            results[r.rank] = cloudpickle.loads(msg[2])
                        except Exception as exc:
                            failures[r.rank] = _local_error(f"rank {r.rank}'s result could not be unpickled here", exc)
                    waiting.discard(r.rank)

        while waiting:
            now = time.monotonic()
            if give_up_at is not None and now >= give_up_at:
                break
            if deadline is not None and now >= deadline:
                self.flush_partial_lines()
                raise WorkerTimeout(timeout, sorted(waiting), {r.rank: r.last_line for r in self.ranks})
            limit = min(x for x in (0.1, give_up_at and give_up_at - now, deadline and deadline - now) if x)
            handle(self.pump(max(limit, 0.0)))
            for r in self.ranks:
                if r.rank in waiting and r.proc.poll() is not None:
                    handle(self.drain(r))  # its last words may still be in the pipe
                    if r.rank in waiting:
                        code = r.proc.returncode
                        failures[r.rank] = {"type": "WorkerExited", "silent": True, "time": 0.0,
                                            "message": f"rank {r.rank} exited with code {code}{_signal_name(code)} "
                                                       "without reporting a Python error",
                                            "traceback": f"(no traceback: the process ended; last output: "
                                                         f"{r.last_line or 'nothing'})"}
                        waiting.discard(r.rank)
            if failures and give_up_at is None:
                give_up_at = time.monotonic() + _GRACE_AFTER_ERROR
        if failures:
            self.flush_partial_lines()
            raise self._worker_error(failures, results, waiting)
        return results

    def _worker_error(self, failures: dict[int, dict], results: dict[int, Any], running: set[int]) -> WorkerError:
        # A process that died silently is usually the cause, and the others' errors its consequences;
        # otherwise the earliest error (workers stamp the time they caught it) came first.
        first = min(failures, key=lambda k: (not failures[k].get("silent"), failures[k].get("time", 0.0), k))
        info = failures[first]
        others = {}
        for r in self.ranks:
            if r.rank == first:
                continue
            if r.rank in failures:
                other = failures[r.rank]
                others[r.rank] = f"also failed: {other['type']}: {_first_line(other['message'])}"
            elif r.rank in results:
                others[r.rank] = "finished normally"
            elif r.rank in running:
                others[r.rank] = f"was still running and has been stopped (last output: {r.last_line or 'nothing'})"
        exception = None
        if info.get("exception"):
            try:
                exception = pickle.loads(info["exception"])
            except Exception:
                pass  # the class may not exist here; the traceback text says it all
        err = WorkerError(first, info["type"], info["message"], info["traceback"], others, exception)
        err.stopped = sorted(running)
        return err

    # -- ending --------------------------------------------------------------------------------------

    def finish(self, deadline: float | None) -> None:
        """Let the workers exit on their own (their command pipes are closed), printing what they print."""
        end = time.monotonic() + _EXIT_WAIT
        if deadline is not None:
            end = min(end, max(deadline, time.monotonic() + 0.5))
        while time.monotonic() < end and any(r.proc.poll() is None for r in self.ranks):
            self.pump(0.02)
        self.kill()

    def kill(self) -> None:
        """Stop every worker and whatever it started, reap them, and release pipes and the store's port."""
        for r in self.ranks:
            try:
                os.killpg(r.proc.pid, signal.SIGKILL)  # each worker leads its own session: pgid == pid
            except (ProcessLookupError, PermissionError):
                pass
        for r in self.ranks:
            r.proc.wait()
        for r in self.ranks:
            self.drain(r)  # print what they said before they went
        self.flush_partial_lines()
        for r in self.ranks:
            for fd in (r.cmd_fd, r.res_fd):
                if fd is not None and fd in self.sel.get_map():
                    self.sel.unregister(fd)
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
            r.cmd_fd = None
            for f in (r.proc.stdout, r.proc.stderr):
                if f.fileno() in self.sel.get_map():
                    self.sel.unregister(f.fileno())
                f.close()
        self.ranks = []
        self.sel.close()
        self.store = None  # closes the listening socket

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self.ranks]


def _first_line(text: str) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def _local_error(message: str, exc: BaseException) -> dict:
    import traceback

    return {"type": type(exc).__name__, "message": f"{message}: {exc}", "time": time.time(),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}


def _deadline(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout


# ---- one-shot jobs ------------------------------------------------------------------------------------


def _one_shot(payload: bytes, nproc: int, backend: str, timeout: float | None,
              ranks: frozenset[int] | None) -> dict[int, Any]:
    __tracebackhide__ = True
    deadline = _deadline(timeout)
    group = _Group(nproc, backend, ranks)
    try:
        seq = group.send(payload, close=True)
        results = group.wait(seq, deadline, timeout)
        group.finish(deadline)
        return dict(sorted(results.items()))
    finally:
        group.kill()  # after an error, a timeout or Ctrl-C: nothing may outlive the call


def run(fn: Callable, *args: Any, nproc: int = 2, backend: str = "auto", timeout: float | None = 120.0,
        **kwargs: Any) -> dict[int, Any]:
    """Run fn(*args, **kwargs) on `nproc` fresh ranks and return {rank: return value} (tensors on the CPU).

    Each rank gets torchrun's environment and an initialised default process group (destroyed at the end).
    fn may be defined in the notebook. `nproc`, `backend` and `timeout` are this function's own keywords;
    to pass arguments with those names to fn, use functools.partial.
    Raises WorkerError (a rank failed) or WorkerTimeout; either way no worker is left running.
    """
    __tracebackhide__ = True
    nproc, timeout = _check_nproc(nproc), _check_timeout(timeout)
    payload = _pickle_call(fn, args, kwargs)
    return _one_shot(payload, nproc, pick_backend(backend, nproc), timeout, None)


def _code_payload(source: str, filename: str) -> bytes:
    import cloudpickle

    if not isinstance(source, str):
        raise TypeError(f"source must be a string of Python code, got {type(source).__name__}")
    compile(source, filename, "exec")  # a syntax error is reported here, before any process starts
    return cloudpickle.dumps(("code", source, filename))


def run_code(source: str, nproc: int = 2, backend: str = "auto", timeout: float | None = 120.0,
             ranks: Iterable[int] | None = None, filename: str = "<torchrun cell>") -> dict[int, Any]:
    """Run a cell's source on `nproc` fresh ranks (what %%torchrun does); `ranks` limits whose output shows.

    `torch`, `dist` and `os` are predefined, as in the --cli script. Returns {rank: value of the cell's last
    expression} (None where the cell does not end with an expression).
    """
    __tracebackhide__ = True
    nproc, timeout = _check_nproc(nproc), _check_timeout(timeout)
    show = _check_ranks(ranks, nproc)
    payload = _code_payload(source, filename)
    return _one_shot(payload, nproc, pick_backend(backend, nproc), timeout, show)


# ---- a pool of workers kept alive ---------------------------------------------------------------------

_pools: weakref.WeakSet = weakref.WeakSet()
_current: Pool | None = None


def current_pool() -> Pool | None:
    """The most recently started Pool that is still open (the one %%ranks uses)."""
    return _current if _current is not None and not _current.closed else None


class Pool:
    """`nproc` workers and their process group, kept alive across cells.

        with Pool(4) as pool:
            pool.run(fn, x)          # {rank: fn(x)}, like run() but without the start-up cost
            pool.exec("y = rank")    # run source in each rank's persistent namespace (what %%ranks does)

    A failure that leaves ranks out of step (some still running), a timeout or Ctrl-C shuts the pool down:
    its process group could not be trusted any more. Create a new one.
    """

    def __init__(self, nproc: int = 2, backend: str = "auto", timeout: float | None = 120.0,
                 ranks: Iterable[int] | None = None):
        global _current
        self.nproc = _check_nproc(nproc)
        timeout = _check_timeout(timeout)
        self.show = _check_ranks(ranks, self.nproc)
        self.backend = pick_backend(backend, self.nproc)
        self._group: _Group | None = _Group(self.nproc, self.backend, self.show)
        try:
            self._group.wait(None, _deadline(timeout), timeout)  # start-up errors show here, not at first use
        except BaseException:
            self._group.kill()
            self._group = None
            raise
        _pools.add(self)
        _current = self

    @property
    def closed(self) -> bool:
        return self._group is None

    @property
    def pids(self) -> list[int]:
        """Worker process ids, by rank."""
        return self._group.pids if self._group else []

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pids {self.pids}"
        return f"Pool(nproc={self.nproc}, backend={self.backend!r}, {state})"

    def run(self, fn: Callable, *args: Any, timeout: float | None = 120.0, **kwargs: Any) -> dict[int, Any]:
        """fn(*args, **kwargs) on every rank of the pool; returns {rank: return value} (tensors on the CPU)."""
        __tracebackhide__ = True
        timeout = _check_timeout(timeout)
        return self._call(_pickle_call(fn, args, kwargs), timeout, self.show)

    def exec(self, source: str, timeout: float | None = 120.0, ranks: Iterable[int] | None = None,
             filename: str = "<ranks cell>") -> dict[int, Any]:
        """Run source in each rank's own namespace, which persists between calls; returns {rank: value of
        the last expression}. `torch`, `dist` and `os` are predefined."""
        __tracebackhide__ = True
        timeout = _check_timeout(timeout)
        show = _check_ranks(ranks, self.nproc) if ranks is not None else self.show
        return self._call(_code_payload(source, filename), timeout, show)

    def _call(self, payload: bytes, timeout: float | None, show: frozenset[int] | None) -> dict[int, Any]:
        __tracebackhide__ = True
        if self._group is None:
            raise LaunchError("this Pool is closed; create a new one with Pool(nproc)")
        group = self._group
        group.show = show
        try:
            results = group.wait(group.send(payload), _deadline(timeout), timeout)
        except WorkerError as err:
            if err.stopped or any(r.proc.poll() is not None for r in group.ranks):
                self._kill()
                _add_note(err, "The pool has been shut down because its ranks were no longer in step; "
                               "create a new Pool.")
            raise
        except BaseException as err:  # a timeout or Ctrl-C: some ranks are stuck somewhere
            self._kill()
            if isinstance(err, WorkerTimeout):
                _add_note(err, "The pool has been shut down; create a new Pool.")
            raise
        finally:
            group.show = self.show
            group.flush_partial_lines()
        return dict(sorted(results.items()))

    def close(self) -> None:
        """End the workers (after destroying their process group) and free everything they held."""
        global _current
        group, self._group = self._group, None
        if _current is self:
            _current = None
        if group is not None:
            for r in group.ranks:  # closing the command pipe asks the worker to finish and exit
                if r.cmd_fd is not None:
                    r.close_after_write = True
                    group._write_some(r)
            group.finish(None)

    def _kill(self) -> None:
        """Stop the workers at once (they may be stuck in a collective): no goodbye, no waiting."""
        global _current
        group, self._group = self._group, None
        if _current is self:
            _current = None
        if group is not None:
            group.kill()

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_group", None) is not None:
            self._group.kill()


@atexit.register
def _close_pools() -> None:
    for pool in list(_pools):
        if pool._group is not None:
            pool._group.kill()


# ---- the real torchrun CLI ----------------------------------------------------------------------------

_CLI_PREAMBLE = '''\
# A %%torchrun --cli cell as a script, run by the real torchrun CLI: the same code, the production path.
import os

import torch
import torch.distributed as dist

backend = {backend!r}
if backend == "nccl":
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group(backend)
# ---- the cell ----
'''
_CLI_POSTAMBLE = "\n# ---- end of the cell ----\ndist.destroy_process_group()\n"
_TORCHRUN_PREFIX = re.compile(r"^\[default(\d+)\]:")


def _descendants(pid: int) -> list[int]:
    """Every process below pid (Linux /proc; torchrun puts its workers in sessions of their own)."""
    children: dict[int, list[int]] = {}
    try:
        entries = [e for e in os.listdir("/proc") if e.isdigit()]
    except OSError:
        return []
    for entry in entries:
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def cli_command(script: str, nproc: int, ranks: frozenset[int] | None = None, log_dir: str | None = None) -> list[str]:
    """The torchrun command line that %%torchrun --cli runs (python -m torch.distributed.run is torchrun)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--tee=3"]
    if log_dir:
        cmd.append(f"--log-dir={log_dir}")
    if ranks is not None:
        cmd.append(f"--local-ranks-filter={','.join(map(str, sorted(ranks)))}")
    return cmd + [script]


def run_cli(source: str, nproc: int = 2, backend: str = "auto", timeout: float | None = 120.0,
            ranks: Iterable[int] | None = None) -> None:
    """Run a cell's source through the real torchrun CLI (%%torchrun --cli), streaming its output here.

    The cell is written, after a preamble that initialises the process group, to a script in a private
    temporary directory (removed afterwards). Raises LaunchError if torchrun fails, WorkerTimeout at the timeout.
    """
    __tracebackhide__ = True
    nproc, timeout = _check_nproc(nproc), _check_timeout(timeout)
    show = _check_ranks(ranks, nproc)
    _code_payload(source, "<torchrun cell>")
    backend = pick_backend(backend, nproc)
    tmp = tempfile.mkdtemp(prefix="course-torchrun-")
    proc = None
    try:
        script = os.path.join(tmp, "cell.py")
        with open(script, "w") as f:
            f.write(_CLI_PREAMBLE.format(backend=backend) + source + _CLI_POSTAMBLE)
        cmd = cli_command(script, nproc, show, os.path.join(tmp, "logs"))
        print("$ torchrun " + " ".join(cmd[3:]), flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=tmp)  # anything torchrun writes lands in tmp
        env["PYTHONPATH"] = _pythonpath()
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        last = _stream_cli(proc, _deadline(timeout), _use_colour(), len(str(nproc - 1)))
        if proc.returncode is None:
            raise WorkerTimeout(timeout, [r for r in range(nproc) if show is None or r in show] or list(range(nproc)),
                                last)
        if proc.returncode != 0:
            raise LaunchError(f"torchrun exited with code {proc.returncode}{_signal_name(proc.returncode)}; "
                              "its report is above")
    finally:
        if proc is not None:
            for pid in _descendants(proc.pid) + [proc.pid]:
                for kill in (os.killpg, os.kill):
                    try:
                        kill(pid, signal.SIGKILL)
                    except (ProcessLookupError, PermissionError):
                        pass
            proc.wait()
            proc.stdout.close()
            proc.stderr.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _stream_cli(proc: subprocess.Popen, deadline: float | None, colour: bool, width: int) -> dict[int, str]:
    """Print torchrun's output live, recolouring its [defaultN]: prefixes; return each rank's last line."""
    sel = selectors.DefaultSelector()
    partial: dict[int, bytes] = {}
    last: dict[int, str] = {}
    for f in (proc.stdout, proc.stderr):
        os.set_blocking(f.fileno(), False)
        sel.register(f.fileno(), selectors.EVENT_READ, sys.stdout if f is proc.stdout else sys.stderr)
        partial[f.fileno()] = b""

    def emit(raw: bytes, stream) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        m = _TORCHRUN_PREFIX.match(line)
        if m:
            rank = int(m.group(1))
            line = _prefix(rank, width, colour) + line[m.end():]
            last[rank] = line
        print(line, file=stream)

    try:
        while sel.get_map():
            if deadline is not None and time.monotonic() >= deadline:
                return last
            wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic()))
            for key, _ in sel.select(wait):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    sel.unregister(key.fd)
                    if partial[key.fd]:
                        emit(partial[key.fd], key.data)
                    continue
                *lines, partial[key.fd] = (partial[key.fd] + data).split(b"\n")
                for line in lines:
                    emit(line, key.data)
            sys.stdout.flush()
        proc.wait()
        return last
    finally:
        sel.close()
