"""A zygote: a process with torch imported whose only job is to fork the CPU ranks' fork servers.

Every launch of CPU ranks starts a fork server (forkserver.py): a fresh interpreter that imports torch, about
2.5 s of CPU. Two kinds of process launch many times and may keep a helper running meanwhile:
- A grader's probe launches ranks in a process that already has torch imported, but forking the probe itself
  would hand the ranks whatever the solution changed in it (a patched `torch.distributed`, a replaced check).
  So the probe calls `start()` before the first line of student code: that forks a zygote, which keeps this
  clean state.
- A test session (tests/conftest.py) calls `spawn_on_first_use()`: its first launch spawns the zygote as a
  fresh interpreter (a pytest-xdist worker has threads, so it must not fork itself), which imports torch once.
A notebook never has one: nothing may keep running after its cell.

    launcher                                       zygote
    start() / first launch      -- fork/spawn -->  waits on its socket
    ForkServer(env, fds)        -- env, fds ---->  fork: a server that takes `env` and the launcher's cwd and
                                <- pid, pidfd ---  serves the fds as forkserver.serve_ranks does (own session,
                                                   dies with the zygote)

Its ranks are like a fresh server's: the launch's environment (and what torch reads of it at import, re-read
in forkserver._become_rank), their own seeds, no fd of the launcher's (the zygote keeps only its socket and the standard
streams, so nothing reaches a probe's result pipe). The zygote dies with its launcher (PR_SET_PDEATHSIG, and
EOF on its socket). Where it is gone or cannot be used (no pidfd_open, too many fds, COURSE_LAUNCH_ZYGOTE=0),
ForkServer starts a fresh interpreter as before.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import threading

MAX_FDS = 250  # SCM_RIGHTS carries at most 253 fds in one message (SCM_MAX_FD)
REPLY_TIMEOUT = 30.0  # seconds for the zygote to answer (it only forks)
UNKNOWN_EXIT = -1  # a remote server's exit code: its parent, the zygote, reaped it

_current: Zygote | None = None
_spawn_wanted: int | None = None  # the pid of the process whose first launch spawns a zygote


class RemoteServer:
    """A fork server forked by the zygote: quacks like the subprocess.Popen of a fresh one (pid, stdin, poll,
    wait, returncode). It is not our child, so its exit is seen and it is signalled through a pidfd, which
    never refers to another process however long ago it exited."""

    def __init__(self, pid: int, pidfd: int, stdin_fd: int):
        self.pid, self.pidfd = pid, pidfd
        self.stdin = os.fdopen(stdin_fd, "wb", 0)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None and select.select([self.pidfd], [], [], 0)[0]:
            self._exited()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            if not select.select([self.pidfd], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired("fork server", timeout)
            self._exited()
        return self.returncode

    def kill(self) -> None:
        if self.returncode is None:
            try:
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def _exited(self) -> None:
        self.returncode = UNKNOWN_EXIT
        os.close(self.pidfd)


class Zygote:
    """The launcher's end of a zygote's socket; `owner` is the process that forked it."""

    def __init__(self, pid: int, owner: int, sock: socket.socket, proc: subprocess.Popen | None = None):
        self.pid, self.owner, self.sock = pid, owner, sock
        self.sock.settimeout(REPLY_TIMEOUT)  # it only forks, so it answers at once unless gone or stopped
        self.lock = threading.Lock()  # one request and its reply at a time
        self.broken = False  # once a request failed, a late reply could answer the next one: not used again
        self.proc = proc  # a spawned zygote's (a test session's); a forked one is reaped with its launcher

    def fork_server(self, env: dict[str, str], spec: dict, stderr_fd: int) -> RemoteServer | None:
        """Have the zygote fork a fork server for `spec` (forkserver.py's, fds as ours); None if it cannot."""
        fds = [spec["status"]] + [fd for rank in spec["ranks"] for fd in rank.values()]
        if len(fds) + 2 > MAX_FDS or self.broken:
            return None
        index = {fd: i for i, fd in enumerate(fds)}
        request = {"env": env, "cwd": os.getcwd(), "stdin": len(fds), "stderr": len(fds) + 1,
                   "spec": {"status": index[spec["status"]],
                            "ranks": [{k: index[fd] for k, fd in rank.items()} for rank in spec["ranks"]]}}
        command_r, command_w = os.pipe()  # the server's stdin: "close", or EOF
        try:
            with self.lock:
                socket.send_fds(self.sock, [json.dumps(request).encode()], fds + [command_r, stderr_fd])
                msg, got, _, _ = socket.recv_fds(self.sock, 64, 1)
        except OSError:  # the zygote is gone, stopped, or its socket closed, or the request too big: a fresh server
            msg, got = b"", []
        finally:
            os.close(command_r)
        words = msg.split()
        if words[:1] != [b"pid"] or len(words) != 2 or len(got) != 1:
            self.broken = True
            for fd in got + [command_w]:
                os.close(fd)
            return None
        os.set_inheritable(got[0], False)  # (fds received over SCM_RIGHTS are inheritable)
        return RemoteServer(int(words[1]), got[0], command_w)


def _supported() -> bool:
    """Linux 5.3 and Python 3.9 have pidfds; elsewhere every launch starts a fresh server."""
    return hasattr(os, "pidfd_open") and hasattr(signal, "pidfd_send_signal")


def current() -> Zygote | None:
    """The zygote this process started, if any (forked children of this process do not inherit it); a test
    session's is spawned here on first use (see spawn_on_first_use)."""
    if _spawn_wanted == os.getpid() and (_current is None or _current.owner != os.getpid()):
        _spawn()
    return _current if _current is not None and _current.owner == os.getpid() else None


def spawn_on_first_use() -> None:
    """Have the first launch of CPU ranks in this process spawn a zygote: a fresh interpreter that imports torch
    once and then forks the fork servers of every later launch, until stop(). For a test session, whose launches
    would each import torch again; a notebook must not keep a process running after its cell, so it never does.
    (A process with threads, as a pytest-xdist worker, cannot fork itself safely: hence a fresh interpreter.)"""
    global _spawn_wanted
    _spawn_wanted = os.getpid()


def stop() -> None:
    """End the zygote this process started or spawned, and with it every server it forked (PR_SET_PDEATHSIG)."""
    global _current, _spawn_wanted
    z, _current, _spawn_wanted = _current, None, None
    if z is None or z.owner != os.getpid():
        return
    z.sock.close()  # EOF: it returns, and os._exit()s
    if z.proc is not None:
        try:
            z.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            z.proc.kill()
            z.proc.wait()


def _spawn() -> None:
    global _current
    if not _supported():
        return
    if threading.current_thread() is not threading.main_thread():
        return  # it would die with this thread (PR_SET_PDEATHSIG): a later launch from the main thread spawns it
    import sys

    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "course_utils.launch.zygote", str(theirs.fileno()), str(os.getpid())],
            pass_fds=(theirs.fileno(),), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            start_new_session=True)
    finally:
        theirs.close()
    _current = Zygote(proc.pid, os.getpid(), ours, proc)


