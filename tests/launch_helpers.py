"""Shared by the tests of course_utils.launch: notebook-style functions, and proof that nothing is left.

Functions under test are defined the way a notebook cell defines them (in a module named __main__), so
cloudpickle must ship them by value, as it does from Jupyter.
"""

from __future__ import annotations

import linecache
import os
import socket
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def cell_function(source: str, name: str):
    """Define `name` as a notebook cell would: in __main__, which the workers cannot import, with its source
    in linecache under a file name that does not exist (IPython's /tmp/ipykernel_*/*.py are like that)."""
    source = textwrap.dedent(source)
    filename = f"<cell {name}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace = {"__name__": "__main__"}
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


@pytest.fixture(autouse=True, scope="module")
def tcpstore_warmed():
    """The first TCPStore of a process opens a pipe that lives as long as the process (libuv's); open it
    now so the file-descriptor counts below see only what each launch leaves behind."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    del store


def cuda_initialised() -> bool:
    """Whether this process has a CUDA context (imports torch only if something already did)."""
    torch = sys.modules.get("torch")
    return bool(torch is not None and torch.cuda.is_initialized())


def assert_cuda_untouched(before: dict) -> None:
    """The launcher did not initialise CUDA here. (A test file run earlier in the same worker may have: then
    this proves nothing, and tests/test_launch_gpu.py's fresh interpreters prove it on a GPU box.)"""
    assert cuda_initialised() == before["cuda"], "the launcher initialised CUDA in the notebook's process"


def children(me: psutil.Process) -> list:
    """me's processes still running (zombies, a moment from being reaped, left out)."""
    found = []
    for c in me.children(recursive=True):
        try:
            if c.status() != psutil.STATUS_ZOMBIE:
                found.append(c)
        except psutil.NoSuchProcess:
            pass
    return found


def snapshot() -> dict:
    me = psutil.Process()
    return {"children": children(me), "fds": len(os.listdir("/proc/self/fd")),
            "cuda": cuda_initialised(),
            "listening": [c for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN]}


def assert_clean(before: dict) -> None:
    """Nothing the launcher started survives: processes, listening ports, file descriptors."""
    me = psutil.Process()
    deadline = time.monotonic() + 5
    while children(me) and time.monotonic() < deadline:  # reaped already; belt and braces
        time.sleep(0.05)
    assert children(me) == before["children"] == []
    assert [c for c in me.net_connections("inet") if c.status == psutil.CONN_LISTEN] == before["listening"]
    assert len(os.listdir("/proc/self/fd")) == before["fds"]


def alive(pids: list[int]) -> list[int]:
    out = []
    for p in pids:
        try:
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.NoSuchProcess:
            pass
    return out


def assert_gone(pids: list[int], within: float = 10.0) -> None:
    deadline = time.monotonic() + within
    left = alive(pids)
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = alive(pids)
    assert left == [], f"still alive: {left}"


ALL_REDUCE = cell_function("""
    import os
    import torch
    import torch.distributed as dist

    def all_reduce_rank(scale=1.0):
        t = torch.full((3,), float(dist.get_rank() + 1)) * scale
        dist.all_reduce(t)
        print(f"sum is {t[0].item():g}")
        keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME",
                "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS",
                "TORCHELASTIC_USE_AGENT_STORE", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES"]
        env = {k: os.environ.get(k) for k in keys}
        return {"tensor": t, "env": env, "backend": dist.get_backend(), "pid": os.getpid(), "pgid": os.getpgrp()}
""", "all_reduce_rank")

FAILS_ON_RANK_1 = cell_function("""
    import torch
    import torch.distributed as dist

    def fails_on_rank_1():
        if dist.get_rank() == 1:
            raise ValueError("rank 1 has bad data")
        print("entering all_reduce")
        dist.all_reduce(torch.ones(1))  # the others wait here for rank 1, which never comes
""", "fails_on_rank_1")


def processes_with(marker: str) -> list[str]:
    """Command lines of live processes that contain `marker` (anyone's, seen from outside any sandbox)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if marker in cmd and state != "Z":
                found.append(f"{entry.name}: {cmd}")
    return found


def listening(port: int) -> bool:
    """Whether something on this machine accepts connections on `port` (a server left behind)."""
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
        return True
    except OSError:
        return False


def listeners(ports: list[int]) -> dict[int, int | None]:
    """{port: pid} for each of `ports` that a process on this machine listens on (None: psutil cannot say which)."""
    wanted = set(ports)
    return {c.laddr.port: c.pid for c in psutil.net_connections("tcp")
            if c.status == psutil.CONN_LISTEN and c.laddr.port in wanted}


def left_listening(before: dict[int, int | None]) -> list[int]:
    """The ports of `before` (listeners() taken before a stop) that the same process still listens on: a server left
    behind. A port another process listens on now was free again and taken, under parallel tests by another test's
    kernel or server: not counted. A listener psutil cannot name is."""
    return sorted(port for port, pid in listeners(list(before)).items() if pid is None or pid == before[port])
