"""A class on one box: each student a system user whose home holds a workspace made by `make lab`.

    python -m course_utils.classroom collect --roster roster.txt    WORKSPACE/notebooks/NN_*.ipynb -> submissions/
    python -m course_utils.classroom grade --master-dir notebooks   the grader on submissions/ -> grades/
    python -m course_utils.classroom return --roster roster.txt     grades/ -> WORKSPACE/notebooks/feedback/

The roster is plain text: one username per line; `#` starts a comment. A student's workspace is found by
--workspace-template (default `~{user}/workspace`: what `make lab LAB_WORKSPACE=~/workspace` makes).
submissions/ and grades/ hold everyone's work, so they are made mode 0700; feedback/ is 0700 and the student's.
"""

from __future__ import annotations

import argparse
import csv
import errno
import hashlib
import io
import json
import os
import pwd
import re
import shutil
import stat
import sys
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from . import workspace as ws
from .roster import RosterError, read_roster

TEMPLATE = "~{user}/" + ws.DEFAULT
LESSON = re.compile(r"\d\d_.*\.ipynb")  # the lesson notebooks, as the masters name them
MAX_BYTES = 50 << 20  # the grader's MAX_SUBMISSION_BYTES: it would not grade a larger notebook
# WORKSPACE/notebooks/feedback: what `return` writes, in the folder the student's lab shows (a sub-folder: the
# lessons themselves are never touched, and collect takes only the lessons at the top)
FEEDBACK = "feedback"
SCORES, JUNIT, EXECUTED = "scores.csv", "grades.xml", "executed"  # inside grades/


class ClassroomError(RuntimeError):
    """Bad input or a step that cannot go on: the message says what was wrong and what to do."""


@dataclass
class Collected:
    """One student's part of submissions/manifest.json."""

    workspace: str
    status: str = "collected"  # or why nothing was: no workspace, not the student's, no notebooks
    notebooks: dict[str, dict] = field(default_factory=dict)  # name -> {source, mtime, sha256}
    skipped: dict[str, str] = field(default_factory=dict)  # name -> why it was not copied


def workspace_of(user: str, template: str = TEMPLATE) -> Path:
    """A student's workspace: the template with {user} filled in and ~ expanded."""
    try:
        if "{user}" not in template:
            raise KeyError("user")
        return Path(os.path.expanduser(template.format(user=user)))
    except (KeyError, IndexError, ValueError) as e:
        raise ClassroomError(f"--workspace-template {template!r} must contain {{user}} and no other {{...}}, e.g. "
                             f"{TEMPLATE!r}") from e


def _account(user: str) -> pwd.struct_passwd | None:
    try:
        return pwd.getpwnam(user)
    except KeyError:  # not a system user (a test's fake student): no ownership to check or give
        return None


def _remove(folder: Path) -> None:
    if folder.exists():
        for path in [folder, *folder.rglob("*")]:  # read-only folders (submissions) cannot be emptied otherwise
            if path.is_dir() and not path.is_symlink():
                path.chmod(0o700)
        shutil.rmtree(folder)


def _fresh(folder: Path) -> Path:
    """An empty, private sibling of `folder` to build its new version in (then `_swap`)."""
    new = folder.with_name(f".{folder.name}.new")
    _remove(new)  # left by an interrupted run
    new.mkdir(mode=0o700, parents=True)
    return new


def _swap(new: Path, old: Path) -> bool:
    """Put the finished folder `new` in place of `old`, replaced whole; True if there was an old one."""
    had = old.exists()
    _remove(old)
    new.rename(old)
    return had


def _copy_notebook(src_dir: int, name: str, dest: Path) -> dict:
    """Copy one notebook without following links (a student's link could point at another's work); its record."""
    with os.fdopen(os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=src_dir), "rb") as f:
        st = os.fstat(f.fileno())  # NONBLOCK above: opening a FIFO would wait for a writer
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_BYTES:
            raise OSError(f"not a regular file of at most {MAX_BYTES >> 20} MiB")
        data = f.read()
    dest.write_bytes(data)
    os.utime(dest, (st.st_atime, st.st_mtime))
    dest.chmod(0o444)
    return {"mtime": datetime.fromtimestamp(st.st_mtime, timezone.utc).isoformat(),
            "sha256": hashlib.sha256(data).hexdigest()}


