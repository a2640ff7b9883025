"""A group of worker processes: start them, serve them from one select() loop, stop them.

The parent hosts the rendezvous TCPStore on a socket it bound to 127.0.0.1:0 (a free port by construction,
as torchrun's agent hosts its store), starts each rank as a fresh interpreter leading its own session, and
talks to it over three private pipes (commands in; results, errors and stack dumps out) besides its stdout
and stderr, which are printed live, prefixed by rank, in the calling cell.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import subprocess
import sys
import time
import traceback
from typing import Any

from . import procs, stacks
from .env import group_environment, rank_environment, use_fork_server
from .errors import LaunchError, WorkerError, WorkerTimeout, describe_other, first_failure, signal_name
from .forkserver import ForkServer
from .output import RankOutput, flush
from .pickling import loads_on_cpu
from .transport import FrameReader, Outbox, encode, widen_pipe

GRACE_AFTER_ERROR = 1.0  # seconds the other ranks get to report after one fails, before they are stopped
EXIT_WAIT = 5.0  # seconds workers get to exit on their own once their work is done
STACK_WAIT = 2.0  # seconds to wait for stuck ranks' stack dumps at a timeout


class _Rank:
    """One worker process and the parent's ends of its pipes."""

    def __init__(self, rank: int, proc: subprocess.Popen, cmd_fd: int, res_fd: int, stack_fd: int):
        self.rank, self.proc = rank, proc
        self.cmd_fd: int | None = cmd_fd
        self.res_fd, self.stack_fd = res_fd, stack_fd
        self.out_fd, self.err_fd = proc.stdout.fileno(), proc.stderr.fileno()
        self.frames, self.outbox = FrameReader(), Outbox()
        self.close_after_write = False
        self.returned = 0  # the last call whose function returned (its result may still be on the way)
        self.ready = False  # it has joined the process group


