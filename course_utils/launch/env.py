"""The environment a rank starts with: torchrun's contract, plus what the launcher needs."""

from __future__ import annotations

import os
import socket
import sys
import threading
import uuid

_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pythonpath() -> str:
    """PYTHONPATH for children: enough to import course_utils from a checkout, without ever putting
    site-packages ahead of the standard library (where PYTHONPATH entries go)."""
    import site

    installed = set(site.getsitepackages()) | {site.getusersitepackages()}
    parts = [] if _PACKAGE_PARENT in installed else [_PACKAGE_PARENT]
    return os.pathsep.join(parts + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else []))


def loopback_interface() -> str | None:
    try:
        return next((name for _, name in socket.if_nameindex() if name in ("lo", "lo0")), None)
    except OSError:
        return None


def device_environment(backend: str, gpus: bool) -> dict[str, str]:
    """What hides the GPUs from ranks that should not touch them, and keeps gloo on loopback."""
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # torchrun's default: no oversubscription
    if not gpus:
        env["CUDA_VISIBLE_DEVICES"] = ""  # torch.cuda.is_available() is False in the rank: no context anywhere
    loopback = loopback_interface()
    if backend == "gloo" and loopback:
        env["GLOO_SOCKET_IFNAME"] = os.environ.get("GLOO_SOCKET_IFNAME", loopback)  # not an interface to nowhere
    return env


def use_fork_server(gpus: bool) -> bool:
    """Whether a group's ranks are forked by one fork server (forkserver.py) rather than started one by one.

    Only ranks that see no GPU are: forking is what saves their start-up (a 4-rank gloo launch in about half
    the time of fresh interpreters), and it has been proven on CPU ranks only; GPU ranks pay for their CUDA
    start-up anyway."""
    return not gpus


def group_environment(nproc: int, port: int, backend: str, gpus: bool) -> dict[str, str]:
    """Every rank's environment but its rank numbers (see rank_environment)."""
    n = str(nproc)
    env = dict(os.environ)
    env.update({
        # torchrun's contract, as torch.distributed.elastic's LocalElasticAgent sets it
        "WORLD_SIZE": n, "LOCAL_WORLD_SIZE": n, "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
        "ROLE_NAME": "default", "ROLE_WORLD_SIZE": n, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
        "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": f"course-{uuid.uuid4().hex[:12]}",
        "TORCHELASTIC_USE_AGENT_STORE": "True",  # workers join the store we host, as under torchrun's agent
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": os.environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
        # ours
        "PYTHONUNBUFFERED": "1",  # live output
        "PYTHONPATH": pythonpath(),
        "COURSE_LAUNCH_PARENT": str(os.getpid()),
        # PR_SET_PDEATHSIG follows the launching *thread*; only the main thread lives as long as the process.
        "COURSE_LAUNCH_PDEATHSIG": "1" if threading.current_thread() is threading.main_thread() else "0",
        "COURSE_LAUNCH_BACKEND": backend,
        "COURSE_LAUNCH_SYSPATH": os.pathsep.join(p for p in sys.path if p and os.path.isdir(p)),
    })
    env.update(device_environment(backend, gpus))
    return env


def rank_environment(env: dict[str, str], rank: int, fds: dict[str, int]) -> dict[str, str]:
    """One rank's environment: its rank numbers and the pipes it talks to the parent through."""
    return dict(env, RANK=str(rank), LOCAL_RANK=str(rank), ROLE_RANK=str(rank),
                **{f"COURSE_LAUNCH_{name.upper()}_FD": str(fd) for name, fd in fds.items()})
