"""The student's workspace: their own copies of the lessons, made from the masters by the release tool.

    python -m course_utils.workspace sync                  make what is missing (`make lab` runs this)
    python -m course_utils.workspace reset 02_cuda_streams   start one lesson over (the old copy is kept aside)

Layout (WORKSPACE, default `workspace/` in the repository, git-ignored):
    WORKSPACE/notebooks/NN_topic.ipynb   the student versions: solutions replaced by `raise NotImplementedError()`;
                                         JupyterLab serves this folder, so students edit and save here
    WORKSPACE/launch, WORKSPACE/benchmarks  links to the repository's folders, which lessons run scripts from
                                         (a notebook finds them next to its own folder, as in the repository)
    WORKSPACE/backups/                   copies that `reset` replaced

A lesson is written once, when it first appears among the masters, and never overwritten afterwards: a new
lesson shows up at the next start, a lesson the student has worked on keeps their work. Only `reset` replaces
one (moving the old copy to backups/ first).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

LINKS = ("launch", "benchmarks")  # repository folders that notebooks reach as ../launch, ../benchmarks
DEFAULT = "workspace"  # `make lab`'s LAB_WORKSPACE, relative to the repository
NOTEBOOKS = "notebooks"  # WORKSPACE/notebooks: the lessons the student edits

__all__ = ["DEFAULT", "LINKS", "NOTEBOOKS", "lesson_name", "reset", "sync"]


def _repo_of(masters: Path) -> Path:
    return masters.resolve().parent


def _write_student_version(master: Path, target: Path, released: bool = False) -> None:
    # `released`: the masters are student versions already (the hub's copy, made by the release tool as root,
    # for students who may not read the real masters): copied as they are.
    if released:
        text = master.read_text()
    else:  # imported here: nbformat takes seconds to import on a loaded machine, and the hub's sync needs none
        import nbformat

        from .grading.release import dumps, student_version

        text = dumps(student_version(nbformat.read(master, as_version=4), str(master)))
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, target)  # atomic: a half-written notebook is never seen


def _link(workspace: Path, repo: Path) -> None:
    for name in LINKS:
        link, target = workspace / name, repo / name
        if not target.is_dir():
            continue
        want = os.path.relpath(target, workspace.resolve())
        if link.is_symlink():
            if os.readlink(link) == want:
                continue
            link.unlink()
        elif link.exists():
            continue  # something the student made: leave it alone
        link.symlink_to(want, target_is_directory=True)


def sync(masters: str | Path = "notebooks", workspace: str | Path = DEFAULT, released: bool = False,
         repo: str | Path | None = None) -> dict[str, str]:
    """Write the student version of every master missing from WORKSPACE/notebooks; keep every existing one.

    `released`: MASTERS holds student versions already, copied as they are (JupyterHub's students, who may not
    read notebooks/). `repo`: the repository whose launch/ and benchmarks/ the workspace links to (default: the
    folder above MASTERS). Returns {notebook file name: "created" | "kept"}."""
    masters, workspace = Path(masters), Path(workspace)
    lessons = sorted(masters.glob("*.ipynb"))
    if not lessons:
        from .grading.release import ReleaseError

        raise ReleaseError(f"no notebooks in {masters}")
    folder = workspace / NOTEBOOKS
    folder.mkdir(parents=True, exist_ok=True)
    _link(workspace, Path(repo).resolve() if repo else _repo_of(masters))
    done = {}
    for master in lessons:
        target = folder / master.name
        if target.exists():
            done[master.name] = "kept"
        else:
            _write_student_version(master, target, released)
            done[master.name] = "created"
    return done


def lesson_name(name: str, masters: str | Path = "notebooks") -> str:
    """The master's file name for '02', '02_cuda_streams' or '02_cuda_streams.ipynb'; ValueError if none or several."""
    names = sorted(p.name for p in Path(masters).glob("*.ipynb"))
    stem = name.removesuffix(".ipynb")
    hits = [n for n in names if n.removesuffix(".ipynb") == stem] or [n for n in names if n.startswith(stem + "_")]
    if len(hits) != 1:
        raise ValueError(f"{name!r} names {'no lesson' if not hits else 'several lessons'}; the lessons are "
                         + ", ".join(n.removesuffix(".ipynb") for n in names))
    return hits[0]


def reset(name: str, masters: str | Path = "notebooks", workspace: str | Path = DEFAULT,
          released: bool = False, repo: str | Path | None = None) -> tuple[Path, Path | None]:
    """Replace one lesson of the workspace by a fresh student version. The old copy (if any) is moved to
    WORKSPACE/backups/. Returns (the fresh notebook, the backup or None). `released`, `repo`: as for sync."""
    masters, workspace = Path(masters), Path(workspace)
    file = lesson_name(name, masters)
    sync(masters, workspace, released, repo)  # the workspace exists, with every lesson
    target = workspace / NOTEBOOKS / file
    backup = None
    if target.exists():
        backups = workspace / "backups"
        backups.mkdir(exist_ok=True)
        backup = backups / f"{target.stem}.{time.strftime('%Y%m%d-%H%M%S')}.ipynb"
        n = 1
        while backup.exists():
            backup = backups / f"{target.stem}.{time.strftime('%Y%m%d-%H%M%S')}-{n}.ipynb"
            n += 1
        os.replace(target, backup)
    _write_student_version(masters / file, target, released)
    return target, backup


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m course_utils.workspace", description=__doc__.split("\n\n")[0])
    parser.add_argument("--masters", default="notebooks", help="the instructor masters (default: notebooks)")
    parser.add_argument("--workspace", default=os.environ.get("COURSE_WORKSPACE", DEFAULT),
                        help="the student's workspace (default: $COURSE_WORKSPACE or workspace)")
    parser.add_argument("--released", action="store_true",
                        help="MASTERS holds student versions already (the hub's copy): copy them as they are")
    parser.add_argument("--repo", help="the repository the workspace's launch/ and benchmarks/ link to "
                        "(default: the folder above MASTERS)")
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("sync", help="create the workspace's missing lessons; existing ones are kept")
    p_reset = sub.add_parser("reset", help="start lessons over from the masters (old copies go to backups/)")
    p_reset.add_argument("lessons", nargs="+", help="e.g. 02_cuda_streams (or just 02)")
    args = parser.parse_args(argv)
    try:
        if args.command == "sync":
            done = sync(args.masters, args.workspace, args.released, args.repo)
            new = [n for n, what in done.items() if what == "created"]
            kept = len(done) - len(new)
            print(f"workspace {Path(args.workspace) / NOTEBOOKS}: "
                  + (f"new: {', '.join(new)}" if new else "no new lessons")
                  + (f"; {kept} kept as you left them" if kept else ""))
        else:
            for name in args.lessons:
                fresh, backup = reset(name, args.masters, args.workspace, args.released, args.repo)
                print(f"reset {fresh}" + (f" (your previous copy: {backup})" if backup else ""))
    except (ValueError, OSError) as e:  # ReleaseError is a ValueError
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
