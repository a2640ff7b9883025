"""`make hub HUB_SPAWNER=slurm`: each student's JupyterLab runs as a Slurm job of theirs, with a GPU of its own
(--gres=gpu:1), and the hub proxies to it.

Real parts throughout: the test cluster of tests/test_slurm.py (slurmctld and two slurmd "nodes" on 127.0.0.1),
started here in a folder every account may read (students' sbatch reads its slurm.conf), with one GPU per node
for Slurm to hand out (gres/gpu whose device file is /dev/null: scheduling and CUDA_VISIBLE_DEVICES are Slurm's,
nothing opens the device); the accounts and the `make hub` of tests/test_hub.py, with batchspawner's SlurmSpawner.
Two students each ask for one GPU, so Slurm puts their jobs on different nodes. Needs root, like both.
"""

from __future__ import annotations

import os
import pwd
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.launch_helpers import assert_gone, left_listening, listeners
from tests.test_hub import (
    Hub,
    _why_not,
    copy_repo,
    login,
    make_accounts,
    open_lab,
    processes_of,
    remove_accounts,
    students_python,
)
from tests.test_slurm import Cluster, ensure_slurm

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch" / "hub"))

from hub_slurm import gres, node_addresses  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600), pytest.mark.ranks]


def test_the_jobs_gres_and_the_nodes_addresses():
    from batchspawner import SlurmSpawner, format_template

    assert gres(1) == "gpu:1" and gres(4) == "gpu:4" and gres(0) == ""
    template = SlurmSpawner.batch_script.default_value
    assert "#SBATCH --gres=gpu:2\n" in format_template(template, gres=gres(2), cmd="lab")
    assert "--gres" not in format_template(template, gres=gres(0), cmd="lab")  # HUB_SLURM_GPUS=0: no gres asked
    shown = ("NodeName=n1 Arch=x86_64 CoresPerSocket=1 NodeAddr=127.0.0.1 NodeHostName=box Port=1\n"
             "NodeName=gpu7 Arch=x86_64 NodeAddr=gpu7 NodeHostName=gpu7\n")
    assert node_addresses(shown) == {"n1": "127.0.0.1"}


@pytest.fixture(scope="module")
def slurm_hub():
    why = _why_not()
    if why:
        pytest.skip(why)
    ensure_slurm()
    res = subprocess.run(["bash", str(ROOT / "launch" / "hub" / "setup_proxy.sh")], capture_output=True, text=True)
    if res.returncode:
        (pytest.fail if os.environ.get("CI") else pytest.skip)(f"no JupyterHub proxy: {res.stdout}{res.stderr}")
    tmp = Path(tempfile.mkdtemp(prefix="course-hub-slurm-"))  # readable by students: the repo and slurm.conf
    os.chmod(tmp, 0o755)
    (tmp / "slurm").mkdir(mode=0o755)
    cluster = Cluster(tmp / "slurm", fake_gpus=True)
    tag = secrets.token_hex(2)
    names = {"s1": f"chs{tag}a", "s2": f"chs{tag}b", "teacher": f"chs{tag}t", "outsider": f"chs{tag}x"}
    hub = None
    try:
        cluster.start()
        py = students_python(tmp)
        repo = copy_repo(tmp / "repo")
        passwords = make_accounts(tmp, repo, py, names)
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_CONF", str(cluster.conf))  # the hub's commands and the jobs find the test cluster
            hub = Hub(repo, py, tmp / "students.txt", names["teacher"], tmp / "hub.log", "HUB_SPAWNER=slurm",
                      "HUB_SLURM_GPUS=1")
        hub.names, hub.passwords, hub.cluster = names, passwords, cluster
        yield hub
    finally:
        if hub is not None:
            hub.stop()
            (ROOT / "tests" / "artifacts").mkdir(parents=True, exist_ok=True)
            shutil.copy(hub.log, ROOT / "tests" / "artifacts" / "hub-slurm.log")
        cluster.stop()
        left = cluster.ours()
        remove_accounts(list(names.values()))
        shutil.rmtree(tmp, ignore_errors=True)
        assert not left, f"processes of the test cluster still running: {left}"


