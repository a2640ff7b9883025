"""Which GPUs each user's server sees (make hub's HUB_GPUS), and kernels that take turns on them.

Timings are the course's evidence, and two processes' kernels on one GPU change each other's timings. So every
kernel the hub starts loads `course_utils.gpu_lock` (a kernel spec in HUB_DIR/jupyter, found through
JUPYTER_PATH): each cell holds its kernel's GPUs while it runs, and a cell that has to wait prints who holds them
and for how long. Locks are taken in sorted order, so a lesson that needs two GPUs claims both at once and two
students never wait for each other in a circle. The grader takes the same locks.

Policies (students are numbered by their line in the roster; instructors always see every GPU):
- shared (default): every server sees every GPU; students' cells take turns on the box. Lessons 05-11 get all GPUs.
- each: student k sees GPU k alone; refused when there are more students than GPUs. Lessons 05-11 then run their
  multi-GPU parts from the recordings, as on a one-GPU machine.
- round-robin: student k sees GPU k mod n; the students who share a GPU take turns on it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

POLICIES = ("shared", "each", "round-robin")


def check_policy(policy: str, students: list[str], gpu_ids: tuple[str, ...]) -> list[str]:
    """Why `policy` cannot serve this class on these GPUs (empty: it can)."""
    if policy not in POLICIES:
        return [f"HUB_GPUS={policy!r}: choose one of {', '.join(POLICIES)} (docs/classroom.md#the-gpus)"]
    if policy == "each" and len(students) > len(gpu_ids):
        return [f"HUB_GPUS=each gives every student a GPU of their own, but {len(students)} students share "
                f"{len(gpu_ids)} GPUs: use HUB_GPUS=round-robin (students on one GPU take turns) or shared"]
    return []


def visible_for(policy: str, user: str, students: list[str], gpu_ids: tuple[str, ...]) -> str | None:
    """CUDA_VISIBLE_DEVICES for `user`'s server, or None: every GPU (shared, an instructor, no GPU at all)."""
    if policy == "shared" or user not in students or not gpu_ids:
        return None
    k = students.index(user)
    return gpu_ids[k] if policy == "each" else gpu_ids[k % len(gpu_ids)]


def write_kernel_spec(jupyter_dir: Path, python: str = sys.executable) -> Path:
    """JUPYTER_DIR/kernels/python3/kernel.json: the default Python kernel, with the GPU turns loaded. It keeps
    the name python3, which the lessons' metadata asks for, so every lesson opens with it."""
    folder = jupyter_dir / "kernels" / "python3"
    folder.mkdir(parents=True, exist_ok=True)
    spec = {"argv": [python, "-m", "ipykernel_launcher", "-f", "{connection_file}", "--ext=course_utils.gpu_lock"],
            "display_name": "Python 3 (ipykernel)", "language": "python",
            "metadata": {"debugger": True}}
    path = folder / "kernel.json"
    path.write_text(json.dumps(spec, indent=1) + "\n")
    for p in (jupyter_dir, jupyter_dir / "kernels", folder):
        p.chmod(0o755)
    path.chmod(0o644)
    return path
