"""A zygote (course_utils/launch/zygote.py) forks the fork servers of a process that started one, as a grader's
probe does before the solution runs: its ranks must look like those of a fresh server (own session, own seeds,
no inherited fds, OMP_NUM_THREADS honoured), see nothing the launcher changed after the zygote started, and die
with the launcher; a zygote that is gone means a fresh server, not an error.

Each case runs in a fresh interpreter (tests/fixtures/zygote_launcher.py): a zygote is a fork of its launcher,
which must be single-threaded when it forks, and a pytest worker is not."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = Path(__file__).parent / "fixtures" / "zygote_launcher.py"


def launcher(case: str, tmp_path: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, str(LAUNCHER), case], cwd=tmp_path, stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONPATH": str(ROOT), **env})


def report(case: str, tmp_path: Path, **env: str) -> dict:
    proc = launcher(case, tmp_path, **env)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    return json.loads(out.splitlines()[-1])


def assert_gone(pids: list[int], timeout: float = 20) -> None:
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        left = [p for p in procs if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"still running: {left}")


@pytest.mark.timeout(180)
def test_ranks_of_a_zygote_look_like_fresh_ones_and_see_no_later_change(tmp_path):
    seen = report("compare", tmp_path)
    zygote, fresh, forked = seen["zygote"], seen["fresh"], seen["forked"]
    # the fresh server is the launcher's child; the zygote's server is the zygote's
    assert {r["server_parent"] for r in fresh.values()} == {seen["launcher"]}
    assert {r["server_parent"] for r in forked.values()} == {zygote}
    assert forked["0"]["server_cmdline"] == seen["launcher_cmdline"]  # a fork of the launcher: no new python
    assert "course_utils.launch.forkserver" in fresh["0"]["server_cmdline"]
    for ranks in (fresh, forked):
        for rank, r in ranks.items():
            assert r["sid"] == r["pid"] and r["rank"] == rank
            assert r["threads"] == 1  # OMP_NUM_THREADS=1 from the launcher, though the zygote's torch had 2
            assert r["cwd"] == seen["cwd"]  # the launcher's cwd at the launch, not when the zygote started
            assert r["patched"] is False  # the launcher replaced dist.all_reduce after the zygote started
            assert r["stale_env"] is False  # nor an environment variable it had then
            assert r["debug"].endswith("DETAIL")  # TORCH_DISTRIBUTED_DEBUG set after the zygote started
        for key in ("seed", "numpy", "random"):  # numpy is imported in the zygote: reseeded all the same
            assert len({r[key] for r in ranks.values()}) == 3, (key, ranks)
    # no fd of the launcher's (its secret pipe) reaches a rank: as many pipes as a fresh server's ranks hold
    assert seen["secret"] not in {p for r in forked.values() for p in r["pipes"]}
    assert [len(r["pipes"]) for r in forked.values()] == [len(r["pipes"]) for r in fresh.values()]
    assert seen["left"] == []  # after the launches: nothing below the launcher but the zygote


@pytest.mark.timeout(120)
def test_a_zygote_that_is_gone_means_a_fresh_server(tmp_path):
    seen = report("killed", tmp_path)
    assert seen["ranks"] == {"0": "0", "1": "1"}
    assert "course_utils.launch.forkserver" in seen["server_cmdline"]


@pytest.mark.timeout(120)
def test_nothing_outlives_a_launcher_that_dies_with_a_pool_open(tmp_path):
    proc = launcher("abandon", tmp_path)
    line = proc.stdout.readline()
    pids = json.loads(line)
    assert len(pids["ranks"]) == 2 and pids["server"] and pids["zygote"]
    proc.kill()
    proc.wait()
    assert_gone([pids["zygote"], pids["server"], *pids["ranks"]])


@pytest.mark.timeout(120)
def test_this_sessions_launches_are_forked_by_its_spawned_zygote():
    """tests/conftest.py has every pytest process spawn a zygote on its first launch of CPU ranks: a fresh
    interpreter that imported torch once, whose forks serve every later launch."""
    from course_utils import launch
    from course_utils.launch import zygote
    from tests.launch_helpers import cell_function

    where = cell_function("""
        import os

        def where():
            with open(f"/proc/{os.getppid()}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[1])
    """, "where")
    z = zygote.current()
    assert z is not None and z.proc is not None
    assert "course_utils.launch.zygote" in " ".join(psutil.Process(z.pid).cmdline())
    assert set(launch.run(where, nproc=2, backend="gloo").values()) == {z.pid}
    with launch.Pool(2, backend="gloo") as pool:
        assert set(pool.run(where).values()) == {z.pid}
