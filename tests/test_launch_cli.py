"""%%torchrun --cli: the real torchrun CLI, its output in the cell, and its shutdown: SIGTERM first, then
killing after a grace period, never a signal to a pid already reaped, nothing left running."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import time

import pytest

from course_utils.launch import LaunchError, WorkerTimeout, cli, procs
from tests.launch_helpers import (
    alive,
    assert_clean,
    assert_gone,
    snapshot,
    tcpstore_warmed,  # noqa: F401  (an autouse fixture)
)

pytestmark = pytest.mark.ranks


@pytest.fixture(scope="module")
def shell():
    from IPython.core.interactiveshell import InteractiveShell

    ip = InteractiveShell.instance()
    ip.run_line_magic("load_ext", "course_utils")
    return ip


@pytest.mark.timeout(120)
def test_torchrun_magic_cli_uses_the_real_torchrun(shell, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # to see that the private directory goes away
    before = snapshot()
    cell = "import os\nprint('rank', os.environ['RANK'], 'port', os.environ['MASTER_PORT'], flush=True)\n"
    shell.run_cell_magic("torchrun", "-n 2 --backend gloo --cli --ranks 1", cell)
    captured = capsys.readouterr()
    out = captured.out
    assert "$ torchrun --standalone --nproc-per-node=2" in out and "--local-ranks-filter=1" in out
    assert "[rank 1] rank 1 port" in out and "rank 0 port" not in out
    assert "OMP_NUM_THREADS" not in captured.err  # torchrun's banner shows only when it had to set it
    with pytest.raises(LaunchError, match="torchrun exited with code 1"):
        shell.run_cell_magic("torchrun", "-n 2 --backend gloo --cli", "raise SystemExit(7)")
    assert list(tmp_path.iterdir()) == []
    assert_clean(before)


def _worker_pids(text: str) -> list[int]:
    return [int(p) for p in re.findall(r"WORKER PID (\d+)", text)]


HANG = """\
import os, signal, time
{ignore}print("WORKER PID", os.getpid(), flush=True)
if dist.get_rank() == 0:
    dist.barrier()
else:
    time.sleep(300)
"""


@pytest.mark.timeout(120)
def test_a_cli_hang_ends_at_the_timeout_with_stacks_and_nothing_left(capsys):
    before = snapshot()
    with pytest.raises(WorkerTimeout) as info:
        cli.run_cli(HANG.format(ignore=""), nproc=2, backend="gloo", timeout=25)  # torchrun starts slowly
    pids = _worker_pids(capsys.readouterr().out)
    assert len(pids) == 2
    err = info.value
    assert err.running == [0, 1]
    assert 'File "<torchrun cell>", line 4, in <module>\n    dist.barrier()' in err.stacks[0]
    assert 'File "<torchrun cell>", line 6, in <module>\n    time.sleep(300)' in err.stacks[1]
    assert_gone(pids)
    assert_clean(before)


@pytest.mark.timeout(120)
def test_workers_that_ignore_sigterm_are_killed_after_the_grace_period(capsys, monkeypatch):
    monkeypatch.setenv("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", "120")  # torchrun would wait that long for them
    monkeypatch.setattr(cli, "SHUTDOWN_GRACE", 2.0)
    before = snapshot()
    ignore = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    start = time.monotonic()
    with pytest.raises(WorkerTimeout):
        cli.run_cli(HANG.format(ignore=ignore), nproc=2, backend="gloo", timeout=25)
    assert time.monotonic() - start < 25 + 2.0 + 10
    pids = _worker_pids(capsys.readouterr().out)
    assert len(pids) == 2
    assert_gone(pids)
    assert_clean(before)


def test_stopping_never_signals_a_process_already_reaped(monkeypatch):
    proc = subprocess.Popen([sys.executable, "-c", "pass"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True)
    while procs.exit_code(proc) is None:  # exited, but not reaped: its pid is still reserved for us
        time.sleep(0.01)
    assert procs.exit_code(proc) == 0 and proc.returncode is None
    proc.wait()
    sent = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: sent.append(("kill", pid, sig)))
    monkeypatch.setattr(os, "killpg", lambda pid, sig: sent.append(("killpg", pid, sig)))
    cli.stop(proc)
    procs.kill_group(proc)
    assert sent == []
    proc.stdout.close()
    proc.stderr.close()


def test_exit_codes_are_read_without_reaping():
    proc = subprocess.Popen([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)"])
    while procs.exit_code(proc) is None:
        time.sleep(0.01)
    assert procs.exit_code(proc) == -signal.SIGTERM and proc.returncode is None and alive([proc.pid]) == []
    assert proc.wait() == -signal.SIGTERM
