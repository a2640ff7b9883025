"""Shared test set-up.

COURSE_REQUIRE_GPU=1 (set by `make test-gpu`) turns every skip for want of a GPU into a failure, so a
GPU run proves the GPU paths instead of quietly skipping them. Skips for other reasons (an optional tool
missing) stay skips, and so do tests marked `multigpu` on a machine with a single GPU.

On a GPU box a test that times the GPU (marked gpu, multigpu or gpu_timing, and every notebook) holds every
GPU's machine-wide lock (course_utils.gpu_lock) while it runs; the grader takes the same locks for its GPU
checks. Whatever a test left running is named and ended when the session ends.
"""

from __future__ import annotations

import ast
import functools
import os
import re
import sys
import time
from pathlib import Path

import pytest

REQUIRE_GPU = os.environ.get("COURSE_REQUIRE_GPU") == "1"


@functools.cache
def _cuda_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # torch missing or broken: treat as no GPU
        return 0


def is_gpu_skip(reason: str) -> bool:
    """A skip that means 'no GPU here' (as opposed to, say, an optional tool missing)."""
    return bool(re.search(r"\b(GPU|GPUs|CUDA|cuda|NCCL)\b", reason))


# A lesson whose test file (tests/lessons/test_<notebook stem>.py) defines this test executes its notebook whole and
# live on the GPUs, to check the facts it prints. Under `make test-gpu` (COURSE_REQUIRE_GPU=1), where that test runs
# (two GPUs if it is marked multigpu, else one), nbmake does not execute the notebook a second time: on a GPU box
# every notebook holds the GPUs alone, and these are among the longest.
EXECUTING_TEST = "test_the_notebook_on_gpus_shows_the_facts"
LESSON_TESTS = Path(__file__).parent / "lessons"


@functools.cache
def executing_test(notebook: str) -> tuple[str | None, int]:
    """(the test that executes `notebook` live, the GPUs it needs), or (None, 0) when its lesson has none."""
    path = LESSON_TESTS / f"test_{Path(notebook).stem}.py"
    if not path.is_file():
        return None, 0
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == EXECUTING_TEST:
            multi = any("multigpu" in ast.unparse(d) for d in node.decorator_list)
            return f"tests/lessons/{path.name}::{EXECUTING_TEST}", 2 if multi else 1
    return None, 0


def executed_by_a_test(item, gpus: int) -> str | None:
    """The test that executes this notebook item live on `gpus` GPUs under make test-gpu (None: nbmake runs it)."""
    test, needs = executing_test(item.path.name) if item.path.suffix == ".ipynb" else (None, 0)
    return test if REQUIRE_GPU and test and gpus >= needs else None


def pytest_collection_modifyitems(config, items):
    n = _cuda_count()
    for item in items:
        if LESSON_TESTS in item.path.parents:
            item.add_marker(pytest.mark.lesson)
        if "gpu" in item.keywords and n < 1:
            item.add_marker(pytest.mark.skip(reason="needs a GPU"))
        if "multigpu" in item.keywords and n < 2:
            item.add_marker(pytest.mark.skip(reason="needs two or more GPUs"))
    for item in items:
        if item.path.suffix == ".ipynb":  # nbmake's: a kernel that died before its first cell is started again
            item.runtest = retrying_kernel_start(item.runtest, item.path.name)
    gone = [item for item in items if executed_by_a_test(item, n)]
    if gone:
        config.hook.pytest_deselected(items=gone)
        items[:] = [item for item in items if item not in gone]
    if hasattr(config, "workerinput"):  # an xdist worker: the controller hands out work in this order
        items[:] = longest_first(items)


def longest_first(items: list) -> list:
    """The files in the order `--dist loadgroup` hands them out, longest first, each file's tests kept in order:
    the files marked slow as a whole (a file that is one long fixture: the attack matrix, the browser), then the
    notebooks, then the others by their number of tests. A file is one worker's unit of work, so a long one
    handed out last would run alone at the end (xdist's own order, by number of tests, did that to the browser
    test's three tests, and `make test` took about 200 s longer on a 2-core machine)."""
    files: dict = {}
    for item in items:
        files.setdefault(item.path, []).append(item)

    def cost(path) -> tuple:
        module = files[path][0].getparent(pytest.Module)
        whole_file_slow = module is not None and any(m.name == "slow" for m in module.iter_markers())
        return (not whole_file_slow, path.suffix != ".ipynb", -len(files[path]))

    return [item for path in sorted(files, key=cost) for item in files[path]]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    if REQUIRE_GPU and getattr(config.option, "nbmake", False):  # said once, by the xdist controller too
        n = _cuda_count()
        for path in sorted((config.rootpath / "notebooks").glob("*.ipynb")):
            name = path.name
            test, needs = executing_test(name)
            if test and n >= needs:
                terminalreporter.write_line(f"[conftest] {name}: not executed by nbmake here; {test} executes it")


