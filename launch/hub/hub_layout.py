"""The permission layout of a class on one box, made as root by `make hub` before the hub starts.

    python launch/hub/hub_layout.py        (start_hub.sh runs it with the COURSE_HUB_* settings)

Students run code as their own accounts on the instructor's machine, so the file modes are the wall:
- notebooks/ (the masters: solutions), tests/ (wrong answers) and the git directory (every past master) belong
  to the instructors' group (course-instructors) and are closed to others: 2770 for notebooks/ (instructors edit
  masters from their hub server; files group-writable), 0750 for the others.
- the rest of the repository (course_utils, launch, benchmarks) and the Python environment stay readable by all:
  students' kernels import course_utils and torch from there. Every folder above them must let others pass (o+x).
- HUB_DIR (0711): state/ (0700: the hub's database, cookie secret, passwords) and release/ (0755: the lessons'
  student versions, what each student's workspace is made from, since students cannot read the masters).
- HUB_DIR/jupyter (0755): the kernel spec every server uses, which loads the GPU turns (hub_gpus.py).
- students' homes are 0700 (launch/hub/accounts.py makes them so): nobody reads another's work.
"""

from __future__ import annotations

import grp
import os
import pwd
import stat
import subprocess
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hub_gpus import check_policy, write_kernel_spec  # noqa: E402  (this folder is not a package)
from hub_settings import Settings, from_env  # noqa: E402
from hub_slurm import check as check_spawner  # noqa: E402

from course_utils.roster import RosterError, parse_admins, read_roster  # noqa: E402

# What grading writes in the repository (README's instructor section, course_utils.classroom): collected work,
# graded notebooks, scores.
GRADING_OUTPUTS = ("submissions", "grades", "feedback", "scores.csv", "grades.xml")


def ensure_group(name: str, members: list[str]) -> int:
    """The gid of group `name`, made if missing, with every existing account of `members` in it."""
    try:
        gid = grp.getgrnam(name).gr_gid
    except KeyError:
        subprocess.run(["groupadd", "--system", name], check=True)
        gid = grp.getgrnam(name).gr_gid
    for user in members:
        if user in accounts_missing([user]):
            continue
        if user not in grp.getgrnam(name).gr_mem:
            subprocess.run(["gpasswd", "--add", user, name], check=True, stdout=subprocess.DEVNULL)
    return gid


def accounts_missing(names: list[str]) -> list[str]:
    """The names that are no system account (they could not log in with PAM, nor run a server)."""
    missing = []
    for name in names:
        try:
            pwd.getpwnam(name)
        except KeyError:
            missing.append(name)
    return missing


def git_dir(repo: Path) -> Path | None:
    """The repository's git directory (a worktree's `.git` file names it; its objects live in the common one)."""
    dot = repo / ".git"
    if dot.is_dir():
        return dot
    if dot.is_file():
        res = subprocess.run(["git", "-C", str(repo), "rev-parse", "--path-format=absolute", "--git-common-dir"],
                             capture_output=True, text=True, check=False)
        if res.returncode == 0 and res.stdout.strip():
            return Path(res.stdout.strip())
    return None


def close_to_students(repo: Path, gid: int) -> list[Path]:
    """Give notebooks/, tests/ and the git directory to the instructors' group, closed to others, and close
    grading's outputs to others. Returns what was closed."""
    closed = []
    masters = repo / "notebooks"
    for root, dirs, files in os.walk(masters):
        for name in dirs + files:  # masters editable by every instructor, whoever saved a file first
            path = Path(root) / name
            if not path.is_symlink():
                os.chown(path, -1, gid)
                os.chmod(path, path.stat().st_mode | (0o2070 if path.is_dir() else 0o060))
    for path in (masters, repo / "tests", git_dir(repo)):
        if path is not None and path.is_dir():
            os.chown(path, -1, gid)
            os.chmod(path, 0o2770 if path == masters else 0o750)
            closed.append(path)
    for name in GRADING_OUTPUTS:  # every student's work and scores: whatever their modes, none for others
        path = repo / name
        if path.exists() and not path.is_symlink():
            os.chmod(path, path.stat().st_mode & ~0o007)
            closed.append(path)
    return closed


