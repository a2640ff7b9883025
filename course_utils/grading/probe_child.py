"""One exercise's probe, in its own sandboxed process (started by probe.run_probe; never by hand).

    python -m course_utils.grading.probe_child RESULT_FD      (the request, pickled, on stdin)

Before the first line of student code it sets its limits (no core files, a cap on every file it writes, first in
line for the out-of-memory killer), imports the exercise's checks module, takes the check's `probe` and `entry`,
and writes one byte, b"R", to RESULT_FD: the grader's clock for the exercise starts there, so starting Python and
importing torch is not the student's time. Then it runs the master's setup cells and the submission's solution
cells in a fresh namespace, calls `probe(namespace[entry], inputs)` and writes an 8-byte length and
`checks.to_bytes({"status": ..., ...})` to RESULT_FD. Then it exits; the sandbox's PID namespace ends with it, and
so does everything the student's code started.
"""

from __future__ import annotations

import builtins
import linecache
import os
import pickle
import signal
import struct
import sys
import traceback

LEN = struct.Struct(">Q")
READY = b"R"
MAX_TRACEBACK = 4000


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def _short_traceback(err: BaseException) -> str:
    try:
        lines = traceback.format_exception(type(err), err, err.__traceback__)
        text = "".join(lines[-12:]).strip()
    except BaseException:  # an exception whose __str__ itself fails
        text = f"{type(err).__name__} (its message could not be shown)"
    return text if len(text) <= MAX_TRACEBACK else "..." + text[-MAX_TRACEBACK:]


def _limit(max_file_bytes: int) -> None:
    import resource

    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the size limit fails instead of killing
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")  # a student's memory hog goes first, not the grader
    except OSError:
        pass


def _run(req: dict, namespace: dict, probe, entry: str, inputs) -> dict:
    try:
        for where, source in req["program"]:
            linecache.cache[where] = (len(source), None, source.splitlines(True), where)
            try:
                code = compile(source, where, "exec", dont_inherit=True)
            except SyntaxError as e:
                raise SyntaxError(f"{e.msg} in {where}, line {e.lineno}") from None
            exec(code, namespace)
        if entry not in namespace:
            return {"status": "error", "message": f"the solution does not define `{entry}`"}
        return {"status": "ok", "data": probe(namespace[entry], inputs)}
    except NotImplementedError as e:
        return {"status": "not attempted", "message": _short_traceback(e)}
    except BaseException as e:  # SystemExit and KeyboardInterrupt too: the verdict is still "failed"
        return {"status": "error", "message": _short_traceback(e)}


def main(argv: list[str]) -> None:
    result_fd = int(argv[0])
    status = 1
    try:
        req = pickle.loads(sys.stdin.buffer.read())  # from the grader, which wrote it before any student code ran
        _limit(int(req["max_file_bytes"]))
        from course_utils import checks
        from course_utils.grading.checks_modules import import_checks_module

        import_checks_module(req["checks_module"])
        to_bytes = checks.to_bytes
        ex = checks.exercise(req["grade_id"])
        probe, entry = ex.probe, ex.entry  # taken before any student code runs
        inputs = checks.from_bytes(req["inputs"])
        namespace = {"__name__": "__course_probe__", "__builtins__": builtins, "__doc__": None}
        _write_all(result_fd, READY)
        result = _run(req, namespace, probe, entry, inputs)
        try:
            payload = to_bytes(result)
        except BaseException as e:  # the probe returned something that is not plain data
            payload = to_bytes({"status": "error", "message": f"the probe's result is not plain data: {e}"[:2000]})
        _write_all(result_fd, LEN.pack(len(payload)) + payload)
        status = 0
    except BaseException:  # the set-up itself failed: tell the grader on stderr, exit non-zero
        try:
            traceback.print_exc()
        except BaseException:
            pass
    finally:
        os._exit(status)  # no atexit handlers, no finalisers of the student's objects


if __name__ == "__main__":
    main(sys.argv[1:])
