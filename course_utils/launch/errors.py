"""What can go wrong in a launch, as exceptions that explain themselves.

Bad arguments are ValueError/TypeError (raised before any process starts); LaunchError is everything
after: a rank failed (WorkerError), the job ran out of time (WorkerTimeout), torchrun failed.
"""

from __future__ import annotations

import re
import signal

# Errors a rank reports only because another rank went away: its connection closed under it.
_PEER_LOST = re.compile(r"Connection (reset|closed) by peer|Broken pipe|remote process exited|"
                        r"NCCL communicator was aborted|Connection refused", re.IGNORECASE)


class LaunchError(RuntimeError):
    """A launch went wrong: bad arguments are ValueError/TypeError, this is everything after."""


class WorkerError(LaunchError):
    """A rank failed. `rank` failed first; `traceback` is its remote traceback; `others` says, per rank,
    what happened to the rest; `exception` is the original exception when it could be sent back."""

    def __init__(self, rank: int, exc_type: str, message: str, traceback: str, others: dict[int, str],
                 exception: BaseException | None = None):
        self.rank, self.exc_type, self.traceback = rank, exc_type, traceback
        self.others, self.exception = others, exception
        self.stopped: list[int] = []  # ranks still running when it failed (then stopped)
        summary = f"{exc_type}: {message}" if message else exc_type
        lines = [f"rank {rank} failed first: {summary}", "", f"--- traceback from rank {rank} ---", traceback.rstrip()]
        if others:
            lines += ["", "--- the other ranks ---"] + [f"rank {r}: {s}" for r, s in sorted(others.items())]
        super().__init__("\n".join(lines))


class WorkerTimeout(LaunchError, TimeoutError):
    """The job ran past its timeout, and every worker was stopped.

    `running`: ranks still running their code; `stacks`: for each of them, where its Python code was when
    time ran out; `sending`: ranks that had returned but whose results were still on the way back;
    `starting`: ranks that had not finished starting (importing torch, joining the process group);
    `last_output`: the last line each rank printed.
    """

    def __init__(self, timeout: float | None, running: list[int], last_output: dict[int, str],
                 stacks: dict[int, str] | None = None, sending: list[int] | None = None,
                 starting: list[int] | None = None):
        self.timeout, self.running, self.last_output = timeout, list(running), last_output
        self.stacks, self.sending, self.starting = dict(stacks or {}), list(sending or []), list(starting or [])
        limit = f"the {timeout:g} s timeout" if timeout is not None else "the timeout"
        lines = []
        if self.starting:
            lines.append(f"{_ranks(self.starting)} had not finished starting (importing torch, joining the process "
                         f"group) at {limit}: a busy machine or a slow file system; pass a larger timeout.")
        if self.running:
            lines.append(f"{_ranks(self.running)} {'were' if len(self.running) > 1 else 'was'} still running after "
                         f"{limit}, so every worker was stopped.")
        if self.sending:
            were = "s were" if len(self.sending) > 1 else " was"
            lines.append(f"{_ranks(self.sending)} had finished, but the result{were} still on the way back at "
                         f"{limit}: return less data, or pass a larger timeout.")
        if self.running:
            lines.append("A hang like this is usually mismatched collectives or send/recv (one rank waits for a "
                         "partner that never comes); if the work is just slow, pass a larger timeout.")
        for r in sorted(self.stacks):
            lines += ["", f"--- where rank {r} was (most recent call last) ---", self.stacks[r].rstrip()]
        lines += ["", "Last thing each rank printed:"]
        lines += [f"  rank {r}: {last_output.get(r) or '(nothing)'}" for r in sorted(last_output)]
        super().__init__("\n".join(lines))


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def add_note(err: BaseException, note: str) -> None:
    """Append a paragraph to an exception's message (str(err) shows it, in every Python version)."""
    err.args = (f"{err.args[0]}\n\n{note}",) if err.args else (note,)


def signal_name(code: int) -> str:
    """' (SIGKILL)' for a return code of -9; '' for a normal exit code."""
    try:
        return f" ({signal.Signals(-code).name})" if code < 0 else ""
    except ValueError:
        return ""


def first_line(text: str) -> str:
    return (text or "").strip().splitlines()[0] if (text or "").strip() else ""


def is_consequence(info: dict) -> bool:
    """Whether a rank's error says only that a peer went away (its connection closed under it)."""
    return bool(_PEER_LOST.search(first_line(info.get("message", ""))))


def first_failure(failures: dict[int, dict]) -> int:
    """The rank whose failure came first: one that died silently (usually the cause), else one whose error is
    more than a lost connection (a peer's timeout closes the connection, and on a busy machine the rank that
    sees it can stamp its error before the timed-out one does), else the earliest (workers stamp the time
    they caught their error)."""
    return min(failures, key=lambda k: (not failures[k].get("silent"), is_consequence(failures[k]),
                                        failures[k].get("time", 0.0), k))


def describe_other(info: dict, first: int) -> str:
    """One line about a rank that also failed once rank `first` had: plainly a consequence when its
    connection to the failed rank closed under it (gloo's 'Connection reset by peer ... GLHF!' says no more)."""
    message = first_line(info.get("message", ""))
    lost = _PEER_LOST.search(message)
    if lost:
        return (f"stopped waiting: its connection closed when rank {first} failed "
                f"({info['type']}: {lost.group(0)})")
    if len(message) > 200:
        message = message[:200] + " ..."
    return f"also failed: {info['type']}: {message}"
