"""Where a student's code runs when it is graded: bubblewrap, as an unprivileged user, with nothing of ours in reach.

- `Sandbox`: a throwaway folder (work/ is the cwd; home/, tmp/, ipython/, mpl/, cache/) removed by `close()`.
- `command(box, argv, gpus=...)`: the command line that runs `argv` inside bubblewrap (`bwrap`, the sandbox under
  Flatpak) with its own user, PID, network, IPC, UTS and mount namespaces, as an unprivileged uid with no
  capabilities, and `--die-with-parent`: killing the process we start ends everything the student started.
  Mounted, read-only: the system's libraries, /sys, the Python prefix and package folders, the course package
  and the checks modules named. Read-write: the box only. Private: /tmp, /dev/shm, /proc, its own loopback network. Of
  /dev, the usual null/zero/random nodes and the device nodes of the GPUs it is given, nothing else. Not mounted
  at all: the masters, their checkpoints and git history, the repository, other submissions, the grader's files.
- `env(box, ...)`: the sandboxed process's whole environment, an allowlist (no token or secret of ours leaks in).
- `stop(pid)`: kills the sandbox started as process `pid` and waits until every process in it is gone.
- `require()`: raises `SandboxUnavailable`, saying how to install bubblewrap, where it is missing.

Run as root (how the course's own commands run on CI), the grader first drops to uid 65534 (`setpriv`): bubblewrap
started as root would still act as root outside its namespaces. The mount sources are bound into the box
beforehand in a private mount namespace (`unshare --mount`), because the unprivileged uid may not be able to walk
to them (a Python under /root, mode 0700).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from ..launch.procs import children

SANDBOX_UID = 65534  # "nobody": owns nothing of ours
TMPFS_BYTES = 2 << 30  # /tmp and /dev/shm inside: private, memory-backed, capped
INSTALL_HINT = ("install bubblewrap (Debian/Ubuntu: `sudo apt-get install bubblewrap`; `make test` does it when run "
                "as root) or, for trusted work only, grade with --no-sandbox")
# Names passed into the sandbox from our environment; everything else is left out.
_ENV_NAMES = ("LANG", "LC_ALL", "LC_CTYPE", "TZ", "LD_LIBRARY_PATH", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
              "CUDA_DEVICE_ORDER", "COURSE_REQUIRE_GPU", "PYTORCH_NVML_BASED_CUDA_CHECK")
_ENV_PREFIXES = ("NCCL_", "TORCH_", "NVSHMEM_")
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
_SYS = ("/sys",)  # read-only: NCCL and NVML read the PCI topology there
_ETC = ("/etc/ld.so.cache", "/etc/hosts", "/etc/nsswitch.conf", "/etc/localtime", "/etc/passwd", "/etc/group",
        "/etc/alternatives", "/etc/ssl/certs", "/etc/fonts", "/etc/matplotlibrc")


class SandboxUnavailable(RuntimeError):
    """bubblewrap (or setpriv/unshare, when run as root) is missing or does not work here."""


class Sandbox:
    """A throwaway folder: work/ (the cwd), home/, tmp/, ipython/, mpl/, cache/. Use as a context manager.

    Run as root, its folders belong to SANDBOX_UID, so that the sandboxed process can write in them."""

    def __init__(self, prefix: str = "course-grading-", parent: str | None = None):
        parent = parent or tempfile.gettempdir()
        if os.geteuid() == 0 and not _reachable(Path(parent)):
            parent = "/tmp"  # bubblewrap runs as SANDBOX_UID and must walk to the box (pytest's temp dirs are 0700)
        self.root = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
        for sub in ("work", "home", "tmp", "ipython", "mpl", "cache"):
            (self.root / sub).mkdir()
            if os.geteuid() == 0:
                os.chown(self.root / sub, SANDBOX_UID, SANDBOX_UID)
        if os.geteuid() == 0:
            self.root.chmod(0o711)  # the unprivileged uid walks through to its folders; lists nothing

    @property
    def work(self) -> Path:
        return self.root / "work"

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> Sandbox:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _reachable(folder: Path) -> bool:
    """Whether any user may walk through every folder down to `folder`."""
    folder = folder.resolve()
    return all(p.stat().st_mode & 0o001 for p in [folder, *folder.parents])


def env(box: Sandbox, cuda_visible_devices: str = "", extra: dict[str, str] | None = None) -> dict[str, str]:
    """The whole environment of a sandboxed process: home, temp and tool configs in `box`, a few settings of
    ours (NCCL_*, TORCH_*, locale, threads), the course package on PYTHONPATH, and `extra`."""
    root = box.root
    out = {k: v for k, v in os.environ.items() if k in _ENV_NAMES or k.startswith(_ENV_PREFIXES)}
    out.update({
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), "/usr/local/bin", "/usr/bin", "/bin"]),
        "HOME": str(root / "home"),
        "TMPDIR": str(root / "tmp"),
        "IPYTHONDIR": str(root / "ipython"),
        "MPLCONFIGDIR": str(root / "mpl"),
        "XDG_CACHE_HOME": str(root / "cache"),
        "XDG_CONFIG_HOME": str(root / "home" / ".config"),
        "JUPYTER_CONFIG_DIR": str(root / "home" / ".jupyter"),
        "JUPYTER_DATA_DIR": str(root / "home" / ".local" / "share" / "jupyter"),
        "JUPYTER_RUNTIME_DIR": str(root / "tmp"),
        "PYTHONPATH": os.pathsep.join(python_path()),
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONUNBUFFERED": "1",
        "MPLBACKEND": "Agg",
        "CUDA_VISIBLE_DEVICES": cuda_visible_devices,
    })
    out.update(extra or {})
    return out


def _course_package() -> Path:
    import course_utils

    return Path(course_utils.__file__).resolve().parent


def python_path() -> list[str]:
    """Where the sandbox finds the course package and the package folders named in our PYTHONPATH."""
    own = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and _is_package_folder(Path(p))]
    return [str(_course_package().parent)] + own


def _is_package_folder(path: Path) -> bool:
    """A folder that installed packages live in (it holds *.dist-info): mounted; a source tree is not."""
    try:
        return path.is_dir() and any(p.name.endswith(".dist-info") for p in path.iterdir())
    except OSError:
        return False


def read_only_paths(extra: list[str | os.PathLike] = ()) -> list[Path]:
    """What the sandbox sees, read-only: system libraries, the Python prefix and package folders, the course
    package, and `extra` (checks modules given by file). Nothing else of this machine's files."""
    paths = [Path(p) for p in _SYSTEM + _SYS + _ETC if os.path.exists(p) and not os.path.islink(p)]
    paths += [Path(sys.base_prefix), Path(sys.prefix), _course_package()]
    paths += [Path(p) for p in sys.path if p and _is_package_folder(Path(p))]
    paths += [Path(p).resolve() for p in extra]
    out: list[Path] = []
    for p in paths:
        if p.exists() and p not in out and not any(q in p.parents for q in out):
            out = [q for q in out if p not in q.parents] + [p]
    return sorted(out)


