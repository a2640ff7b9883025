"""The lab as students meet it: JupyterLab started by `make lab`'s script, driven by a real browser.

For every lesson (solved where a widget needs the solution or there is no exercise, else its untouched student
version): open it from the student workspace, Run All from the menu, wait for the kernel to go idle, and fail on a
traceback, a code cell not executed, raw ANSI codes, "Error displaying widget", a dead kernel,
or a widget whose view does not change when used (the ring stepper in 07, the bucket explorer in 08).
Screenshots of each notebook go to tests/artifacts/browser/ (git-ignored). Kernels are shut down through the
REST API, and nothing is left listening or running afterwards.

One JupyterLab server and one browser serve the whole module (one file: one xdist group under conftest's
scheduler, so it runs beside the rest of `make test`). The workspace is a temporary one, made as a
student who solved every exercise would have it (the release tool's student versions with the answers
kept), so Run All goes through every cell; lessons run in their CPU configuration. Beside each lesson stands
its untouched student version (<stem>__unsolved.ipynb): Run All must go through every cell of it too, each check
cell saying that its exercise is not attempted yet (or that it needs a GPU), as the lab's kernels run with
COURSE_LAB=1.

Needs playwright (`pip install -e .[dev]`) and Debian's chromium (`apt-get install chromium`; `make test`'s
set-up installs it when run as root). Where chromium is missing the tests are skipped, saying so, except under
CI (CI set in the environment), where they fail.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest

from course_utils.grading.release import dumps, exercises, student_version
from tests.launch_helpers import left_listening, listeners

ROOT = Path(__file__).resolve().parents[1]
MASTERS = ROOT / "notebooks"
ARTIFACTS = ROOT / "tests" / "artifacts" / "browser"
LESSONS = sorted(p.name for p in MASTERS.glob("*.ipynb"))
URL = re.compile(r"^Course lab: (http://127\.0\.0\.1:(\d+))/lab\?token=([0-9a-f]+)$")
NOTEBOOK_TIMEOUT = 420  # s for one lesson's Run All (a lesson takes about 60 s or less on a 2-core CPU)
VIEWPORT = {"width": 1280, "height": 900}  # what a student's laptop shows (the notebook's output is about 840 px wide)
SHOT_VIEWPORT = {"width": 1280, "height": 2400}
ANSI = re.compile(r"\x1b\[|\[(?:\d{1,3};)*\d{1,3}m")
TRACEBACK = "Traceback (most recent call last)"
# Text that reads as a failure in the lab when nothing has failed: a lesson's run must not show it.
NOT_AN_ERROR = {
    "Setting OMP_NUM_THREADS environment variable": "torchrun's OMP_NUM_THREADS banner (shown as an error-red block)",
    "GLHF": "gloo's 'Connection reset by peer ... GLHF!' after a crash demo",
    "not found or not working": "doctor() treating a machine without GPUs as broken",
    "n/a (of": "a timeline footer row that does not apply",
}

# The tests run the lessons in turn (each bounded by NOTEBOOK_TIMEOUT): minutes each on an idle 2-core machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(2700), pytest.mark.ranks]


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser"):
        path = shutil.which(name)
        if path:
            return path
    return None


def _need_browser() -> str:
    path = chromium()
    why = None
    if path is None:
        why = ("Debian's chromium is not installed: `sudo apt-get install chromium` (make test's set-up, "
               "tests/install_browser.sh, installs it when run as root)")
    else:
        try:
            import playwright.sync_api  # noqa: F401
        except ImportError:
            why = "playwright is not installed: `.venv/bin/pip install -e .[dev]` (or `pip install playwright`)"
    if why:
        if os.environ.get("CI"):
            pytest.fail(f"the browser test must run in CI: {why}")
        pytest.skip(why)
    return path


def _api(base: str, token: str, path: str, method: str = "GET"):
    req = urllib.request.Request(f"{base}/api/{path}", method=method, headers={"Authorization": f"token {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        body = r.read()
        return json.loads(body) if body else None



UNSOLVED = "__unsolved"


def solved_workspace(folder: Path, lessons: list[str]) -> Path:
    """A workspace as a student who solved every exercise has it (the student versions, answers kept), with the
    untouched student version of each lesson that has exercises beside it (<stem>__unsolved.ipynb)."""
    nbs = folder / "notebooks"
    nbs.mkdir(parents=True)
    for name in lessons:
        master = nbformat.read(MASTERS / name, as_version=4)
        done = {ex.grade_id for ex in exercises(master, name)}
        (nbs / name).write_text(dumps(student_version(master, name, completed=done)))
        if done:
            (nbs / name.replace(".ipynb", f"{UNSOLVED}.ipynb")).write_text(dumps(student_version(master, name)))
    return folder


class Lab:
    """`bash launch/start_lab.sh` (what `make lab` runs) in its own session, on a given workspace."""

    def __init__(self, workspace: Path, env: dict):
        self.proc = subprocess.Popen(["bash", "launch/start_lab.sh", sys.executable, "0", "student"], cwd=ROOT,
                                     env=dict(env, COURSE_WORKSPACE=str(workspace)), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.seen: list[str] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None:
                break
            self.seen.append(line)
            m = URL.match(line.strip())
            if m:
                self.base, self.port, self.token = m.group(1), int(m.group(2)), m.group(3)
                break
        if not hasattr(self, "base"):
            self.stop()
            raise AssertionError("the lab printed no URL:\n" + "".join(self.seen))
        # the rest of the server's output is kept for the report (and its pipe never fills)
        import threading

        threading.Thread(target=lambda: self.seen.extend(self.proc.stdout), daemon=True).start()

    def api(self, path: str, method: str = "GET"):
        return _api(self.base, self.token, path, method)

    def descendants(self) -> list:
        import psutil

        try:
            return psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return []

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


# ---- reading the page (textContent: JupyterLab leaves off-screen cells out of innerText) ----

_CELLS_JS = """(root) => Array.from(root.querySelectorAll(
    '.jp-Notebook > .jp-Cell, .jp-WindowedPanel-viewport > .jp-Cell')).map((cell, i) => ({
    index: i,
    code: cell.classList.contains('jp-CodeCell'),
    prompt: (cell.querySelector('.jp-InputArea-prompt') || {}).textContent || '',
    outputs: Array.from(cell.querySelectorAll('.jp-OutputArea-output')).map(o => ({
      mime: o.getAttribute('data-mime-type') || '',
      text: o.textContent || '',
    })),
  }))"""


def read_cells(page) -> list[dict]:
    return page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook").first.evaluate(_CELLS_JS)


def kernel_status(page) -> str:
    return (page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook-ExecutionIndicator").first
            .get_attribute("data-status") or "")


def problems(cells: list[dict]) -> list[str]:
    found = []
    for c in cells:
        if not c["code"]:
            continue
        where = f"cell {c['index']}"
        prompt = c["prompt"].strip()
        if not re.fullmatch(r"\[\d+\]:", prompt):
            found.append(f"{where}: not executed (prompt {prompt!r})")
        for o in c["outputs"]:
            text = o["text"]
            if TRACEBACK in text and "stderr" in o["mime"]:
                found.append(f"{where}: traceback in its output:\n{text[-1500:]}")
            if ANSI.search(text):
                found.append(f"{where}: raw ANSI codes in its output: {ANSI.search(text).group(0)!r} in "
                             f"{text[max(0, ANSI.search(text).start() - 80):ANSI.search(text).end() + 40]!r}")
            if "Error displaying widget" in text:
                found.append(f"{where}: Error displaying widget")
            found += [f"{where}: {why}" for words, why in NOT_AN_ERROR.items() if words in text]
    return found


def open_notebook(page, lab: Lab, name: str) -> None:
    """Open `name` alone (`reset`: no saved layout reopens other tabs) and wait until its kernel is connected."""
    page.goto(f"{lab.base}/lab/tree/{name}?token={lab.token}&reset")
    page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell").first.wait_for(timeout=60_000)
    deadline = time.monotonic() + 60
    while True:  # the page's own indicator says idle before a kernel is there: ask the server too
        kernels = [s["kernel"] for s in lab.api("sessions") if s["path"] == name]
        if kernels:
            kernel = lab.api(f"kernels/{kernels[0]['id']}")
            if kernel["connections"] > 0 and kernel["execution_state"] == "idle" and kernel_status(page) == "idle":
                return
        assert time.monotonic() < deadline, f"{name}: the kernel did not start (status {kernel_status(page)!r})"
        page.wait_for_timeout(200)


def run_all(page, name: str) -> None:
    """Run > Run All Cells (the command has no default shortcut); fail if no cell starts within 30 s."""
    page.locator(".lm-MenuBar-item", has_text=re.compile(r"^Run$")).click()
    page.locator(".lm-Menu-item:visible", has_text="Run All Cells").first.click()
    deadline = time.monotonic() + 30
    while not any(c["code"] and re.search(r"\[(\*|\d+)\]", c["prompt"]) for c in read_cells(page)):
        assert time.monotonic() < deadline, f"{name}: Run All Cells started no cell"
        page.wait_for_timeout(200)


def wait_until_done(page, name: str, timeout: float = NOTEBOOK_TIMEOUT) -> list[dict]:
    """Wait until no cell is queued or running and the kernel is idle (twice in a row, a second apart)."""
    start, settled = time.monotonic(), 0
    page.wait_for_timeout(500)
    while True:
        cells = read_cells(page)
        busy = any(c["code"] and "*" in c["prompt"] for c in cells)
        status = kernel_status(page)
        if status in ("dead", "unknown", "terminating", "restarting", "autorestarting"):
            raise AssertionError(f"{name}: the kernel is {status}")
        settled = settled + 1 if not busy and status == "idle" else 0
        if settled >= 2:
            return cells
        if time.monotonic() - start > timeout:
            raise AssertionError(f"{name}: still running after {timeout} s; running or queued: "
                                 + ", ".join(str(c["index"]) for c in cells if "*" in c["prompt"]))
        page.wait_for_timeout(1000)


def screenshots(page, name: str) -> None:
    """The notebook page by page from the top, as JPEGs in ARTIFACTS/NAME-NN.jpg."""
    stem = name.removesuffix(".ipynb")
    for old in ARTIFACTS.glob(f"{stem}-*.jpg"):
        old.unlink()
    page.set_viewport_size(SHOT_VIEWPORT)  # fewer, taller pictures: each one costs about as much as a page
    try:
        scroller = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-WindowedPanel-outer").first
        scroller.evaluate("el => { el.scrollTop = 0; }")
        for k in range(40):
            page.wait_for_timeout(50)
            page.screenshot(path=str(ARTIFACTS / f"{stem}-{k:02d}.jpg"), type="jpeg", quality=60)
            moved = scroller.evaluate("el => { const t = el.scrollTop; el.scrollTop = t + el.clientHeight - 60; "
                                      "return el.scrollTop > t; }")
            if not moved:
                break
    finally:
        page.set_viewport_size(VIEWPORT)


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    _need_browser()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    lessons = [n for n in LESSONS if not os.environ.get("COURSE_BROWSER_ONLY")
               or any(n.startswith(p) for p in os.environ["COURSE_BROWSER_ONLY"].split(","))]
    tmp = tmp_path_factory.mktemp("browser")
    ws = solved_workspace(tmp / "workspace", lessons)
    kernel = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"}}
    for name, middle in (("zz_fails", "1/0"), ("zz_dies", "import os\nos._exit(1)")):
        (ws / "notebooks" / f"{name}.ipynb").write_text(dumps(nbformat.v4.new_notebook(cells=[
            nbformat.v4.new_code_cell("print('before')"), nbformat.v4.new_code_cell(middle),
            nbformat.v4.new_code_cell("print('after')")], metadata=kernel)))
    # JupyterLab's settings and layouts in the temporary folder: the user's own are neither read nor changed
    news = tmp / "settings" / "@jupyterlab" / "apputils-extension" / "notification.jupyterlab-settings"
    news.parent.mkdir(parents=True)
    news.write_text(json.dumps({"fetchNews": "false", "checkForUpdates": False}))  # no pop-up over the cells
    env = dict(os.environ, JUPYTERLAB_SETTINGS_DIR=str(tmp / "settings"),
               JUPYTERLAB_WORKSPACES_DIR=str(tmp / "layouts"), JUPYTER_RUNTIME_DIR=str(tmp / "runtime"))
    server = Lab(ws, env)
    server.lessons = lessons
    server.times, server.started = {}, []
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def page(lab):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox", "--disable-gpu"])
        try:
            context = browser.new_context(viewport=VIEWPORT)
            yield context.new_page()
        finally:
            browser.close()


def run_notebook(page, lab: Lab, name: str) -> list[dict]:
    start = time.monotonic()
    open_notebook(page, lab, name)
    run_all(page, name)
    try:
        cells = wait_until_done(page, name)
        page.wait_for_timeout(500)  # widget views render after their cell finished
        cells = read_cells(page)
    finally:
        lab.times[name] = round(time.monotonic() - start, 1)
    return cells


def shut_down_kernels(lab: Lab) -> None:
    for session in lab.api("sessions"):
        lab.api(f"sessions/{session['id']}", "DELETE")
    for kernel in lab.api("kernels"):
        lab.api(f"kernels/{kernel['id']}", "DELETE")


def check_notebook(page, lab: Lab, name: str) -> tuple[list[dict], list[str]]:
    """Run `name` in the browser: (its cells as read from the page, what is wrong with them)."""
    cells: list[dict] = []
    try:
        cells = run_notebook(page, lab, name)
        found = problems(cells)
        if not any(c["code"] for c in cells):
            found.append("no code cells seen")
        if name.startswith("07_") and UNSOLVED not in name:
            found += ring_stepper_problems(page)
        if name.startswith("08_") and UNSOLVED not in name:
            found += bucket_explorer_problems(page)
        found += [f"a dialog: {text.strip()[:300]}" for text in page.locator(".jp-Dialog").all_text_contents()
                  if "died" in text or "Restarting" in text or "rror" in text]
    except Exception as e:  # one lesson's failure (or the page's) must not hide the other lessons
        found = [f"{type(e).__name__}: {e}"]
    return cells, found


def solved_run(name: str) -> bool:
    """Whether the browser runs the solved version of lesson `name`: where a widget needs the learner's solution
    (07's ring stepper, 08's bucket explorer) and where there are no exercises (the student version is all there
    is). Every other lesson's cells run in the browser in its untouched student version (the next test), and
    nbmake runs its master."""
    master = nbformat.read(MASTERS / name, as_version=4)
    return name.startswith(("07_", "08_")) or not exercises(master, name)


def test_every_lesson_runs_in_the_browser(lab, page):
    failures, images, stderr = {}, {}, {}
    for name in filter(solved_run, lab.lessons):
        cells, found = check_notebook(page, lab, name)
        t0 = time.monotonic()
        screenshots(page, name)
        lab.times[f"{name} screenshots"] = round(time.monotonic() - t0, 1)
        stderr[name] = [(c["index"], o["text"][:400]) for c in cells for o in c["outputs"] if "stderr" in o["mime"]]
        images[name] = page.locator(".jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output img").evaluate_all(
            "els => els.map(e => [e.naturalWidth, e.clientWidth])")
        if found:
            failures[name] = found
        lab.started.extend(lab.descendants())  # the kernel and whatever it started (ranks, torchrun, ...)
        shut_down_kernels(lab)
    (ARTIFACTS / "times.json").write_text(json.dumps(lab.times, indent=1))
    # each picture's [natural width, width shown] in px: how much JupyterLab shrank it (text size in the browser)
    (ARTIFACTS / "images.json").write_text(json.dumps(images))
    (ARTIFACTS / "stderr.json").write_text(json.dumps(stderr, indent=1))  # what shows in red, for review
    assert not failures, "\n\n".join(f"{name}:\n" + "\n".join(found) for name, found in failures.items())


def test_run_all_goes_past_every_unsolved_exercise_in_the_browser(lab, page):
    """An untouched student version runs top to bottom in the lab: no traceback, no cell left unexecuted, and
    each exercise's check cell says "not attempted yet" (or, for a GPU-only exercise here, that it needs a GPU)."""
    from course_utils import checks

    gpu = _cuda_here()
    failures = {}
    for name in lab.lessons:
        unsolved = name.replace(".ipynb", f"{UNSOLVED}.ipynb")
        master = nbformat.read(MASTERS / name, as_version=4)
        expected = {ex.grade_id: checks.exercise(ex.grade_id) for ex in exercises(master, name)}
        if not expected:
            continue
        cells, found = check_notebook(page, lab, unsolved)
        said = " ".join(o["text"] for c in cells for o in c["outputs"])
        for gid, ex in expected.items():
            marker = checks.SKIP_MARKER if ex.needs_gpu and not ex.cpu_part and not gpu else \
                f"{checks.NOT_ATTEMPTED_MARKER} {gid}"
            if marker not in said:
                found.append(f"{gid}: its check cell did not say {marker!r}")
        if found:
            failures[unsolved] = found
        lab.started.extend(lab.descendants())
        shut_down_kernels(lab)
    assert not failures, "\n\n".join(f"{name}:\n" + "\n".join(found) for name, found in failures.items())