def hub_dirs(settings: Settings) -> None:
    """HUB_DIR 0711, its state/ 0700 (secrets), release/ 0755 (what students' workspaces are made from)."""
    for path, mode in ((settings.hub_dir, 0o711), (settings.state, 0o700), (settings.release.parent, 0o755),
                       (settings.release, 0o755)):
        path.mkdir(parents=True, exist_ok=True)
        os.chmod(path, mode)


def not_open_to_all(paths: list[Path]) -> list[str]:
    """Why students' processes could not use `paths`: a folder on the way that others may not pass (o+x) or a
    path itself that others may not read."""
    problems = []
    for path in paths:
        for folder in [*reversed(path.parents), path]:
            mode = folder.stat().st_mode
            need = (stat.S_IROTH | stat.S_IXOTH) if folder == path else stat.S_IXOTH
            if mode & need != need:
                problems.append(f"{folder} is {stat.filemode(mode)}: students cannot reach {path} "
                                f"(chmod o+{'rx' if folder == path else 'x'} {folder}, or keep the course elsewhere)")
                break
    return problems


def python_paths() -> list[Path]:
    """What students' servers need of this Python: the environment, its interpreter and standard library (a venv
    made from a Python under /root, e.g. pyenv's, is closed to them whatever the venv's own modes)."""
    paths = sysconfig.get_paths()
    return [Path(sys.prefix), Path(os.path.realpath(sys.executable)), Path(paths["stdlib"]), Path(paths["purelib"])]


def release_lessons(settings: Settings) -> int:
    """Write the student versions of the masters into HUB_DIR/release/notebooks, and the masters without their
    solutions into HUB_DIR/release/grading (what `make check` scores against); returns how many lessons."""
    import nbformat

    from course_utils.grading.release import dumps, release, unsolved_master

    written = release([settings.repo / "notebooks"], settings.release)
    settings.grading.mkdir(parents=True, exist_ok=True)
    os.chmod(settings.grading, 0o755)
    for master, student, _found in written:
        os.chmod(student, 0o644)
        copy = settings.grading / master.name
        copy.write_text(dumps(unsolved_master(nbformat.read(master, as_version=4), str(master))), encoding="utf-8")
        os.chmod(copy, 0o644)
    return len(written)


def prepare(settings: Settings) -> list[str]:
    """Make the layout; returns the problems that keep the hub from serving the class (empty: ready)."""
    students = read_roster(settings.roster, required=False)
    admins = parse_admins(settings.admins)
    if not students and not admins:
        return [f"the roster {settings.roster} lists nobody, and ADMINS is empty: nobody could log in"]
    problems = [f"{name} (roster or ADMINS) has no system account: create it with `make students` "
                f"(launch/hub/accounts.py)" for name in accounts_missing(students + admins)]
    problems += check_policy(settings.gpus, students, settings.gpu_ids) + check_spawner(settings)
    gid = ensure_group(settings.group, admins)
    closed = close_to_students(settings.repo, gid)
    hub_dirs(settings)
    count = release_lessons(settings)
    write_kernel_spec(settings.jupyter)
    problems += not_open_to_all([settings.repo / "course_utils", settings.repo / "launch", settings.release,
                                 settings.grading, *python_paths()])
    print(f"hub: {len(students)} students, instructors {admins or 'none'} (group {settings.group}); closed to "
          f"students: {', '.join(str(p) for p in closed)}; {count} lessons released in {settings.release}")
    return problems


def main() -> int:
    """`make hub`'s first step; exits 1, saying why, when the class could not be served."""
    if os.geteuid() != 0:
        print("hub: run `make hub` as root: it makes the permission layout and starts servers as each student",
              file=sys.stderr)
        return 1
    try:
        problems = prepare(from_env())
    except RosterError as e:
        problems = [str(e)]
    for problem in problems:
        print(f"hub: error: {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
