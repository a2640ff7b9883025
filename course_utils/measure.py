"""Small measuring tools the lessons share: a GPU sleep of known length, the best of repeats, and a
counter of host syncs.

`torch.cuda._sleep(cycles)` spins one thread for a number of SM clock cycles (`clock64()`, in
aten/src/ATen/cuda/Sleep.cu): one block on one SM, so it leaves the rest of the GPU idle. Clocks differ
between GPUs (and with boost), so `cycles_per_ms()` times known counts with CUDA events instead of assuming
a frequency. A sleep lasts cycles / clock: where the SM clock runs lower when the sleep runs than when it was
calibrated (a GPU that idled drops to a low clock and ramps back up over some ms; a GPU near its power
limit lowers its clock), the same sleep takes longer. `sleep_check()` prints what a sleep really took, and a
kernels-mode timeline labels each sleep with its measured length ("sleep 5.0 ms").
"""

from __future__ import annotations

import functools
import os
import statistics
import sys
import warnings
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode


def _timed_sleep(cycles: int) -> float:
    """ms that one `torch.cuda._sleep(cycles)` took on the current stream, between two CUDA events."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def raise_clock(ms: float = 50.0, rate: float | None = None) -> None:
    """Keep the GPU busy for about `ms` ms and wait for it, so that its SM clock has ramped up from idle.

    Call it right before work whose sleeps must last what was asked (an idle GPU's clock is low, and a sleep
    launched at that moment runs slower until the clock is up). Without `rate` it spins 1e6 cycles per ms
    asked (a 1 GHz guess, so no calibration is needed): about half of `ms` at a 2 GHz clock.
    """
    torch.cuda._sleep(max(1, int(ms * (rate if rate is not None else 1e6))))
    torch.cuda.synchronize()


@functools.lru_cache(maxsize=8)
def cycles_per_ms(device: int | None = None, probe_cycles: int = 20_000_000, repeats: int = 5) -> float:
    """Cycles per millisecond of `torch.cuda._sleep` on this GPU: the median of `repeats` timed sleeps of
    `probe_cycles` (about 10 ms each at 2 GHz), after a burst of about 50 ms that loads the kernel and brings
    the SM clock up from idle (timed from idle, the first sleeps ran at a lower clock, and the rate came out low).

    Cached per argument set; `cycles_per_ms.cache_clear()` makes the next call measure again."""
    if not torch.cuda.is_available():
        raise RuntimeError("cycles_per_ms needs a CUDA GPU")
    dev = torch.cuda.current_device() if device is None else device
    with torch.cuda.device(dev):
        raise_clock(100.0)  # about 50 ms at 2 GHz; also the kernel's first launch (lazy loading), untimed
        rates = [probe_cycles / _timed_sleep(probe_cycles) for _ in range(repeats)]
    return statistics.median(rates)


def gpu_sleep(ms: float, rate: float | None = None) -> None:
    """Enqueue one kernel that keeps one SM busy for about `ms` ms on the current stream (host returns at once).

    The kernel counts SM clock cycles, so it lasts `ms` at the clock `cycles_per_ms()` measured; at a lower
    clock it lasts longer (see the module docstring). Returns None, so a cell that ends with it prints nothing."""
    torch.cuda._sleep(max(1, int(ms * (rate if rate is not None else cycles_per_ms()))))


@dataclass
class SleepCheck:
    """What `sleep_check` measured: each requested length (ms) and what the sleep took, timed with events."""

    requested_ms: list[float]
    measured_ms: list[float]
    rate: float

    @property
    def worst_ratio(self) -> float:
        """The largest measured / requested of the sleeps (1.0: every sleep as long as asked)."""
        return max(m / r for r, m in zip(self.requested_ms, self.measured_ms, strict=True))

    def summary(self) -> str:
        rows = [f"gpu_sleep({r:g}) took {m:.2f} ms ({m / r:.0%} of the request)"
                for r, m in zip(self.requested_ms, self.measured_ms, strict=True)]
        return f"calibration: {self.rate / 1e6:.3f} GHz (cycles per ns)\n" + "\n".join(rows)


def sleep_check(requested_ms: Iterable[float] = (1.0, 5.0, 20.0), rate: float | None = None,
                warm: bool = False) -> SleepCheck:
    """Time `gpu_sleep(ms)` for each requested length, one at a time on the current stream, with CUDA events.

    warm=False times them as a lesson's sleeps run (whatever the clock is now); warm=True raises the clock first.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("sleep_check needs a CUDA GPU")
    rate = cycles_per_ms() if rate is None else rate
    if warm:
        raise_clock(50.0, rate)
    requested = [float(ms) for ms in requested_ms]
    measured = [_timed_sleep(max(1, int(ms * rate))) for ms in requested]
    return SleepCheck(requested, measured, rate)


