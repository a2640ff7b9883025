"""Frames on the pipes between the launcher and its workers, in time linear in their size.

A frame is a 16-byte header (two big-endian lengths), a small pickled `meta` tuple of plain Python data
(never tensors) and a `payload` of raw bytes (a pickled call, result or exception). The reader allocates
the body once the header says how big it is and lets the kernel copy straight into it (os.readv), so a
256 MiB result costs one pass over 256 MiB, not one pass over the growing buffer per 64 KiB read.

    parent -> worker  ("call", seq)             payload: the pickled call
    worker -> parent  ("ready", info)           the process group is up
                      ("returned", seq)         the call returned; its result is being pickled and sent
                      ("ok", seq)               payload: the pickled result
                      ("error", seq, info)      payload: the pickled exception, or nothing
"""

from __future__ import annotations

import collections
import os
import pickle
import struct

HEADER = struct.Struct(">QQ")  # len(meta), len(payload)
_READ_BUDGET = 16 << 20  # bytes one read_some() takes from a pipe before the loop looks at the others
_ALIGN = 16  # as pickling.ALIGN: tensor data received lands on aligned addresses
_PIPE_SIZE = 1 << 20  # the largest pipe an unprivileged Linux process may ask for (fs.pipe-max-size)


def widen_pipe(fd: int) -> None:
    """Ask for a 1 MiB pipe buffer (Linux): fewer wake-ups per large result. Elsewhere the default stays."""
    try:
        import fcntl

        fcntl.fcntl(fd, getattr(fcntl, "F_SETPIPE_SZ", 1031), _PIPE_SIZE)
    except (ImportError, OSError):
        pass


Payload = bytes | bytearray | memoryview | list  # one buffer, or a list of buffers sent back to back


def encode(meta: tuple, payload: Payload = b"") -> list[memoryview]:
    """The frame's pieces, not joined: joining would copy the payload once more. The payload may itself come
    in pieces (a pickle stream and the tensor data beside it: pickling.dumps_on_cpu)."""
    head = pickle.dumps(meta, protocol=pickle.HIGHEST_PROTOCOL)
    head += bytes(-len(head) % _ALIGN)  # the payload starts aligned (unpickling ignores bytes after the end)
    parts = [memoryview(p).cast("B") for p in (payload if isinstance(payload, list) else [payload])]
    size = sum(len(p) for p in parts)
    return [memoryview(HEADER.pack(len(head), size)), memoryview(head), *parts]


def write_frame(fd: int, meta: tuple, payload: Payload = b"") -> None:
    """Write one frame to a blocking fd (the worker's side)."""
    for part in encode(meta, payload):
        while part:
            part = part[os.write(fd, part):]


def _read_exact_into(fd: int, buf: bytearray) -> bool:
    view, got = memoryview(buf), 0
    while got < len(buf):
        n = os.readv(fd, [view[got:]])
        if n == 0:
            return False
        got += n
    return True


def read_frame(fd: int) -> tuple[tuple, memoryview] | None:
    """Read one frame from a blocking fd (the worker's side); None at end of file."""
    head = bytearray(HEADER.size)
    if not _read_exact_into(fd, head):
        return None
    meta_len, payload_len = HEADER.unpack(head)
    body = bytearray(meta_len + payload_len)
    if not _read_exact_into(fd, body):
        return None
    view = memoryview(body)
    return pickle.loads(view[:meta_len]), view[meta_len:]


class FrameReader:
    """Reassembles frames from a non-blocking fd (the parent's side), whatever the sizes of the reads."""

    def __init__(self) -> None:
        self._head = bytearray()
        self._body: bytearray | None = None
        self._got = 0
        self._meta_len = 0
        self.eof = False

    @property
    def receiving(self) -> bool:
        """A frame has begun to arrive and is not complete yet."""
        return bool(self._head)

    def read_some(self, fd: int) -> tuple[list[tuple[tuple, memoryview]], bool]:
        """Read what the pipe holds, up to a budget. Returns (the frames completed, whether to call again):
        False once the pipe is empty for now or at end of file (see `eof`)."""
        frames: list[tuple[tuple, memoryview]] = []
        budget = _READ_BUDGET
        try:
            while budget > 0:
                if self._body is None:
                    data = os.read(fd, HEADER.size - len(self._head))
                    if not data:
                        self.eof = True
                        return frames, False
                    self._head += data
                    if len(self._head) < HEADER.size:
                        continue
                    self._meta_len, payload_len = HEADER.unpack(self._head)
                    self._body, self._got = bytearray(self._meta_len + payload_len), 0
                else:
                    n = os.readv(fd, [memoryview(self._body)[self._got:]])
                    if n == 0:
                        self.eof = True
                        return frames, False
                    self._got += n
                    budget -= n
                if self._got == len(self._body):
                    view = memoryview(self._body)
                    frames.append((pickle.loads(view[:self._meta_len]), view[self._meta_len:]))
                    self._head, self._body, self._got = bytearray(), None, 0
        except BlockingIOError:
            return frames, False
        return frames, True


class Outbox:
    """Bytes queued for a non-blocking fd, as a queue of views: sending never re-copies what is left."""

    def __init__(self) -> None:
        self._parts: collections.deque[memoryview] = collections.deque()

    def __bool__(self) -> bool:
        return bool(self._parts)

    def put(self, parts: list[memoryview]) -> None:
        self._parts.extend(p for p in parts if len(p))

    def clear(self) -> None:
        self._parts.clear()

    def write_some(self, fd: int) -> None:
        """Write until the pipe is full or nothing is left. BrokenPipeError goes to the caller."""
        try:
            while self._parts:
                part = self._parts[0]
                n = os.write(fd, part)
                if n == len(part):
                    self._parts.popleft()
                else:
                    self._parts[0] = part[n:]
        except BlockingIOError:
            pass