def _cuda_here() -> bool:
    import torch

    return torch.cuda.is_available()


def ring_stepper_problems(page) -> list[str]:
    view = page.locator(".jp-OutputArea-output .widget-vbox", has=page.locator("button", has_text="next")).first
    if view.count() == 0:
        return ["07: the ring stepper did not render (no 'next' button)"]
    view.scroll_into_view_if_needed()
    before = view.text_content()
    page.screenshot(path=str(ARTIFACTS / "07-stepper-before.png"))
    view.locator("button", has_text="next").click()
    page.wait_for_function("([el, t]) => el.textContent !== t", arg=[view.element_handle(), before], timeout=10_000)
    page.screenshot(path=str(ARTIFACTS / "07-stepper-after.png"))
    after = view.text_content()
    return [] if "step 1 of" in after and "step 0 of" in before else [
        f"07: the ring stepper's caption did not go from step 0 to step 1: {before[:200]!r} -> {after[:200]!r}"]


def bucket_explorer_problems(page) -> list[str]:
    view = page.locator(".jp-OutputArea-output .widget-vbox", has=page.locator(".widget-image")).first
    if view.count() == 0:
        return ["08: the bucket explorer did not render (no image widget)"]
    view.scroll_into_view_if_needed()
    image = view.locator("img").first
    before = image.get_attribute("src")
    page.screenshot(path=str(ARTIFACTS / "08-explorer-before.png"))
    # click the slider's track a quarter of the way along: the cap there differs from the start (the best cap)
    track = view.locator(".widget-slider .noUi-target, .widget-slider .slider-container").first
    box = track.bounding_box()
    track.click(position={"x": box["width"] * 0.25, "y": box["height"] / 2})
    try:
        page.wait_for_function("([el, s]) => el.getAttribute('src') !== s", arg=[image.element_handle(), before],
                               timeout=20_000)
    except Exception:
        return ["08: the bucket explorer's picture did not change when its slider moved"]
    page.screenshot(path=str(ARTIFACTS / "08-explorer-after.png"))
    return []


