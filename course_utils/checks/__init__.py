"""Exercise checks: a probe that runs the student's code, and a verdict decided on plain data.

Every exercise is one `Exercise`, registered by its lesson's module (checks/cuda_streams.py, ...):

    def make_inputs() -> dict:                 # fresh inputs, made where the verdict is decided
        return {"n": 5, "seed": 1234}

    def probe(answer, inputs) -> dict:         # runs beside the student's code; returns plain data only
        return {"out": answer(inputs["n"])}

    def judge(inputs, data) -> str:            # the verdict, from plain data; raises CheckFailed
        expect(data["out"] == 2 * inputs["n"], "ex99_double", "...", data["out"])
        return "detail for the pass line"

    register(Exercise("ex99_double", entry="double", probe=probe, judge=judge, inputs=make_inputs))

Where each part runs:
- In a notebook, the check cell calls `check("ex99_double", double)`: inputs, probe and judge all run in the
  kernel, for the student's feedback. It prints "passed: ..." or raises CheckFailed; `pytest --nbmake`
  on a notebook therefore passes exactly when its exercises pass.
- The grader (course_utils.grading) never trusts that cell. It makes the inputs in its own process, runs
  the master's setup cells plus the submission's solution in a separate throwaway process, calls
  `probe(<the value the solution defined under entry>, inputs)` there, receives the result as plain
  data (`to_bytes`/`from_bytes`: tensors and builtins only, loaded with torch's weights-only unpickler)
  and calls `judge` in its own process. So a judge must only use its inputs and the plain data, never
  an object the student made, and must compute every expected value itself.

Outcomes: passed; failed (CheckFailed, "expected ..., saw ..."); skipped (a GPU exercise on a machine
without CUDA: "skipped: needs a GPU", and under COURSE_REQUIRE_GPU=1 that is a failure); not attempted
(the solution still raises NotImplementedError, the stub that student versions carry). A GPU exercise
with `cpu_part=True` is probed on CPU too (inputs["gpu"] is False) and, if that part passes, reported
as "skipped: needs a GPU (ex..: CPU part passed; GPU part not graded on this machine)".
"""

from __future__ import annotations

import contextlib
import importlib
import io
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

SKIP_MARKER = "skipped: needs a GPU"
NOT_ATTEMPTED_MARKER = "not attempted yet:"
LAB_ENV = "COURSE_LAB"  # "1" in `make lab`'s kernels: an unsolved exercise's check says so instead of raising
PASS_MARKER = "passed:"
CPU_PART_PASSED = "CPU part passed; GPU part not graded on this machine"



class CheckFailed(AssertionError):
    """An exercise check did not pass; the message says what was expected and what was seen."""


@dataclass(frozen=True)
class Exercise:
    """One graded exercise: how to feed the student's answer and how to judge what came back."""

    grade_id: str
    entry: str  # the name the solution cell defines (a function, a class or a value)
    probe: Callable[[Any, dict], dict]
    judge: Callable[[dict, dict], str]
    inputs: Callable[[], dict] = field(default=lambda: {})
    needs_gpu: bool = False
    cpu_part: bool = False  # a GPU exercise whose probe also checks something on CPU (inputs["gpu"] False)
    timeout_s: float = 120.0  # for the probe, in the grader
    # inputs() that cost real runs (lesson 10's fault reports): the grader builds them once per grading run and
    # gives every submission the same ones (still made afresh for each run, never seen by the student's code
    # before its probe)
    inputs_once: bool = False


_REGISTRY: dict[str, Exercise] = {}


def register(ex: Exercise) -> Exercise:
    """Add an exercise to the registry (a lesson module calls this at import)."""
    if ex.grade_id in _REGISTRY and _REGISTRY[ex.grade_id] is not ex:
        raise ValueError(f"exercise {ex.grade_id!r} is registered twice")
    _REGISTRY[ex.grade_id] = ex
    return ex


