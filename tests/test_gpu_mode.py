"""`make test-gpu` must fail when a GPU test is skipped: prove the conftest rule with a nested pytest run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import is_gpu_skip

ROOT = Path(__file__).resolve().parents[1]

SAMPLE = '''
import pytest

def test_needs_gpu():
    pytest.skip("needs a GPU")

def test_optional_tool():
    pytest.skip("jupyterlab is not installed here")
'''


def test_gpu_skip_reasons():
    assert is_gpu_skip("needs a GPU") and is_gpu_skip("needs two or more GPUs") and is_gpu_skip("CUDA only")
    assert not is_gpu_skip("jupyterlab is not installed here")


@pytest.mark.parametrize("require", ["0", "1"])
def test_require_gpu_turns_gpu_skips_into_failures(tmp_path, require):
    (tmp_path / "test_sample.py").write_text(SAMPLE)
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    env = {**os.environ, "COURSE_REQUIRE_GPU": require}
    res = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120,
    )
    if require == "1":
        assert res.returncode == 1, res.stdout
        assert "1 failed" in res.stdout and "1 skipped" in res.stdout
    else:
        assert res.returncode == 0, res.stdout
        assert "2 skipped" in res.stdout
