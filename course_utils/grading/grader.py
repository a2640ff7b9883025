"""The grader: masters read once, a probe per exercise, verdicts decided here from plain data.

    with Grader(Options(jobs=4, checks_modules=("tests/fixtures/grading/fixture_checks.py",))) as g:
        for grade in g.grade_all([(submission, master), ...]):   # a Grade (or an error string) per pair
            ...

See grade.py (the command) for the rules and the README's instructor section for why.
"""

from __future__ import annotations

import copy
import os
import re
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import nbformat

from .. import gpu_lock
from ..gpu_lock import visible_gpus
from . import assemble, release, sandbox
from .checks_modules import load_checks
from .probe import run_probe
from .report import FAILED, NOT_ATTEMPTED, PASSED, SKIPPED, ExerciseResult, Grade

MAX_SUBMISSION_BYTES = 50 << 20
_JUDGE_MODULES = ("course_utils.measure", "course_utils.timeline", "course_utils.reference")


class GradeError(RuntimeError):
    """The grader cannot grade: no master for a submission, a broken master, no sandbox to run students' code in."""


@dataclass
class Options:
    timeout: float = 600  # seconds per submission (all its probes), and for the feedback run
    cell_timeout: float = 120  # seconds per probe (capped by the exercise's own timeout_s) and per feedback cell
    max_cell_output: int = 1_000_000  # characters kept per cell in the feedback run
    executed_dir: str | os.PathLike | None = None
    jobs: int = 1
    checks_modules: tuple[str, ...] = ()
    gpus: tuple[str, ...] | None = None  # GPU ids to use; None: every GPU this process can see
    sandbox: bool = True  # False (--no-sandbox): students' code runs unconfined, for trusted work only


def _checks_module(check) -> str:
    """How a probe imports the module that registered `check`: the course's by name, any other by its file."""
    name = check.probe.__module__
    if name.startswith("course_utils."):
        return name
    return str(Path(sys.modules[name].__file__).resolve())


def _clean(text: str, limit: int = 4000) -> str:
    """A message fit for a table, CSV and XML: no control characters, bounded length."""
    text = re.sub(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]", "?", str(text)).strip()
    return text if len(text) <= limit else text[:limit] + "..."


