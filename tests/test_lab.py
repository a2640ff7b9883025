"""`make lab` starts JupyterLab on 127.0.0.1 with a token, and refuses requests without it."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _status(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


@pytest.mark.timeout(120)
def test_make_lab_requires_token():
    pytest.importorskip("jupyterlab", reason="JupyterLab is not installed in this interpreter")
    port = _free_port()
    proc = subprocess.Popen(
        ["make", "-s", "lab", f"LAB_PORT={port}", f"PY={sys.executable}"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )
    try:
        url, seen = None, []
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            line = proc.stdout.readline()
            if not line and proc.poll() is not None:
                break
            seen.append(line)
            # Jupyter's own line says the server is up; ours (printed first) carries the token.
            m = re.search(r"(http://127\.0\.0\.1:\d+)/lab\?token=([0-9a-f]+)", line)
            if m and url is None:
                url = m.groups()
            if "Use Control-C to stop" in line:
                break
        assert url, "no URL with a token printed:\n" + "".join(seen)
        base, token = url
        # Jupyter may have moved to another port if ours was taken: find the one it reported.
        ports = re.findall(r"http://127\.0\.0\.1:(\d+)/", "".join(seen))
        base = f"http://127.0.0.1:{ports[-1]}"
        while time.monotonic() < deadline:  # the banner can come a moment before the socket listens
            try:
                socket.create_connection(("127.0.0.1", int(ports[-1])), timeout=2).close()
                break
            except OSError:
                time.sleep(0.2)
        assert _status(f"{base}/api/contents") == 403
        assert _status(f"{base}/api/contents?token=wrong{token}") == 403
        assert _status(f"{base}/api/contents?token={token}") == 200
        # Bound to loopback only: the machine's other addresses refuse the connection.
        other = socket.gethostbyname(socket.gethostname())
        if not other.startswith("127."):
            with pytest.raises(OSError):
                socket.create_connection((other, int(ports[-1])), timeout=2).close()
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