def sleep_kernels(spans: Iterable[Any]) -> list[Any]:
    """The sleep kernels among a timeline's spans (Span objects or their dicts), by start time: their
    `end_ms - start_ms` is what each sleep really took, to predict from instead of the requested lengths."""
    from .timeline.spans import is_sleep_kernel

    def get(s: Any, key: str) -> Any:
        return s[key] if isinstance(s, dict) else getattr(s, key)

    found = [s for s in spans if get(s, "kind") == "compute" and is_sleep_kernel(str(get(s, "name")))]
    return sorted(found, key=lambda s: get(s, "start_ms"))


def best_of(fn: Callable[[], float], repeats: int = 3) -> float:
    """The smallest of `repeats` calls of a timing function: noise on a shared machine only adds time."""
    return min(fn() for _ in range(repeats))


# ----------------------------------------------------------------------------------- counting host syncs

SYNC_WARNING = "called a synchronizing CUDA operation"  # c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync

# Tensor methods that hand tensor *data* to Python (or to host memory): on a CUDA tensor each waits for the GPU.
_READ_METHODS = ("item", "tolist", "cpu", "numpy", "__bool__", "__float__", "__int__", "__index__", "__complex__",
                 "__repr__", "__format__", "__array__")
# aten ops whose result the host needs before it can go on: on CUDA each one is a sync.
_READ_OPS = frozenset({
    "_local_scalar_dense", "equal", "allclose", "is_nonzero",  # a value (or a bool) for Python
    "nonzero", "masked_select", "index", "_unique", "_unique2", "unique_dim", "unique_consecutive",
    "unique_dim_consecutive", "bincount", "repeat_interleave",  # a shape that depends on the data
})


@dataclass
class SyncCount:
    """What `count_syncs()` saw; filled in while the block runs, complete when it ends."""

    count: int = 0
    calls: list[str] = field(default_factory=list)  # what each counted sync was: "Tensor.item", "aten.nonzero", ...
    where: list[str] = field(default_factory=list)  # the line of your code that made it: "file:line"
    debug_syncs: int | None = None  # raw reports of torch.cuda.set_sync_debug_mode (None where CUDA is absent)


class _Counter:
    """State shared by the two modes: what to count, and how deep we are inside a counted call."""

    def __init__(self, result: SyncCount, cpu_as_device: bool):
        self.result, self.cpu_as_device = result, cpu_as_device
        self.depth = 0  # >0 inside a counted call: the reads it makes itself (print -> item ...) are one sync
        self.host: dict[int, weakref.ref] = {}  # CPU-as-device mode: tensors that are already host copies
        self.absorbed: set[int] = set()  # ids of sync-debug warnings raised inside counted calls (theirs)
        self.caught: list | None = None

    def on_device(self, t: Any) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        if t.device.type != "cpu":
            return t.device.type != "meta"
        ref = self.host.get(id(t))
        return self.cpu_as_device and not (ref is not None and ref() is t)

    def mark_host(self, out: Any) -> None:
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                key = id(t)
                self.host[key] = weakref.ref(t, lambda _, key=key: self.host.pop(key, None))

    def counted(self, name: str, run: Callable[[], Any]) -> Any:
        """Run a call that reads device data: count it once, with the line of user code that made it."""
        self.result.calls.append(name)
        self.result.where.append(_user_line())
        self.result.count += 1
        before = self._seen()
        self.depth += 1
        try:
            return run()
        finally:
            self.depth -= 1
            self._absorb(before)

    def passed_through(self, run: Callable[[], Any]) -> Any:
        """Run a Python-level call that is not itself a read (torch.nonzero, t[mask], torch.unique, ...).

        A read op that the dispatch mode counts inside it is one sync. C++ hands the sync debug mode's
        warning to Python only when the outermost C++ call returns (PyWarningHandler), that is after the
        counted op has finished: the reports that arrive before this call returns are that op's, not new
        syncs. A call in which nothing was counted keeps its reports: they are counted in `_settle`.
        """
        count, before = self.result.count, self._seen()
        try:
            return run()
        finally:
            if self.result.count > count:
                self._absorb(before)

    def _seen(self) -> int:
        return len(self.caught) if self.caught is not None else 0

    def _absorb(self, before: int) -> None:
        """The debug-mode reports recorded since `before` belong to a call already counted."""
        if self.caught is not None:
            self.absorbed.update(id(w) for w in self.caught[before:])


