"""Run code on N worker processes with torchrun's environment, from a notebook cell.

    run(fn, *args, nproc=2)     one job: fresh workers, every rank's return value, nothing left behind
    Pool(nproc)                 workers and their process group kept alive across cells (%%ranks)
    run_code(source, nproc=2)   a cell's source on fresh workers (what %%torchrun does)
    run_cli(source, nproc=2)    the same cell through the real torchrun CLI (%%torchrun --cli)

How it avoids the usual pains:
- Workers are never forks of the notebook, so CUDA state in it cannot break them: GPU ranks are fresh
  interpreters (`python -m course_utils.launch.worker`), CPU ranks are forked by a fresh interpreter that
  imported torch once for all of them (forkserver.py). The notebook itself never initialises CUDA or a
  process group: results and exceptions come back with every tensor on the CPU (pickling.py).
- NCCL ranks each own GPU LOCAL_RANK; gloo ranks see no GPU unless asked (gpus=True), so a CPU lesson on
  a GPU machine opens no CUDA context.
- The function travels by cloudpickle: one defined in the notebook is pickled by value.
- The parent hosts the rendezvous TCPStore on a socket it bound to 127.0.0.1:0 (an atomic free port).
- One select() loop prints every rank's output live, prefixed by rank, in the executing cell, and
  collects results of any size in linear time (transport.py).
- Each worker leads its own session and dies with the parent. A failure, a timeout or Ctrl-C stops every
  worker; a timeout first shows where each stuck rank was. No process, port or temporary file survives.

Modules, leaves first: errors, options (arguments, backend, GPUs), env, transport, pickling, output, stacks,
procs; forkserver (the CPU ranks' parent); group (the worker group); worker (its entry point); jobs (run,
run_code), pool, cli; magics.
The names below load their module on first use, so a worker importing transport and pickling does not
pay for the parent's side.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "run": "jobs", "run_code": "jobs", "Pool": "pool", "current_pool": "pool", "run_cli": "cli",
    "cli_command": "cli", "LaunchError": "errors", "WorkerError": "errors", "WorkerTimeout": "errors",
    "BACKENDS": "options", "pick_backend": "options",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