KERNEL_START_FAILED = "Kernel died before replying to kernel_info"  # jupyter_client's words
KERNEL_STARTS = 3


def retrying_kernel_start(run, name: str):
    """`run` (which starts a Jupyter kernel and runs a notebook), called again up to KERNEL_STARTS times in all while
    its kernel dies before running a cell, each new start warned about: under parallel runs the port that
    jupyter_client picked can be taken before the kernel binds it (treebeardtech/nbmake#129). Nothing of the
    notebook has run then, so starting again is safe; a kernel that dies in a cell is a failure as before. Used for
    nbmake's items and by exercise_cells.run_cells."""
    import warnings

    def again():
        for start in range(1, KERNEL_STARTS + 1):
            try:
                return run()
            except RuntimeError as exc:
                if KERNEL_START_FAILED not in str(exc) or start == KERNEL_STARTS:
                    raise
                warnings.warn(f"{name}: the Jupyter kernel died before it ran a cell ({exc}); "
                              f"starting a new one ({start + 1} of {KERNEL_STARTS})", stacklevel=2)
        raise AssertionError("unreachable")

    return again


def _times_the_gpu(item) -> bool:
    """A test whose GPU work a parallel test on the same GPU would distort: the notebooks, tests marked gpu,
    multigpu or gpu_timing (a lesson's tests that time the GPU whenever there is one)."""
    return item.path.suffix == ".ipynb" or any(m in item.keywords for m in ("gpu", "multigpu", "gpu_timing"))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """On a GPU box a test that times the GPU holds every GPU alone (`course_utils.gpu_lock`, machine-wide), so
    kernels of a parallel test never make concurrency appear or vanish; the grader takes the same locks for its
    GPU checks. Other tests run in parallel meanwhile."""
    if not (_cuda_count() and _times_the_gpu(item)):
        yield
        return
    from course_utils import gpu_lock

    with gpu_lock.holding(gpu_lock.visible_gpus(), f"the test {item.nodeid}"):
        yield


SESSION_ENV = "COURSE_TEST_SESSION"


def pytest_configure(config):
    # A mark every process this pytest process starts inherits (unless given an environment of its own), so
    # whatever is still running when the session ends can be found, reparented or not.
    os.environ[SESSION_ENV] = f"{os.getpid()}-{time.time_ns()}"


def _strays() -> list:
    """Processes other than this one that carry this session's mark."""
    import psutil

    mark = f"{SESSION_ENV}={os.environ.get(SESSION_ENV)}".encode() + b"\0"
    found = []
    for pid in psutil.pids():
        if pid == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if mark in f.read() + b"\0":
                    found.append(psutil.Process(pid))
        except (OSError, psutil.Error):
            continue
    return found


def pytest_sessionfinish(session, exitstatus):
    """Whatever a test started and left running (an orphaned rank, a kernel, a server) is named and ended here: a
    stray process holding a worker's pipes keeps xdist waiting at teardown_nodes for ever."""
    config = session.config
    if not sys.platform.startswith("linux") or (getattr(config.option, "numprocesses", None)
                                                 and not hasattr(config, "workerinput")):
        return  # an xdist controller runs no tests (and its workers, alive still, carry its mark)
    import psutil

    def alive(p) -> bool:
        try:
            return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
        except psutil.Error:
            return False

    deadline = time.monotonic() + 5  # a process on its way out gets a moment
    strays = _strays()
    while strays and time.monotonic() < deadline:
        time.sleep(0.2)
        strays = [p for p in strays if alive(p)]
    if strays:
        names = [_described(p) for p in strays]
        os.write(2, f"\n[conftest] processes left running by the tests, now killed: {names}\n".encode())
        for p in strays:
            try:
                p.kill()
            except psutil.Error:
                pass


