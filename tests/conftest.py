"""Shared test set-up.

COURSE_REQUIRE_GPU=1 (set by `make test-gpu`) turns every skip for want of a GPU into a failure, so a
GPU run proves the GPU paths instead of quietly skipping them. Skips for other reasons (an optional tool
missing) stay skips, and so do tests marked `multigpu` on a machine with a single GPU.
"""

from __future__ import annotations

import functools
import os
import re

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


def times_the_gpu(item) -> bool:
    """Tests whose GPU timings would be distorted by another test process using the same GPU."""
    path = item.path
    return ("gpu" in item.keywords or "multigpu" in item.keywords or path.suffix == ".ipynb"
            or path.name.startswith(("test_lesson", "test_exercises")))


def pytest_collection_modifyitems(config, items):
    n = _cuda_count()
    for item in items:
        if "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more GPUs"))
        # With `--dist loadgroup` (the Makefile) a group runs in one xdist worker. Tests that time the GPU
        # share one group, so they run one after another: kernels of a parallel test queued on the same GPU
        # would delay ours and make concurrency appear or vanish. Other tests are grouped by file (as
        # --dist loadfile would), so a module's fixtures are built once.
        group = "cuda" if n and times_the_gpu(item) else str(item.path)
        item.add_marker(pytest.mark.xdist_group(group))


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
