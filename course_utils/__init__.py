"""Helpers for the course: hardware facts, launching ranks from a cell, timelines, checks.

Submodules are imported lazily (`cu.launch`, `cu.timeline`, ...) so `import course_utils` is cheap
and never initialises CUDA.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_SUBMODULES = {"hardware", "launch", "timeline", "measure", "bench", "reference", "checks", "grading", "grade",
               "release", "widgets", "bucket_explorer", "plot_ranks"}


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name == "doctor":
        return importlib.import_module(f"{__name__}.hardware").doctor
    raise AttributeError(f"module 'course_utils' has no attribute {name!r}")


def load_ipython_extension(ipython) -> None:
    """`%load_ext course_utils` registers the %%torchrun and %%ranks cell magics."""
    from .launch.magics import load_ipython_extension as _load

    _load(ipython)