def start() -> None:
    """Fork the zygote from this process as it is now. Call it before untrusted code runs, from the main
    thread of a single-threaded process (what the fork copies is all the ranks will ever see of this one)."""
    global _current
    if not _supported():
        return
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            ours.close()
            _serve(theirs)
            code = 0
        finally:
            os._exit(code)
    theirs.close()
    _current = Zygote(pid, os.getpid(), ours)


def _serve(sock: socket.socket) -> None:
    """The zygote: fork a server per request until the launcher is gone; reap the servers that exited."""
    from .worker import die_with_parent_thread

    die_with_parent_thread()
    keep = sock.fileno()
    os.closerange(3, keep)  # the launcher's fds (a probe's result pipe) are not for the zygote or the ranks
    os.closerange(keep + 1, os.sysconf("SC_OPEN_MAX"))
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    while True:
        ready = select.select([sock], [], [], 0.1)[0]  # (the timeout: reap an exited server soon)
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:
                pass
        except ChildProcessError:
            pass
        if not ready:
            continue
        msg, fds, _, _ = socket.recv_fds(sock, 1 << 22, MAX_FDS)
        if not msg:  # the launcher is gone
            return
        try:
            request = json.loads(msg)
            pid = os.fork()
        except Exception:  # not a request of ours (cut short, or not from the launcher): say no
            for fd in fds:
                os.close(fd)
            try:
                sock.send(b"no")
            except OSError:
                return
            continue
        if pid == 0:
            code = 1
            try:
                sock.close()
                _become_server(request, fds)
                code = 0
            finally:
                os._exit(code)
        for fd in fds:  # the server holds them now: the status pipe's EOF must mean that it is gone
            os.close(fd)
        pidfd = os.pidfd_open(pid)  # before any waitpid: the pid is surely the server's
        try:
            socket.send_fds(sock, [f"pid {pid}".encode()], [pidfd])
        except OSError:
            return
        finally:
            os.close(pidfd)


def _become_server(request: dict, fds: list[int]) -> None:
    """In the zygote's child: its own session, the launcher's environment and cwd, then serve the ranks."""
    from .forkserver import serve_ranks
    from .worker import die_with_parent_thread

    os.setsid()
    die_with_parent_thread()  # with the zygote, which forks from its only thread
    zygote = os.getppid()
    os.dup2(fds[request["stdin"]], 0)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(fds[request["stderr"]], 2)
    for fd in (null, fds[request["stdin"]], fds[request["stderr"]]):
        os.close(fd)
    try:
        os.chdir(request["cwd"])
    except OSError:
        pass
    os.environ.clear()
    os.environ.update(request["env"])
    spec = request["spec"]
    spec = {"status": fds[spec["status"]],
            "ranks": [{k: fds[i] for k, i in rank.items()} for rank in spec["ranks"]]}
    serve_ranks(spec, parent=zygote)


def main(argv: list[str]) -> None:
    """A spawned zygote (see spawn_on_first_use): import what a fork server needs once, then serve."""
    sock, owner = socket.socket(fileno=int(argv[0])), int(argv[1])
    from . import worker  # noqa: F401  lean: transport and pickling

    if os.getppid() != owner:  # the owner died before we got here
        os._exit(1)
    import torch  # noqa: F401  once, for every server this zygote forks
    import torch.distributed  # noqa: F401

    _serve(sock)
    os._exit(0)


if __name__ == "__main__":
    import sys

    main(sys.argv[1:])
