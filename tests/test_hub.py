"""A class on one box: `make hub` (JupyterHub, PAM, one server per student as that student), with real parts.

One hub serves the module: started as root by `make hub` itself on a free port, in a copy of the repository (the
hub closes notebooks/ and tests/ to students: the checkout under test keeps its modes), with a temporary roster of
two students and an instructor, real system accounts made by launch/hub/accounts.py (useradd, chpasswd) and an
account that is not on the roster. People log in through the hub's own login form (HTTP, with its xsrf token),
as a browser does. The tests check who may log in, that each student's server runs as their own account on
their own workspace (read from /proc), that a student's processes cannot read the masters, the tests or another
student's home but can import course_utils and torch, that the instructor's server serves the masters, and that
stopping the hub leaves no process and no listening port. Accounts, the instructors' group (when the hub made it)
and the copy are removed afterwards.

Needs root, useradd/chpasswd/userdel/runuser, PAM (pamela), and a Python that other accounts may run: where this
environment's interpreter lies under a folder closed to others (pyenv under /root), a venv of the system's Python
of the same version is made that reads this environment's packages (the hub checks the same, see hub_layout.py).
"""

from __future__ import annotations

import grp
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

import pytest

from tests.launch_helpers import assert_gone, left_listening, listeners, listening

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch" / "hub"))

from hub_layout import not_open_to_all  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.ranks]

GROUP = "course-instructors"
START_TIMEOUT = 150  # s for the hub to answer, and again for a server to start, on a loaded 2-core machine
ARTIFACTS = ROOT / "tests" / "artifacts"
PROXY = ROOT / ".hub" / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
# Simulated GPUs for HUB_GPUS=each (hub_gpus.py): the hub hands them out by roster line; nothing opens them.
GPUS = {"COURSE_HUB_GPU_IDS": "6,7"}


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "the hub runs each student's server as that student: run as root"
    missing = [t for t in ("useradd", "userdel", "chpasswd", "runuser", "make") if not shutil.which(t)]
    if missing:
        return f"needs {', '.join(missing)} (useradd and friends: Debian's passwd package)"
    try:
        import pamela  # noqa: F401
    except ImportError:
        return "PAM is missing (pamela, JupyterHub's PAM binding, or libpam)"
    if not Path("/etc/pam.d/login").exists():
        return "no PAM 'login' service (/etc/pam.d/login)"
    return None


def free_base_port() -> int:
    """A port P with P, P+1 and P+2 free (the hub's public port, its API, the proxy's API)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base < 65000 and not any(listening(base + k) for k in range(3)):
            return base
    raise AssertionError("no three free ports in a row")



def students_python(tmp: Path) -> str:
    """A Python that other accounts can run, with this environment's packages."""
    purelib = sysconfig.get_paths()["purelib"]
    if not not_open_to_all([Path(sys.prefix), Path(os.path.realpath(sys.executable)),
                            Path(sysconfig.get_paths()["stdlib"]), Path(purelib)]):
        return sys.executable
    system = Path(f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}")
    if not system.exists() or not_open_to_all([Path(purelib)]):
        pytest.skip(f"this environment's Python ({os.path.realpath(sys.executable)}) is closed to other accounts "
                    f"and there is no {system} to make one that is")
    venv = tmp / "venv"
    subprocess.run([str(system), "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python3*/site-packages"))
    (site / "course-env.pth").write_text(purelib + "\n")  # this environment's packages (same Python version)
    for name in ("etc", "share"):  # Jupyter's extension settings and JupyterLab's pages, found under sys.prefix
        if (Path(sys.prefix) / name).is_dir():
            (venv / name).symlink_to(Path(sys.prefix) / name)
    return str(venv / "bin" / "python")


def copy_repo(dest: Path) -> Path:
    """The parts of the repository that the hub uses, with a stand-in for tests/ (the wrong answers)."""
    dest.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", ".ipynb_checkpoints")
    for name in ("course_utils", "launch", "benchmarks", "notebooks"):
        shutil.copytree(ROOT / name, dest / name, ignore=skip)
    for name in ("Makefile", "pyproject.toml"):
        shutil.copy(ROOT / name, dest / name)
    (dest / "tests").mkdir()
    (dest / "tests" / "wrong_answer.py").write_text("# a wrong answer the students must not see\n")
    (dest / "submissions" / "someone").mkdir(parents=True)  # as grading leaves it, but open to all
    os.chmod(dest / "submissions", 0o755)
    return dest


