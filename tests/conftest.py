"""Shared test set-up.

COURSE_REQUIRE_GPU=1 (set by `make test-gpu`) turns every skip for want of a GPU into a failure, so a
GPU run proves the GPU paths instead of quietly skipping them. Skips for other reasons (an optional tool
missing) stay skips, and so do tests marked `multigpu` on a machine with a single GPU.
"""

from __future__ import annotations

import functools
import os
import re
from pathlib import Path

import pytest

REQUIRE_GPU = os.environ.get("COURSE_REQUIRE_GPU") == "1"


@functools.cache
def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # torch missing or broken: treat as no GPU
        return 0


def is_gpu_skip(reason: str) -> bool:
    """A skip that means 'no GPU here' (as opposed to, say, an optional tool missing)."""
    return bool(re.search(r"\b(GPU|GPUs|CUDA|cuda|NCCL)\b", reason))


def pytest_collection_modifyitems(config, items):
    n = _cuda_count()
    for item in items:
        if "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more GPUs"))


@functools.cache
def _file_times_the_gpu(path: str) -> bool:
    """A test file (or notebook) whose GPU timings a parallel test on the same GPU would distort: the notebooks,
    the lesson and exercise tests, and any file with a test marked gpu or multigpu."""
    p = Path(path)
    if p.suffix == ".ipynb" or p.name.startswith(("test_lesson", "test_exercises")):
        return True
    try:
        return bool(re.search(r"mark\.(gpu|multigpu)\b", p.read_text()))
    except OSError:
        return False


@pytest.hookimpl(optionalhook=True)  # `-p no:xdist` runs have no such hook
def pytest_xdist_make_scheduler(config, log):
    """Schedule `--dist loadgroup` runs by file, and every file that times the GPU in one group ("cuda").

    One file's tests run in one worker, so a module's expensive fixtures (a grading lab, a notebook kernel, a
    pool of ranks) are built once; on a GPU box the files that time the GPU run one after another in one worker,
    as kernels of a parallel test queued on the same GPU would make concurrency appear or vanish. (xdist's own
    loadgroup reads xdist_group marks through the item's old `_nodeid`, which pytest 9 no longer uses: it
    silently scheduled test by test.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath

    class FileOrCuda(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "cuda" if _cuda_count() and _file_times_the_gpu(str(root / path)) else path

    return FileOrCuda(config, log)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (REQUIRE_GPU and report.skipped):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    more_than_here = "multigpu" in item.keywords and _cuda_count() < 2
    if is_gpu_skip(reason) and not more_than_here:
        report.outcome = "failed"
        report.longrepr = f"skipped for want of a GPU under COURSE_REQUIRE_GPU=1: {reason}"
