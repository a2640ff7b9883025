"""CPU ranks forked from one fresh interpreter that imported torch once: a fork server per launch.

Importing torch costs each rank about 1.5 s of CPU, most of what starting a small job costs (4 ranks on a
2-core laptop: about 3 s before their first line runs). So for ranks that see no GPU the launcher starts one
fresh interpreter, `python -m course_utils.launch.forkserver`, with the group's environment; it imports torch
and the worker and forks every rank. A rank is still a process that no notebook state (CUDA, threads, a
process group) ever touched: the server is single-threaded and initialises neither CUDA nor a process group.
Ranks that use GPUs start as fresh interpreters of their own (group.py).

The server is its ranks' parent, so only it can see their exit statuses and keep their pids from being
reused: it reports each exit over a status pipe and reaps nobody until the launcher closes it, which keeps
procs.py's rule (signal only what is not reaped). Ranks die with the server (PR_SET_PDEATHSIG and their
watchdog), the server with the launcher.

    launcher                         server
    ForkServer(env, fds)  -------->  import torch; fork ranks 0..n-1 (own session, own pipes, own RANK)
                          <--------  "pids 4711 4712"      (status pipe)
    ForkedRank.poll()     <--------  "exit 1 -9"           (rank 1 exited, killed by signal 9; not reaped)
    ForkServer.close()    -------->  "close" (its stdin): kill what still runs, reap every rank, exit
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import time

from .procs import pid_exit_code

SPEC = "COURSE_FORKSERVER_SPEC"  # json: the status pipe's fd and each rank's fds (out, err, cmd, result, stack)
START_TIMEOUT = 300.0  # seconds the server may take to import torch and fork (a loaded machine is slow)
CLOSE_TIMEOUT = 10.0  # seconds the server gets to reap its ranks before it is killed


# -- the launcher's side ------------------------------------------------------------------------------


class ForkedRank:
    """A rank the server forked; quacks like the subprocess.Popen objects group.py and procs.py handle."""

    def __init__(self, server: ForkServer, index: int, pid: int, stdout, stderr):
        self.server, self.index, self.pid = server, index, pid
        self.stdout, self.stderr = stdout, stderr
        self.status: int | None = None  # its exit code (negative: a signal) once the server reported it
        self.returncode: int | None = None  # set once reaped: from then on its pid may be someone else's

    def poll(self) -> int | None:
        """The exit code once the rank has exited; it stays unreaped (its pid ours) until the server closes."""
        self.server.update()
        return self.status if self.status is not None else self.returncode  # returncode: a server that died

    def wait(self) -> int:
        """Stop and reap every rank of the server (the launcher waits only for ranks it has stopped)."""
        self.server.close()
        return self.returncode


class ForkServer:
    """The server of one group: `fds` holds, per rank, the fds the rank keeps (cmd, result, stack)."""

    def __init__(self, env: dict[str, str], fds: list[dict[str, int]]):
        from .errors import LaunchError

        pipes = [(os.pipe(), os.pipe()) for _ in fds]  # each rank's stdout and stderr: (read, write)
        status_r, status_w = os.pipe()
        spec = {"status": status_w,
                "ranks": [dict(f, out=o[1], err=e[1]) for f, (o, e) in zip(fds, pipes, strict=True)]}
        passed = [status_w] + [fd for rank in spec["ranks"] for fd in rank.values()]
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "course_utils.launch.forkserver"],
                env=dict(env, **{SPEC: json.dumps(spec)}), pass_fds=passed, stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=pipes[0][1][1],  # what the server itself says (an import error) reads as rank 0's
                start_new_session=True)
        except BaseException:
            for fd in [status_r, status_w] + [fd for o, e in pipes for fd in (*o, *e)]:
                os.close(fd)
            raise
        for fd in [status_w] + [w for o, e in pipes for w in (o[1], e[1])]:
            os.close(fd)
        self.status_fd: int | None = status_r
        self.buffer, self.closed = b"", False
        self.ranks: list[ForkedRank] = []
        streams = [(os.fdopen(o[0], "rb", 0), os.fdopen(e[0], "rb", 0)) for o, e in pipes]
        try:
            pids = self._read_pids(len(fds))
        except BaseException as exc:
            self._kill()
            said = _read_now(streams[0][1].fileno())
            for out, err in streams:
                out.close()
                err.close()
            self.close()
            if isinstance(exc, RuntimeError):
                raise LaunchError(f"the fork server that starts the CPU ranks {exc}; it said:\n{said or '(nothing)'}"
                                  ) from None
            raise
        self.ranks = [ForkedRank(self, i, pid, out, err)
                      for i, (pid, (out, err)) in enumerate(zip(pids, streams, strict=True))]

    def _read_pids(self, n: int) -> list[int]:
        end = time.monotonic() + START_TIMEOUT
        while b"\n" not in self.buffer:
            if self.proc.poll() is not None:
                raise RuntimeError(f"exited with code {self.proc.returncode} before starting any rank")
            if time.monotonic() > end:
                raise RuntimeError(f"started no rank within {START_TIMEOUT:.0f} s")
            if select.select([self.status_fd], [], [], 0.1)[0] and self._read() == 0:
                raise RuntimeError("closed its status pipe before starting any rank")
        line, self.buffer = self.buffer.split(b"\n", 1)
        words = line.split()
        if words[:1] != [b"pids"] or len(words) != n + 1:
            raise RuntimeError(f"said {line!r} instead of the pids of {n} ranks")
        os.set_blocking(self.status_fd, False)
        return [int(w) for w in words[1:]]

    def _read(self) -> int | None:
        """One read from the status pipe into the buffer: the bytes read (0 at EOF), None if none are there now."""
        try:
            data = os.read(self.status_fd, 1 << 16)
        except BlockingIOError:
            return None
        self.buffer += data
        return len(data)

    def update(self) -> None:
        """Take in the exits the server has reported so far; never blocks."""
        n = None
        while self.status_fd is not None and (n := self._read()):
            pass
        self._take_exits()
        if n == 0 and not self.closed:  # EOF: the server is gone before being closed (killed); its ranks went with
            self.close()  # it and someone else may reap them, so their pids must never be signalled from here on

    def _take_exits(self) -> None:
        """Each whole "exit INDEX CODE" line in the buffer sets that rank's status."""
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            _, index, code = line.split()
            self.ranks[int(index)].status = int(code)

    def _kill(self) -> None:
        """Kill the server; its ranks follow (PR_SET_PDEATHSIG, or their watchdog)."""
        if self.proc.returncode is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass

    def close(self) -> None:
        """Have the server kill what still runs, reap every rank and exit; every rank's returncode is then set."""
        if self.closed:
            return
        self.closed = True
        try:
            self.proc.stdin.write(b"close\n")
            self.proc.stdin.close()
        except OSError:  # it is gone already, and its ranks with it
            pass
        try:
            self.proc.wait(timeout=CLOSE_TIMEOUT)
        except BaseException:
            self._kill()
            self.proc.wait()
        if self.status_fd is not None:
            os.set_blocking(self.status_fd, True)  # the server has exited: its last reports, then EOF
            while self._read():
                pass
            self._take_exits()
            os.close(self.status_fd)
            self.status_fd = None
        for r in self.ranks:  # one it could not report on died with it
            r.returncode = r.status if r.status is not None else -signal.SIGKILL


