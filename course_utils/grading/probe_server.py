"""The probe server: a process with torch and the checks loaded that forks one throwaway probe per exercise.

    python -m course_utils.grading.probe_server FD      (started by probe.ProbeServer; FD: its socket)

Starting Python and importing torch takes seconds; forking a process that already has them takes
milliseconds. So the grader starts this server once, and for each (submission, exercise) asks it to fork a
probe. The server itself never runs a student's code: only its forked children do, and each child, before
the first line of student code:
- leaves the server's session (setsid), dies with the server, and becomes a subreaper (orphans of what it
  starts stay below it, so the grader can kill them all);
- closes the server's socket (it cannot ask for more processes) and keeps only the pipe for its result;
- moves cwd, HOME, TMPDIR, IPYTHONDIR, caches into a throwaway folder, pins CUDA_VISIBLE_DEVICES, sends
  stdout to /dev/null and stderr to a capped file;
- fences its writes into that folder, /dev and /proc, and hides the masters, their git history, the submissions
  and other sandboxes from its reads (Landlock, where the kernel has it);
- forks a zygote (course_utils/launch/zygote.py) that forks the fork servers of the CPU ranks it launches,
  so that they start from this clean state without importing torch again;
- takes the exercise's `probe` function from the checks module.
Then it execs the master's setup cells and the submission's solution cells in a fresh namespace, calls
`probe(namespace[entry], inputs)` and writes `checks.to_bytes({"status": ..., ...})` to its pipe.

Protocol on the socket (the grader is the only peer): grader -> server: a byte b"R" carrying the result
pipe's fd (SCM_RIGHTS) and an 8-byte length, then a pickled request dict. Server -> grader: 8-byte length +
pickled tuple: ("ready", info) | ("started", job, pid) with the probe's pidfd attached | ("exited", pid,
exitcode) once the server reaped it (and killed what it left behind) | ("failed", job, message).
Only the trusted grader writes requests; a probe cannot reach this socket.
"""

from __future__ import annotations

import builtins
import importlib
import importlib.util
import linecache
import os
import pickle
import select
import shutil
import signal
import socket
import struct
import sys
import traceback
from pathlib import Path

from . import sandbox

_LEN = struct.Struct(">Q")
CHECKS_MODULES_ENV = "COURSE_CHECKS_MODULES"
# Imported once here so that probes (and the setup cells they run) start warm.
WARM_MODULES = ("numpy", "torch", "matplotlib", "matplotlib.pyplot", "IPython.display", "course_utils.checks",
                "course_utils.measure", "course_utils.timeline", "course_utils.launch", "course_utils.reference",
                "course_utils.hardware", "course_utils.bench")
MAX_TRACEBACK = 4000


# ---------------------------------------------------------------------------------------------- check modules


