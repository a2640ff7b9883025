"""Grading time, old grader vs new: the same classes graded by both, wall time of the command, best of N.

    python benchmarks/grading_time.py [--lesson notebooks/02_cuda_streams.ipynb] [--repeats 2] [-j 1]

The old grader (whole submission run in one kernel, verdicts read from its output) is taken from git, at the
commit before course_utils/grading existed (OLD_COMMIT), into a temporary package, with the fixture lesson as
it was then. Each case grades a class of three submissions (the master, the student version, the wrong
answers) of the fixture lesson, then of one real lesson, with each grader's command line. The new grader is
timed as instructors run it (verdicts only) and with --executed-dir (also the feedback notebooks, which the
old grader always produced). Prints each time and the ratios new / old.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OLD_COMMIT = "f25adec"  # the last commit with course_utils/grade.py running whole notebooks
FIXTURE = ROOT / "tests" / "fixtures" / "grading"


def git_show(path: str) -> str:
    return subprocess.run(["git", "show", f"{OLD_COMMIT}:{path}"], cwd=ROOT, check=True, capture_output=True,
                          text=True).stdout


def old_grader(base: Path) -> Path:
    """The old grader as package `oldgrade` in base/old_pkg; returns the folder to put on PYTHONPATH."""
    pkg = base / "old_pkg" / "oldgrade"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name in ("grade.py", "release.py", "_notebook_exec.py"):
        text = git_show(f"course_utils/{name}").replace("from .checks import", "from course_utils.checks import")
        (pkg / name).write_text(text)
    return pkg.parent


def write_class(folder: Path, master_path: Path, wrong_dir: Path | None) -> None:
    from course_utils import release

    m = nbformat.read(master_path, as_version=4)
    ids = [ex.grade_id for ex in release.exercises(m, str(master_path))]
    wrong = {}
    if wrong_dir is not None and wrong_dir.is_dir():
        wrong = {p.stem: p.read_text() for p in sorted(wrong_dir.glob("*.py")) if "__" not in p.stem and p.stem in ids}
    subs = {"master": m, "student": release.student_version(m, "x"), "wrong": release.substitute(m, wrong, "x")}
    for who, nb in subs.items():
        path = folder / who / master_path.name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(release.dumps(nb))


def timed(cmd: list[str], cwd: Path, env: dict) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=3600)
    seconds = time.perf_counter() - t0
    if proc.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(cmd)} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lesson", type=Path, default=ROOT / "notebooks" / "02_cuda_streams.ipynb")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("-j", "--jobs", type=int, default=1)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="grading-time-") as tmp:
        base = Path(tmp)
        old_path = old_grader(base)
        old_masters = base / "old_masters"  # the fixture as the old grader knew it (old-style check cells)
        old_masters.mkdir()
        (old_masters / "99_fixture.ipynb").write_text(git_show("tests/fixtures/grading/99_fixture.ipynb"))
        (old_masters / "fixture_checks.py").write_text(git_show("tests/fixtures/grading/fixture_checks.py"))
        (base / "old_wrong").mkdir()
        for name in ("ex99_add", "ex99_mean", "ex99_gpu"):
            old = git_show(f"tests/fixtures/wrong_answers/99_fixture/{name}.py")
            (base / "old_wrong" / f"{name}.py").write_text(old)
        cases = {
            "fixture": (old_masters / "99_fixture.ipynb", base / "old_wrong", FIXTURE / "99_fixture.ipynb",
                        FIXTURE.parent / "wrong_answers" / "99_fixture"),
            args.lesson.stem: (args.lesson, ROOT / "tests" / "wrong_answers" / args.lesson.stem, args.lesson,
                               ROOT / "tests" / "wrong_answers" / args.lesson.stem),
        }
        env = {k: v for k, v in os.environ.items() if k != "COURSE_CHECKS_MODULES"}
        old_env = {**env, "PYTHONPATH": os.pathsep.join([str(old_path), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)}
        j = ["-j", str(args.jobs)]
        results = {}
        for case, (old_master, old_wrong, new_master, new_wrong) in cases.items():
            write_class(base / case / "old", old_master, old_wrong)
            write_class(base / case / "new", new_master, new_wrong)
            old_cmd = [sys.executable, "-m", "oldgrade.grade", "old", "--master-dir", str(old_master.parent), *j]
            new_cmd = [sys.executable, "-m", "course_utils.grade", "new", "--master-dir", str(new_master.parent),
                       "--checks-module", str(FIXTURE / "fixture_checks.py"), *j]
            fb_cmd = new_cmd + ["--executed-dir", str(base / case / "executed")]
            times: dict[str, list[float]] = {"old": [], "new": [], "new+feedback": []}
            for _ in range(args.repeats):  # interleaved, so a busy moment of the machine hits all three
                times["old"].append(timed(old_cmd, base / case, old_env))
                times["new"].append(timed(new_cmd, base / case, env))
                times["new+feedback"].append(timed(fb_cmd, base / case, env))
            results[case] = {k: min(v) for k, v in times.items()}
            r = results[case]
            print(f"{case:<22} old {r['old']:6.1f} s   new {r['new']:6.1f} s ({r['new'] / r['old']:.2f}x)   "
                  f"new + feedback notebooks {r['new+feedback']:6.1f} s ({r['new+feedback'] / r['old']:.2f}x)",
                  flush=True)
        total = {k: sum(r[k] for r in results.values()) for k in ("old", "new", "new+feedback")}
        print(f"{'both':<22} old {total['old']:6.1f} s   new {total['new']:6.1f} s ({total['new'] / total['old']:.2f}x)"
              f"   new + feedback notebooks {total['new+feedback']:6.1f} s "
              f"({total['new+feedback'] / total['old']:.2f}x)")
        print(f"ratio new/old: {total['new'] / total['old']:.2f} (verdicts only), "
              f"{total['new+feedback'] / total['old']:.2f} (with --executed-dir, as the old grader always ran)")


if __name__ == "__main__":
    main()