def _user_line() -> str:
    """file:line of the innermost frame outside torch and this module (where the sync is in the user's code)."""
    frame = sys._getframe(1)
    while frame is not None:
        path = frame.f_code.co_filename
        if not (path.startswith(_TORCH_DIR) or path == __file__ or path.startswith("<frozen")):
            return f"{path}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


_TORCH_DIR = os.path.dirname(torch.__file__)


class _ReadCalls(TorchFunctionMode):
    """Python-level calls that read tensor data: t.item(), float(t), if t:, print(t), t.cpu(), t.tolist(), ..."""

    def __init__(self, counter: _Counter):
        super().__init__()
        self.c = counter
        self.reads = {getattr(torch.Tensor, name): name for name in _READ_METHODS}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        name = self.reads.get(func) if c.depth == 0 else None
        if name is None and func is torch.Tensor.to and c.depth == 0 and args[0].device.type != "cpu":
            # Only a real device-to-host copy: on a CPU machine .to("cpu") is also .to(device), a move to the device.
            device, _, non_blocking, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
            if device is not None and device.type == "cpu" and not non_blocking:
                name = "to"
        if name is None or not (args and c.on_device(args[0])):
            out = c.passed_through(lambda: func(*args, **kwargs))
            if c.host:
                tensors = [a for a in args if isinstance(a, torch.Tensor)]
                if tensors and not any(c.on_device(a) for a in tensors):
                    c.mark_host(out)  # computed from host copies only: on a GPU this would run on the CPU
            return out
        if name == "cpu" and args[0].device.type == "cpu":
            # On a GPU this is a copy into a new host tensor; here the call would return the tensor itself.
            # A view stands in for that copy, so the tensor it came from still counts as device data.
            out = c.counted(f"Tensor.{name}", lambda: args[0].view_as(args[0]))
        else:
            out = c.counted(f"Tensor.{name}", lambda: func(*args, **kwargs))
        if name in ("cpu", "to"):
            c.mark_host(out)
        return out


class _ReadOps(TorchDispatchMode):
    """aten ops that need device data on the host, made inside C++ where no Python call shows them."""

    def __init__(self, counter: _Counter):
        super().__init__()
        self.c = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.c
        if c.depth == 0 and _is_read_op(func, args, kwargs) and args and c.on_device(args[0]):
            return c.counted(f"aten.{func.overloadpacket.__name__}", lambda: func(*args, **kwargs))
        if c.depth == 0 and func.overloadpacket.__name__ in ("_to_copy", "copy_") and _is_d2h(func, args, kwargs):
            return c.counted(f"aten.{func.overloadpacket.__name__} (device to host)", lambda: func(*args, **kwargs))
        return func(*args, **kwargs)


def _is_read_op(func: Any, args: tuple, kwargs: dict) -> bool:
    name = func.overloadpacket.__name__
    if name not in _READ_OPS:
        return False
    if name == "index":  # only a boolean mask makes the result's shape depend on the data
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in args[1])
    if name == "repeat_interleave":  # tensor repeats without output_size: the shape depends on the data
        return func._overloadname in ("Tensor", "self_Tensor") and kwargs.get("output_size") is None
    return True


def _is_d2h(func: Any, args: tuple, kwargs: dict) -> bool:
    """A blocking copy from a GPU tensor into host memory (a non_blocking one does not wait)."""
    if kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True):
        return False
    if func.overloadpacket.__name__ == "copy_":
        dst, src = args[0], args[1]
        return dst.device.type == "cpu" and src.device.type == "cuda"
    dev = kwargs.get("device")
    return args[0].device.type == "cuda" and dev is not None and torch.device(dev).type == "cpu"


