"""How calls, results and exceptions travel: cloudpickle out to the ranks, and back onto the CPU only.

- Calls (parent -> ranks): fn and its arguments by cloudpickle, so a function defined in a notebook
  travels by value. A tensor that is not on the CPU is refused with a clear error: it would be rebuilt
  on the same device index in every rank (cuda:0 for all of them), or fail in ranks that see no GPU.
- Results and exceptions (ranks -> parent): pickled with every tensor moved to the CPU, and unpickled in
  the parent by one unpickler that restores any storage that still names a GPU on the CPU (as
  torch.load(map_location="cpu") does). So nothing the notebook receives initialises CUDA there.
"""

from __future__ import annotations

import io
import linecache
import os
import pickle
from collections.abc import Callable
from typing import Any

# ---- tensor data: one copy each way ------------------------------------------------------------------


def _storage_reduction(obj: Any):
    """A CPU TypedStorage (what a pickled tensor holds) as its raw bytes, or None for anything else.

    torch pickles a storage by running torch.save into a bytes object and pickling that: two extra copies
    each way. Its bytes as a PickleBuffer go into the pickle in one copy and come back as a bytearray the
    storage then shares, so tensors travel at about memory-copy speed.
    """
    import torch

    if type(obj) is not torch.storage.TypedStorage:
        return None
    raw = obj._untyped_storage  # (TypedStorage.device would warn that TypedStorage is deprecated)
    if raw.device.type != "cpu":
        return None
    data = torch.empty(0, dtype=torch.uint8).set_(raw).numpy() if raw.nbytes() else b""
    return _typed_storage_from_bytes, (pickle.PickleBuffer(data), obj.dtype)


def _typed_storage_from_bytes(data: bytearray | bytes, dtype):
    import torch

    raw = torch.frombuffer(data, dtype=torch.uint8).untyped_storage() if len(data) else torch.UntypedStorage(0)
    return torch.storage.TypedStorage(wrap_storage=raw, dtype=dtype, _internal=True)


# ---- calls: parent -> ranks ---------------------------------------------------------------------------


class _DeviceTensor(TypeError):
    def __init__(self, device: object):
        self.device = device
        super().__init__(f"a tensor on {device}")


def _dumps_call(obj: Any) -> bytes:
    import cloudpickle
    import torch

    class Pickler(cloudpickle.Pickler):
        def reducer_override(self, o):
            if isinstance(o, (torch.Tensor, torch.UntypedStorage)) and o.device.type != "cpu":
                raise _DeviceTensor(o.device)
            return _storage_reduction(o) or super().reducer_override(o)

    buf = io.BytesIO()
    Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    return buf.getvalue()


def dumps_call(fn: Callable, args: tuple, kwargs: dict) -> bytes:
    """Pickle fn(*args, **kwargs) for the ranks, or say exactly which part cannot travel and why."""
    if not callable(fn):
        raise TypeError(f"fn must be callable (a function to run on every rank), got {type(fn).__name__}")
    try:
        return _dumps_call(("fn", fn, args, kwargs, cell_sources(fn)))
    except Exception as exc:
        parts = [("fn", fn)] + [(f"argument {i}", a) for i, a in enumerate(args)]
        parts += [(f"keyword argument {k!r}", v) for k, v in kwargs.items()]
        culprit, cause = "the call", exc
        for name, obj in parts:
            try:
                _dumps_call(obj)
            except Exception as part_exc:
                culprit, cause = name, part_exc
                break
        if isinstance(cause, _DeviceTensor):
            holds = "uses" if culprit == "fn" else "holds"
            raise TypeError(
                f"{culprit} {holds} a tensor on {cause.device}, which cannot be sent to the ranks: it would arrive "
                f"on {cause.device} in every rank (or fail where a rank sees no GPU). Send it on the CPU (x.cpu(), "
                "or create it inside fn) and move it to the rank's own device inside fn, e.g. "
                "x.to(f\"cuda:{os.environ['LOCAL_RANK']}\")") from None
        raise TypeError(f"{culprit} cannot be sent to the workers ({type(cause).__name__}: {cause}). Everything "
                        "travels by cloudpickle: pass plain data (numbers, lists, tensors), and create things like "
                        "open files, locks or sockets inside fn.") from exc


