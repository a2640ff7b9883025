"""Run a notebook that may misbehave: fresh sandboxed kernel, time limits, capped output, no leftovers.

The grader runs a submission's notebook only to hand it back as feedback (--executed-dir): verdicts come
from probes (grading/probe.py), never from this run. Still, the kernel runs a student's code, so it runs in
bubblewrap as a probe does (grading/sandbox.py: a throwaway folder, its own namespaces, an unprivileged uid), and
talks to us over Unix sockets in its folder (ZeroMQ's ipc transport: the kernel has no network of ours).

Built on nbclient's cell machinery, with what grading untrusted notebooks needs on top:
- every cell runs even after an error (like the grader of a course: a broken exercise must not zero the rest);
- a cell past its time limit is interrupted; if the kernel ignores the interrupt it is killed and the
  remaining cells are reported as not run; the whole notebook has its own limit too;
- a kernel that dies (os._exit, a crash) ends the run; the cells after it are "not run";
- output kept per cell and per notebook is capped (a cell printing 100 MB costs memory only once, in transit);
- the kernel, its process group and its other descendants are killed at the end, whatever happened.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import nbformat
from jupyter_client.manager import AsyncKernelManager
from nbclient import NotebookClient
from nbclient.exceptions import DeadKernelError

from . import sandbox as sandboxing
from .sandbox import Sandbox

TIMEOUT_ENAME = "CellTimeoutError"
CUT_NOTE = "\n[grader: output cut here; it passed the limit of {} characters]\n"


@dataclass
class CellRun:
    """What happened to one cell. status: ok, error, timeout, not run (code cells only)."""

    index: int
    status: str
    ename: str = ""
    evalue: str = ""
    stdout: str = ""
    seconds: float = 0.0


@dataclass
class NotebookRun:
    cells: dict[int, CellRun] = field(default_factory=dict)
    stopped: str = ""  # why the run ended before the last cell, empty if it did not
    seconds: float = 0.0
    nb: object = None  # the executed notebook, outputs capped


class _SandboxedKernelManager(AsyncKernelManager):
    """Starts the usual kernel command inside bubblewrap (sandbox.command), when `box` is set."""

    box: Sandbox | None = None
    gpus: list[str] = []
    read_only: list[str] = []
    environ: dict[str, str] = {}

    def format_kernel_cmd(self, extra_arguments=None):
        cmd = super().format_kernel_cmd(extra_arguments)
        if self.box is None:
            return cmd
        # A signal to our process would not reach the kernel (bubblewrap gives it a session of its own): ask the
        # kernel itself to interrupt, over its control channel.
        self.kernel_spec.interrupt_mode = "message"
        return sandboxing.command(self.box, cmd, gpus=self.gpus, read_only=self.read_only, environ=self.environ)

    def write_connection_file(self, **kw):
        super().write_connection_file(**kw)
        if self.box is not None and os.geteuid() == 0:  # the kernel runs as the sandbox's uid and reads it
            os.chown(self.connection_file, sandboxing.SANDBOX_UID, sandboxing.SANDBOX_UID)


class _GradingClient(NotebookClient):
    """NotebookClient that caps the output it keeps and remembers each cell's output-reading task."""

    def __init__(self, nb, max_cell_output: int, max_total_output: int, **kw):
        super().__init__(nb, **kw)
        self.max_cell_output = max_cell_output
        self.max_total_output = max_total_output
        self.total_output = 0
        self.cell_output: dict[int, int] = {}
        self.cut_cells: set[int] = set()
        self.output_task: asyncio.Task | None = None
        self.replies: dict[int, dict] = {}
        self.on_cell_executed = self._record_reply

    def _record_reply(self, cell, cell_index, execute_reply=None, **_):
        self.replies[cell_index] = (execute_reply or {}).get("content", {})

    async def _async_poll_output_msg(self, parent_msg_id, cell, cell_index):
        self.output_task = asyncio.current_task()
        return await super()._async_poll_output_msg(parent_msg_id, cell, cell_index)

    def output(self, outs, msg, display_id, cell_index):
        content = msg.get("content", {})
        kind = msg.get("msg_type")
        used = self.cell_output.get(cell_index, 0)
        left = max(0, min(self.max_cell_output - used, self.max_total_output - self.total_output))
        if kind == "error":
            tb = content.get("traceback") or []
            content["traceback"] = tb[:3] + ["..."] + tb[-20:] if len(tb) > 23 else tb
            size = sum(len(t) for t in content["traceback"]) + len(str(content.get("evalue", "")))
            if size > 20_000:  # a huge message string; keep the start, which says what failed
                content["evalue"] = str(content.get("evalue", ""))[:2000]
                content["traceback"] = [t[:2000] for t in content["traceback"][-5:]]
            size = min(size, 20_000)  # error outputs are always kept (the grader reads them)
        elif kind == "stream":
            text = content.get("text", "")
            size = len(text)
            if size > left:
                self._cut(cell_index)
                if not left:
                    return None
                content["text"] = text[:left]
                size = left
        else:
            data = content.get("data", {})
            size = sum(len(v) if isinstance(v, str) else len(str(v)) for v in data.values())
            if size > left:
                self._cut(cell_index)
                return None
        self.cell_output[cell_index] = used + size
        self.total_output += size
        return super().output(outs, msg, display_id, cell_index)

    def _cut(self, cell_index):
        self.cut_cells.add(cell_index)

    def note_cut(self, cell, index: int) -> None:
        """After a cell ran: say in its outputs that some of them were dropped."""
        if index in self.cut_cells:
            limit = min(self.max_cell_output, self.max_total_output)
            cell.outputs.append(nbformat.v4.new_output("stream", name="stderr", text=CUT_NOTE.format(limit)))


