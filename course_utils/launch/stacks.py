"""Where a stuck rank was: faulthandler's dump of its threads, rewritten as a short traceback.

Workers register faulthandler on SIGUSR1 (it prints every thread's Python stack from inside the signal
handler, so it works while the rank sits in a C++ collective that never returns to Python). This module
turns that text into what a student reads: the threads running their code, most recent call last, with
source lines, without the launcher's own frames.
"""

from __future__ import annotations

import linecache
import os
import re

_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+) in (?P<name>.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) (?P<id>0x[0-9a-f]+)")
_LAUNCHER_DIR = os.path.dirname(os.path.abspath(__file__))


def remember_source(source: str, filename: str) -> None:
    """Keep a cell's source under its pseudo file name here too, so stacks from the ranks show its lines."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)


def _ours(filename: str) -> bool:
    """Frames of the launcher, or of the machinery under it, which say nothing about the student's code."""
    return (os.path.dirname(os.path.abspath(filename)) == _LAUNCHER_DIR or "runpy" in filename
            or filename.startswith("<frozen importlib"))


def _threads(dump: str) -> list[tuple[str, list[tuple[str, int, str]]]]:
    threads: list[tuple[str, list[tuple[str, int, str]]]] = []
    for line in dump.splitlines():
        head = _THREAD.match(line)
        if head:
            threads.append((head.group("id"), []))
            continue
        frame = _FRAME.match(line)
        if frame and threads:
            threads[-1][1].append((frame.group("file"), int(frame.group("line")), frame.group("name")))
    return threads


def readable(dump: str, rename: dict[str, tuple[str, int]] | None = None) -> str:
    """faulthandler's text -> a traceback-like listing of the threads that run code other than ours.

    rename maps a file to (the name to show, lines to subtract): the --cli script is shown as the cell.
    """
    shown = []
    for thread_id, frames in _threads(dump):
        frames = [f for f in frames if not _ours(f[0])]
        if not frames or all(os.path.basename(f[0]) == "threading.py" for f in frames):
            continue  # the launcher's watchdog, or a thread of ours with nothing of the student's on it
        lines = []
        for filename, lineno, name in reversed(frames):  # faulthandler lists the most recent call first
            source = linecache.getline(filename, lineno).strip()
            shown_as, offset = (rename or {}).get(filename, (filename, 0))
            lines.append(f'  File "{shown_as}", line {lineno - offset}, in {name}')
            if source:
                lines.append(f"    {source}")
        shown.append((thread_id, lines))
    if not shown:
        return dump.strip() or "(no Python stack came back)"
    if len(shown) == 1:
        return "\n".join(shown[0][1])
    return "\n".join(f"thread {tid}:\n" + "\n".join(lines) for tid, lines in shown)