def _read_now(fd: int) -> str:
    """What is in a pipe now, without waiting."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    except BlockingIOError:
        pass
    return data.decode("utf-8", "replace").strip()


# -- the server's side --------------------------------------------------------------------------------


def _become_rank(index: int, spec: dict, server: int) -> None:
    """In a freshly forked child: its own session, its own pipes and nothing else of the server's, its RANK."""
    os.setsid()  # first: from here on killpg(pid) reaches this rank and all it starts
    mine = spec["ranks"][index]
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.dup2(mine["out"], 1)
    os.dup2(mine["err"], 2)
    keep = {mine["cmd"], mine["result"], mine["stack"]}
    for fd in {spec["status"], devnull} | {fd for r in spec["ranks"] for fd in r.values()}:
        if fd not in keep and fd > 2:
            os.close(fd)
    import torch

    torch.seed()  # a fresh interpreter seeds torch's generator from the OS; forked ranks would all share one
    # Python's random reseeds itself in a forked child; numpy's does not, where torch imported it.
    if "numpy.random" in sys.modules:
        sys.modules["numpy.random"].seed()
    os.environ.update(RANK=str(index), LOCAL_RANK=str(index), ROLE_RANK=str(index),
                      COURSE_LAUNCH_CMD_FD=str(mine["cmd"]), COURSE_LAUNCH_RESULT_FD=str(mine["result"]),
                      COURSE_LAUNCH_STACK_FD=str(mine["stack"]),
                      COURSE_LAUNCH_PARENT=str(server),  # the rank dies with the server
                      COURSE_LAUNCH_PDEATHSIG="1")  # the server forks from its main (and only) thread


def _serve(status: int, pids: list[int], launcher: int) -> None:
    """Report each rank's exit as it happens, without reaping; on "close" (or the launcher gone) stop and reap."""
    reported: set[int] = set()

    def report(index: int, code: int) -> None:
        os.write(status, f"exit {index} {code}\n".encode())
        reported.add(index)

    while True:
        asked = select.select([0], [], [], 0.05)[0]  # "close", or EOF: the launcher is done
        for index, pid in enumerate(pids):
            if index not in reported and (code := pid_exit_code(pid)) is not None:
                report(index, code)
        if asked or os.getppid() != launcher:
            break
    for pid in pids:  # what still runs in each rank's session, or the rank itself if it never got to setsid
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for index, pid in enumerate(pids):
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        if index not in reported:
            report(index, code)


def serve_ranks(spec: dict, parent: int) -> None:
    """Be the server: fork every rank of `spec`, report the pids, then serve (see _serve); never returns.

    `parent` is the launcher: its end ends the server."""
    from . import worker  # lean: transport and pickling

    if os.getppid() != parent:  # it died before we got here
        os._exit(1)
    server = os.getpid()
    import torch  # noqa: F401  what makes a rank slow to start: done once, here, for every rank
    import torch.distributed  # noqa: F401

    pids = []
    for index in range(len(spec["ranks"])):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                _become_rank(index, spec, server)
                code = worker.main()
            except BaseException:
                import traceback

                traceback.print_exc()
            finally:
                worker.exit_fast(code)
        pids.append(pid)
    for rank in spec["ranks"]:
        for fd in rank.values():
            os.close(fd)
    os.write(spec["status"], ("pids " + " ".join(map(str, pids)) + "\n").encode())
    _serve(spec["status"], pids, parent)
    os._exit(0)  # nothing of torch's to tear down here


def main() -> None:
    spec = json.loads(os.environ.pop(SPEC))
    from . import worker

    if os.environ.get("COURSE_LAUNCH_PDEATHSIG") == "1":
        worker.die_with_parent_thread()
    serve_ranks(spec, parent=int(os.environ["COURSE_LAUNCH_PARENT"]))


if __name__ == "__main__":
    main()
