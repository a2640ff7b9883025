"""Students' servers as Slurm jobs: `make hub HUB_SPAWNER=slurm` (docs/classroom.md#on-a-slurm-cluster).

The hub runs on a machine with Slurm's client commands (a login node) and starts each user's JupyterLab as a
Slurm job of its own with batchspawner's SlurmSpawner (its MultiSlurmSpawner, which also knows nodes whose names
do not resolve). Everything else is as on one box: the same accounts, the same workspace made before each start
(hub_spawn.py, on the hub's machine: homes must be shared with the nodes, as on any cluster), the same single-user
server, run as the student because the student submits the job (`runuser -u STUDENT -- sbatch`, from the hub,
which runs as root).

- GPUs: each job asks for `--gres=gpu:N` (HUB_SLURM_GPUS, default 1): Slurm gives the job N GPUs of its own and
  sets CUDA_VISIBLE_DEVICES; the box's policy (HUB_GPUS) does not apply. N=0 asks for none (a cluster, or the
  tests' cluster, without GPUs). Each job takes the course's GPU turns among its own kernels only (a lock
  folder per student): Slurm keeps other jobs off its GPUs.
- The job's server tells the hub its port (batchspawner-singleuser posts it to the hub's /api/batchspawner), and
  the proxy reaches it at the address of the node Slurm ran it on. The hub's own API must be reachable from the
  nodes: HUB_API_IP (default 127.0.0.1, enough when the nodes are this machine).
- Stopping a server, or the hub, cancels its job (scancel).
- batchspawner's API handler is replaced by one that takes the port alone (port_only_api: the stock one lets a
  student's token run commands as root).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from hub_settings import Settings

SPAWNERS = ("local", "slurm")
SLURM_COMMANDS = ("sbatch", "squeue", "scancel", "scontrol")
# What batchspawner's wrapper runs once it has told the hub the port: an executable Python file (it looks the
# command up on PATH and runs it with runpy, in the interpreter that runs the wrapper).
SINGLEUSER = Path(__file__).resolve().parent / "jupyterhub-singleuser"


def check(settings: Settings) -> list[str]:
    """Why the hub cannot start students' servers with this spawner (empty: it can)."""
    if settings.spawner not in SPAWNERS:
        return [f"HUB_SPAWNER={settings.spawner!r}: choose local or slurm (docs/classroom.md)"]
    if settings.spawner == "local":
        return []
    problems = [f"HUB_SPAWNER=slurm needs Slurm's {name} on PATH (a login node of the cluster)"
                for name in SLURM_COMMANDS if not shutil.which(name)]
    if settings.slurm_gpus < 0:
        problems.append(f"HUB_SLURM_GPUS={settings.slurm_gpus}: give a number of GPUs, 0 or more")
    return problems


def gres(gpus: int) -> str:
    """The job's --gres: N GPUs, or no --gres line at all for 0 (a CPU partition, a cluster without GPUs)."""
    return f"gpu:{gpus}" if gpus > 0 else ""


def lock_dir(spawner) -> str:
    """COURSE_GPU_LOCK_DIR for a user's job: their own (JupyterHub calls it for each server it starts)."""
    return f"/tmp/course_utils-gpu-locks-{spawner.user.name}"


def node_addresses(text: str) -> dict[str, str]:
    """{node: address} from `scontrol show nodes --oneliner`, for nodes whose NodeAddr is not their name (several
    slurmd on one host, or names the hub's machine cannot resolve)."""
    found = {}
    for line in text.splitlines():
        fields = dict(f.split("=", 1) for f in line.split() if "=" in f)
        name, addr = fields.get("NodeName"), fields.get("NodeAddr")
        if name and addr and addr != name:
            found[name] = addr
    return found


def port_only_api() -> type:
    """The hub's /api/batchspawner, narrowed to what batchspawner's wrapper sends: the server's port.

    batchspawner's own handler sets every attribute of the spawner that the request names, and the spawner puts
    some of them (job_id, exec_prefix, its commands) into shell commands that the hub runs as root: a student who
    reads the token in their server's environment (a lab terminal shows it) could run any command as root. This
    one takes {"port": N} from the server's own token and refuses anything else (400)."""
    import json

    from batchspawner.api import BatchSpawnerAPIHandler
    from tornado import web

    class PortOnlyAPIHandler(BatchSpawnerAPIHandler):
        @web.authenticated
        def post(self):
            token = self.get_auth_token()
            spawner = next((s for s in self.current_user.spawners.values() if s.api_token == token), None)
            data = self.get_json_body()
            port = data["port"] if isinstance(data, dict) and set(data) == {"port"} else None
            if spawner is None or type(port) is not int or not 0 < port < 65536:
                raise web.HTTPError(400, "a server's own token may set its port alone: {\"port\": N}")
            spawner.port = port
            self.set_status(201)
            self.finish(json.dumps({"message": "BatchSpawner data configured"}))

    return PortOnlyAPIHandler


def configure(c, settings: Settings) -> None:
    """Set the hub's config `c` to start each server as a Slurm job."""
    import batchspawner  # noqa: F401  (registers /api/batchspawner, where a job reports its server's port)
    from jupyterhub.apihandlers import default_handlers

    handler = port_only_api()
    default_handlers[:] = [(route, handler) if route == "/api/batchspawner" else (route, *rest)
                           for route, *rest in default_handlers]

    c.JupyterHub.spawner_class = "batchspawner.MultiSlurmSpawner"
    shown = subprocess.run(["scontrol", "show", "nodes", "--oneliner"], capture_output=True, text=True, timeout=60)
    if shown.returncode:
        raise RuntimeError(f"HUB_SPAWNER=slurm: `scontrol show nodes` failed: {shown.stderr.strip()}")
    c.MultiSlurmSpawner.daemon_resolver = node_addresses(shown.stdout)
    # The student submits, queries and cancels their own job: it runs as them, and squeue shows it as theirs.
    c.BatchSpawnerBase.exec_prefix = "runuser -u {username} --"
    c.SlurmSpawner.req_gres = gres(settings.slurm_gpus)
    c.SlurmSpawner.req_partition = settings.slurm_partition
    # The GPU turns (course_utils.gpu_lock) in a folder of the student's own: Slurm already gives each job GPUs no
    # other job uses, and numbers them from 0 in every job (with ConstrainDevices), so two students' jobs on one node
    # would otherwise wait for each other on "GPU 0" while holding different GPUs. Within the job the turns still
    # order the student's own cells.
    c.Spawner.environment = {**c.Spawner.environment, "COURSE_GPU_LOCK_DIR": lock_dir}
    c.BatchSpawnerBase.batchspawner_singleuser_cmd = f"{sys.executable} -m batchspawner.singleuser"
    c.Spawner.cmd = [str(SINGLEUSER)]
    # JupyterHub's default, and SLURM_CONF: a cluster whose slurm.conf is not in the default place (the tests'
    # cluster) reaches the job's own srun.
    c.Spawner.env_keep = ["JUPYTERHUB_SINGLEUSER_APP", "SLURM_CONF"]
    c.Spawner.start_timeout = 300  # a job may wait in the queue
