"""Where a student's code runs when it is graded: a throwaway place, writes fenced in, nothing left behind.

- `Sandbox`: a throwaway folder with its own cwd, home, temp dir, IPython and matplotlib config, and the
  environment that points there (`env()`), removed by `close()`.
- `restrict(write, hide)`: from then on this process and its children may write only beneath `write` and
  may not read what is beneath `hide` (the masters, their git history, other submissions, other sandboxes)
  (Linux Landlock, an unprivileged kernel sandbox; no root, no container); with Landlock ABI >= 6 they also
  cannot signal processes outside the sandbox (the grader, the probe server). Returns 0 where the kernel
  has no Landlock: then only `FileGuard` protects the files, and nothing is hidden.
- `FileGuard`: a copy of the files a submission must not change (masters, the package, the grading
  account's IPython startup folder); `restore()` puts back whatever changed and says what it was.
- `kill_tree(pid)`: SIGKILL a process, its process group and every descendant.

`python -m course_utils.grading.sandbox --write P --hide Q ... -- CMD...` applies restrict and execs CMD (the
feedback kernel starts this way). This module imports nothing heavy: it is on the kernel's start-up path.
"""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import signal
import sys
import tempfile
from pathlib import Path

# ---------------------------------------------------------------------------------------------- sandbox folder


_PREFIXES = ("course-probe-", "course-notebook-", "course-grading-")


class Sandbox:
    """A throwaway folder: work/ (the cwd), home/, tmp/, ipython/, mpl/. Use as a context manager."""

    def __init__(self, prefix: str = "course-grading-", parent: str | None = None):
        self.root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        for sub in ("work", "home", "tmp", "ipython", "mpl", "cache"):
            (self.root / sub).mkdir()

    @property
    def work(self) -> Path:
        return self.root / "work"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """`base` (default: this process's environment) with home, temp and tool configs moved in here."""
        return sandbox_env(self.root, dict(os.environ if base is None else base))

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sandbox_env(root: str | os.PathLike, env: dict[str, str]) -> dict[str, str]:
    """`env` with home, temp dirs, IPython/matplotlib/Jupyter config and caches moved beneath `root`."""
    root = Path(root)
    env = {k: v for k, v in env.items() if not k.startswith(("JUPYTER_", "JPY_"))}
    env.pop("PYTHONSTARTUP", None)
    env.update({
        "HOME": str(root / "home"),
        "TMPDIR": str(root / "tmp"),
        "TEMP": str(root / "tmp"),
        "TMP": str(root / "tmp"),
        "IPYTHONDIR": str(root / "ipython"),
        "MPLCONFIGDIR": str(root / "mpl"),
        "XDG_CACHE_HOME": str(root / "cache"),
        "XDG_CONFIG_HOME": str(root / "home" / ".config"),
        "JUPYTER_CONFIG_DIR": str(root / "home" / ".jupyter"),
        "JUPYTER_DATA_DIR": str(root / "home" / ".local" / "share" / "jupyter"),
        "JUPYTER_RUNTIME_DIR": str(root / "tmp"),
        "PYTHONDONTWRITEBYTECODE": "1",
        "MPLBACKEND": "Agg",
    })
    return env


# ---------------------------------------------------------------------------------------------- Landlock

_SYS_CREATE, _SYS_ADD_RULE, _SYS_RESTRICT = 444, 445, 446  # the same numbers on x86_64 and aarch64
_PR_SET_NO_NEW_PRIVS = 38
_RULE_PATH_BENEATH = 1
_CREATE_RULESET_VERSION = 1
# Landlock's file system access rights: reading (handled only when something is hidden), and changing.
_EXECUTE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 2, 1 << 3
_READ = _EXECUTE | _READ_FILE | _READ_DIR
_WRITE_FILE, _REMOVE_DIR, _REMOVE_FILE = 1 << 1, 1 << 4, 1 << 5
_MAKE = sum(1 << i for i in range(6, 13))  # MAKE_CHAR .. MAKE_SYM (dirs, regular files, sockets, fifos, links)
_REFER, _TRUNCATE = 1 << 13, 1 << 14  # ABI 2, ABI 3
_FILE_RIGHTS = _EXECUTE | _READ_FILE | _WRITE_FILE | _TRUNCATE  # what a rule on a file (not a folder) may grant
_SCOPE_SIGNAL = 1 << 1  # ABI 6: no signals to processes outside the sandbox


