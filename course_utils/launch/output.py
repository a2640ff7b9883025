"""Ranks' output, printed live in the cell as `[rank r] line`: the one routine both launch paths use.

The worker group feeds each rank's stdout and stderr here with the rank known; the torchrun CLI path
feeds torchrun's own output, whose lines carry torchrun's `[defaultN]:` prefix, and lets this module read
the rank from it. Either way the lines look the same, colour is used only where it renders, and the last
line each rank printed is kept for error messages.
"""

from __future__ import annotations

import os
import re
import sys
from typing import TextIO

_COLOURS = (34, 32, 35, 36, 33, 31, 94, 92, 95, 96, 93, 91)  # ANSI: blue, green, magenta, cyan, yellow, red, ...
TORCHRUN_PREFIX = re.compile(r"^\[default(\d+)\]:")
# Lines a rank's libraries print that say nothing to a learner and are dropped: kineto (torch 2.13) marks every
# profiler start and stop with a "USDT" line for tracing tools, at a level above ERROR, so KINETO_LOG_LEVEL cannot
# hide it without hiding kineto's errors too; and kineto reports "no CUDA device" (cudaErrorNoDevice, code 100)
# as an ERROR when a profiler starts in a rank whose GPUs are hidden (gloo ranks on a GPU machine, torch 2.11).
NOISE = re.compile(r"^USDT:\S+ \S+ \d+:\d+ SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)$"
                   r"|^ERROR:\S+ \S+ \d+:\d+ DeviceProperties\.cpp:\d+\] gpuGetDeviceCount failed with code 100$")


def in_jupyter_kernel() -> bool:
    """True inside a Jupyter kernel (which renders ANSI colour), not merely when ipykernel was imported."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    return type(shell).__name__ == "ZMQInteractiveShell"


def use_colour() -> bool:
    """NO_COLOR wins, then FORCE_COLOR; otherwise colour only in a Jupyter kernel or a terminal."""
    if os.environ.get("NO_COLOR"):
        return False
    if os.environ.get("FORCE_COLOR"):
        return True
    return in_jupyter_kernel() or sys.stdout.isatty()


def prefix(rank: int, width: int, colour: bool) -> str:
    text = f"[rank {rank:>{width}}]"
    return f"\033[{_COLOURS[rank % len(_COLOURS)]}m{text}\033[0m " if colour else f"{text} "


class RankOutput:
    """Splits byte streams into lines and prints each with its rank's prefix.

    Streams are keyed by any hashable (a file descriptor); `feed` may be given arbitrary chunks: a line
    split across reads is held back until its end arrives, and each byte is copied a bounded number of times.
    """

    def __init__(self, nproc: int, show: frozenset[int] | None = None, colour: bool | None = None):
        self.width = len(str(max(nproc - 1, 0)))
        self.show = show
        self.colour = use_colour() if colour is None else colour
        self.last: dict[int, str] = {}
        self._partial: dict[object, tuple[bytearray, TextIO, int | None]] = {}

    def feed(self, key: object, data: bytes, stream: TextIO, rank: int | None) -> None:
        """Print the complete lines in data. rank=None: each line names its rank with torchrun's prefix."""
        held = self._partial.get(key)
        cut = data.rfind(b"\n")
        if cut < 0:
            if held is None:
                self._partial[key] = (bytearray(data), stream, rank)
            else:
                held[0].extend(data)
            return
        lines = ((bytes(held[0]) + data[:cut]) if held else data[:cut]).split(b"\n")
        if cut + 1 < len(data):
            self._partial[key] = (bytearray(data[cut + 1:]), stream, rank)
        else:
            self._partial.pop(key, None)
        for raw in lines:
            self.line(raw.decode("utf-8", "replace"), stream, rank)

    def end(self, key: object) -> None:
        """The stream ended (or is about to be abandoned): print its unfinished last line."""
        held = self._partial.pop(key, None)
        if held and held[0]:
            self.line(held[0].decode("utf-8", "replace"), held[1], held[2])

    def end_all(self) -> None:
        for key in list(self._partial):
            self.end(key)
        flush()

    def line(self, text: str, stream: TextIO, rank: int | None) -> None:
        text = text.rstrip("\r")
        if rank is None:
            m = TORCHRUN_PREFIX.match(text)
            if m is None:  # torchrun's own messages (its agent's log lines): as they are
                print(text, file=stream)
                return
            rank, text = int(m.group(1)), text[m.end():]
        if NOISE.match(text):
            return
        if text.strip():
            self.last[rank] = text
        if self.show is None or rank in self.show:
            print(prefix(rank, self.width, self.colour) + text, file=stream)


def flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