def dumps_code(source: str, filename: str) -> bytes:
    """Pickle a cell's source for the ranks; a syntax error is raised here, before any process starts."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a string of Python code, got {type(source).__name__}")
    compile(source, filename, "exec")
    return pickle.dumps(("code", source, filename), protocol=pickle.HIGHEST_PROTOCOL)


def cell_sources(fn: Callable) -> dict[str, list[str]]:
    """The notebook cell that defined fn (IPython keeps it in linecache), so worker tracebacks show code."""
    filename = getattr(getattr(fn, "__code__", None), "co_filename", "")
    entry = linecache.cache.get(filename)
    if not filename or entry is None or os.path.exists(filename):  # real files the workers can read themselves
        return {}
    return {filename: list(entry[2])}


# ---- results and exceptions: ranks -> parent ------------------------------------------------------------


def dumps_on_cpu(value: Any) -> bytes:
    """Pickle a result or an exception with every tensor moved to the CPU (the worker's side)."""
    import cloudpickle
    import torch

    class CPUPickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
                cpu = obj.detach().cpu()
                if isinstance(obj, torch.nn.Parameter):
                    return torch.nn.Parameter, (cpu, obj.requires_grad)
                return torch.Tensor.detach, (cpu,)
            if isinstance(obj, torch.UntypedStorage) and obj.device.type != "cpu":
                return torch.UntypedStorage.cpu, (obj,)
            return _storage_reduction(obj) or super().reducer_override(obj)

    buf = io.BytesIO()
    CPUPickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buf.getvalue()


def _storage_on_cpu(data: bytes):
    """torch.storage._load_from_bytes, restoring on the CPU: a storage saved on a GPU comes back on the CPU."""
    import torch

    return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)


def _device_tensor_on_cpu(data, dtype, device, requires_grad):
    """torch._utils._rebuild_device_tensor_from_numpy (tensors of devices without storages), on the CPU."""
    import torch

    tensor = torch.from_numpy(data).to(dtype=dtype, device="cpu")
    tensor.requires_grad = requires_grad
    return tensor


_ON_CPU = {
    ("torch.storage", "_load_from_bytes"): _storage_on_cpu,
    ("torch._utils", "_rebuild_device_tensor_from_numpy"): _device_tensor_on_cpu,
}


class CPUUnpickler(pickle.Unpickler):
    """Unpickles anything a rank sent with every tensor storage restored on the CPU.

    torch pickles a storage as torch.storage._load_from_bytes(<torch.save bytes>), which restores it on the
    device it was saved from; this unpickler substitutes the same load with map_location="cpu".
    """

    def find_class(self, module: str, name: str):
        return _ON_CPU.get((module, name)) or super().find_class(module, name)


class _ViewReader:
    """A read-only file over a memoryview, so unpickling a received frame copies nothing extra."""

    def __init__(self, view: memoryview):
        self._view, self._pos = view, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else min(len(self._view), self._pos + n)
        data = bytes(self._view[self._pos:end])
        self._pos = end
        return data

    def readinto(self, buf) -> int:
        target = memoryview(buf).cast("B")
        n = min(len(target), len(self._view) - self._pos)
        target[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def readline(self) -> bytes:  # only protocol 0's text opcodes use it; scan in windows
        end = self._pos
        while end < len(self._view):
            hit = bytes(self._view[end:end + 4096]).find(b"\n")
            if hit >= 0:
                return self.read(end + hit + 1 - self._pos)
            end += 4096
        return self.read(-1)


def loads_on_cpu(data: bytes | bytearray | memoryview) -> Any:
    """Unpickle what a rank sent with every tensor on the CPU (the parent's side: results and exceptions)."""
    return CPUUnpickler(_ViewReader(memoryview(data).cast("B"))).load()
