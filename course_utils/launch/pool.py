"""A Pool: workers and their process group kept alive across cells (what %%ranks uses)."""

from __future__ import annotations

import atexit
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from . import procs
from .errors import LaunchError, WorkerError, WorkerTimeout, add_note
from .group import Group, deadline_after
from .options import check_nproc, check_ranks, check_timeout, pick_backend, pick_gpus
from .pickling import dumps_call, dumps_code
from .stacks import remember_source

_pools: weakref.WeakSet = weakref.WeakSet()
_current: Pool | None = None


def current_pool() -> Pool | None:
    """The most recently started Pool that is still open (the one %%ranks uses)."""
    return _current if _current is not None and not _current.closed else None


class Pool:
    """`nproc` workers and their process group, kept alive across cells.

        with Pool(4) as pool:
            pool.run(fn, x)          # {rank: fn(x)}, like run() but without the start-up cost
            pool.exec("y = rank")    # run source in each rank's persistent namespace (what %%ranks does)

    A failure that leaves ranks out of step (some still running), a timeout or Ctrl-C shuts the pool down:
    its process group could not be trusted any more. Create a new one.
    """

    def __init__(self, nproc: int = 2, backend: str = "auto", timeout: float | None = 120.0,
                 ranks: Iterable[int] | None = None, gpus: bool | None = None):
        global _current
        self.nproc = check_nproc(nproc)
        timeout = check_timeout(timeout)
        self.show = check_ranks(ranks, self.nproc)
        self.backend = pick_backend(backend, self.nproc)
        self.gpus = pick_gpus(gpus, self.backend)
        self._group: Group | None = Group(self.nproc, self.backend, self.gpus, self.show)
        try:
            self._group.wait(None, deadline_after(timeout), timeout)  # start-up errors show here, not at first use
        except BaseException:
            self._group.kill()
            self._group = None
            raise
        _pools.add(self)
        _current = self

    @property
    def closed(self) -> bool:
        return self._group is None

    @property
    def pids(self) -> list[int]:
        """Worker process ids, by rank."""
        return self._group.pids if self._group else []

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"pids {self.pids}"
        gpus = ", gpus=True" if self.gpus and self.backend == "gloo" else ""
        return f"Pool(nproc={self.nproc}, backend={self.backend!r}{gpus}, {state})"

    def run(self, fn: Callable, *args: Any, timeout: float | None = 120.0, **kwargs: Any) -> dict[int, Any]:
        """fn(*args, **kwargs) on every rank of the pool; returns {rank: return value} (tensors on the CPU)."""
        __tracebackhide__ = True
        timeout = check_timeout(timeout)
        return self._call(dumps_call(fn, args, kwargs), timeout, self.show)

    def exec(self, source: str, timeout: float | None = 120.0, ranks: Iterable[int] | None = None,
             filename: str = "<ranks cell>") -> dict[int, Any]:
        """Run source in each rank's own namespace, which persists between calls; returns {rank: value of
        the last expression}. `torch`, `dist` and `os` are predefined."""
        __tracebackhide__ = True
        timeout = check_timeout(timeout)
        show = check_ranks(ranks, self.nproc) if ranks is not None else self.show
        payload = dumps_code(source, filename)
        remember_source(source, filename)
        return self._call(payload, timeout, show)

    def _call(self, payload: list[memoryview], timeout: float | None, show: frozenset[int] | None) -> dict[int, Any]:
        __tracebackhide__ = True
        if self._group is None:
            raise LaunchError("this Pool is closed; create a new one with Pool(nproc)")
        group = self._group
        group.show = show
        try:
            results = group.wait(group.send(payload), deadline_after(timeout), timeout)
        except WorkerError as err:
            if err.stopped or any(procs.exit_code(r.proc) is not None for r in group.ranks):
                self._kill()
                add_note(err, "The pool has been shut down because its ranks were no longer in step; "
                              "create a new Pool.")
            raise
        except BaseException as err:  # a timeout or Ctrl-C: some ranks are stuck somewhere
            self._kill()
            if isinstance(err, WorkerTimeout):
                add_note(err, "The pool has been shut down; create a new Pool.")
            raise
        finally:
            group.show = self.show
            group.output.end_all()
        return dict(sorted(results.items()))

    def close(self) -> None:
        """End the workers (after destroying their process group) and free everything they held."""
        group = self._detach()
        if group is not None:
            for r in group.ranks:  # closing the command pipe asks the worker to finish and exit
                r.close_after_write = True
                group.write_some(r)
            group.finish(None)

    def _kill(self, quiet: bool = False) -> None:
        """Stop the workers at once (they may be stuck in a collective): no goodbye, no waiting."""
        group = self._detach()
        if group is not None:
            group.kill(quiet=quiet)

    def _detach(self) -> Group | None:
        global _current
        group, self._group = getattr(self, "_group", None), None
        if _current is self:
            _current = None
        return group

    def __enter__(self) -> Pool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        self._kill(quiet=True)  # the garbage collector may run anywhere: print nothing


@atexit.register
def _close_pools() -> None:
    for pool in list(_pools):
        pool._kill(quiet=True)