def import_checks_module(spec: str):
    """Import a module that registers exercises: a dotted name, or a path to a .py file (imported under its
    file name's stem, so a notebook's `import <stem>` finds the same module and registry)."""
    if spec.endswith(".py") or os.sep in spec:
        path = Path(spec).resolve()
        if path.stem in sys.modules and getattr(sys.modules[path.stem], "__file__", None) == str(path):
            return sys.modules[path.stem]
        module_spec = importlib.util.spec_from_file_location(path.stem, path)
        if module_spec is None or module_spec.loader is None or not path.is_file():
            raise ImportError(f"no Python file at {path}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[path.stem] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[path.stem]
            raise
        return module
    return importlib.import_module(spec)


def load_checks(extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Import every lesson's checks module and the `extra` ones; return the errors (a broken module must not
    stop the grading of the others: its exercises are then reported as having no check)."""
    from course_utils import checks

    errors = []
    for name in checks.LESSON_MODULES:
        try:
            importlib.import_module(f"course_utils.checks.{name}")
        except ModuleNotFoundError as err:
            if err.name != f"course_utils.checks.{name}":
                errors.append(f"course_utils.checks.{name}: {err}")
        except Exception as err:
            errors.append(f"course_utils.checks.{name}: {type(err).__name__}: {err}")
    for spec in extra:
        try:
            import_checks_module(spec)
        except Exception as err:
            errors.append(f"{spec}: {type(err).__name__}: {err}")
    return errors


def extra_modules_from_env() -> list[str]:
    return [s for s in os.environ.get(CHECKS_MODULES_ENV, "").split(os.pathsep) if s]


# ---------------------------------------------------------------------------------------------- framing


def send_frame(sock: socket.socket, obj, fds: list[int] = ()) -> None:
    """Send one framed message; `fds` ride with its first byte (SCM_RIGHTS)."""
    body = pickle.dumps(obj)
    data = _LEN.pack(len(body)) + body
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    sock.sendall(data)


def recv_exact(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _recv_request(sock: socket.socket) -> tuple[dict, int] | None:
    msg, fds, _, _ = socket.recv_fds(sock, 1 + _LEN.size, 1)
    if not msg:
        return None
    if len(msg) < 1 + _LEN.size:
        rest = recv_exact(sock, 1 + _LEN.size - len(msg))
        if rest is None:
            return None
        msg += rest
    if msg[:1] != b"R" or len(fds) != 1:
        raise RuntimeError("probe server: malformed request")
    (n,) = _LEN.unpack(msg[1:])
    body = recv_exact(sock, n)
    if body is None:
        return None
    return pickle.loads(body), fds[0]


# ---------------------------------------------------------------------------------------------- the child


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(_LEN.pack(len(data)) + data)
    while view:
        view = view[os.write(fd, view):]


def _short_traceback(err: BaseException) -> str:
    try:
        lines = traceback.format_exception(type(err), err, err.__traceback__)
        text = "".join(lines[-12:]).strip()
    except BaseException:  # an exception whose __str__ itself fails
        text = f"{type(err).__name__} (its message could not be shown)"
    return text if len(text) <= MAX_TRACEBACK else "..." + text[-MAX_TRACEBACK:]


def _isolate(req: dict) -> None:
    """Everything that must hold before student code runs (see the module docstring)."""
    root = Path(req["sandbox"])
    os.setsid()
    sandbox.die_with_parent()
    sandbox.set_child_subreaper()
    env = sandbox.sandbox_env(root, dict(os.environ))
    env["CUDA_VISIBLE_DEVICES"] = req["cuda_visible_devices"]
    os.environ.clear()
    os.environ.update(env)
    import tempfile

    tempfile.tempdir = None
    os.chdir(root / "work")
    null = os.open(os.devnull, os.O_RDWR)
    err = os.open(root / "stderr.log", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.dup2(err, 2)
    os.close(null)
    os.close(err)
    import resource

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the file size limit fails instead of killing
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    limit = int(req["max_file_bytes"])
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    sandbox.prefer_oom_kill()
    if req.get("landlock", True):
        # /proc too: CUDA's initialisation writes there (cudaGetDeviceCount fails with error 304 without it,
        # seen on an H100), also in the ranks a probe starts. Other processes' /proc files stay out of reach:
        # Landlock denies ptrace-mode access (mem, fd, environ) to processes outside the sandbox.
        sandbox.restrict([root, "/dev", "/proc"], list(req.get("hide", ())) + sandbox.other_sandboxes(root))


def run_child(req: dict, result_fd: int) -> None:
    """In the forked probe: isolate, run the program, write the result, wait to be killed (never returns)."""
    status = 1
    try:
        _isolate(req)
        # The CPU ranks a probe launches are forked from this state, fenced in but before any student code,
        # not from a fresh interpreter that imports torch again (course_utils/launch/zygote.py).
        from course_utils.launch import zygote

        zygote.start()
        from course_utils import checks

        to_bytes, write_all = checks.to_bytes, _write_all
        ex = checks.exercise(req["grade_id"])
        probe, entry = ex.probe, ex.entry  # taken before any student code runs
        inputs = checks.from_bytes(req["inputs"])
        namespace = {"__name__": "__course_probe__", "__builtins__": builtins, "__doc__": None}
        try:
            for where, source in req["program"]:
                linecache.cache[where] = (len(source), None, source.splitlines(True), where)
                try:
                    code = compile(source, where, "exec", dont_inherit=True)
                except SyntaxError as e:
                    raise SyntaxError(f"{e.msg} in {where}, line {e.lineno}") from None
                exec(code, namespace)
            if entry not in namespace:
                result = {"status": "error", "message": f"the solution does not define `{entry}`"}
            else:
                data = probe(namespace[entry], inputs)
                result = {"status": "ok", "data": data}
        except NotImplementedError as e:
            result = {"status": "not attempted", "message": _short_traceback(e)}
        except BaseException as e:  # SystemExit and KeyboardInterrupt too: the verdict is still "failed"
            result = {"status": "error", "message": _short_traceback(e)}
        try:
            payload = to_bytes(result)
        except BaseException as e:  # the probe returned something that is not plain data
            payload = to_bytes({"status": "error", "message": f"the probe's result is not plain data: {e}"[:2000]})
        write_all(result_fd, payload)
        status = 0
        # Wait to be killed: while this process lives, whatever it started is still below it (it is a
        # subreaper), so the grader's kill_tree reaches all of it.
        while True:
            select.select([], [], [], 3600)
    except BaseException:  # the isolation itself failed: tell the grader on stderr, exit non-zero
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        os._exit(status)  # no atexit handlers, no finalisers of the student's objects


# ---------------------------------------------------------------------------------------------- the server


def _pidfd(pid: int) -> int | None:
    """A pidfd for our own child (race-free: it cannot be reaped, hence its pid not reused, before we wait)."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):  # Linux < 5.3
        return None


def _kill_orphans_of(session: int) -> None:
    """Kill what a probe that just ended left behind: our adopted children (we are a subreaper) of its session.

    Only children of this process qualify: a new probe with the same pid could only be forked by us, later."""
    me = os.getpid()
    for pid, ppid, sid in sandbox._process_table():
        if ppid == me and sid == session:
            sandbox.kill_tree(pid)


def serve(sock: socket.socket, folders: set[str]) -> None:
    """Fork a probe per request until the grader closes the socket; `folders` collects the probes' folders."""
    sandbox.set_child_subreaper()  # orphans of a probe that exited early land here
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    probes: set[int] = set()
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, st = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                if pid in probes:  # (adopted orphans are reaped silently)
                    probes.discard(pid)
                    _kill_orphans_of(pid)
                    send_frame(sock, ("exited", pid, os.waitstatus_to_exitcode(st)))
        if sock in ready:
            got = _recv_request(sock)
            if got is None:  # the grader is gone
                return
            req, fd = got
            try:
                pid = os.fork()
            except OSError as e:
                os.close(fd)
                send_frame(sock, ("failed", req["job"], f"fork failed: {e}"))
                continue
            if pid == 0:
                try:
                    signal.set_wakeup_fd(-1)
                    for sig in (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGPIPE):
                        signal.signal(sig, signal.SIG_DFL)
                    sock.close()
                    os.close(wake_r)
                    os.close(wake_w)
                    os.set_inheritable(fd, False)
                finally:
                    run_child(req, fd)
            os.close(fd)
            probes.add(pid)
            folders.add(req["sandbox"])
            pidfd = _pidfd(pid)
            send_frame(sock, ("started", req["job"], pid), fds=[pidfd] if pidfd is not None else [])
            if pidfd is not None:
                os.close(pidfd)


def main(argv: list[str]) -> None:
    sock = socket.socket(fileno=int(argv[0]))
    errors = load_checks(extra_modules_from_env())
    for name in WARM_MODULES:
        try:
            importlib.import_module(name)
        except Exception:  # an optional module (matplotlib, IPython) missing costs only speed
            pass
    import torch

    info = {"pid": os.getpid(), "errors": errors, "landlock": sandbox.landlock_abi(),
            "cuda_initialized": bool(torch.cuda.is_initialized())}
    send_frame(sock, ("ready", info))
    folders: set[str] = set()
    try:
        serve(sock, folders)
    finally:
        sandbox.kill_tree(os.getpid(), include_self=False)  # probes still running die with the server
        for folder in folders:  # the grader removes each probe's folder; if it died first, we do
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
