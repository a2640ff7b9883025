"""What only CUDA itself can say (its GPU order, peer access), asked in a short-lived child process.

A CUDA context in the notebook's process would hold GPU memory for the whole session and get in the
way of the worker processes, so the notebook never asks CUDA directly. The child inherits
CUDA_VISIBLE_DEVICES and CUDA_DEVICE_ORDER, so it sees exactly what this process would.
"""

from __future__ import annotations

import json
import subprocess
import sys

_SCRIPT = """
import json, sys, torch
n = torch.cuda.device_count()
gpus = []
for i in range(n):
    p = torch.cuda.get_device_properties(i)
    uuid = getattr(p, "uuid", None)
    gpus.append({"name": p.name, "memory_gib": p.total_memory / 2**30, "cc": f"{p.major}.{p.minor}",
                 "uuid": str(uuid) if uuid is not None else None})
peer = {}
if sys.argv[1] == "1":
    peer = {f"{i}->{j}": torch.cuda.can_device_access_peer(i, j) for i in range(n) for j in range(n) if i != j}
print(json.dumps({"gpus": gpus, "peer": peer}))
"""


def cuda_facts(peer: bool, timeout: float = 120) -> dict | None:
    """{"gpus": [{name, memory_gib, cc, uuid}] in CUDA's order, "peer": {"i->j": bool}} from a child
    process, or None when it fails. torch prints UUIDs without NVML's "GPU-" prefix."""
    try:
        res = subprocess.run([sys.executable, "-c", _SCRIPT, "1" if peer else "0"],
                             capture_output=True, text=True, timeout=timeout)
        return json.loads(res.stdout.strip().splitlines()[-1]) if res.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None