def gpu_device_nodes(gpus: list[str]) -> list[str]:
    """The /dev nodes a process needs for the GPUs `gpus` (CUDA numbers or UUIDs, as gpu_lock hands them out),
    found through NVML's minor numbers; empty where there are none (a CPU machine)."""
    if not gpus:
        return []
    try:
        import pynvml as nv

        nv.nvmlInit()
    except Exception:  # no NVML: no GPUs to give
        return []
    try:
        found = []
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            uuid = nv.nvmlDeviceGetUUID(h)
            bus = nv.nvmlDeviceGetPciInfo(h).busId
            found.append((bus.decode() if isinstance(bus, bytes) else bus,
                          uuid.decode() if isinstance(uuid, bytes) else uuid, nv.nvmlDeviceGetMinorNumber(h)))
    finally:
        nv.nvmlShutdown()
    found.sort()  # CUDA numbers GPUs of one model in PCI bus order (hardware/visible.py says when it may not)
    minors = []
    for g in gpus:
        hits = ([found[int(g)]] if g.isdigit() and int(g) < len(found)
                else [f for f in found if f[1].lower().startswith(g.lower())])
        minors += [m for _, _, m in hits[:1]]
    common = ["/dev/nvidiactl", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools"]
    return [p for p in common + [f"/dev/nvidia{m}" for m in sorted(set(minors))] if os.path.exists(p)]


def require() -> None:
    """Raise SandboxUnavailable (saying how to fix it) unless bubblewrap can be used here."""
    missing = [t for t in ("bwrap",) + (("setpriv", "unshare", "mount") if os.geteuid() == 0 else ())
               if shutil.which(t) is None]
    if missing:
        raise SandboxUnavailable(f"grading runs students' code in a sandbox, and {', '.join(missing)} is missing: "
                                 + INSTALL_HINT)


def command(box: Sandbox, argv: list[str], *, gpus: list[str] = (), read_only: list[str | os.PathLike] = (),
            environ: dict[str, str] | None = None, cwd: str | os.PathLike | None = None) -> list[str]:
    """The command line that runs `argv` in bubblewrap (see the module docstring); `environ` is its whole
    environment (default: env(box)), `read_only` more paths to mount (checks modules), `gpus` the GPUs it
    gets (their device nodes; inside, CUDA numbers them from 0)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable("bubblewrap (bwrap) is missing: " + INSTALL_HINT)
    environ = env(box) if environ is None else environ
    sources = read_only_paths(list(read_only))
    args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--clearenv",
            "--proc", "/proc", "--dev", "/dev", "--size", str(TMPFS_BYTES), "--tmpfs", "/dev/shm",
            "--size", str(TMPFS_BYTES), "--tmpfs", "/tmp"]
    for link in _SYSTEM:
        if os.path.islink(link):  # /lib -> usr/lib on merged-/usr systems
            args += ["--symlink", os.readlink(link), link]
    staged = os.geteuid() == 0
    for i, src in enumerate(sources):
        args += ["--ro-bind", str(box.root / "mnt" / str(i)) if staged else str(src), str(src)]
    for node in gpu_device_nodes(list(gpus)):
        args += ["--dev-bind", node, node]
    args += ["--bind", str(box.root), str(box.root), "--chdir", str(cwd or box.work)]
    for key, value in environ.items():
        args += ["--setenv", key, value]
    args += ["--", *argv]
    if not staged:
        return args
    return _staged(box, sources, args)


def _staged(box: Sandbox, sources: list[Path], bwrap_args: list[str]) -> list[str]:
    """As root: bind each source into box/mnt/<i> in a private mount namespace (where uid 0 can reach it), then
    drop to SANDBOX_UID with no capabilities and run bubblewrap from there."""
    mnt = box.root / "mnt"
    mnt.mkdir(mode=0o755, exist_ok=True)
    binds = []
    for i, src in enumerate(sources):
        target = mnt / str(i)
        if src.is_dir():
            target.mkdir(exist_ok=True)
        else:
            target.touch()
        # --rbind: with what is mounted below it (a container's GPU driver libraries are mounted file by file)
        binds.append(f"mount --rbind {_quote(src)} {_quote(target)}")
    drop = ["setpriv", f"--reuid={SANDBOX_UID}", f"--regid={SANDBOX_UID}", "--clear-groups", "--inh-caps=-all",
            "--bounding-set=-all", "--no-new-privs"]
    script = " && ".join(binds + ["exec " + " ".join(_quote(a) for a in drop + bwrap_args)])
    return ["unshare", "--mount", "--propagation", "private", "--", "/bin/sh", "-c", script]


def _quote(arg: str | os.PathLike) -> str:
    import shlex

    return shlex.quote(str(arg))


def _state(pid: int) -> str:
    """A process's state letter from /proc ("" when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def stop(pid: int, timeout: float = 10) -> None:
    """SIGKILL the sandbox whose first process (bwrap, or the unshare/setpriv before it) is `pid`, our child and
    not yet reaped, then wait until the sandbox's own first process has ended: the kernel ends every other process
    of its PID namespace before that one is gone, so on return nothing the student started is running."""
    inside = children(pid)  # bwrap's child: pid 1 of the sandbox's PID namespace
    try:
        os.killpg(pid, signal.SIGKILL)  # our child leads its own session (start_new_session)
    except (ProcessLookupError, PermissionError):
        pass
    deadline = time.monotonic() + timeout
    while any(_state(p) not in ("", "Z", "X") for p in inside) and time.monotonic() < deadline:
        time.sleep(0.01)