def _described(p) -> tuple:
    """(pid, name, command line) of a psutil.Process, for a report; one that is gone says so."""
    import psutil

    try:
        return p.pid, p.name(), " ".join(p.cmdline())[:200]
    except psutil.Error:
        return p.pid, "?", "(gone)"


WORKER_EXIT_GRACE_S = float(os.environ.get("COURSE_WORKER_EXIT_GRACE_S", "90"))


def _only_waiting_for_the_controller(me) -> bool:
    """True when this worker is done and only waits for xdist's controller to let it go: no child process, no
    thread that could keep it alive (daemon threads cannot: IPython's history-saving thread is one), and the main
    thread back in execnet's loop. An xdist worker lives until the whole run ends, so one that ran out of work
    early waits there for minutes."""
    import threading

    others = [t for t in threading.enumerate() if t is not threading.main_thread() and not t.daemon]
    frame = sys._current_frames().get(threading.main_thread().ident)
    in_execnet = False
    while frame is not None and not in_execnet:
        in_execnet = "execnet" in frame.f_code.co_filename
        frame = frame.f_back
    return in_execnet and not others and not me.children(recursive=True)


def pytest_unconfigure(config):
    """An xdist worker that has not exited WORKER_EXIT_GRACE_S after its session ended (something it started
    keeps it alive: a thread, a child) prints its threads' stacks and its child processes, then ends, so the
    run reports instead of hanging at "teardown_nodes" until an outer timeout."""
    if not hasattr(config, "workerinput"):
        return
    import threading

    def watchdog() -> None:
        import faulthandler

        import psutil

        time.sleep(WORKER_EXIT_GRACE_S)
        me = psutil.Process()
        while _only_waiting_for_the_controller(me):  # workers idle while others finish (GPU turns): harmless
            time.sleep(5)
        lines = [f"[conftest] xdist worker {config.workerinput.get('workerid')} (pid {me.pid}) still alive "
                 f"{WORKER_EXIT_GRACE_S:g} s after its session ended; threads: "
                 f"{[t.name for t in threading.enumerate()]}; children: "
                 f"{[_described(c) for c in me.children(recursive=True)]}"]
        os.write(2, ("\n".join(lines) + "\n").encode())
        faulthandler.dump_traceback(file=2, all_threads=True)
        for c in me.children(recursive=True):
            try:
                c.kill()
            except psutil.Error:  # gone meanwhile
                pass
        os._exit(3)

    threading.Thread(target=watchdog, name="conftest-exit-watchdog", daemon=True).start()


@pytest.hookimpl(optionalhook=True)  # `-p no:xdist` runs have no such hook
def pytest_xdist_make_scheduler(config, log):
    """Schedule `--dist loadgroup` runs by file: one file's tests run in one worker, so a module's expensive
    fixtures (a grading lab, a notebook kernel, a pool of ranks) are built once. On a GPU box the files that
    hold the GPUs nearly throughout (`_mostly_on_the_gpu`) share one scope, "cuda": they run one after another
    in one worker, instead of leaving several workers waiting for the GPU locks while CPU-only files queue.
    (xdist's own loadgroup reads xdist_group marks through the item's old `_nodeid`, which pytest 9 no longer
    uses: it silently scheduled test by test.)"""
    if config.getvalue("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    root = config.rootpath
    config.option.loadscopereorder = False  # keep the workers' order: longest_first's

    class ByFile(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "cuda" if _cuda_count() and _mostly_on_the_gpu(root / path) else path

    return ByFile(config, log)


@functools.cache
def _mostly_on_the_gpu(path) -> bool:
    """A notebook, a *_gpu.py test file, or one whose every test is marked gpu or gpu_timing (module pytestmark)."""
    if path.suffix == ".ipynb" or path.name.endswith("_gpu.py"):
        return True
    try:
        return bool(re.search(r"^pytestmark = .*pytest\.mark\.(gpu|gpu_timing)\b", path.read_text(), re.M))
    except OSError:
        return False


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if not (REQUIRE_GPU and report.skipped):
        return
    reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
    more_than_here = "multigpu" in item.keywords and _cuda_count() < 2
    if is_gpu_skip(reason) and not more_than_here:
        report.outcome = "failed"
        report.longrepr = f"skipped for want of a GPU under COURSE_REQUIRE_GPU=1: {reason}"