def test_a_failing_cell_fails_the_check(lab, page):
    """The check above must be able to fail: a notebook with `1/0` shows a traceback and an unexecuted cell;
    one whose kernel dies is caught too."""
    _, found = check_notebook(page, lab, "zz_fails.ipynb")
    lab.started.extend(lab.descendants())
    shut_down_kernels(lab)
    assert any("traceback" in f and "ZeroDivisionError" in f for f in found), found
    assert any("cell 2: not executed" in f for f in found), found
    _, found = check_notebook(page, lab, "zz_dies.ipynb")
    lab.started.extend(lab.descendants())
    shut_down_kernels(lab)
    assert any(re.search("kernel is (dead|unknown|.*restarting)|died|not executed", f) for f in found), found


def test_nothing_is_left_running(lab, page):
    """Run last in the module: kernels are gone through the API, and once the server stops, no process it ever
    started (kernels, their ranks, torchrun agents; seen after each lesson) is left, and its port is closed."""
    import psutil

    shut_down_kernels(lab)
    assert lab.api("kernels") == [] and lab.api("sessions") == []
    family = lab.started + lab.descendants()
    before = listeners([lab.port])
    lab.stop()
    _, alive = psutil.wait_procs(family, timeout=10)
    alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"still running after the lab stopped: {[' '.join(p.cmdline())[:200] for p in alive]}"
    assert not left_listening(before)
