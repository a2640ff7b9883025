"""%%torchrun --cli: the cell as a script, run by the real torchrun CLI, its output streamed into the cell.

Stopping it (timeout, Ctrl-C) goes the way torchrun expects: SIGTERM to torchrun, whose elastic agent
stops its workers; only if it has not finished after a grace period is it stopped (SIGSTOP, so it cannot
reap a worker whose pid could then be reused) and killed, its workers with it.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable

from . import procs, stacks
from .env import device_environment, pythonpath
from .errors import LaunchError, WorkerTimeout, signal_name
from .group import STACK_WAIT, deadline_after
from .options import check_nproc, check_ranks, check_timeout, pick_backend, pick_gpus
from .output import RankOutput, flush
from .pickling import dumps_code

TORCHRUN_SHUTDOWN = 3  # seconds torchrun's agent gives its workers after SIGTERM (TORCH_ELASTIC_SHUTDOWN_TIMEOUT)
SHUTDOWN_GRACE = 5.0  # seconds we give torchrun after SIGTERM before killing it and its workers

_PREAMBLE = '''\
# A %%torchrun --cli cell as a script, run by the real torchrun CLI: the same code, the production path.
import os

import torch
import torch.distributed as dist
{stack_dump}
backend = {backend!r}
if backend == "nccl":
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)  # each rank owns its GPU
    dist.init_process_group(backend, device_id=torch.device("cuda", local_rank))
else:
    dist.init_process_group(backend)
# ---- the cell ----
'''
_STACK_DUMP = '''
# (course_utils) at the launcher's timeout, write where this rank is, for the timeout's error message
import faulthandler
import time

_stacks = open(os.path.join({folder!r}, f"stack-{{os.environ['RANK']}}.txt"), "w")
faulthandler.dump_traceback_later(max(0.1, {deadline!r} - time.time()), file=_stacks)
'''
_POSTAMBLE = "\n# ---- end of the cell ----\ndist.destroy_process_group()\n"


def cli_command(script: str, nproc: int, ranks: frozenset[int] | None = None, log_dir: str | None = None) -> list[str]:
    """The torchrun command line that %%torchrun --cli runs (python -m torch.distributed.run is torchrun)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", "--tee=3"]
    if log_dir:
        cmd.append(f"--log-dir={log_dir}")
    if ranks is not None:
        cmd.append(f"--local-ranks-filter={','.join(map(str, sorted(ranks)))}")
    return cmd + [script]


def run_cli(source: str, nproc: int = 2, backend: str = "auto", timeout: float | None = 120.0,
            ranks: Iterable[int] | None = None, gpus: bool | None = None) -> None:
    """Run a cell's source through the real torchrun CLI (%%torchrun --cli), streaming its output here.

    The cell is written, after a preamble that initialises the process group, to a script in a private
    temporary directory (removed afterwards). Raises LaunchError if torchrun fails, WorkerTimeout at the
    timeout (with where each rank was); either way torchrun and its workers are gone.
    """
    __tracebackhide__ = True
    nproc, timeout = check_nproc(nproc), check_timeout(timeout)
    show = check_ranks(ranks, nproc)
    dumps_code(source, "<torchrun cell>")  # a syntax error is reported here, before any process starts
    backend = pick_backend(backend, nproc)
    env_devices = device_environment(backend, pick_gpus(gpus, backend))
    tmp = tempfile.mkdtemp(prefix="course-torchrun-")
    proc = None
    try:
        script = os.path.join(tmp, "cell.py")
        dump = "" if timeout is None else _STACK_DUMP.format(folder=tmp, deadline=time.time() + timeout)
        preamble = _PREAMBLE.format(backend=backend, stack_dump=dump)
        with open(script, "w") as f:
            f.write(preamble + source + _POSTAMBLE)
        as_cell = {script: ("<torchrun cell>", preamble.count("\n"))}  # stacks show the cell's own line numbers
        cmd = cli_command(script, nproc, show, os.path.join(tmp, "logs"))
        print("$ torchrun " + " ".join(cmd[3:]), flush=True)
        env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=tmp, PYTHONPATH=pythonpath(), **env_devices)
        env.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", str(TORCHRUN_SHUTDOWN))
        output = RankOutput(nproc)  # torchrun filters ranks itself (--local-ranks-filter)
        deadline = deadline_after(timeout)
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
        with _Streams(proc, output) as streams:
            if not streams.until(lambda: streams.done(), deadline):
                found = _stacks_at_timeout(streams, tmp, nproc)
                output.end_all()
                raise WorkerTimeout(timeout, sorted(found) or list(range(nproc)), output.last,
                                    {r: stacks.readable(text, as_cell) for r, text in found.items()})
            code = procs.exit_code(proc)
        if code != 0:
            raise LaunchError(f"torchrun exited with code {code}{signal_name(code)}; its report is above")
    finally:
        if proc is not None:
            stop(proc)
            proc.stdout.close()
            proc.stderr.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _stacks_at_timeout(streams: _Streams, folder: str, nproc: int) -> dict[int, str]:
    """The ranks' faulthandler dumps, written at the deadline by the ranks still running (give them a moment)."""
    def read() -> dict[int, str]:
        found = {}
        for rank in range(nproc):
            try:
                with open(os.path.join(folder, f"stack-{rank}.txt")) as f:
                    text = f.read()
            except OSError:
                continue
            if text.strip():
                found[rank] = text
        return found

    seen: dict[int, str] = {}
    quiet_since = time.monotonic()

    def settled() -> bool:
        nonlocal seen, quiet_since
        now, current = time.monotonic(), read()
        if current != seen:
            seen, quiet_since = current, now
        return bool(seen) and now - quiet_since > 0.3

    streams.until(settled, time.monotonic() + STACK_WAIT)
    return read()


