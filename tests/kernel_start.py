"""A Jupyter kernel that died before it ran a cell is started again, with a warning.

It happened once in a CI run (04_async_memcpy under nbmake: "Kernel died before replying to kernel_info"), and
nbmake's own parallel runs show it (treebeardtech/nbmake#129: the port jupyter_client picked for the kernel was
taken before the kernel bound it). Nothing of the notebook has run then, so starting again is safe. A kernel
that dies while running a cell is a failure as before."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TypeVar

KERNEL_START_FAILED = "Kernel died before replying to kernel_info"  # jupyter_client's words
KERNEL_STARTS = 3

T = TypeVar("T")


def retrying_kernel_start(run: Callable[[], T], name: str) -> Callable[[], T]:
    """`run` (which starts a kernel and runs a notebook), called again up to KERNEL_STARTS times in all while its
    kernel dies before running a cell; each new start is warned about, naming `name`."""

    def again() -> T:
        for start in range(1, KERNEL_STARTS + 1):
            try:
                return run()
            except RuntimeError as exc:
                if KERNEL_START_FAILED not in str(exc) or start == KERNEL_STARTS:
                    raise
                warnings.warn(f"{name}: the Jupyter kernel died before it ran a cell ({exc}); "
                              f"starting a new one ({start + 1} of {KERNEL_STARTS})", stacklevel=2)
        raise AssertionError("unreachable")

    return again
