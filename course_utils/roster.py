"""A class's roster: the students, one username a line in a text file (`#` starts a comment, blank lines are
ignored), and the instructors, given apart as a list (make's ADMINS="ada, grace").

One reader for everyone who needs the roster: the hub (launch/hub: who may log in, who gets which GPU), the
accounts it makes, and the classroom's collect/grade/return. Usernames are system accounts (the hub runs each
server as its user), so they follow useradd's default rule, in lower case only: JupyterHub lowercases what people
type at login, so a capital letter would name an account nobody can log in to.
"""

from __future__ import annotations

import re
from pathlib import Path

USERNAME = re.compile(r"[a-z_][a-z0-9_-]{0,31}")


class RosterError(ValueError):
    """A roster that cannot be used: the message names the file and line, and says what to write."""


def parse_names(text: str, where: str = "roster") -> list[str]:
    """The usernames in `text` (one a line, `#` comments), in order; RosterError names a bad or repeated line."""
    names: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if not USERNAME.fullmatch(name):
            raise RosterError(f"{where}:{number}: {name!r} is not a username (lower-case letters, digits, '_' and "
                              "'-', starting with a letter or '_', at most 32 characters; one per line)")
        if name in names:
            raise RosterError(f"{where}:{number}: {name} is listed twice")
        names.append(name)
    return names


def read_roster(path: str | Path, required: bool = True) -> list[str]:
    """The students listed in the roster file at `path`: at least one unless not `required` (a hub for
    instructors alone)."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise RosterError(f"roster {path} not found: write one student username per line (# starts a comment) "
                          "and pass it with --roster (make: ROSTER=...)") from None
    except OSError as e:
        raise RosterError(f"cannot read the roster {path}: {e.strerror}") from e
    names = parse_names(text, str(path))
    if required and not names:
        raise RosterError(f"roster {path} names no students: write one username per line")
    return names


def parse_admins(text: str) -> list[str]:
    """The instructors in `text`: usernames separated by spaces or commas (the ADMINS make variable)."""
    return parse_names("\n".join(re.split(r"[\s,]+", text.strip())), "ADMINS")