class GpuPool:
    """GPU ids handed out whole: a job holds its GPUs alone until it gives them back (others wait their turn),
    in this process and machine-wide (`gpu_lock`: two graders, or a grader and a test, never time one GPU at once)."""

    def __init__(self, ids: tuple[str, ...] | list[str]):
        self._free = list(ids)
        self._turns: dict[str, gpu_lock.Turn] = {}
        self._cond = threading.Condition()

    def take(self, n: int = 1) -> str:
        """Wait for `n` free GPUs and take them; returns their CUDA_VISIBLE_DEVICES value ("0" or "2,3")."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._free) >= n)
            taken, self._free = self._free[:n], self._free[n:]
        devices = ",".join(taken)
        try:
            turn = gpu_lock.take(taken, "the course's grader")
        except BaseException:
            self.give(devices)
            raise
        with self._cond:
            self._turns[devices] = turn
        return devices

    def give(self, devices: str) -> None:
        with self._cond:
            turn = self._turns.pop(devices, None)
            if turn is not None:
                turn.release()
            self._free += [d for d in devices.split(",") if d]
            self._cond.notify_all()


@dataclass
class _Submission:
    path: Path
    label: str
    master: assemble.Master
    grade: Grade
    regions: dict = field(default_factory=dict)
    started: float | None = None
    finished: float = 0.0
    lock: threading.Lock = field(default_factory=threading.Lock)

    def time_left(self, budget: float) -> float:
        with self.lock:
            if self.started is None:
                self.started = time.monotonic()
            return self.started + budget - time.monotonic()

    def done(self) -> None:
        with self.lock:
            self.finished = time.monotonic()


class Grader:
    """Grades submissions against masters read once (use as a context manager)."""

    def __init__(self, options: Options | None = None, **kw):
        self.options = options or Options(**kw)
        if self.options.sandbox:
            try:
                sandbox.require()
            except sandbox.SandboxUnavailable as e:
                raise GradeError(str(e)) from None
        gpus = self.options.gpus if self.options.gpus is not None else visible_gpus()
        self.gpus = GpuPool(gpus)
        self.n_gpus = len(gpus)
        self.masters: dict[Path, assemble.Master] = {}
        self._checks_lock = threading.Lock()
        self._checks_loaded = False
        self._inputs_lock = threading.Lock()
        self._shared_inputs: dict[tuple[str, bool], dict] = {}  # (grade_id, gpu) -> inputs of an inputs_once check

    def _load_checks(self) -> None:
        """Import the checks here (once, before the first verdict): the judges run in this process."""
        with self._checks_lock:
            if self._checks_loaded:
                return
            for err in load_checks(self.options.checks_modules):
                print(f"grade: warning: a checks module failed to import: {err}", file=sys.stderr)
            for name in _JUDGE_MODULES:
                __import__(name)
            self._checks_loaded = True

    def close(self) -> None:
        """Nothing to stop: every probe and feedback kernel ended with its own call."""

    def __enter__(self) -> Grader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------------------------------------ masters

    def master(self, path: str | os.PathLike) -> assemble.Master:
        """The parsed master at `path`, read from disk the first time only."""
        key = Path(path).resolve()
        if key not in self.masters:
            try:
                self.masters[key] = assemble.read_master(key)
            except release.ReleaseError as e:
                raise GradeError(f"broken master: {e}") from e
            except Exception as e:
                raise GradeError(f"{path}: cannot read the master: {e}") from e
        return self.masters[key]

    # ------------------------------------------------------------------------------------------ grading

    def grade(self, submission: str | os.PathLike, master: str | os.PathLike) -> Grade:
        """Grade one submission (GradeError if its master is broken)."""
        (result,) = self.grade_all([(submission, master)])
        if isinstance(result, str):
            raise GradeError(result)
        return result

    def grade_all(self, items: list[tuple[str | os.PathLike, str | os.PathLike]]):
        """Grade (submission, master) pairs; yields a Grade (or an error message) per pair, in order."""
        subs: list[_Submission | str] = []
        for path, master_path in items:
            try:
                subs.append(self._prepare(Path(path), self.master(master_path)))
            except GradeError as e:
                subs.append(str(e))
        jobs = max(1, self.options.jobs)
        # Feedback runs have a pool of their own: they overlap the probes (a GPU slot still keeps one job per GPU).
        with ThreadPoolExecutor(jobs, thread_name_prefix="grade") as pool, \
                ThreadPoolExecutor(jobs, thread_name_prefix="feedback") as feedback:
            plans = []
            for sub in subs:
                if isinstance(sub, str):
                    plans.append((sub, []))
                    continue
                futures = []
                if self.options.executed_dir and not sub.grade.stopped:
                    futures.append(feedback.submit(self._feedback, sub))
                futures += [pool.submit(self._exercise, sub, ex) for ex in sub.master.exercises
                            if sub.grade.stopped == ""]
                plans.append((sub, futures))
            for sub, futures in plans:
                if isinstance(sub, str):
                    yield sub
                    continue
                yield self._finish(sub, futures)

    def _prepare(self, path: Path, master: assemble.Master) -> _Submission:
        grade = Grade(_label(path), str(master.path))
        sub = _Submission(path, grade.submission, master, grade)
        try:
            if path.stat().st_size > MAX_SUBMISSION_BYTES:
                raise ValueError(f"it is larger than {MAX_SUBMISSION_BYTES >> 20} MB")
            nb = nbformat.read(path, as_version=4)
            sub.regions = assemble.regions(master, nb)
        except Exception as e:  # not JSON, not a notebook: the submission scores nothing, the class goes on
            grade.stopped = _clean(f"cannot read the submission: {e}", 300)
            grade.exercises = [ExerciseResult(ex.grade_id, ex.points, 0, FAILED, grade.stopped)
                               for ex in master.exercises]
        return sub

    def _finish(self, sub: _Submission, futures: list[Future]) -> Grade:
        results = [f.result() for f in futures]
        if results:
            sub.grade.exercises = [r for r in results if isinstance(r, ExerciseResult)]
            sub.grade.seconds = sub.finished - (sub.started or sub.finished)
        for ex in sub.grade.exercises:
            if ex.status == FAILED and ex.message.startswith("not run: the submission's time limit"):
                sub.grade.stopped = sub.grade.stopped or f"the submission's time limit of {self.options.timeout:g} s"
        return sub.grade

    def _exercise(self, sub: _Submission, ex: assemble.MasterExercise) -> ExerciseResult:
        try:
            status, message = self._verdict(sub, ex)
        except Exception as e:  # a grader or check bug must not cost the rest of the class its grades
            status, message = FAILED, f"the grader failed on this exercise ({type(e).__name__}: {e})"
        sub.done()
        return ExerciseResult(ex.grade_id, ex.points, ex.points if status == PASSED else 0, status, _clean(message))

    def _verdict(self, sub: _Submission, ex: assemble.MasterExercise) -> tuple[str, str]:
        from course_utils import checks

        self._load_checks()
        if not assemble.attempted(ex, sub.regions):
            missing = all(sub.regions.get(i) is None for i in ex.solutions)
            return NOT_ATTEMPTED, ("the submission has no solution cell for it" if missing
                                   else "the solution is still `raise NotImplementedError()`")
        try:
            check = checks.exercise(ex.grade_id)
        except KeyError:
            return FAILED, (f"no check registered for exercise {ex.grade_id!r}: a module in course_utils/checks/ "
                            "must register an Exercise for it (or pass its module with --checks-module)")
        except Exception as e:
            return FAILED, f"the checks module of {ex.grade_id!r} failed to import ({type(e).__name__}: {e})"
        n_gpus = max(1, int(getattr(check, "n_gpus", 1)))  # an exercise may declare that it needs several
        gpu_needed = check.needs_gpu and self.n_gpus >= n_gpus
        if check.needs_gpu and not gpu_needed and not check.cpu_part:
            return self._skip(ex.grade_id, "needs a GPU; not graded on this machine" if n_gpus == 1 else
                              f"needs {n_gpus} GPUs; this machine has {self.n_gpus}")
        try:
            inputs = self._inputs(check, gpu_needed)
        except Exception as e:
            return FAILED, f"the check's inputs() failed ({type(e).__name__}: {e})"
        left = sub.time_left(self.options.timeout)
        limit = min(check.timeout_s, self.options.cell_timeout, left)
        if limit <= 0:
            return FAILED, f"not run: the submission's time limit of {self.options.timeout:g} s was used up"
        gpu = self.gpus.take(n_gpus) if gpu_needed else ""
        try:
            module = _checks_module(check)
            outcome = run_probe(assemble.program(sub.master, ex, sub.regions), ex.grade_id, checks.to_bytes(inputs),
                                checks_module=module, gpus=[g for g in gpu.split(",") if g], timeout=limit,
                                read_only=[module] if module.endswith(".py") else [], sandboxed=self.options.sandbox)
        finally:
            if gpu_needed:
                self.gpus.give(gpu)
        if outcome.status == "not attempted":
            return NOT_ATTEMPTED, "the solution raised NotImplementedError"
        if outcome.status != "ok":
            return FAILED, outcome.message
        try:
            detail = check.judge(inputs, outcome.data)
        except checks.CheckFailed as e:
            return FAILED, str(e)
        except Exception as e:  # data of the wrong shape (a broken or forged probe result) fails
            return FAILED, f"the check could not judge what the probe returned ({type(e).__name__}: {e})"
        if check.needs_gpu and not gpu_needed:
            return self._skip(ex.grade_id, f"needs a GPU ({checks.CPU_PART_PASSED})")
        return PASSED, detail if isinstance(detail, str) else ""

    def _inputs(self, check, gpu: bool) -> dict:
        """The check's inputs for one submission; an inputs_once check's are built once per run (under a lock, so
        -j N builds them once too) and each submission gets its own copy."""
        from course_utils import checks

        if not check.inputs_once:
            return checks.plain({**check.inputs(), "gpu": gpu})
        key = (check.grade_id, gpu)
        with self._inputs_lock:
            if key not in self._shared_inputs:
                self._shared_inputs[key] = checks.plain({**check.inputs(), "gpu": gpu})
            return copy.deepcopy(self._shared_inputs[key])

    def _skip(self, grade_id: str, message: str) -> tuple[str, str]:
        from course_utils import checks

        if checks.require_gpu_mode():
            return FAILED, f"{message}; COURSE_REQUIRE_GPU=1 forbids skipping it"
        return SKIPPED, message

    def _feedback(self, sub: _Submission) -> None:
        """Run the assembled notebook for the student to read (never for a verdict); write it to executed_dir."""
        from .notebook import run_notebook

        nb = assemble.feedback_notebook(sub.master, sub.regions)
        files = [str(Path(s).resolve()) for s in self.options.checks_modules if s.endswith(".py") or os.sep in s]
        gpu = self.gpus.take(1) if self.n_gpus else ""
        kernel = nb.metadata.get("kernelspec", {}).get("name") or "python3"
        try:
            run = run_notebook(nb, kernel_name=kernel, cell_timeout=self.options.cell_timeout,
                               timeout=self.options.timeout, max_cell_output=self.options.max_cell_output,
                               sandbox=self.options.sandbox, gpus=[gpu] if gpu else [], read_only=files)
            if run.stopped:
                sub.grade.notes.append(_clean(f"feedback run: {run.stopped}", 300))
        except Exception as e:  # the kernel would not start: the feedback is missing, the grades stand
            sub.grade.notes.append(_clean(f"feedback run failed: {type(e).__name__}: {e}", 300))
        finally:
            if self.n_gpus:
                self.gpus.give(gpu)
        out = executed_path(self.options.executed_dir, sub.label)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(release.dumps(nb), encoding="utf-8")



def executed_path(executed_dir: str | os.PathLike, submission: str) -> Path:
    """Where --executed-dir keeps the feedback notebook of `submission` (as the CSV's `submission` column names it)."""
    return Path(executed_dir) / submission.lstrip(os.sep).replace(os.sep, "__")


def _label(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd()))
    except ValueError:
        return str(path)