@contextmanager
def count_syncs(cpu_as_device: bool | None = None) -> Iterator[SyncCount]:
    """Count the host syncs (reads of device data) made inside the block.

        with count_syncs() as s:
            loss.item(); print(t); torch.nonzero(t)
        s.count, s.calls, s.where   # 3, ['Tensor.item', 'Tensor.__repr__', 'aten.nonzero'], [file:line, ...]

    Three instruments, so that neither Python nor C++ reads slip past:
    - a TorchFunctionMode sees the Python calls that hand tensor data to Python or host memory:
      `.item()`, `float(t)`, `int(t)`, `bool(t)` (so `if t:`), `print(t)`/`repr`/`format`, `.cpu()`,
      `.to("cpu")` of a GPU tensor, `.tolist()`, `.numpy()`;
    - a TorchDispatchMode sees the aten ops that do it below Python: `_local_scalar_dense` (indexing
      with a 0-d tensor, `allclose`, ...), blocking device-to-host copies, and ops whose output shape
      depends on the data (`nonzero`, `masked_select`, boolean-mask indexing, `unique`, `bincount`, ...);
    - with CUDA, `torch.cuda.set_sync_debug_mode("warn")` reports every sync made through c10's
      `memcpy_and_sync`/`stream_synchronize` (item, D2H copies, nonzero, `Stream.synchronize()`), even
      inside C++ kernels; those that no counted call explains are counted one each.
    Each counted call counts once (print(t) on a CUDA tensor makes many syncs inside; `debug_syncs` has the
    raw number of debug-mode reports). A report belongs to a counted call when it arrives while that call
    runs, or, for a read op counted by the dispatch mode (torch.nonzero, t[t > 0], torch.unique, ...),
    before the Python call around that op returns: C++ passes the warning on to Python only then.
    Reads inside the Python code of other torch functions are seen as the operators they run.
    `torch.cuda.synchronize()` and `Event.synchronize()` are waits you wrote yourself: they are not
    counted (set_sync_debug_mode does not report them either); time them instead.
    Nor is the wait no counter can see: the first launch of a kernel in a process loads it (lazy module
    loading) and can wait for the GPU; only a clock shows it (lesson 01).

    cpu_as_device: count reads of CPU tensors too, as if they lived on a GPU (default: True when CUDA is
    unavailable, so a CPU-only machine finds the same sync points). Tensors that came from `.cpu()` inside
    the block, and tensors computed from them alone, are host data then and are not counted. There,
    `.to("cpu")` is not counted: on a CPU machine it cannot be told from `.to(device)`.
    Syncs made in autograd's backward threads are not seen by the warning filter (there are none in
    ordinary layers).
    """
    if cpu_as_device is None:
        cpu_as_device = not torch.cuda.is_available()
    result = SyncCount()
    counter = _Counter(result, cpu_as_device)
    cuda = torch.cuda.is_available()
    caught: list = []
    try:
        with warnings.catch_warnings(record=True) as recorded:
            warnings.simplefilter("always")
            counter.caught = recorded if cuda else None
            previous = torch.cuda.get_sync_debug_mode() if cuda else None
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                with _ReadCalls(counter), _ReadOps(counter):
                    yield result
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode(previous)
                caught = list(recorded)
    finally:  # also when the block raised: the counts so far, and the user's own warnings passed on
        _settle(result, counter, caught, cuda)


def _settle(result: SyncCount, counter: _Counter, caught: list, cuda: bool) -> None:
    """Count the debug-mode reports no counted call explains; pass on every warning that is not ours."""
    if cuda:
        syncs = [w for w in caught if SYNC_WARNING in str(w.message)]
        result.debug_syncs = len(syncs)
        for w in syncs:
            if id(w) not in counter.absorbed:  # a sync inside C++ that no counted call explains
                result.calls.append("CUDA sync (set_sync_debug_mode)")
                result.where.append(f"{w.filename}:{w.lineno}")
                result.count += 1
    for w in caught:
        # The first set_sync_debug_mode() of a process also warns that the mode is a prototype: not news.
        text = str(w.message)
        if SYNC_WARNING not in text and "detect all synchronizing operations" not in text:
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