def collect_one(user: str, template: str, dest: Path) -> Collected:
    """Copy one student's lesson notebooks into `dest` (read-only). Never raises for a student's state."""
    folder = workspace_of(user, template) / ws.NOTEBOOKS
    got = Collected(workspace=str(folder.parent))
    account = _account(user)
    try:
        src = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as e:
        got.status = ("no workspace: " if e.errno == errno.ENOENT else "not collected: ") + f"{folder}: {e.strerror}"
        return got
    try:
        owner = os.fstat(src).st_uid
        if account and owner != account.pw_uid:  # e.g. a link to another student's workspace
            got.status = f"not collected: {folder} belongs to uid {owner}, not to {user}"
            return got
        dest.mkdir(mode=0o755)
        for name in sorted(n for n in os.listdir(src) if LESSON.fullmatch(n)):
            try:
                got.notebooks[name] = {"source": str(folder / name), **_copy_notebook(src, name, dest / name)}
            except OSError as e:  # ELOOP: O_NOFOLLOW met a link
                got.skipped[name] = "a link, not a file" if e.errno == errno.ELOOP else (e.strerror or str(e))
    finally:
        os.close(src)
    dest.chmod(0o555)
    if not got.notebooks:
        got.status = f"no lesson notebooks (NN_*.ipynb) in {folder}"
    return got


