"""Creates the system accounts of a class from its roster (as root): `make students ROSTER=roster.txt`.

    python launch/hub/accounts.py ROSTER [--admins "ada grace"] [--passwords FILE] [--no-passwords]

Each missing account is made with useradd (a home of its own, its own group, bash); every listed home is made
0700, so no student reads another's work. New accounts get a random password (chpasswd), written to FILE
(default .hub/state/initial-passwords.txt, 0600, root's alone) for the instructor to hand out; students change it
with `passwd` in their lab's terminal. --no-passwords leaves new accounts locked, for the first-use authenticator
(the hub then asks for a password at the first login). Existing accounts keep their password.
"""

from __future__ import annotations

import argparse
import os
import pwd
import secrets
import subprocess
import sys
from pathlib import Path

# this folder (not a package), and the repository's course_utils whichever checkout installed the environment
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]

from hub_settings import from_env  # noqa: E402

from course_utils.roster import RosterError, parse_admins, read_roster  # noqa: E402


def create(names: list[str], passwords: bool = True) -> dict[str, str | None]:
    """Make each missing account; return {new name: its password (None: locked)}. Every home ends up 0700."""
    made: dict[str, str | None] = {}
    for name in names:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "--create-home", "--user-group", "--shell", "/bin/bash", name], check=True)
            made[name] = secrets.token_urlsafe(9) if passwords else None
        os.chmod(pwd.getpwnam(name).pw_dir, 0o700)  # whatever HOME_MODE this system's useradd uses
    lines = "".join(f"{name}:{pw}\n" for name, pw in made.items() if pw)
    if lines:
        subprocess.run(["chpasswd"], input=lines, text=True, check=True)
    return made


def record(made: dict[str, str | None], file: Path) -> None:
    """Append the new accounts' passwords to `file`, readable by root alone."""
    file.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with os.fdopen(fd, "a") as out:
        out.writelines(f"{name} {pw}\n" for name, pw in made.items() if pw)
    os.chmod(file, 0o600)


def main(argv: list[str] | None = None) -> int:
    """The command line; exits 1 with the reason when the roster is unreadable or we are not root."""
    parser = argparse.ArgumentParser(prog="python launch/hub/accounts.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("roster", help="the students, one username a line (# comments)")
    parser.add_argument("--admins", default="", help="instructors' accounts to make too, e.g. 'ada grace'")
    parser.add_argument("--passwords", type=Path, default=from_env().state / "initial-passwords.txt",
                        help="where new accounts' passwords are written (default: %(default)s)")
    parser.add_argument("--no-passwords", action="store_true", help="leave new accounts locked (first-use login)")
    args = parser.parse_args(argv)
    if os.geteuid() != 0:
        print("accounts: run as root (sudo make students ...)", file=sys.stderr)
        return 1
    try:
        names = read_roster(args.roster) + parse_admins(args.admins)
    except RosterError as e:
        print(f"accounts: error: {e}", file=sys.stderr)
        return 1
    made = create(list(dict.fromkeys(names)), passwords=not args.no_passwords)
    if made and not args.no_passwords:
        record(made, args.passwords)
    print(f"accounts: {len(made)} made ({', '.join(made) or 'none'}), {len(names) - len(made)} already there"
          + (f"; new passwords in {args.passwords}" if made and not args.no_passwords else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