def make_accounts(tmp: Path, repo: Path, py: str, names: dict[str, str]) -> dict[str, str]:
    """Two students and an instructor from a roster (`make students`: useradd, chpasswd), and one account that is
    not on the roster. Returns {role: password}."""
    roster = tmp / "students.txt"
    roster.write_text(f"# a test class\n{names['s1']}\n\n{names['s2']}   # the second student\n")
    res = subprocess.run(["make", "students", f"PY={py}", f"ROSTER={roster}", f"ADMINS={names['teacher']}"],
                         cwd=repo, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout + res.stderr
    passwords = repo / ".hub" / "state" / "initial-passwords.txt"
    by_name = dict(line.split() for line in passwords.read_text().splitlines())
    assert oct(os.stat(passwords).st_mode & 0o777) == "0o600"
    outsider = secrets.token_urlsafe(9)
    subprocess.run(["useradd", "--create-home", names["outsider"]], check=True)
    subprocess.run(["chpasswd"], input=f"{names['outsider']}:{outsider}\n", text=True, check=True)
    return {role: by_name[name] for role, name in names.items() if name in by_name} | {"outsider": outsider}


def own_work(name: str) -> str:
    """A lesson that student `name` already worked on, in their workspace, as they would have saved it."""
    home = Path(pwd.getpwnam(name).pw_dir)
    folder = home / "workspace" / "notebooks"
    folder.mkdir(parents=True)
    mine = "# my own work, never to be overwritten"
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {}, "outputs": [],
                     "source": mine}], "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    (folder / "00_start_here.ipynb").write_text(json.dumps(nb))
    account = pwd.getpwnam(name)
    for path in (home / "workspace", folder, folder / "00_start_here.ipynb"):
        os.chown(path, account.pw_uid, account.pw_gid)
    return mine