def collect(roster: list[str], template: str, submissions: Path) -> dict[str, Collected]:
    """submissions/<user>/NN_*.ipynb for each student, read-only, and submissions/manifest.json; replaces any old
    collection whole."""
    new = _fresh(submissions)
    found = {user: collect_one(user, template, new / user) for user in roster}
    manifest = {"collected_at": datetime.now(timezone.utc).isoformat(), "workspace_template": template,
                "students": {user: asdict(c) for user, c in found.items()}}
    (new / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (new / "manifest.json").chmod(0o444)
    if _swap(new, submissions):
        print(f"collect: replaced the previous collection in {submissions}/")
    return found


def grade(submissions: Path, grades: Path, master_dir: Path, grader_args: list[str]) -> int:
    """Run the grader on every collected notebook that has a master; reports and feedback notebooks in grades/.
    Returns the grader's exit status (1: some submissions could not be graded; they are named above)."""
    from .grading.grade import main as grade_main  # the grader and its imports load only for this step

    masters = {p.name for p in master_dir.glob("*.ipynb")}
    if not masters:
        raise ClassroomError(f"no master notebooks in {master_dir}/: pass --master-dir (the instructor's notebooks/)")
    files = sorted(p for p in submissions.glob("*/*.ipynb") if p.name in masters)
    others = sorted(p for p in submissions.glob("*/*.ipynb") if p.name not in masters)
    if others:
        print(f"grade: not graded (no master of that name): {', '.join(str(p) for p in others)}")
    if not files:
        raise ClassroomError(f"nothing to grade in {submissions}/: run `collect` first")
    new = _fresh(grades)
    rc = grade_main([*map(str, files), "--master-dir", str(master_dir), "--csv", str(new / SCORES),
                     "--junit", str(new / JUNIT), "--executed-dir", str(new / EXECUTED), *grader_args])
    if rc not in (0, 1) or not (new / SCORES).is_file():
        raise ClassroomError(f"the grader failed (exit status {rc}; its message is above): fix that and run `grade` "
                             f"again; {grades}/ was left as it was")
    (new / EXECUTED).mkdir(exist_ok=True)
    if _swap(new, grades):
        print(f"grade: replaced the previous grades in {grades}/")
    return rc


def _scores_text(user: str, rows: list[dict[str, str]], fields: list[str]) -> str:
    """The student's rows of the class CSV, as markdown: a section per notebook."""
    exercise_cols = fields[3:-3]  # student, submission, master, <exercises...>, total, max, notes
    lines = [f"# Grades for {user}", "", f"Returned {time.strftime('%Y-%m-%d %H:%M %Z')}. Each notebook here is "
             "the lesson as the grader ran it with your answers; your own notebooks were not changed.", ""]
    for row in rows:
        lines += [f"## {Path(row['submission']).name}: {row['total']} of {row['max']} points", "",
                  "| exercise | points |", "|---|---|"]
        lines += [f"| {c} | {row[c]} |" for c in exercise_cols if row[c] != ""]
        lines += ["", f"Not passed, and why: {row['notes']}" if row["notes"] else "Every exercise passed.", ""]
    return "\n".join(lines)


def _open_feedback(workspace: Path, owner: pwd.struct_passwd | None) -> int:
    """A descriptor of WORKSPACE/notebooks/feedback (made if missing), 0700 and the student's. Descriptors and
    O_NOFOLLOW, because as root a path the student controls could otherwise lead the writes into another's folder."""
    where = workspace / ws.NOTEBOOKS / FEEDBACK
    top = os.open(workspace, os.O_RDONLY | os.O_DIRECTORY)
    try:
        if owner and os.fstat(top).st_uid != owner.pw_uid:
            raise ClassroomError(f"{workspace} does not belong to {owner.pw_name}: nothing written there")
        try:
            lessons = os.open(ws.NOTEBOOKS, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=top)
        except OSError as e:
            raise ClassroomError(f"{workspace / ws.NOTEBOOKS} is not a folder ({e.strerror})") from e
    finally:
        os.close(top)
    try:
        if owner and os.fstat(lessons).st_uid != owner.pw_uid:
            raise ClassroomError(f"{workspace / ws.NOTEBOOKS} does not belong to {owner.pw_name}: nothing written")
        try:
            os.mkdir(FEEDBACK, 0o700, dir_fd=lessons)
        except FileExistsError:
            pass
        try:
            fd = os.open(FEEDBACK, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW, dir_fd=lessons)
        except OSError as e:
            raise ClassroomError(f"{where} is not a folder ({e.strerror}): move it away") from e
    finally:
        os.close(lessons)
    if owner:
        if os.fstat(fd).st_uid not in (0, owner.pw_uid):
            os.close(fd)
            raise ClassroomError(f"{where} belongs to someone else: nothing written there")
        os.fchown(fd, owner.pw_uid, owner.pw_gid)
    os.fchmod(fd, 0o700)
    return fd


def _write_private(folder: int, name: str, data: bytes, owner: pwd.struct_passwd | None) -> None:
    """Write `name` in `folder` mode 0600 (the student's): a new file renamed over any old one, so a link or hard
    link the student left there is replaced, never written through."""
    tmp = f".{name}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600, dir_fd=folder)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        if owner:
            os.fchown(f.fileno(), owner.pw_uid, owner.pw_gid)
        os.fchmod(f.fileno(), 0o600)
    os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)


def _return_one(user: str, rows: list[dict[str, str]], fields: list[str], workspace: Path, grades: Path) -> str:
    from .grading.grader import executed_path  # where the grader put each feedback notebook

    owner = _account(user) if os.geteuid() == 0 else None  # a test's fake student keeps the instructor's files
    folder = _open_feedback(workspace, owner)
    try:
        _write_private(folder, "scores.md", _scores_text(user, rows, fields).encode(), owner)
        table = io.StringIO()
        writer = csv.DictWriter(table, fields, lineterminator="\n")
        writer.writeheader()
        writer.writerows(rows)
        _write_private(folder, "scores.csv", table.getvalue().encode(), owner)
        sent = 0
        for row in rows:
            executed = executed_path(grades / EXECUTED, row["submission"])
            if executed.is_file():
                _write_private(folder, Path(row["submission"]).name, executed.read_bytes(), owner)
                sent += 1
    finally:
        os.close(folder)
    return f"returned {len(rows)} score rows and {sent} feedback notebooks to {workspace / ws.NOTEBOOKS / FEEDBACK}"


