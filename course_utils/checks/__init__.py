"""Exercise checks. Each check says what was expected and what it saw.

A check cell calls one function from here or from a lesson submodule (checks/streams.py, ...). Outcomes:
- passed: the function returns (and prints a one-line "passed: ..." message);
- failed: it raises `CheckFailed` with "expected ..., saw ..." in the message;
- skipped: a check that needs CUDA prints a line starting with SKIP_MARKER and returns, so the notebook
  goes on on a CPU-only machine. Under COURSE_REQUIRE_GPU=1 (`make test-gpu`) a skip is a failure.
- not attempted: the grader's name for an exercise whose solution cell (or the check, calling the student's
  code) raised NotImplementedError, the stub that student versions carry.
The grader (course_utils.grade) reads these outcomes from the check cell's result, so a check must not catch
NotImplementedError (or print SKIP_MARKER) on the student's behalf.
"""

from __future__ import annotations

import os
from typing import Any

SKIP_MARKER = "skipped: needs a GPU"
PASS_MARKER = "passed:"


class CheckFailed(AssertionError):
    """An exercise check did not pass; the message says what was expected and what was seen."""


def require_gpu_mode() -> bool:
    """True when skips for want of a GPU must fail (set by `make test-gpu`)."""
    return os.environ.get("COURSE_REQUIRE_GPU") == "1"


def gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def needs_gpu(exercise: str) -> bool:
    """Return True if CUDA is here; otherwise report the exercise as skipped and return False.

    Use as the first line of a CUDA-only check:  `if not needs_gpu("streams"): return`
    """
    if gpu_available():
        return True
    if require_gpu_mode():
        raise CheckFailed(f"{exercise}: needs a GPU, and COURSE_REQUIRE_GPU=1 forbids skipping it")
    print(f"{SKIP_MARKER} ({exercise} runs on CUDA; this machine has none, so it is not graded here)")
    return False


def expect(ok: bool, exercise: str, expected: str, seen: Any, hint: str = "") -> None:
    """Raise CheckFailed unless `ok`, with a message a student can act on."""
    if not ok:
        msg = f"{exercise}: expected {expected}, saw {seen}"
        if hint:
            msg += f". Hint: {hint}"
        raise CheckFailed(msg)


def passed(exercise: str, detail: str = "") -> None:
    """Print the pass line (the grader and the student both read it)."""
    print(f"{PASS_MARKER} {exercise}" + (f" ({detail})" if detail else ""))