class Hub:
    """`make hub` in its own session, on a copy of the repository."""

    def __init__(self, repo: Path, py: str, roster: Path, admin: str, log: Path, *make_args: str):
        self.port, self.log = free_base_port(), log
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            ["make", "hub", f"PY={py}", f"ROSTER={roster}", f"ADMINS={admin}", f"HUB_PORT={self.port}",
             f"HUB_PROXY={PROXY}", *make_args], cwd=repo, stdin=subprocess.DEVNULL, stdout=log.open("w"),
            stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **GPUS})
        deadline = time.monotonic() + START_TIMEOUT
        while "JupyterHub is now running" not in log.read_text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"the hub did not start:\n{log.read_text()[-5000:]}")
            time.sleep(0.5)

    def hub_process(self):
        import psutil

        try:
            kids = psutil.Process(self.proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            return None
        return next((p for p in kids if "jupyterhub_config.py" in " ".join(p.cmdline())), None)

    def stop(self) -> None:
        """SIGTERM to the hub, which stops every server and the proxy; then anything of its session left over."""
        hub = self.hub_process()
        if hub is not None:
            hub.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what is still there is a bug the tests report
        except ProcessLookupError:
            pass
        self.proc.wait()


def login(hub: Hub, name: str, password: str, spawn: bool = True):
    """Log in through the hub's login form, as a browser does, and start the server unless not `spawn`; returns
    the session (None when refused)."""
    import requests

    s = requests.Session()
    page = s.get(f"{hub.base}/hub/login", timeout=30)
    xsrf = re.search(r'name="_xsrf" value="([^"]+)"', page.text).group(1)
    r = s.post(f"{hub.base}/hub/login?next=", data={"username": name, "password": password, "_xsrf": xsrf},
               timeout=START_TIMEOUT, allow_redirects=False)
    if r.status_code != 302:
        return None
    if spawn:
        s.get(f"{hub.base}/hub/spawn", timeout=START_TIMEOUT)  # where the login sends a browser: starts the server
    return s


def open_lab(hub: Hub, session, name: str) -> None:
    """Open the user's JupyterLab page as a browser does, once their server is up: the server's own login (OAuth
    with the hub) gives the session the cookie its REST API asks for."""
    deadline = time.monotonic() + START_TIMEOUT
    while True:
        r = session.get(f"{hub.base}/user/{name}/lab", timeout=60)
        if r.status_code == 200 and r.url.startswith(f"{hub.base}/user/{name}/lab"):
            return
        assert time.monotonic() < deadline, f"{name}'s server did not answer: {r.status_code} {r.url}"
        time.sleep(1)


def browser_login(hub: Hub, users: dict[str, str]) -> dict | None:
    """Log `users` (name: password) in with chromium at once (Debian's, through playwright, as tests/test_browser.py
    drives it), each in a browser context of their own: the login forms are sent one after the other, then each
    page waits for its server and shows JupyterLab with the workspace's lessons. Returns a requests session per
    name with that browser's cookies; None where there is no chromium or playwright (then forms go over HTTP)."""
    import requests

    browser_path = shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        browser_path = None
    if browser_path is None:
        if os.environ.get("CI"):
            pytest.fail("chromium and playwright must be there under CI (make test's set-up installs chromium)")
        return None
    cookies = {}
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox", "--disable-gpu"])
        try:
            pages = {name: browser.new_context().new_page() for name in users}
            for name, page in pages.items():
                page.goto(f"{hub.base}/hub/login")
                page.fill("#username_input", name)
                page.fill("#password_input", users[name])
            for page in pages.values():  # both servers start together, as in a class's first minute
                page.click("#login_submit", no_wait_after=True)
            for name, page in pages.items():
                page.wait_for_url(re.compile(f"/user/{name}/lab"), timeout=START_TIMEOUT * 1000)
                page.locator(".jp-DirListing-item", has_text="07_ring_allreduce.ipynb").first.wait_for(
                    timeout=60_000)
                cookies[name] = page.context.cookies()
        finally:
            browser.close()
    sessions = {}
    for name, jar in cookies.items():
        sessions[name] = requests.Session()
        for c in jar:
            sessions[name].cookies.set(c["name"], c["value"], domain=c["domain"], path=c["path"])
    return sessions


def contents(hub: Hub, session, name: str, path: str = "") -> dict:
    """The user's server's contents API, through the proxy."""
    r = session.get(f"{hub.base}/user/{name}/api/contents/{path}", timeout=60)
    assert r.status_code == 200, f"{name}'s contents API said {r.status_code} for {path!r}"
    return r.json()


def servers() -> dict[str, dict]:
    """The single-user servers running now, from /proc: {user: {pid, uid, root_dir, ports}}."""
    import psutil

    found = {}
    for p in psutil.process_iter(["pid", "cmdline", "uids"]):
        try:
            if "jupyterhub.singleuser" not in " ".join(p.info["cmdline"] or []):
                continue
            env = p.environ()
            ports = [c.laddr.port for c in p.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found[env.get("JUPYTERHUB_USER", "?")] = {"pid": p.pid, "uid": p.info["uids"].real, "ports": ports,
                                                  "root_dir": env.get("JUPYTERHUB_ROOT_DIR"), "env": env}
    return found


def processes_of(names: list[str]) -> list:
    import psutil

    uids = set()
    for name in names:
        try:
            uids.add(pwd.getpwnam(name).pw_uid)
        except KeyError:
            pass
    return [p for p in psutil.process_iter(["uids"]) if p.info["uids"] and p.info["uids"].real in uids]


def remove_accounts(names: list[str]) -> None:
    for p in processes_of(names):  # only these accounts' processes, which this test started through the hub
        try:
            p.kill()
        except Exception:
            pass
    for name in names:
        subprocess.run(["userdel", "--remove", name], capture_output=True)


@pytest.fixture(scope="module")
def hub():
    why = _why_not()
    if why:
        pytest.skip(why)
    res = subprocess.run(["bash", str(ROOT / "launch" / "hub" / "setup_proxy.sh")], capture_output=True, text=True)
    if res.returncode:  # make test's set-up runs the same script
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"no JupyterHub proxy: {res.stdout}{res.stderr}")
    group_was_there = any(g.gr_name == GROUP for g in grp.getgrall())
    tmp = Path(tempfile.mkdtemp(prefix="course-hub-"))  # not under pytest's 0700 folder: students read the copy
    os.chmod(tmp, 0o755)
    tag = secrets.token_hex(2)
    names = {"s1": f"cht{tag}a", "s2": f"cht{tag}b", "teacher": f"cht{tag}t", "outsider": f"cht{tag}x"}
    server = None
    try:
        py = students_python(tmp)
        repo = copy_repo(tmp / "repo")
        passwords = make_accounts(tmp, repo, py, names)
        mine = own_work(names["s1"])
        server = Hub(repo, py, tmp / "students.txt", names["teacher"], tmp / "hub.log", "HUB_GPUS=each")
        server.names, server.passwords, server.repo, server.py, server.mine = names, passwords, repo, py, mine
        server.tmp = tmp
        server.sessions = {}
        yield server
    finally:
        if server is not None:
            server.stop()
            ARTIFACTS.mkdir(parents=True, exist_ok=True)
            shutil.copy(server.log, ARTIFACTS / "hub.log")  # the hub's own log, for a failure's report
        remove_accounts(list(names.values()))
        if not group_was_there:
            subprocess.run(["groupdel", GROUP], capture_output=True)
        shutil.rmtree(tmp, ignore_errors=True)


def test_only_the_roster_and_instructors_log_in(hub):
    names, pw = hub.names, hub.passwords
    assert login(hub, names["s1"], pw["s1"] + "x") is None, "a wrong password was accepted"
    assert login(hub, names["outsider"], pw["outsider"]) is None, "an account not on the roster logged in"
    hub.sessions["teacher"] = login(hub, names["teacher"], pw["teacher"])  # over HTTP, then both students at once
    assert hub.sessions["teacher"] is not None, f"the instructor could not log in:\n{hub.log.read_text()[-3000:]}"
    students = {names[r]: pw[r] for r in ("s1", "s2")}
    in_browser = browser_login(hub, students) or {n: login(hub, n, p) for n, p in students.items()}
    for role in ("s1", "s2"):
        hub.sessions[role] = in_browser[names[role]]
        assert hub.sessions[role] is not None, f"{role} could not log in:\n{hub.log.read_text()[-3000:]}"
    for role in ("s1", "s2", "teacher"):
        open_lab(hub, hub.sessions[role], names[role])


def test_each_student_has_a_server_of_their_own_on_their_own_workspace(hub):
    names = hub.names
    listing = {role: contents(hub, hub.sessions[role], names[role]) for role in ("s1", "s2")}
    running = servers()
    for role in ("s1", "s2"):
        name = names[role]
        account = pwd.getpwnam(name)
        assert running[name]["uid"] == account.pw_uid, f"{name}'s server runs as uid {running[name]['uid']}"
        workspace = Path(account.pw_dir) / "workspace"
        assert running[name]["root_dir"] == str(workspace / "notebooks")
        lessons = sorted(c["name"] for c in listing[role]["content"] if c["name"].endswith(".ipynb"))
        assert lessons == sorted(p.name for p in (ROOT / "notebooks").glob("*.ipynb"))
        owners = {(workspace / "notebooks" / n).stat().st_uid for n in lessons}
        assert owners == {account.pw_uid}, "the workspace's lessons are not the student's own files"
        assert running[name]["env"].get("COURSE_LAB") == "1"
        # HUB_GPUS=each on the simulated GPUs: a GPU of their own, in roster order, and kernels that take turns
        assert running[name]["env"].get("CUDA_VISIBLE_DEVICES") == GPUS["COURSE_HUB_GPU_IDS"].split(",")[
            ["s1", "s2"].index(role)]
        specs = hub.sessions[role].get(f"{hub.base}/user/{name}/api/kernelspecs", timeout=60).json()
        assert "--ext=course_utils.gpu_lock" in specs["kernelspecs"]["python3"]["spec"]["argv"], specs
    kept = contents(hub, hub.sessions["s1"], names["s1"], "00_start_here.ipynb")
    assert hub.mine in json.dumps(kept["content"]), "the hub overwrote a lesson the student had worked on"
    fresh = json.dumps(contents(hub, hub.sessions["s2"], names["s2"], "07_ring_allreduce.ipynb")["content"])
    assert "NotImplementedError" in fresh and "BEGIN SOLUTION" not in fresh, "a student got a solution"


PROBE = """
import json, os, sys
out = {}
for what, path in json.loads(sys.argv[1]).items():
    try:
        out[what] = os.listdir(path) if os.path.isdir(path) else open(path).read()[:40]
    except OSError as e:
        out[what] = type(e).__name__
import course_utils, torch
out["imports"] = [course_utils.__file__, torch.__version__]
print(json.dumps(out))
"""


def test_a_students_processes_read_neither_the_masters_nor_the_tests_nor_another_home(hub):
    names, repo = hub.names, hub.repo
    env = servers()[names["s1"]]["env"]  # what the student's kernels and terminals get
    targets = {"masters": repo / "notebooks", "a master": repo / "notebooks" / "07_ring_allreduce.ipynb",
               "tests": repo / "tests" / "wrong_answer.py", "other home": Path(pwd.getpwnam(names["s2"]).pw_dir),
               "other workspace": Path(pwd.getpwnam(names["s2"]).pw_dir) / "workspace" / "notebooks",
               "hub state": repo / ".hub" / "state", "submissions": repo / "submissions",
               "released": repo / ".hub" / "release" / "notebooks",
               "own workspace": Path(env["JUPYTERHUB_ROOT_DIR"])}
    res = subprocess.run(["runuser", "-u", names["s1"], "--", hub.py, "-c", PROBE,
                          json.dumps({k: str(v) for k, v in targets.items()})],
                         cwd=env["HOME"], env={k: env[k] for k in ("HOME", "PATH", "PYTHONPATH", "USER")},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    seen = json.loads(res.stdout)
    for what in ("masters", "a master", "tests", "other home", "other workspace", "hub state", "submissions"):
        assert seen[what] == "PermissionError", f"a student read the {what}: {seen[what]!r}"
    assert "07_ring_allreduce.ipynb" in seen["released"] and "07_ring_allreduce.ipynb" in seen["own workspace"]
    assert seen["imports"][0] == str(repo / "course_utils" / "__init__.py")
    assert shutil.which("python", path=env["PATH"]) == str(Path(hub.py).parent / "python"), "a terminal's python"


def test_a_student_checks_their_lessons_against_the_masters_without_solutions(hub):
    """`make -C REPO check` in a student's terminal: their workspace, scored against release/grading, which holds
    every cell of the masters but the solutions."""
    name, repo = hub.names["s1"], hub.repo
    env = servers()[name]["env"]
    grading = Path(env["MASTER_DIR"])
    assert grading == repo / ".hub" / "release" / "grading" and Path(env["LAB_WORKSPACE"]) == Path(
        env["JUPYTERHUB_ROOT_DIR"]).parent
    assert "lstsq" in (repo / "notebooks" / "04_async_memcpy.ipynb").read_text()  # ex04's solution, in the master
    assert "lstsq" not in (grading / "04_async_memcpy.ipynb").read_text()
    keep = ("HOME", "PATH", "PYTHONPATH", "USER", "LAB_WORKSPACE", "MASTER_DIR")
    res = subprocess.run(["runuser", "-u", name, "--", "make", "-s", "-C", str(repo), "check", "NB=04_async_memcpy",
                          f"PY={hub.py}"], cwd=env["HOME"], env={k: env[k] for k in keep},
                         capture_output=True, text=True, timeout=600)
    out = res.stdout + res.stderr
    assert res.returncode != 0 and "Traceback" not in out and "PermissionError" not in out, out[-3000:]
    for gid in ("ex04_copy_time", "ex04_overlap_makespan", "ex04_prefetcher", "ex04_losses_to_host"):
        assert re.search(rf"{gid}\b.*not attempted", res.stdout), out[-3000:]


def test_the_instructor_gets_the_masters(hub):
    name = hub.names["teacher"]
    master = contents(hub, hub.sessions["teacher"], name, "07_ring_allreduce.ipynb")
    assert "BEGIN SOLUTION" in json.dumps(master["content"])
    running = servers()[name]
    assert running["uid"] == pwd.getpwnam(name).pw_uid
    assert running["root_dir"] == str(hub.repo / "notebooks")
    assert "CUDA_VISIBLE_DEVICES" not in running["env"], "an instructor sees every GPU"
    assert name in grp.getgrnam(GROUP).gr_mem
    modes = {p: oct(os.stat(hub.repo / p).st_mode & 0o7777) for p in ("notebooks", "tests", ".hub/state")}
    assert modes == {"notebooks": "0o2770", "tests": "0o750", ".hub/state": "0o700"}


def culler_running(hub: Hub) -> bool:
    """Whether the hub runs jupyterhub-idle-culler as its service (a child of the hub's process)."""
    import psutil

    try:
        children = psutil.Process(hub.proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return False
    return any("jupyterhub_idle_culler" in " ".join(c.cmdline()) for c in children if c.is_running())


def _xsrf(session, path: str) -> dict:
    """The header a cookie-authenticated POST/PUT/DELETE needs: the _xsrf cookie that the page at `path` set."""
    token = next((c.value for c in session.cookies if c.name == "_xsrf" and path.startswith(c.path)), None)
    return {"X-XSRFToken": token} if token else {}


def test_a_students_saved_work_survives_a_restart_of_their_server(hub):
    """Saved through the lab (its contents API, as the lab's Save does), the server stopped and started again
    through the hub's API, as the hub's home page does: the work is still there."""
    name, session = hub.names["s2"], hub.sessions["s2"]
    lab = f"/user/{name}/"
    nb = {"cells": [{"cell_type": "code", "execution_count": None, "id": "c1", "metadata": {}, "outputs": [],
                     "source": "answer = 42  # saved before the restart"}],
          "metadata": {}, "nbformat": 4, "nbformat_minor": 5}
    r = session.put(f"{hub.base}{lab}api/contents/saved_work.ipynb", json={"type": "notebook", "content": nb},
                    headers=_xsrf(session, lab), timeout=60)
    assert r.status_code in (200, 201), f"saving said {r.status_code}: {r.text[:300]}"
    api = f"{hub.base}/hub/api/users/{name}/server"
    r = session.delete(api, headers=_xsrf(session, "/hub/"), timeout=START_TIMEOUT)
    assert r.status_code in (202, 204), f"stopping said {r.status_code}: {r.text[:300]}"
    deadline = time.monotonic() + START_TIMEOUT
    while name in servers():
        assert time.monotonic() < deadline, f"{name}'s server did not stop"
        time.sleep(0.5)
    r = session.post(api, headers=_xsrf(session, "/hub/"), timeout=START_TIMEOUT)
    assert r.status_code in (201, 202), f"starting said {r.status_code}: {r.text[:300]}"
    open_lab(hub, session, name)
    kept = contents(hub, session, name, "saved_work.ipynb")
    assert "saved before the restart" in json.dumps(kept["content"])


def test_stopping_the_hub_leaves_nothing_running(hub):
    ours = set(hub.names.values())  # a server of another hub on this machine (another test's) is not ours to check
    ports = [hub.port + k for k in range(3)] + [p for name, s in servers().items() if name in ours for p in s["ports"]]
    assert len(ports) > 3
    assert culler_running(hub), "make hub's default (HUB_CULL_IDLE=3600) runs the idle culler"
    before = listeners(ports)
    assert sorted(before) == sorted(set(ports)), before
    hub.stop()
    assert hub.proc.returncode is not None
    # a server that has just exited can be a zombie for a moment, until its parent reaps it: gone, not running
    assert_gone([p.pid for p in processes_of(list(hub.names.values()))])
    assert not left_listening(before), "a port is still listening after the hub stopped"
    assert "Cleaning up single-user servers" in hub.log.read_text()


IDLE_S = 10  # the second hub's HUB_CULL_IDLE: short, so that the culler's work is seen within the test


def test_with_first_use_login_a_student_picks_their_password_once_and_idle_servers_stop(hub):
    """HUB_AUTH=firstuse (jupyterhub-firstuseauthenticator): the first login sets the password, later ones must
    give it; the roster still decides who may log in. With HUB_CULL_IDLE=10 the server that nobody uses is stopped
    by the idle culler (it checks every IDLE_S/2 s), and the student's files stay."""
    names = hub.names
    first = Hub(hub.repo, hub.py, hub.tmp / "students.txt", names["teacher"], hub.tmp / "hub-firstuse.log",
                "HUB_AUTH=firstuse", f"HUB_CULL_IDLE={IDLE_S}")
    try:
        assert login(first, names["s1"], "picked-at-first-login", spawn=False) is not None
        assert login(first, names["s1"], "another-password", spawn=False) is None
        assert login(first, names["s1"], "picked-at-first-login") is not None  # and its server starts
        assert login(first, names["outsider"], "picked-at-first-login", spawn=False) is None
        assert "FirstUseAuthenticator" in first.log.read_text()
        deadline = time.monotonic() + START_TIMEOUT
        while names["s1"] not in servers():
            assert time.monotonic() < deadline, f"s1's server did not start:\n{first.log.read_text()[-3000:]}"
            time.sleep(1)
        started = time.monotonic()
        while names["s1"] in servers():
            assert time.monotonic() < started + 20 * IDLE_S, \
                f"the idle server was not stopped:\n{first.log.read_text()[-3000:]}"
            time.sleep(1)
        assert "Culling server" in first.log.read_text(), first.log.read_text()[-3000:]
        assert hub.mine in (Path(pwd.getpwnam(names["s1"]).pw_dir) / "workspace" / "notebooks"
                            / "00_start_here.ipynb").read_text(), "culling took the student's work"
    finally:
        before = listeners(list(range(first.port, first.port + 3)))
        first.stop()
    assert not left_listening(before)
    assert_gone([p.pid for p in processes_of(list(names.values()))])