def lesson_modules() -> list[str]:
    """The lesson modules that register exercises: every module of this package (checks/<lesson>.py)."""
    import pkgutil

    return sorted(m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_"))


def exercise(grade_id: str) -> Exercise:
    """The registered exercise `grade_id` (imports the lesson modules on first use)."""
    if grade_id not in _REGISTRY:
        for name in lesson_modules():
            try:
                importlib.import_module(f"{__name__}.{name}")
            except ModuleNotFoundError as err:
                if err.name != f"{__name__}.{name}":
                    raise
    if grade_id not in _REGISTRY:
        raise KeyError(f"no check is registered for exercise {grade_id!r} (known: {sorted(_REGISTRY)})")
    return _REGISTRY[grade_id]


def require_gpu_mode() -> bool:
    """True when skips for want of a GPU must fail (set by `make test-gpu`)."""
    return os.environ.get("COURSE_REQUIRE_GPU") == "1"


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Keep file descriptor 2 quiet inside (some torch builds' profiler prints lines on stderr at every run)."""
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def passes(verdict: Callable[..., Any], *args: Any) -> bool:
    """Whether a judge's `verdict(*args)` passes. A probe may ask, only to stop early once a run will fail (the
    grader judges the data afresh, so a probe misled into stopping or going on costs the student only)."""
    try:
        verdict(*args)
    except Exception:
        return False
    return True


def expect(ok: bool, exercise: str, expected: str, seen: Any, hint: str = "") -> None:
    """Raise CheckFailed unless `ok` is exactly True, with a message a student can act on."""
    if type(ok) is not bool:  # a judge compares plain data; a tensor or numpy bool means a bug in the judge
        raise TypeError(f"expect() takes a bool, got {type(ok).__name__}: compare plain data with bool(...)")
    if not ok:
        msg = f"{exercise}: expected {expected}, saw {seen}"
        if hint:
            msg += f". Hint: {hint}"
        raise CheckFailed(msg)


def close(a: float, b: float, rel: float = 1e-6, abs_: float = 0.0) -> bool:
    """math.isclose for plain numbers only (a bool is not a number here)."""
    return _is_number(a) and _is_number(b) and math.isclose(a, b, rel_tol=rel, abs_tol=abs_)


def _is_number(x: Any) -> bool:
    return type(x) in (int, float) and math.isfinite(x)


# ----------------------------------------------------------------------------------------- plain data

_PLAIN_SCALARS = (bool, int, float, str, type(None))


MAX_DECODED_BYTES = 256 << 20  # what a probe's result may take in the judge's memory, once decoded


def plain(data: Any, where: str = "result", budget: list[int] | None = None) -> Any:
    """`data` if it is plain (builtins of exact type, and CPU tensors), else TypeError.

    Exact types: a subclass of float or dict could carry its own __eq__ into a judge. `budget` ([bytes left]),
    when given, is spent on every node and tensor before it is copied (ValueError once it runs out): a small
    pickle can name one object or one tensor's storage many times, and each name becomes a copy here."""
    import torch

    t = type(data)
    if budget is not None:
        budget[0] -= 64 + (len(data) if t is str else data.numel() * data.element_size() if t is torch.Tensor else 0)
        if budget[0] < 0:
            raise ValueError(f"{where}: the result is larger than {MAX_DECODED_BYTES >> 20} MiB once decoded")
    if t in _PLAIN_SCALARS:
        return data
    if t is torch.Tensor:
        return data.detach().cpu().clone()
    if t in (list, tuple):
        return [plain(x, f"{where}[{i}]", budget) for i, x in enumerate(data)]
    if t is dict:
        out = {}
        for k, v in data.items():
            if type(k) is not str:
                raise TypeError(f"{where}: keys must be str, got {type(k).__name__}")
            out[k] = plain(v, f"{where}[{k!r}]", budget)
        return out
    raise TypeError(f"{where}: {t.__module__}.{t.__qualname__} is not plain data (use numbers, str, lists, dicts, "
                    "tensors)")


def to_bytes(data: Any) -> bytes:
    """Serialise plain data for the trip from a probe to a judge."""
    import torch

    buf = io.BytesIO()
    torch.save(plain(data), buf)
    return buf.getvalue()


def _check_archive(raw: bytes) -> None:
    """ValueError unless `raw` is a torch.save archive whose records are stored as they are (to_bytes writes no
    other kind): a compressed record could decode to far more than the bytes that came over the pipe."""
    import zipfile

    try:
        records = zipfile.ZipFile(io.BytesIO(raw)).infolist()
    except (zipfile.BadZipFile, ValueError) as e:
        raise ValueError(f"not an archive that to_bytes writes ({e})") from None
    total = 0
    for r in records:
        if r.compress_type != zipfile.ZIP_STORED or r.file_size != r.compress_size:
            raise ValueError(f"record {r.filename!r} is compressed; to_bytes stores records as they are")
        total += r.file_size
    if total > len(raw):
        raise ValueError("its records claim more bytes than the archive holds")


def from_bytes(raw: bytes, limit: int = MAX_DECODED_BYTES) -> Any:
    """The inverse of to_bytes, with torch's weights-only unpickler: no code of the sender's runs here, and what
    it decodes stays under `limit` bytes (records checked before loading, copies counted before they are made)."""
    import torch

    _check_archive(raw)
    return plain(torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu"), budget=[limit])


# ----------------------------------------------------------------------------------------- in a notebook


def _skip(grade_id: str, detail: str = "") -> None:
    if require_gpu_mode():
        raise CheckFailed(f"{grade_id}: needs a GPU, and COURSE_REQUIRE_GPU=1 forbids skipping it")
    # One statement of what counted: the CPU part's pass when there was one, else that nothing was graded
    print(f"{SKIP_MARKER} ({grade_id}: " + (detail or "it runs on CUDA, which this machine lacks: not graded here")
          + ")")


def _not_attempted(grade_id: str) -> None:
    # In the lab (`make lab`), Run All goes on past an exercise the learner has not started yet.
    print(f"{NOT_ATTEMPTED_MARKER} {grade_id} (write your answer in place of `raise NotImplementedError()` above, "
          "then run this cell again; the lesson goes on meanwhile)")


def _unsolved(err: BaseException, answer: Any) -> bool:
    """Whether `err` comes from the stub: a NotImplementedError here, or a check failure that reports one (from
    a rank the check launched) while the answer's source still holds `raise NotImplementedError()`."""
    if isinstance(err, NotImplementedError):
        return True
    if "NotImplementedError" not in str(err):
        return False
    import inspect

    try:
        return "raise NotImplementedError()" in inspect.getsource(answer)
    except (OSError, TypeError):  # no source to read (a builtin, a value)
        return False


def _is_theirs(filename: str) -> bool:
    """Whether a traceback frame's file is the learner's (a notebook cell), not the course's package or a library."""
    import sys

    ours = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return not filename.startswith((ours, sys.prefix, sys.base_prefix)) and not filename.startswith("<frozen")


def _line_of_theirs(frames: list[tuple[str, int, str, str]]) -> str:
    """ ", in line N of your code: `...`" for the last of (file, line number, function, source) that is the
    learner's, or "" where there is none. The source comes from linecache where the frame lacks it (a rank's
    traceback names the cell's file, which only the kernel that ran the cell can read)."""
    import linecache

    theirs = [f for f in frames if _is_theirs(f[0])]
    if not theirs:
        return ""
    filename, lineno, function, line = theirs[-1]
    line = (line or linecache.getline(filename, lineno)).strip()
    return f", in line {lineno} of your code: `{line}`" if line else f", in line {lineno} of your {function}"


def _your_line(err: BaseException) -> str:
    """Where the learner's own code raised `err` (see _line_of_theirs)."""
    import traceback

    return _line_of_theirs([(f.filename, f.lineno, f.name, f.line) for f in traceback.extract_tb(err.__traceback__)])


def rank_error(err: Any) -> str:
    """One line for a rank that failed (a launch.WorkerError): "rank 2: IndexError: tuple index out of range, in
    line 9 of your code: `...`", without the launcher's or the checker's frames."""
    import re

    frames = re.findall(r'^\s*File "([^"]+)", line (\d+), in (\S+)\n(?:    (?!\s*File ")(.*)\n)?',
                        err.traceback + "\n", re.M)
    lines = [ln for ln in str(err).splitlines() if ln.strip()]
    summary = (lines[0] if lines else err.exc_type).removeprefix(f"rank {err.rank} failed first: ")
    return f"rank {err.rank}: {summary[:600]}" + _line_of_theirs([(f, int(n), fn, src) for f, n, fn, src in frames])


def check(grade_id: str, answer: Any) -> None:
    """Run exercise `grade_id` on the student's `answer`, here, and print the verdict.

    The check cell of every exercise is one call of this. A NotImplementedError from the student's stub
    is left to propagate (the exercise is then "not attempted")."""
    ex = exercise(grade_id)
    gpu = gpu_available()
    if ex.needs_gpu and not gpu and not ex.cpu_part:
        _skip(grade_id)
        return
    inputs = plain({**ex.inputs(), "gpu": gpu})
    try:
        result = ex.probe(answer, inputs)
    except (CheckFailed, NotImplementedError) as err:
        if os.environ.get(LAB_ENV) != "1" or not _unsolved(err, answer):
            raise
        _not_attempted(grade_id)
        return
    except Exception as err:  # the learner's code failed: say where in it, not where in the checker
        where = _your_line(err)
        if not where:
            raise
        raise CheckFailed(f"{grade_id}: your code raised {type(err).__name__}: {err}{where}") from None
    data = from_bytes(to_bytes(result))  # the same plain-data trip the grader makes
    try:
        detail = ex.judge(inputs, data)
    except CheckFailed as err:  # ranks that raised the stub's error come back as data, judged here
        if os.environ.get(LAB_ENV) != "1" or not _unsolved(err, answer):
            raise
        _not_attempted(grade_id)
        return
    if ex.needs_gpu and not gpu:
        _skip(grade_id, CPU_PART_PASSED)
        return
    print(f"{PASS_MARKER} {grade_id}" + (f" ({detail})" if detail else ""))


def passed(exercise: str, detail: str = "") -> None:
    """Print the pass line (kept for callers that report a pass themselves)."""
    print(f"{PASS_MARKER} {exercise}" + (f" ({detail})" if detail else ""))

