"""Who may use the class's JupyterHub: the roster of students and the instructors (admins).

The roster is a text file, one username per line; `#` starts a comment, blank lines are ignored. Instructors are
given apart (`make hub ADMINS="ada grace"`): they log in to the masters, students to their own workspace.
Usernames are system accounts (the hub runs each server as its user), so they follow useradd's rules.
"""

from __future__ import annotations

import re
from pathlib import Path

# Debian's default for useradd (NAME_REGEX), lower case only: JupyterHub lowercases what people type at login,
# so a capital letter in the roster would name an account nobody can log in to.
USERNAME = re.compile(r"^[a-z_][a-z0-9_-]{0,31}$")


class RosterError(ValueError):
    """A roster line that is not a usable username."""


def parse_names(text: str, where: str = "roster") -> list[str]:
    """The usernames in `text` (one a line, `#` comments), in order, each once; RosterError names a bad line."""
    names: list[str] = []
    for number, line in enumerate(text.splitlines(), 1):
        name = line.split("#", 1)[0].strip()
        if not name:
            continue
        if not USERNAME.match(name):
            raise RosterError(f"{where}, line {number}: {name!r} is not a username (lower-case letters, digits, "
                              "'_' and '-', starting with a letter or '_', at most 32 characters)")
        if name not in names:
            names.append(name)
    return names


def read_roster(path: str | Path) -> list[str]:
    """The students listed in the roster file at `path`."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise RosterError(f"cannot read the roster {path}: {e.strerror}") from e
    return parse_names(text, str(path))


def parse_admins(text: str) -> list[str]:
    """The instructors in `text`: usernames separated by spaces or commas (the ADMINS make variable)."""
    return parse_names("\n".join(re.split(r"[\s,]+", text.strip())), "ADMINS")