def return_feedback(roster: list[str], template: str, grades: Path) -> dict[str, str]:
    """Each student's scores (scores.md, scores.csv) and feedback notebooks into WORKSPACE/notebooks/feedback/.
    Returns {user: what happened}."""
    if not (grades / SCORES).is_file():
        raise ClassroomError(f"no {grades / SCORES}: run `grade` first")
    with open(grades / SCORES, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        fields, rows = list(reader.fieldnames or []), list(reader)
    done = {}
    for user in roster:
        mine = [r for r in rows if r["student"] == user]
        try:
            done[user] = (_return_one(user, mine, fields, workspace_of(user, template), grades) if mine
                          else "no grades (nothing collected or graded): nothing returned")
        except (ClassroomError, OSError) as e:
            done[user] = f"not returned: {e}"
    for user in sorted({r["student"] for r in rows} - set(roster)):
        done[user] = "graded but not on the roster: nothing returned"
    return done


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--roster", type=Path, default=Path("roster.txt"),
                        help="one student username per line, # comments (default roster.txt)")
    common.add_argument("--workspace-template", default=TEMPLATE,
                        help=f"each student's workspace, {{user}} filled in (default {TEMPLATE})")
    common.add_argument("--submissions", type=Path, default=Path("submissions"), help="default submissions/")
    common.add_argument("--grades", type=Path, default=Path("grades"), help="default grades/")
    parser = argparse.ArgumentParser(prog="python -m course_utils.classroom", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("collect", parents=[common], help="copy each student's lesson notebooks into submissions/")
    p = sub.add_parser("grade", parents=[common], help="grade submissions/ into grades/ (needs bubblewrap)")
    p.add_argument("--master-dir", type=Path, default=Path("notebooks"), help="the masters (default notebooks/)")
    p.add_argument("-j", "--jobs", type=int, default=1, help="probes run at once (the grader's -j)")
    p.add_argument("--timeout", type=float, help="seconds per submission (the grader's default 600)")
    p.add_argument("--cell-timeout", type=float, help="seconds per probe and feedback cell (the grader's default 120)")
    p.add_argument("--gpus", help="comma-separated GPU ids (default: all visible)")
    p.add_argument("--checks-module", action="append", default=[], help="the grader's option of that name")
    sub.add_parser("return", parents=[common], help="put each student's grades into WORKSPACE/notebooks/feedback/")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.command == "grade":
            extra = ["-j", str(args.jobs)] + [a for m in args.checks_module for a in ("--checks-module", m)]
            extra += [a for opt in ("timeout", "cell_timeout", "gpus") if getattr(args, opt) is not None
                      for a in (f"--{opt.replace('_', '-')}", str(getattr(args, opt)))]
            rc = grade(args.submissions, args.grades, args.master_dir, extra)
            print(f"grade: scores in {args.grades / SCORES}; next: `return` hands each student their part")
            return rc
        roster = read_roster(args.roster)
        if args.command == "collect":
            found = collect(roster, args.workspace_template, args.submissions)
            for user, c in found.items():
                print(f"  {user}: " + (f"{len(c.notebooks)} notebooks" if c.notebooks else c.status)
                      + "".join(f"; skipped {n} ({why})" for n, why in c.skipped.items()))
            n = sum(bool(c.notebooks) for c in found.values())
            print(f"collect: {n} of {len(found)} students collected into {args.submissions}/ (manifest.json)")
            return 0 if n else 1
        done = return_feedback(roster, args.workspace_template, args.grades)
        for user, what in done.items():
            print(f"  {user}: {what}")
        return 0 if all(w.startswith("returned") for w in done.values()) else 1
    except (ClassroomError, RosterError) as e:
        print(f"classroom: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