def stop(proc: subprocess.Popen) -> None:
    """End torchrun and its workers, politely first; reap torchrun. Never signals a reaped pid."""
    interrupted = None
    if procs.exit_code(proc) is None:
        os.kill(proc.pid, signal.SIGTERM)  # not reaped (exit_code leaves it a zombie at worst): still ours
        try:
            with _Streams(proc, None) as streams:  # keep its pipes flowing; its shutdown noise is not news
                streams.until(lambda: procs.exit_code(proc) is not None, time.monotonic() + SHUTDOWN_GRACE)
        except KeyboardInterrupt as exc:  # Ctrl-C again while waiting: skip the rest of the grace period
            interrupted = exc
    if procs.exit_code(proc) is None:
        # Stopped, torchrun cannot reap its workers, so their pids stay theirs while we kill them. Each leads
        # its own session (torchrun starts them so), so killing its group reaches what it started too.
        os.kill(proc.pid, signal.SIGSTOP)
        for child in procs.children(proc.pid):
            for kill in (os.killpg, os.kill):
                try:
                    kill(child, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
        procs.kill_group(proc)
    proc.wait()
    if interrupted is not None:
        raise interrupted


class _Streams:
    """torchrun's stdout and stderr, read without blocking; printed through RankOutput, or discarded."""

    def __init__(self, proc: subprocess.Popen, output: RankOutput | None):
        self.proc, self.output = proc, output
        self.sel = selectors.DefaultSelector()
        for f, stream in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
            if not f.closed:
                os.set_blocking(f.fileno(), False)
                self.sel.register(f.fileno(), selectors.EVENT_READ, stream)

    def __enter__(self) -> _Streams:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.output is not None:
            self.output.end_all()
        self.sel.close()

    def done(self) -> bool:
        return not self.sel.get_map() and procs.exit_code(self.proc) is not None

    def until(self, condition, deadline: float | None) -> bool:
        """Stream until condition() holds (True) or the deadline passes (False)."""
        while not condition():
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                return False
            wait = 0.1 if deadline is None else max(0.0, min(0.1, deadline - now))
            if not self.sel.get_map():
                time.sleep(wait)
                continue
            for key, _ in self.sel.select(wait):
                try:
                    data = os.read(key.fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    self.sel.unregister(key.fd)
                    if self.output is not None:
                        self.output.end(key.fd)
                elif self.output is not None:
                    self.output.feed(key.fd, data, key.data, None)
            flush()
        return True