def _stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", []) if o.get("output_type") == "stream"
                   and o.get("name") == "stdout")


def _error(cell) -> tuple[str, str]:
    for o in cell.get("outputs", []):
        if o.get("output_type") == "error":
            return o.get("ename", ""), o.get("evalue", "")
    return "", ""


def _client(nb, *, kernel_name, cell_timeout, deadline, max_cell_output, max_total_output) -> _GradingClient:
    """nbclient's client for this run: errors do not stop it, a cell past its limit is interrupted."""
    client = _GradingClient(
        nb,
        max_cell_output,
        max_total_output,
        kernel_name=kernel_name,
        allow_errors=True,
        interrupt_on_timeout=True,
        error_on_timeout={"ename": TIMEOUT_ENAME, "evalue": ""},  # evalue set per cell in _run_cell
        timeout_func=lambda cell: max(1, min(cell_timeout, deadline - time.monotonic())),
        shutdown_kernel="immediate",
        iopub_timeout=4,
        startup_timeout=60,
        record_timing=False,
    )
    client.reset_execution_trackers()
    return client


def _kernel_manager(client, *, kernel_name, box: Sandbox, gpus: list[str], read_only: list[str],
                    sandboxed: bool) -> dict:
    """Give `client` a kernel manager that talks over sockets in the box (in bubblewrap when `sandboxed`);
    returns the keyword arguments that start its kernel with the right environment."""
    # Python finds the checks modules given by file beside the course package.
    python_path = os.pathsep.join(sorted({str(Path(f).parent) for f in read_only}) + sandboxing.python_path())
    cuda = ",".join(str(i) for i in range(len(gpus))) if sandboxed else ",".join(gpus)
    environ = sandboxing.env(box, cuda, {"PYTHONPATH": python_path})
    client.km = _SandboxedKernelManager(kernel_name=kernel_name, transport="ipc", ip=str(box.root / "tmp" / "ipc"),
                                        connection_file=str(box.root / "tmp" / "kernel.json"))
    if not sandboxed:
        return {"env": environ}
    client.km.box, client.km.gpus, client.km.read_only = box, list(gpus), list(read_only)
    client.km.environ = environ
    return {"env": {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}}


async def _run_cell(client, cell, index: int, count: int, limit: float) -> tuple[CellRun, str]:
    """Run one code cell within `limit` seconds: what happened to it, and why the run must stop (or "")."""
    client.error_on_timeout["evalue"] = f"cell {index} ran past its time limit of {limit:.3g} s and was stopped"
    t0 = time.monotonic()
    try:
        await asyncio.wait_for(client.async_execute_cell(cell, index, execution_count=count), limit + 30)
    except DeadKernelError:
        died = "the kernel died (os._exit or a crash)"
        return (CellRun(index, "error", "DeadKernelError", died, _stdout(cell), time.monotonic() - t0),
                f"the kernel died in cell {index}")
    except asyncio.TimeoutError:  # nbclient itself stuck: treat as a kernel that would not stop
        return (CellRun(index, "timeout", TIMEOUT_ENAME, f"cell {index} never finished", _stdout(cell),
                        time.monotonic() - t0), f"cell {index} never finished")
    client.note_cut(cell, index)
    reply = client.replies.get(index, {})
    ename, evalue = _error(cell)
    if reply.get("status") == "error" and reply.get("ename") == TIMEOUT_ENAME:
        ename, evalue = TIMEOUT_ENAME, reply.get("evalue", "")
    elif reply.get("status") == "error" and not ename:
        ename, evalue = reply.get("ename", "Error"), reply.get("evalue", "")
    status = "timeout" if ename == TIMEOUT_ENAME else ("error" if ename else "ok")
    run = CellRun(index, status, ename, evalue, _stdout(cell), time.monotonic() - t0)
    task = client.output_task
    if status == "timeout" and task is not None and task.cancelled():
        # The interrupt did not bring the kernel back to idle: it is stuck; stop here.
        return run, f"the kernel ignored the interrupt after the time limit in cell {index}"
    return run, ""