class Group:
    """N workers, the store they rendezvous on, and the loop that serves them."""

    def __init__(self, nproc: int, backend: str, gpus: bool, show: frozenset[int] | None = None):
        import torch.distributed as dist

        if os.name != "posix":  # sessions, pass_fds and killpg are POSIX
            raise LaunchError("course_utils.launch needs Linux or macOS; on Windows use WSL2")
        self.nproc, self.backend = nproc, backend
        self.output = RankOutput(nproc, show)
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
        self.server: ForkServer | None = None
        try:
            env = group_environment(nproc, self.port, backend, gpus)
            self._start(env, forked=use_fork_server(gpus))
        except BaseException:
            self.kill()
            raise

    @property
    def show(self) -> frozenset[int] | None:
        return self.output.show

    @show.setter
    def show(self, ranks: frozenset[int] | None) -> None:
        self.output.show = ranks

    @property
    def pids(self) -> list[int]:
        return [r.proc.pid for r in self.ranks]

    def _start(self, env: dict[str, str], forked: bool) -> None:
        """Start every rank: all forked by one fork server (CPU ranks), or each as a fresh interpreter."""
        pipes: list[tuple[int, ...]] = []  # per rank: cmd (read, write), result (read, write), stack (read, write)
        try:
            for _ in range(self.nproc):
                pipes.append(os.pipe() + os.pipe() + os.pipe())
                widen_pipe(pipes[-1][1])
                widen_pipe(pipes[-1][2])
            if forked:
                self.server = ForkServer(env, [_theirs(fds) for fds in pipes])
            for rank, fds in enumerate(pipes):
                if forked:
                    proc = self.server.ranks[rank]
                else:
                    proc = subprocess.Popen(
                        [sys.executable, "-m", "course_utils.launch.worker"],
                        env=rank_environment(env, rank, _theirs(fds)), pass_fds=tuple(_theirs(fds).values()),
                        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                        start_new_session=True)
                _close(list(_theirs(fds).values()))  # the rank holds its own copies now
                self._add(rank, proc, fds)
        except BaseException:
            _close([fd for fds in pipes[len(self.ranks):] for fd in fds])  # the added ones kill() closes
            raise

    def _add(self, rank: int, proc, fds: tuple[int, ...]) -> None:
        """Serve a started rank: its output and results read by the select loop, its commands written by it."""
        cmd_w, res_r, stk_r = fds[1], fds[2], fds[4]
        r = _Rank(rank, proc, cmd_w, res_r, stk_r)
        self.ranks.append(r)
        for fd in (r.out_fd, r.err_fd, r.res_fd, r.cmd_fd, r.stack_fd):
            os.set_blocking(fd, False)
        for fd in (r.out_fd, r.err_fd, r.res_fd):
            self.sel.register(fd, selectors.EVENT_READ, r)

    # -- sending -------------------------------------------------------------------------------------

    def send(self, payload: list[memoryview], close: bool = False) -> int:
        """Queue one call for every rank; close=True closes the command pipes after it (one-shot jobs)."""
        self.seq += 1
        for r in self.ranks:
            if r.cmd_fd is None:
                continue
            r.outbox.put(encode(("call", self.seq), payload))
            r.close_after_write = close
            self.write_some(r)
        return self.seq

    def write_some(self, r: _Rank) -> None:
        """Write what the pipe takes; the select loop finishes the rest. Closes the pipe once asked to."""
        if r.cmd_fd is None:
            return
        try:
            r.outbox.write_some(r.cmd_fd)
        except BrokenPipeError:
            r.outbox.clear()  # the worker is gone; the loop notices its exit
        registered = r.cmd_fd in self.sel.get_map()
        if r.outbox and not registered:
            self.sel.register(r.cmd_fd, selectors.EVENT_WRITE, r)
        elif not r.outbox:
            if registered:
                self.sel.unregister(r.cmd_fd)
            if r.close_after_write:
                os.close(r.cmd_fd)
                r.cmd_fd = None

    # -- receiving -----------------------------------------------------------------------------------

    def pump(self, timeout: float) -> list[tuple[_Rank, tuple, memoryview]]:
        """Wait up to `timeout` s, print whatever output arrived, and return the frames that arrived."""
        frames: list[tuple[_Rank, tuple, memoryview]] = []
        if not self.sel.get_map():
            time.sleep(timeout)
            return frames
        for key, events in self.sel.select(timeout):
            if events & selectors.EVENT_WRITE:
                self.write_some(key.data)
            else:
                self._read_some(key.data, key.fd, frames)
        flush()
        return frames

    def drain(self, r: _Rank) -> list[tuple[_Rank, tuple, memoryview]]:
        """Read everything rank r has written so far (its process may have exited)."""
        frames: list[tuple[_Rank, tuple, memoryview]] = []
        for fd in (r.out_fd, r.err_fd, r.res_fd):
            while fd in self.sel.get_map() and self._read_some(r, fd, frames):
                pass
        flush()
        return frames

    def _read_some(self, r: _Rank, fd: int, frames: list) -> bool:
        """One read from fd; False once there is nothing more to read now (or ever)."""
        if fd == r.res_fd:
            got, more = r.frames.read_some(fd)
            frames += [(r, meta, payload) for meta, payload in got]
            if r.frames.eof:
                self.sel.unregister(fd)
            return more
        try:
            data = os.read(fd, 1 << 16)
        except BlockingIOError:
            return False
        if not data:  # EOF: the worker closed it (or died)
            self.sel.unregister(fd)
            self.output.end(fd)
            return False
        self.output.feed(fd, data, sys.stdout if fd == r.out_fd else sys.stderr, r.rank)
        return True

    # -- waiting -------------------------------------------------------------------------------------

    def wait(self, seq: int | None, deadline: float | None, timeout: float | None) -> dict[int, Any]:
        """Wait until every rank has answered call `seq` (seq=None: until every rank is ready).

        Returns {rank: value}. Raises WorkerError once a rank fails (after giving the others a moment to
        report), WorkerTimeout at the deadline. Stopping the workers is the caller's job.
        """
        __tracebackhide__ = True  # IPython and pytest skip this frame: the remote traceback is the story
        waiting = set(range(self.nproc))
        results: dict[int, Any] = {}
        failures: dict[int, dict] = {}  # rank -> error info (from the worker, or made here)
        give_up_at = None

        def handle(batch):
            for r, meta, payload in batch:
                kind = meta[0]
                if kind == "ready":
                    r.ready = True
                    if seq is None:
                        waiting.discard(r.rank)
                elif kind == "returned":
                    r.returned = meta[1]
                elif meta[1] is None or meta[1] == seq:  # None: it failed while starting
                    if kind == "error":
                        failures[r.rank] = dict(meta[2], exception=payload)
                    else:
                        try:
                            results[r.rank] = loads_on_cpu(payload)
                        except Exception as exc:
                            failures[r.rank] = _local_error(f"rank {r.rank}'s result could not be unpickled here", exc)
                    waiting.discard(r.rank)

        while waiting:
            now = time.monotonic()
            if give_up_at is not None and now >= give_up_at:
                break
            if deadline is not None and now >= deadline:
                raise self._timeout(waiting, seq, timeout)
            limit = min(x for x in (0.1, give_up_at and give_up_at - now, deadline and deadline - now) if x)
            handle(self.pump(max(limit, 0.0)))
            for r in self.ranks:
                if r.rank in waiting and procs.exit_code(r.proc) is not None:
                    handle(self.drain(r))  # its last words may still be in the pipe
                    if r.rank in waiting:
                        code = procs.exit_code(r.proc)
                        last = self.output.last.get(r.rank) or "nothing"
                        failures[r.rank] = {"type": "WorkerExited", "silent": True, "time": 0.0,
                                            "message": f"rank {r.rank} exited with code {code}{signal_name(code)} "
                                                       "without reporting a Python error",
                                            "traceback": f"(no traceback: the process ended; last output: {last})"}
                        waiting.discard(r.rank)
            if failures and give_up_at is None:
                give_up_at = time.monotonic() + GRACE_AFTER_ERROR
        if failures:
            self.output.end_all()
            raise self._worker_error(failures, results, waiting)
        return results

    def _timeout(self, waiting: set[int], seq: int | None, timeout: float | None) -> WorkerTimeout:
        """The error for a deadline: where each stuck rank was, and which ranks were only sending results."""
        late = [r for r in self.ranks if r.rank in waiting]
        sending = [r for r in late if seq is not None and (r.returned == seq or r.frames.receiving)]
        starting = [r for r in late if not r.ready]
        stuck = [r for r in late if r not in sending and r not in starting]
        dumps = self.dump_stacks(stuck)
        self.output.end_all()
        return WorkerTimeout(timeout, [r.rank for r in stuck], {r.rank: self.output.last.get(r.rank, "")
                                                                 for r in self.ranks},
                             {rank: stacks.readable(text) for rank, text in dumps.items()},
                             [r.rank for r in sending], [r.rank for r in starting])

    def dump_stacks(self, ranks: list[_Rank]) -> dict[int, str]:
        """Ask each rank for its Python stacks (SIGUSR1 -> faulthandler) and collect what they write."""
        asked = []
        for r in ranks:
            if procs.exit_code(r.proc) is None:  # alive and not reaped: the pid is surely this worker
                os.kill(r.proc.pid, signal.SIGUSR1)
                asked.append(r)
        texts = {r.rank: bytearray() for r in asked}
        end, quiet_since = time.monotonic() + STACK_WAIT, time.monotonic()
        with selectors.DefaultSelector() as sel:
            for r in asked:
                sel.register(r.stack_fd, selectors.EVENT_READ, r)
            while sel.get_map() and time.monotonic() < end:
                events = sel.select(0.1)
                for key, _ in events:
                    try:
                        data = os.read(key.fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if data:
                        texts[key.data.rank] += data
                    else:
                        sel.unregister(key.fd)
                now = time.monotonic()
                if events:
                    quiet_since = now
                elif all(texts.values()) and now - quiet_since > 0.2:  # everyone wrote, and then nothing more
                    break
        return {rank: text.decode("utf-8", "replace") for rank, text in texts.items()}

    def _worker_error(self, failures: dict[int, dict], results: dict[int, Any], running: set[int]) -> WorkerError:
        first = first_failure(failures)
        info = failures[first]
        others = {}
        for r in self.ranks:
            if r.rank == first:
                continue
            if r.rank in failures:
                others[r.rank] = describe_other(failures[r.rank], first)
            elif r.rank in results:
                others[r.rank] = "finished normally"
            elif r.rank in running:
                last = self.output.last.get(r.rank) or "nothing"
                others[r.rank] = f"was still running and has been stopped (last output: {last})"
        exception = None
        if info.get("exception"):
            try:
                exception = loads_on_cpu(info["exception"])
            except Exception:
                pass  # the class may not exist here; the traceback text says it all
        err = WorkerError(first, info["type"], info["message"], info["traceback"], others, exception)
        err.stopped = sorted(running)
        return err

    # -- ending --------------------------------------------------------------------------------------

    def finish(self, deadline: float | None) -> None:
        """Let the workers exit on their own (their command pipes are closed), printing what they print."""
        end = time.monotonic() + EXIT_WAIT
        if deadline is not None:
            end = min(end, max(deadline, time.monotonic() + 0.5))
        while time.monotonic() < end and any(procs.exit_code(r.proc) is None for r in self.ranks):
            self.pump(0.02)
        self.kill()

    def kill(self, quiet: bool = False) -> None:
        """Stop every worker and whatever it started, reap them, and release pipes and the store's port.
        quiet=True (garbage collection, interpreter exit): print nothing of what they left in the pipes."""
        for r in self.ranks:
            procs.kill_group(r.proc)  # each worker leads its own session: its group holds all it started
        for r in self.ranks:
            r.proc.wait()
        if self.server is not None:
            self.server.close()  # (done already by the waits above, unless no rank got started)
        if not quiet:
            for r in self.ranks:
                self.drain(r)  # print what they said before they went
            self.output.end_all()
        for r in self.ranks:
            for fd in (r.cmd_fd, r.res_fd, r.stack_fd):
                if fd is None:
                    continue
                if fd in self.sel.get_map():
                    self.sel.unregister(fd)
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


def _theirs(fds: tuple[int, ...]) -> dict[str, int]:
    """A rank's ends of its three pipes (the others are the parent's)."""
    return {"cmd": fds[0], "result": fds[3], "stack": fds[5]}


def _close(fds: list[int]) -> None:
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _local_error(message: str, exc: BaseException) -> dict:
    return {"type": type(exc).__name__, "message": f"{message}: {exc}", "time": time.time(),
            "traceback": "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))}


def deadline_after(timeout: float | None) -> float | None:
    return None if timeout is None else time.monotonic() + timeout
