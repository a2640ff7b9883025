"""One-shot jobs: fresh workers for one call, every rank's result back, nothing left behind."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from .group import Group, deadline_after
from .options import check_nproc, check_ranks, check_timeout, pick_backend, pick_gpus
from .pickling import dumps_call, dumps_code
from .stacks import remember_source


def one_shot(payload: list[memoryview], nproc: int, backend: str, gpus: bool, timeout: float | None,
             ranks: frozenset[int] | None) -> dict[int, Any]:
    """Start a group, send it one call, collect the answers, and stop it whatever happens."""
    __tracebackhide__ = True
    deadline = deadline_after(timeout)
    group = Group(nproc, backend, gpus, ranks)
    try:
        # Every rank joins the process group before any runs the call: a rank whose call runs no collective
        # returns at once, and if it then exited it would close its gloo connections under a rank still joining,
        # which fails ("connectFullMesh failed ... Connection closed by peer").
        group.wait(None, deadline, timeout)
        seq = group.send(payload, close=True)
        results = group.wait(seq, deadline, timeout)
        group.finish(deadline)
        return dict(sorted(results.items()))
    finally:
        group.kill()  # after an error, a timeout or Ctrl-C: nothing may outlive the call


def run(fn: Callable, *args: Any, nproc: int = 2, backend: str = "auto", timeout: float | None = 120.0,
        gpus: bool | None = None, **kwargs: Any) -> dict[int, Any]:
    """Run fn(*args, **kwargs) on `nproc` fresh ranks and return {rank: return value} (tensors on the CPU).

    Each rank gets torchrun's environment and an initialised default process group (destroyed at the end).
    fn may be defined in the notebook. NCCL ranks each own GPU LOCAL_RANK; gloo ranks see no GPU unless
    gpus=True. `nproc`, `backend`, `timeout` and `gpus` are this function's own keywords; to pass arguments
    with those names to fn, use functools.partial.
    Raises WorkerError (a rank failed) or WorkerTimeout; either way no worker is left running.
    """
    __tracebackhide__ = True
    nproc, timeout = check_nproc(nproc), check_timeout(timeout)
    payload = dumps_call(fn, args, kwargs)
    backend = pick_backend(backend, nproc)
    return one_shot(payload, nproc, backend, pick_gpus(gpus, backend), timeout, None)


def run_code(source: str, nproc: int = 2, backend: str = "auto", timeout: float | None = 120.0,
             ranks: Iterable[int] | None = None, filename: str = "<torchrun cell>",
             gpus: bool | None = None) -> dict[int, Any]:
    """Run a cell's source on `nproc` fresh ranks (what %%torchrun does); `ranks` limits whose output shows.

    `torch`, `dist` and `os` are predefined, as in the --cli script. Returns {rank: value of the cell's last
    expression} (None where the cell does not end with an expression).
    """
    __tracebackhide__ = True
    nproc, timeout = check_nproc(nproc), check_timeout(timeout)
    show = check_ranks(ranks, nproc)
    payload = dumps_code(source, filename)
    remember_source(source, filename)
    backend = pick_backend(backend, nproc)
    return one_shot(payload, nproc, backend, pick_gpus(gpus, backend), timeout, show)
