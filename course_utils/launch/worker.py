"""One rank of a job started by `course_utils.launch`: `python -m course_utils.launch.worker`.

The parent gives every worker torchrun's environment (RANK, WORLD_SIZE, MASTER_PORT, ...) plus three
private pipes, and hosts the TCPStore the workers rendezvous on, as torchrun's agent does
(TORCHELASTIC_USE_AGENT_STORE=True). The worker initialises the default process group, runs the calls it
is sent until its command pipe closes, and destroys the process group before it exits. Frames: transport.py.

This module stays lean: it imports torch once and nothing heavy besides, because its start-up time is
the launcher's start-up time.
"""

from __future__ import annotations

import ast
import ctypes
import faulthandler
import linecache
import os
import signal
import sys
import threading
import time
import traceback

from .pickling import dumps_on_cpu, loads_on_cpu
from .transport import read_frame, write_frame


def die_with_parent_thread() -> None:
    """SIGKILL this process when the thread that started it exits (Linux; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG
        except OSError:
            pass


def _die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """Never outlive the launching process (a dead kernel must not keep GPU memory or ports)."""
    if use_pdeathsig:
        # PR_SET_PDEATHSIG fires when the parent *thread* exits, so the parent asks for it only when it
        # launches from its main thread; the watchdog below covers every other case.
        die_with_parent_thread()

    def watchdog() -> None:
        while True:
            if os.getppid() != parent_pid:
                try:
                    os.killpg(os.getpgrp(), signal.SIGKILL)  # this worker and anything it started
                finally:
                    os._exit(1)
            time.sleep(0.5)

    if os.getppid() != parent_pid:  # the parent died before we got here
        os._exit(1)
    threading.Thread(target=watchdog, name="course-launch-watchdog", daemon=True).start()


def _error_info(exc: BaseException) -> tuple[dict, list[memoryview]]:
    """(what the parent prints: type, message, traceback text, time) and the pickled exception, if it pickles."""
    tb = exc.__traceback__
    # Drop this module's own leading frames: the student's code is the story.
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        pickled = dumps_on_cpu(exc)  # tensors inside it travel on the CPU, like results
    except Exception:  # an exception holding unpicklable state still reports its traceback
        pickled = []
    return {"type": type(exc).__qualname__, "message": str(exc), "traceback": text, "time": time.time()}, pickled


def _send_error(fd: int, seq: int | None, exc: BaseException) -> None:
    info, pickled = _error_info(exc)
    write_frame(fd, ("error", seq, info), pickled)


def _run_code(source: str, filename: str, namespace: dict):
    """exec a cell; like IPython, a final expression is evaluated and becomes the rank's result."""
    # Register the source so tracebacks show the cell's lines, not just line numbers.
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tree = ast.parse(source, filename)
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    exec(compile(tree, filename, "exec"), namespace)
    if last is not None:
        return eval(compile(ast.Expression(last.value), filename, "eval"), namespace)
    return None


def _call(payload: memoryview, namespace: dict):
    # Unpickled here, so that a module missing in the worker is this call's error. The parent sends no tensor
    # off the CPU (pickling.dumps_call refuses them), and the CPU unpickler keeps it that way.
    call = loads_on_cpu(payload)
    if call[0] == "fn":
        _, fn, args, kwargs, sources = call
        for filename, lines in sources.items():  # a notebook function's cell source, for tracebacks
            linecache.cache.setdefault(filename, (sum(map(len, lines)), None, lines, filename))
        return fn(*args, **kwargs)
    _, source, filename = call
    return _run_code(source, filename, namespace)


def _init_process_group(backend: str, local_rank: int):
    """The default process group; NCCL ranks own GPU `local_rank` (set before init, and bound with device_id)."""
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        try:
            dist.init_process_group("nccl", device_id=device)
        except TypeError:  # a torch without device_id (before 2.3)
            dist.init_process_group("nccl")
        return f"cuda:{local_rank} ({torch.cuda.get_device_name(local_rank)})"
    dist.init_process_group(backend)
    return "cpu"


def main() -> int:
    env = os.environ
    # First of all: at a timeout the parent asks for every thread's Python stack with SIGUSR1. faulthandler
    # writes it from the signal handler itself, so it works while the rank is stuck inside a C++ collective.
    faulthandler.register(signal.SIGUSR1, file=int(env["COURSE_LAUNCH_STACK_FD"]), all_threads=True)
    _die_with_parent(int(env["COURSE_LAUNCH_PARENT"]), env.get("COURSE_LAUNCH_PDEATHSIG") == "1")
    cmd_fd, res_fd = int(env["COURSE_LAUNCH_CMD_FD"]), int(env["COURSE_LAUNCH_RESULT_FD"])
    # Modules the notebook can import (its folder, sys.path edits) must be importable here too, so that
    # functions pickled by reference load; appended, so they never shadow installed packages.
    for entry in env.get("COURSE_LAUNCH_SYSPATH", "").split(os.pathsep):
        if entry and entry not in sys.path:
            sys.path.append(entry)

    try:
        import torch
        import torch.distributed as dist

        device = _init_process_group(env["COURSE_LAUNCH_BACKEND"], int(env["LOCAL_RANK"]))
    except BaseException as exc:
        _send_error(res_fd, None, exc)  # None: failed while starting
        return 1
    write_frame(res_fd, ("ready", {"pid": os.getpid(), "device": device}))

    # %%ranks cells share one namespace per rank; torch and dist are there as the --cli preamble has them.
    namespace = {"__name__": "__main__", "__builtins__": __builtins__, "os": os, "torch": torch, "dist": dist}
    try:
        while True:
            frame = read_frame(cmd_fd)
            if frame is None:  # the parent closed the pipe: we are done
                break
            (_, seq), payload = frame
            try:
                value = _call(payload, namespace)
            except SystemExit as exc:  # sys.exit(0) in a cell is a success, as under torchrun
                if exc.code not in (None, 0):
                    _send_error(res_fd, seq, exc)
                    continue
                value = None
            except BaseException as exc:
                _send_error(res_fd, seq, exc)
                continue
            finally:
                sys.stdout.flush()  # output printed by the call reaches the parent before its result
                sys.stderr.flush()
            write_frame(res_fd, ("returned", seq))  # from here on, a timeout is about sending, not a hang
            try:
                data = dumps_on_cpu(value)
            except Exception as exc:
                _send_error(res_fd, seq, TypeError(
                    f"rank {env['RANK']} returned a {type(value).__name__} that cannot be pickled ({exc}); return "
                    "plain data (numbers, lists, dicts, tensors) instead"))
                continue
            del value
            write_frame(res_fd, ("ok", seq), data)
            del data
    finally:
        namespace.clear()  # the cells' objects go now, so files they left open are flushed and closed
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def exit_fast(code: int) -> None:
    """Exit without tearing torch's modules down one by one, which takes about a second.

    atexit handlers still run and the standard streams are flushed; what is skipped is the module
    teardown, which has nothing left to release that the OS does not reclaim anyway.
    """
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_fast(main())