class _RulesetAttr(ctypes.Structure):
    _fields_ = [("handled_access_fs", ctypes.c_uint64), ("handled_access_net", ctypes.c_uint64),
                ("scoped", ctypes.c_uint64)]


class _PathBeneathAttr(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


def _libc():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 where there is none (not Linux, too old, or disabled)."""
    if not sys.platform.startswith("linux") or platform.machine() not in ("x86_64", "aarch64", "AMD64"):
        return 0
    try:
        abi = _libc().syscall(_SYS_CREATE, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except Exception:  # no libc through ctypes
        return 0
    return max(int(abi), 0)


def _hidden_set(hide: list[str | os.PathLike]) -> list[Path]:
    return sorted({Path(os.path.realpath(h)) for h in hide if os.path.lexists(h)})


def _read_rules(hide: list[Path]) -> list[tuple[str, int]]:
    """Read rights for everything but `hide`: directory listing everywhere (names only), and full read rights
    beneath every entry of every ancestor of a hidden path that neither is, holds nor links into one."""
    ancestors = {a for h in hide for a in h.parents}
    hidden = set(hide)
    rules = [("/", _READ_DIR)]
    for folder in sorted(ancestors):
        try:
            entries = list(os.scandir(folder))
        except OSError:
            continue
        for entry in entries:
            path = Path(entry.path)
            if path in ancestors or path in hidden:
                continue
            real = Path(os.path.realpath(path))
            if real in hidden or real in ancestors or any(h in real.parents for h in hidden):
                continue  # a link into a hidden place
            rules.append((str(path), _READ))
    return rules


def restrict(write: list[str | os.PathLike], hide: list[str | os.PathLike] = ()) -> int:
    """Fence this process (and what it starts) in, for good: it may write only beneath `write`, and may not
    read what is beneath `hide` (it still sees the names). Where Landlock has the signal scope (ABI >= 6) it
    may not signal processes outside its sandbox either.

    Returns the Landlock ABI applied (0: not applied, nothing changed). Paths that do not exist are skipped.
    """
    abi = landlock_abi()
    if abi < 1:
        return 0
    libc = _libc()
    handled = _WRITE_FILE | _REMOVE_DIR | _REMOVE_FILE | _MAKE
    if abi >= 2:
        handled |= _REFER
    if abi >= 3:
        handled |= _TRUNCATE
    hidden = _hidden_set(list(hide))
    rules = [(str(p), handled | (_READ if hidden else 0)) for p in write]
    if hidden:
        handled |= _READ
        rules += _read_rules(hidden)
    attr = _RulesetAttr(handled, 0, _SCOPE_SIGNAL if abi >= 6 else 0)
    size = 24 if abi >= 6 else (16 if abi >= 4 else 8)  # the struct grew with the ABI
    ruleset = libc.syscall(_SYS_CREATE, ctypes.byref(attr), ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        return 0
    try:
        for path, rights in rules:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                if not os.path.isdir(path):
                    rights &= _FILE_RIGHTS
                rule = _PathBeneathAttr(rights & handled, fd)
                if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(ruleset), ctypes.c_int(_RULE_PATH_BENEATH),
                                ctypes.byref(rule), ctypes.c_uint32(0)) < 0:
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
            finally:
                os.close(fd)
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(_SYS_RESTRICT, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(ruleset)
    return abi


def restrict_writes(paths: list[str | os.PathLike]) -> int:
    """restrict(write=paths): writes fenced in, reads left alone."""
    return restrict(paths)


def prefer_oom_kill() -> None:
    """Make this process the out-of-memory killer's first choice (a student's memory hog, not the grader)."""
    try:
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def set_child_subreaper() -> None:
    """Orphans of this process's descendants come back to it (so kill_tree finds them), Linux only."""
    if sys.platform.startswith("linux"):
        _libc().prctl(36, 1, 0, 0, 0)  # PR_SET_CHILD_SUBREAPER


def die_with_parent() -> None:
    """SIGKILL this process when the process that forked it exits (Linux only)."""
    if sys.platform.startswith("linux"):
        _libc().prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG


# ---------------------------------------------------------------------------------------------- processes