def jobs(cluster: Cluster) -> list[dict]:
    out = cluster.run("squeue", "-h", "-o", "%i|%u|%T|%j|%N").stdout
    return [dict(zip(("id", "user", "state", "name", "nodes"), ln.split("|"), strict=True))
            for ln in out.splitlines() if ln.strip()]


def server_of(uid: int):
    """The Python that serves a user's lab (batchspawner's wrapper running the single-user server), not srun."""
    import psutil

    found = [p for p in psutil.process_iter(["uids", "cmdline"])
             if p.info["uids"] and p.info["uids"].real == uid and (p.info["cmdline"] or [])[1:3] == [
                 "-m", "batchspawner.singleuser"]]
    assert len(found) == 1, [p.info["cmdline"] for p in found]
    return found[0]


def listening_ports(process) -> list[int]:
    import psutil

    return [c.laddr.port for c in process.net_connections("tcp") if c.status == psutil.CONN_LISTEN]


def test_each_students_server_is_a_slurm_job_of_theirs_with_a_gpu_and_answers_through_the_hub(slurm_hub):

    hub, names = slurm_hub, [slurm_hub.names["s1"], slurm_hub.names["s2"]]
    started = time.monotonic()
    sessions = {name: login(hub, name, hub.passwords[role]) for name, role in zip(names, ("s1", "s2"), strict=True)}
    for name, session in sessions.items():
        assert session is not None, f"{name} could not log in:\n{hub.log.read_text()[-3000:]}"
        open_lab(hub, session, name)
    took = time.monotonic() - started

    queue = {job["user"]: job for job in jobs(hub.cluster)}
    assert set(queue) == set(names), queue
    assert {job["nodes"] for job in queue.values()} == {"n1", "n2"}, f"one GPU per node, one job each: {queue}"
    hub.sessions = sessions
    for name, session in sessions.items():
        job = queue[name]
        r = session.get(f"{hub.base}/user/{name}/api/status", timeout=60)
        assert r.status_code == 200, f"{name}'s lab (/api/status) through the hub said {r.status_code}"
        assert job["state"] == "RUNNING" and job["name"] == "spawner-jupyterhub", job
        shown = hub.cluster.run("scontrol", "show", "job", job["id"], "--oneliner").stdout
        uid = pwd.getpwnam(name).pw_uid
        assert f"UserId={name}({uid})" in shown and "TresPerNode=gres:gpu:1" in shown, shown
        # the server itself: in the job, as the student, on their workspace, seeing the GPU Slurm gave the job
        server = server_of(uid)
        env = server.environ()
        assert env.get("SLURM_JOB_ID") == job["id"] and env.get("JUPYTERHUB_USER") == name
        assert env.get("CUDA_VISIBLE_DEVICES") == "0" and env.get("SLURM_JOB_GPUS") == "0", "Slurm's GPU"
        # the GPU turns among the student's own kernels: every job's GPU is "0", but no other job uses it
        assert env.get("COURSE_GPU_LOCK_DIR") == f"/tmp/course_utils-gpu-locks-{name}"
        assert env.get("JUPYTERHUB_ROOT_DIR") == str(Path(pwd.getpwnam(name).pw_dir) / "workspace" / "notebooks")
        listing = session.get(f"{hub.base}/user/{name}/api/contents/", timeout=60).json()
        assert "07_ring_allreduce.ipynb" in {c["name"] for c in listing["content"]}, "the workspace was not made"
        ports = listening_ports(server)
        assert ports, f"{name}'s server listens on no port"
        print(f"\n{name}: Slurm job {job['id']} on {job['nodes']} ({job['state']}, gres gpu:1, "
              f"CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']}), its lab at port {ports[0]}: /api/status "
              f"{r.status_code} through the hub", end="")
    print(f"\nboth labs started and answered through the hub in {took:.0f} s")


