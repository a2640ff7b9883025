"""One rank of a job started by `course_utils.launch`: `python -m course_utils._worker`.

The parent (launch.py) gives every worker torchrun's environment (RANK, WORLD_SIZE, MASTER_PORT, ...)
plus two private pipes, and hosts the TCPStore the workers rendezvous on, as torchrun's agent does
(TORCHELASTIC_USE_AGENT_STORE=True). The worker initialises the default process group, then runs
the calls it is sent until its command pipe closes, and destroys the process group before it exits.

Wire format on both pipes: an 8-byte big-endian length, then a cloudpickle payload.
  parent -> worker  ("call", seq, payload)  payload = ("fn", fn, args, kwargs) or ("code", source, filename)
  worker -> parent  ("ready", info) | ("ok", seq, value_bytes) | ("error", seq, info)

This module stays lean: it imports torch once and nothing heavy besides, because its start-up time is
the launcher's start-up time.
"""

from __future__ import annotations

import ast
import ctypes
import linecache
import os
import signal
import struct
import sys
import threading
import time
import traceback

_HEADER = struct.Struct(">Q")


def _die_with_parent(parent_pid: int, use_pdeathsig: bool) -> None:
    """Never outlive the launching process (a dead kernel must not keep GPU memory or ports)."""
    if use_pdeathsig and sys.platform.startswith("linux"):
        # PR_SET_PDEATHSIG fires when the parent *thread* exits, so the parent asks for it only when it
        # launches from its main thread; the watchdog below covers every other case.
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 == PR_SET_PDEATHSIG
        except OSError:
            pass

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


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = os.read(fd, min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _read_frame(fd: int):
    import cloudpickle

    header = _read_exact(fd, _HEADER.size)
    if header is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(header)[0])
    if body is None:
        return None
    return cloudpickle.loads(body)


def _write_frame(fd: int, message) -> None:
    import cloudpickle

    body = cloudpickle.dumps(message)
    data = memoryview(_HEADER.pack(len(body)) + body)
    while data:
        data = data[os.write(fd, data) :]


def _dumps_on_cpu(value) -> bytes:
    """Pickle a return value with every tensor moved to the CPU, so the parent never touches CUDA."""
    import io

    import cloudpickle
    import torch

    class CPUPickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
                cpu = obj.detach().cpu()
                if isinstance(obj, torch.nn.Parameter):
                    return torch.nn.Parameter, (cpu, obj.requires_grad)
                return torch.Tensor.detach, (cpu,)
            return super().reducer_override(obj)

    buf = io.BytesIO()
    CPUPickler(buf).dump(value)
    return buf.getvalue()


def _error_info(exc: BaseException) -> dict:
    import cloudpickle

    tb = exc.__traceback__
    # Drop this module's own leading frames: the student's code is the story.
    while tb is not None and tb.tb_next is not None and tb.tb_frame.f_code.co_filename == __file__:
        tb = tb.tb_next
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    try:
        pickled = cloudpickle.dumps(exc)
    except Exception:  # an exception holding unpicklable state still reports its traceback
        pickled = None
    return {"type": type(exc).__qualname__, "message": str(exc), "traceback": text, "exception": pickled,
            "time": time.time()}


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


def _call(payload_bytes: bytes, namespace: dict):
    import cloudpickle

    payload = cloudpickle.loads(payload_bytes)  # here, so that a module missing in the worker is this call's error
    kind = payload[0]
    if kind == "fn":
        _, fn, args, kwargs, sources = payload
        for filename, lines in sources.items():  # a notebook function's cell source, for tracebacks
            linecache.cache.setdefault(filename, (sum(map(len, lines)), None, lines, filename))
        return fn(*args, **kwargs)
    _, source, filename = payload
    return _run_code(source, filename, namespace)


def main() -> int:
    env = os.environ
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

        backend = env["COURSE_LAUNCH_BACKEND"]
        local_rank = int(env["LOCAL_RANK"])
        if backend == "nccl":
            torch.cuda.set_device(local_rank)
            dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
            device = f"cuda:{local_rank} ({torch.cuda.get_device_name(local_rank)})"
        else:
            dist.init_process_group(backend)
            device = "cpu"
    except BaseException as exc:
        _write_frame(res_fd, ("error", None, _error_info(exc)))  # None: failed while starting
        return 1
    _write_frame(res_fd, ("ready", {"pid": os.getpid(), "device": device}))

    # %%ranks cells share one namespace per rank; torch and dist are there as the --cli preamble has them.
    namespace = {"__name__": "__main__", "__builtins__": __builtins__, "os": os, "torch": torch, "dist": dist}
    try:
        while True:
            message = _read_frame(cmd_fd)
            if message is None:  # the parent closed the pipe: we are done
                break
            _, seq, payload = message
            try:
                value = _call(payload, namespace)
            except SystemExit as exc:  # sys.exit(0) in a cell is a success, as under torchrun
                if exc.code not in (None, 0):
                    _write_frame(res_fd, ("error", seq, _error_info(exc)))
                    continue
                value = None
            except BaseException as exc:
                _write_frame(res_fd, ("error", seq, _error_info(exc)))
                continue
            finally:
                sys.stdout.flush()  # output printed by the call reaches the parent before its result
                sys.stderr.flush()
            try:
                data = _dumps_on_cpu(value)
            except Exception as exc:
                hint = TypeError(f"rank {env['RANK']} returned a {type(value).__name__} that cannot be pickled "
                                 f"({exc}); return plain data (numbers, lists, dicts, tensors) instead")
                _write_frame(res_fd, ("error", seq, _error_info(hint)))
                continue
            _write_frame(res_fd, ("ok", seq, data))
    finally:
        namespace.clear()  # the cells' objects go now, so files they left open are flushed and closed
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


def _exit_fast(code: int) -> None:
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
    _exit_fast(main())
