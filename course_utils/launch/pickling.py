"""How calls, results and exceptions travel: cloudpickle out to the ranks, and back onto the CPU only.

- Calls (parent -> ranks): fn and its arguments by cloudpickle, so a function defined in a notebook
  travels by value. A tensor that is not on the CPU is refused with a clear error: it would be rebuilt
  on the same device index in every rank (cuda:0 for all of them), or fail in ranks that see no GPU.
- Results and exceptions (ranks -> parent): pickled with every tensor moved to the CPU, and unpickled in
  the parent by one unpickler that restores any storage that still names a GPU on the CPU (as
  torch.load(map_location="cpu") does). So nothing the notebook receives initialises CUDA there.
"""

from __future__ import annotations

import functools
import io
import linecache
import marshal
import os
import pickle
import struct
import types
from collections.abc import Callable
from typing import Any

ALIGN = 16  # tensor data lands at offsets that are multiples of this (transport.py aligns the payload too)

# ---- the blob: a pickle stream with the tensors' bytes beside it ---------------------------------------
# Protocol 5 hands each tensor's bytes to a callback instead of copying them into the stream ("out of
# band"), so they are written to the pipe straight from the tensor's memory, and the receiving side's
# tensors share the buffer the bytes arrived in: no copy at either end but the kernel's.
#   [count: u32][length: u64] * count, padded to ALIGN; the stream; each buffer, padded to ALIGN


def _padding(n: int) -> int:
    return -n % ALIGN


def _pack(pickler_class: type, obj: Any) -> list[memoryview]:
    buffers: list[pickle.PickleBuffer] = []
    stream = io.BytesIO()
    pickler_class(stream, protocol=5, buffer_callback=buffers.append).dump(obj)
    parts = [memoryview(stream.getvalue())] + [b.raw() for b in buffers]
    head = struct.pack(f">I{len(parts)}Q", len(parts), *map(len, parts))
    out = [memoryview(head + bytes(_padding(len(head))))]
    for part in parts:
        out.append(part)
        if _padding(len(part)):
            out.append(memoryview(bytes(_padding(len(part)))))
    return out


def _unpack(blob: bytes | bytearray | memoryview | list) -> tuple[memoryview, list[memoryview]]:
    if isinstance(blob, list):  # the pieces _pack made, not yet sent anywhere (tests, local use)
        blob = bytearray(b"".join(blob))
    view = memoryview(blob).cast("B")
    (count,) = struct.unpack_from(">I", view)
    lengths = struct.unpack_from(f">{count}Q", view, 4)
    pos, parts = 4 + 8 * count, []
    pos += _padding(pos)
    for length in lengths:
        parts.append(view[pos:pos + length])
        pos += length + _padding(length)
    return parts[0], parts[1:]


def loads_on_cpu(blob: bytes | bytearray | memoryview | list) -> Any:
    """Unpickle what dumps_call/dumps_code/dumps_on_cpu made, with every tensor on the CPU (the parent's
    side: results and exceptions; the worker's side: calls)."""
    stream, buffers = _unpack(blob)
    return CPUUnpickler(_ViewReader(stream), buffers=buffers).load()


# ---- tensor data ----------------------------------------------------------------------------------------


def _storage_reduction(obj: Any):
    """A CPU TypedStorage (what a pickled tensor holds) as its raw bytes, or None for anything else.

    torch pickles a storage by running torch.save into a bytes object and pickling that: two extra copies
    each way. As a PickleBuffer its bytes go out of band (see above) and come back shared, not copied.
    """
    import torch

    if type(obj) is not torch.storage.TypedStorage:
        return None
    raw = obj._untyped_storage  # (TypedStorage.device would warn that TypedStorage is deprecated)
    if raw.device.type != "cpu":
        return None
    data = torch.empty(0, dtype=torch.uint8).set_(raw).numpy() if raw.nbytes() else bytearray()
    return _typed_storage_from_bytes, (pickle.PickleBuffer(data), obj.dtype)


def _typed_storage_from_bytes(data: bytearray | bytes | memoryview, dtype):
    import torch

    if not len(data):
        raw = torch.UntypedStorage(0)
    else:
        if memoryview(data).readonly:  # a tensor must own writable memory
            data = bytearray(data)
        flat = torch.frombuffer(data, dtype=torch.uint8)
        if flat.data_ptr() % ALIGN:  # received at an odd place (never by our framing): give it aligned memory
            flat = flat.clone()
        raw = flat.untyped_storage()
    return torch.storage.TypedStorage(wrap_storage=raw, dtype=dtype, _internal=True)


@functools.cache
def _picklers() -> tuple[type, type]:
    """(the Pickler for calls, the Pickler for results and exceptions); made once, torch imported lazily."""
    import cloudpickle
    import torch

    class CallPickler(cloudpickle.Pickler):
        def reducer_override(self, obj):
            if isinstance(obj, (torch.Tensor, torch.UntypedStorage)) and obj.device.type != "cpu":
                raise _DeviceTensor(obj.device)
            # Code objects travel as marshal data (the .pyc format; the ranks run this same interpreter), which
            # keeps their file name: cloudpickle 3.1.3 renames every file "<dynamic-code>", and a rank's
            # traceback and stack would then show neither the cell's name nor its lines.
            if isinstance(obj, types.CodeType):
                return marshal.loads, (marshal.dumps(obj),)
            return _storage_reduction(obj) or super().reducer_override(obj)

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

    return CallPickler, CPUPickler


# ---- calls: parent -> ranks ---------------------------------------------------------------------------


class _DeviceTensor(TypeError):
    def __init__(self, device: object):
        self.device = device
        super().__init__(f"a tensor on {device}")


def _dumps_call(obj: Any) -> list[memoryview]:
    return _pack(_picklers()[0], obj)


def dumps_call(fn: Callable, args: tuple, kwargs: dict) -> list[memoryview]:
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


def dumps_function(fn: Callable) -> bytes:
    """Pickle a function by value into plain bytes, as a call's fn travels (its code keeps the cell's file name, so
    a traceback from a rank names the cell's lines), for a rank to load later with pickle.loads."""
    stream = io.BytesIO()
    _picklers()[0](stream, protocol=5).dump(fn)
    return stream.getvalue()


def dumps_code(source: str, filename: str) -> list[memoryview]:
    """Pickle a cell's source for the ranks; a syntax error is raised here, before any process starts."""
    if not isinstance(source, str):
        raise TypeError(f"source must be a string of Python code, got {type(source).__name__}")
    compile(source, filename, "exec")
    return _pack(pickle.Pickler, ("code", source, filename))


def cell_sources(fn: Callable) -> dict[str, list[str]]:
    """The notebook cell that defined fn (IPython keeps it in linecache), so worker tracebacks show code."""
    filename = getattr(getattr(fn, "__code__", None), "co_filename", "")
    entry = linecache.cache.get(filename)
    if not filename or entry is None or os.path.exists(filename):  # real files the workers can read themselves
        return {}
    return {filename: list(entry[2])}


# ---- results and exceptions: ranks -> parent ------------------------------------------------------------


def dumps_on_cpu(value: Any) -> list[memoryview]:
    """Pickle a result or an exception with every tensor moved to the CPU (the worker's side)."""
    return _pack(_picklers()[1], value)


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


def loads_pickle_on_cpu(data: bytes | bytearray | memoryview) -> Any:
    """Unpickle a plain pickle stream (as pickle.dumps makes it) with every tensor storage on the CPU."""
    return CPUUnpickler(_ViewReader(memoryview(data).cast("B"))).load()