def test_a_students_server_token_sets_only_its_port(slurm_hub):
    """batchspawner's /hub/api/batchspawner, as batchspawner ships it, sets any attribute of the spawner that the
    request names, and the spawner puts some (job_id, exec_prefix, its commands) into shell commands that the hub
    runs as root: a student who reads the token in their server's environment could run code as root. The course's
    handler takes the port alone (launch/hub/hub_slurm.py)."""
    import requests

    hub, name = slurm_hub, slurm_hub.names["s1"]
    token = server_of(pwd.getpwnam(name).pw_uid).environ()["JUPYTERHUB_API_TOKEN"]  # a lab terminal shows it too
    hub.marker = Path(tempfile.gettempdir()) / f"course-hub-slurm-root-{secrets.token_hex(4)}"
    url = f"http://127.0.0.1:{hub.port + 1}/hub/api/batchspawner"
    for body in ({"job_id": f"1; touch {hub.marker}"}, {"exec_prefix": f"touch {hub.marker};"},
                 {"port": 1234, "batch_cancel_cmd": f"touch {hub.marker}"}, {"port": "1; true"}):
        r = requests.post(url, json=body, headers={"Authorization": f"token {token}"}, timeout=30)
        assert r.status_code == 400, f"the hub took {body}: {r.status_code} {r.text}"
    r = requests.post(url, json={"port": 1234}, timeout=30)
    assert r.status_code == 403, "the hub took a port without a token"
    assert not hub.marker.exists()


def test_a_student_cannot_ask_for_more_gpus_through_the_hubs_api(slurm_hub):
    """batchspawner fills its job script with the options of a server's start (POST /hub/api/users/NAME/server
    {...}), which a student may send: {"gres": "gpu:2"} would take more GPUs than the instructor gives. The hub
    drops them (hub_spawn.py), so the restarted job asks for HUB_SLURM_GPUS=1."""
    hub, name = slurm_hub, slurm_hub.names["s1"]
    session = hub.sessions[name]
    xsrf = {"X-XSRFToken": next(c.value for c in session.cookies if c.name == "_xsrf")}
    api = f"{hub.base}/hub/api/users/{name}"
    r = session.delete(f"{api}/server", headers=xsrf, timeout=60)
    assert r.status_code in (202, 204), (r.status_code, r.text)
    deadline = time.monotonic() + 60
    while any(job["user"] == name for job in jobs(hub.cluster)) or session.get(api, headers=xsrf, timeout=30).json()[
            "servers"]:
        assert time.monotonic() < deadline, "the student's server did not stop"
        time.sleep(0.5)
    r = session.post(f"{api}/server", json={"gres": "gpu:2", "options": "--comment=mine"}, headers=xsrf, timeout=60)
    assert r.status_code in (201, 202), (r.status_code, r.text)
    while not (mine := [job for job in jobs(hub.cluster) if job["user"] == name]):
        assert time.monotonic() < deadline + 60, "no job for the restarted server"
        time.sleep(0.5)
    shown = hub.cluster.run("scontrol", "show", "job", mine[0]["id"], "--oneliner").stdout
    assert "TresPerNode=gres:gpu:1" in shown and "Comment=mine" not in shown, shown
    open_lab(hub, session, name)


def test_stopping_the_hub_cancels_the_job_and_leaves_nothing(slurm_hub):
    hub = slurm_hub
    ports = [hub.port + k for k in range(3)] + [
        port for name in (hub.names["s1"], hub.names["s2"]) for port in listening_ports(
            server_of(pwd.getpwnam(name).pw_uid))]
    assert len(ports) > 3
    before = listeners(ports)
    assert sorted(before) == sorted(set(ports)), before
    hub.stop()
    assert jobs(hub.cluster) == [], "a job is still in the queue after the hub stopped"
    # a server that has just exited can be a zombie until slurmstepd reaps it: gone, not running
    assert_gone([p.pid for p in processes_of(list(hub.names.values()))])
    assert not left_listening(before), "a port is still listening after the hub stopped"
    log = hub.log.read_text()
    assert "Cleaning up single-user servers" in log and "Stopping server job" in log
    marker = getattr(hub, "marker", None)
    assert marker is None or not marker.exists(), "a student's request ran a command as root"