def _process_table() -> list[tuple[int, int, int]]:
    """(pid, parent pid, session id) of every process, from /proc (empty where there is no /proc)."""
    table = []
    proc = Path("/proc")
    if not proc.is_dir():
        return table
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # state ppid pgrp session ...
        table.append((int(entry.name), int(fields[1]), int(fields[3])))
    return table


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (children, grandchildren, ...) and every other process of its session
    (a session leader's detached grandchildren). Uses /proc; psutil where there is no /proc."""
    table = _process_table()
    if not table:
        try:
            import psutil

            return [p.pid for p in psutil.Process(pid).children(recursive=True)]
        except Exception:  # psutil missing or the process gone
            return []
    children: dict[int, list[int]] = {}
    for p, ppid, _ in table:
        children.setdefault(ppid, []).append(p)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    found |= {p for p, _, sid in table if sid == pid and p != pid}
    return sorted(found)


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def kill_tree(pid: int, include_self: bool = True) -> None:
    """SIGKILL every descendant of `pid`, then (include_self) its process group and `pid` itself.

    Everything is stopped first (SIGSTOP, round after round until no new process appears), so nothing can
    fork its way out while we kill; `pid` should be a subreaper (sandbox.set_child_subreaper) so that orphans
    of a double fork are still its descendants."""
    if include_self:
        _signal(pid, signal.SIGSTOP)
    stopped: set[int] = set()
    for _ in range(50):
        new = set(descendants(pid)) - stopped
        if not new:
            break
        for child in new:
            _signal(child, signal.SIGSTOP)
        stopped |= new
    for child in stopped | set(descendants(pid)):
        _signal(child, signal.SIGKILL)
    if include_self:
        if pid != os.getpgrp():
            try:
                os.killpg(pid, signal.SIGKILL)  # it called setsid: its group id is its pid
            except (ProcessLookupError, PermissionError):
                pass
        _signal(pid, signal.SIGKILL)


# ---------------------------------------------------------------------------------------------- file guard

_SKIP_PARTS = {"__pycache__", ".ipynb_checkpoints"}


class FileGuard:
    """The bytes of files that grading must leave alone, and a way to put them back.

    `roots` are files or folders (walked; __pycache__ skipped). A folder that does not exist yet is watched
    too: files that appear in it are removed by `restore()`."""

    def __init__(self, roots: list[str | os.PathLike]):
        self.roots = [Path(r).resolve() for r in roots]
        self.saved: dict[Path, bytes] = {}
        for path in self._files():
            try:
                self.saved[path] = path.read_bytes()
            except OSError:
                pass

    def _files(self) -> list[Path]:
        out = []
        for root in self.roots:
            if root.is_file():
                out.append(root)
            elif root.is_dir():
                for dirpath, dirnames, filenames in os.walk(root):
                    dirnames[:] = [d for d in dirnames if d not in _SKIP_PARTS]
                    out += [Path(dirpath) / f for f in filenames if not f.endswith(".pyc")]
        return out

    def restore(self) -> list[str]:
        """Put back changed or deleted files, delete new ones; return what was wrong (empty: all fine)."""
        wrong = []
        present = set(self._files())
        for path in sorted(present - set(self.saved)):
            wrong.append(f"created {path}")
            try:
                path.unlink()
            except OSError:
                pass
        for path, data in self.saved.items():
            try:
                same = path.read_bytes() == data
            except OSError:
                same = False
            if not same:
                wrong.append(f"{'changed' if path in present else 'deleted'} {path}")
                try:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_bytes(data)
                except OSError as e:
                    wrong.append(f"could not restore {path}: {e}")
        return wrong


def _main(argv: list[str]) -> None:
    """`python -m course_utils.grading.sandbox [--write P]... [--hide P]... -- CMD...`: fence in, exec CMD."""
    if "--" not in argv:
        sys.exit("usage: python -m course_utils.grading.sandbox [--write PATH]... [--hide PATH]... -- CMD...")
    cut = argv.index("--")
    opts, cmd = argv[:cut], argv[cut + 1:]
    write = [opts[i + 1] for i in range(0, len(opts) - 1, 2) if opts[i] == "--write"]
    hide = [opts[i + 1] for i in range(0, len(opts) - 1, 2) if opts[i] == "--hide"]
    set_child_subreaper()  # (jupyter_client already started us in a session of our own)
    prefer_oom_kill()
    restrict(write, hide + other_sandboxes(write[0] if write else None))
    os.execvp(cmd[0], cmd)


def other_sandboxes(own: str | os.PathLike | None) -> list[str]:
    """The grader's other throwaway folders beside `own` (other probes, other kernels): hidden from this one."""
    if own is None:
        return []
    own = Path(own)
    try:
        return [str(p) for p in own.parent.iterdir() if p.name.startswith(_PREFIXES) and p != own]
    except OSError:
        return []


if __name__ == "__main__":
    _main(sys.argv[1:])
