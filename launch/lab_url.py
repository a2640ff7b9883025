"""Print the URL of the Jupyter server with process id PID once it answers: `python launch/lab_url.py PID`.

The port and token come from the server itself (the runtime file `jpserver-PID.json` it writes once it
listens), so the URL is the one that works even when Jupyter had to move to another port. Exits 1 if the
server ends or does not answer within the time limit (--timeout, default 120 s).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path


def runtime_dir() -> Path:
    from jupyter_core.paths import jupyter_runtime_dir

    return Path(jupyter_runtime_dir())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def server_info(pid: int, folder: Path) -> dict | None:
    try:
        info = json.loads((folder / f"jpserver-{pid}.json").read_text())
    except (OSError, ValueError):  # not written yet, or being written
        return None
    return info if info.get("port") else None


def answers(info: dict) -> bool:
    url = f"http://{info['hostname']}:{info['port']}{info['base_url']}api/status?token={info['token']}"
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def lab_url(info: dict) -> str:
    return f"http://{info['hostname']}:{info['port']}{info['base_url']}lab?token={info['token']}"


def wait_for(pid: int, timeout: float) -> str | None:
    folder, deadline = runtime_dir(), time.monotonic() + timeout
    while time.monotonic() < deadline and alive(pid):
        info = server_info(pid, folder)
        if info and answers(info):
            return lab_url(info)
        time.sleep(0.2)
    return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("pid", type=int)
    parser.add_argument("--timeout", type=float, default=120.0)
    args = parser.parse_args()
    url = wait_for(args.pid, args.timeout)
    if url is None:
        print(f"lab: the Jupyter server (pid {args.pid}) did not come up; its messages are above", file=sys.stderr)
        return 1
    print(f"Course lab: {url}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # Ctrl-C reaches the whole foreground group; Jupyter answers it
        sys.exit(130)
