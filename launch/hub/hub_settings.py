"""The hub's settings, read from the COURSE_HUB_* variables that `make hub` sets (Makefile: ROSTER, ADMINS, ...).

One place for both readers: hub_layout.py (run as root before the hub starts) and jupyterhub_config.py.
Relative paths are taken from the repository's root, where `make hub` runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Settings:
    """What `make hub` was asked for; see the Makefile's hub section for each variable."""

    repo: Path
    roster: Path  # students, one username a line
    admins: str  # instructors, separated by spaces or commas
    ip: str
    port: int  # the hub's public port; the hub's own API listens on port+1, the proxy's API on port+2
    hub_dir: Path  # state (0700), the released lessons (0755) and the proxy
    proxy: Path  # configurable-http-proxy
    auth: str  # pam or firstuse
    group: str  # the instructors' group: the only one besides root that reads notebooks/ and tests/
    workspace: str  # the student's workspace, relative to their home
    ssl_cert: str
    ssl_key: str
    gpus: str = "shared"  # the GPU policy (hub_gpus.py)
    gpu_ids: tuple[str, ...] = ()  # the box's GPUs, as CUDA_VISIBLE_DEVICES names them
    spawner: str = "local"  # local (a process on this box) or slurm (a Slurm job per server: hub_slurm.py)
    slurm_gpus: int = 1  # HUB_SPAWNER=slurm: GPUs per student's job (--gres=gpu:N; 0: no GPU asked for)
    slurm_partition: str = ""  # HUB_SPAWNER=slurm: the partition of the students' jobs (empty: Slurm's default)
    api_ip: str = "127.0.0.1"  # where the hub's own API listens (port+1): a cluster's nodes must reach it
    cull_idle: int = 3600  # seconds a server may sit idle before the hub stops it (0: never); the work stays saved

    @property
    def state(self) -> Path:
        return self.hub_dir / "state"

    @property
    def jupyter(self) -> Path:
        """HUB_DIR/jupyter (0755): on every server's JUPYTER_PATH, for its kernel spec (hub_gpus.py)."""
        return self.hub_dir / "jupyter"

    @property
    def release(self) -> Path:
        return self.hub_dir / "release" / "notebooks"

    @property
    def grading(self) -> Path:
        """The masters with their solutions taken out (release.unsolved_master): students' `make check` reads them."""
        return self.hub_dir / "release" / "grading"


def _path(value: str, repo: Path) -> Path:
    return (repo / value).resolve() if not os.path.isabs(value) else Path(value)


def from_env(env: dict[str, str] | None = None) -> Settings:
    """The settings in `env` (default os.environ), with make's defaults for what is not set."""
    env = os.environ if env is None else env
    repo = Path(env.get("COURSE_HUB_REPO", REPO)).resolve()
    hub_dir = _path(env.get("COURSE_HUB_DIR", ".hub"), repo)
    proxy = env.get("COURSE_HUB_PROXY") or str(hub_dir / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy")
    return Settings(
        repo=repo,
        roster=_path(env.get("COURSE_HUB_ROSTER", "roster.txt"), repo),
        admins=env.get("COURSE_HUB_ADMINS", ""),
        ip=env.get("COURSE_HUB_IP", "127.0.0.1"),
        port=int(env.get("COURSE_HUB_PORT", "8000")),
        hub_dir=hub_dir,
        proxy=_path(proxy, repo),
        auth=env.get("COURSE_HUB_AUTH", "pam"),
        group=env.get("COURSE_HUB_GROUP", "course-instructors"),
        workspace=env.get("COURSE_HUB_WORKSPACE", "workspace"),
        ssl_cert=env.get("COURSE_HUB_SSL_CERT", ""),
        ssl_key=env.get("COURSE_HUB_SSL_KEY", ""),
        gpus=env.get("COURSE_HUB_GPUS", "shared"),
        gpu_ids=_gpu_ids(env),
        spawner=env.get("COURSE_HUB_SPAWNER", "local"),
        slurm_gpus=int(env.get("COURSE_HUB_SLURM_GPUS", "1")),
        slurm_partition=env.get("COURSE_HUB_SLURM_PARTITION", ""),
        api_ip=env.get("COURSE_HUB_API_IP", "127.0.0.1"),
        cull_idle=int(env.get("COURSE_HUB_CULL_IDLE", "3600")),
    )


def _gpu_ids(env) -> tuple[str, ...]:
    """COURSE_HUB_GPU_IDS ("0,1": the tests' simulated GPUs), else the GPUs this machine has."""
    if "COURSE_HUB_GPU_IDS" in env:
        return tuple(t.strip() for t in env["COURSE_HUB_GPU_IDS"].split(",") if t.strip())
    from course_utils.gpu_lock import visible_gpus

    return visible_gpus()