async def _run_cells(client, nb, result: NotebookRun, *, deadline: float, timeout: float,
                     cell_timeout: float) -> None:
    """Run the code cells in order into `result`, until the notebook's deadline or a reason to stop."""
    code_cells = [i for i, c in enumerate(nb.cells) if c.cell_type == "code" and c.source.strip()]
    for n, index in enumerate(code_cells):
        left = deadline - time.monotonic()
        if left <= 0 or result.stopped:
            if not result.stopped:
                result.stopped = f"the notebook time limit of {timeout:g} s was reached before cell {index}"
            for j in code_cells[n:]:
                result.cells[j] = CellRun(j, "not run")
            return
        limit = max(1, min(cell_timeout, left))
        result.cells[index], stopped = await _run_cell(client, nb.cells[index], index, n + 1, limit)
        result.stopped = stopped or result.stopped


async def _stop_kernel(client, process) -> None:
    """End the kernel and everything it started, whatever state it is in."""
    if process is not None and process.poll() is None:  # not reaped yet: its pid is still ours to signal
        sandboxing.stop(process.pid)  # the sandbox's first process: with it, the kernel and all it started
    try:
        await asyncio.wait_for(client._async_cleanup_kernel(), 15)
    except Exception:  # kernel already dead, or cleanup stuck
        pass


async def _run(nb, *, kernel_name, cwd, cell_timeout, timeout, max_cell_output, max_total_output,
               box: Sandbox, gpus: list[str], read_only: list[str], sandboxed: bool) -> NotebookRun:
    start = time.monotonic()
    deadline = start + timeout
    result = NotebookRun(nb=nb)
    client = _client(nb, kernel_name=kernel_name, cell_timeout=cell_timeout, deadline=deadline,
                     max_cell_output=max_cell_output, max_total_output=max_total_output)
    launch = _kernel_manager(client, kernel_name=kernel_name, box=box, gpus=gpus, read_only=read_only,
                             sandboxed=sandboxed)
    process = None
    try:
        # The kernel's own stderr (not the cells' output, which comes over iopub) would clutter the report.
        await client.async_start_new_kernel(cwd=str(cwd), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True, **launch)
        process = getattr(getattr(client.km, "provisioner", None), "process", None)
        await client.async_start_new_kernel_client()
        await _run_cells(client, nb, result, deadline=deadline, timeout=timeout, cell_timeout=cell_timeout)
    finally:
        await _stop_kernel(client, process)
    result.seconds = time.monotonic() - start
    return result


def run_notebook(
    nb,
    *,
    cwd: str | os.PathLike | None = None,
    kernel_name: str = "python3",
    cell_timeout: float = 120,
    timeout: float = 600,
    max_cell_output: int = 1_000_000,
    max_total_output: int = 20_000_000,
    sandbox: bool = True,
    gpus: list[str] | tuple[str, ...] = (),
    read_only: list[str] | tuple[str, ...] = (),
) -> NotebookRun:
    """Execute `nb` (modified in place) in a fresh kernel; never raises for the notebook's errors.

    The kernel runs in a throwaway folder (its cwd unless `cwd` is given) with its own home, IPython profile and
    temp dir, and an allowlisted environment; the folder is removed afterwards. sandbox=True (the default): in
    bubblewrap, with the device nodes of `gpus` and `read_only` (checks modules given by file) mounted;
    sandbox=False, for trusted notebooks only: unconfined."""
    box = Sandbox(prefix="course-notebook-")
    try:
        return _run_sync(_run(nb, kernel_name=kernel_name, cwd=cwd or box.work, cell_timeout=cell_timeout,
                              timeout=timeout, max_cell_output=max_cell_output, max_total_output=max_total_output,
                              box=box, gpus=list(gpus), read_only=list(read_only), sandboxed=sandbox))
    finally:
        box.close()


def _run_sync(coro):
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    # Called from a running event loop (a notebook cell): run in a thread with a loop of its own.
    box: dict = {}

    def target():
        try:
            box["result"] = asyncio.run(coro)
        except BaseException as e:  # re-raised in the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join()
    if "error" in box:
        raise box["error"]
    return box["result"]
