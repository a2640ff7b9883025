"""Shared test set-up.

COURSE_REQUIRE_GPU=1 (set by `make test-gpu`) turns every skip into a failure, so a GPU run proves
the GPU paths instead of quietly skipping them.
"""

from __future__ import annotations

import os

import pytest

REQUIRE_GPU = os.environ.get("COURSE_REQUIRE_GPU") == "1"


def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # torch missing or broken: treat as no GPU
        return 0


def pytest_collection_modifyitems(config, items):
    n = _cuda_count()
    for item in items:
        if "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more GPUs"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if REQUIRE_GPU and report.skipped:
        # In a GPU run a skip means a GPU path went unproven.
        report.outcome = "failed"
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        report.longrepr = f"skipped under COURSE_REQUIRE_GPU=1: {reason}"
