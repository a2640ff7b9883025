"""launch/slurm/*.sbatch on a real Slurm: a one-host cluster started here, jobs submitted with `sbatch --wait`.

The cluster: slurmctld and two slurmd, "nodes" n1 and n2, both at 127.0.0.1 on ports of their own, from a
slurm.conf generated in a temporary folder (state, spool, logs and pid files there too; no munge:
AuthType=auth/none, CredType=cred/none; no cgroups: proctrack/linuxproc, task/none). Debian's slurm-wlm
(packages slurmctld, slurmd, slurm-client) is installed by the fixture when missing and this is root (as in
CI); elsewhere the tests skip and say how to get Slurm. slurmd needs root, so does the cluster.

Every process the cluster started is stopped at the end, even after a failure: jobs are cancelled, then
every process whose environment names this cluster's slurm.conf (the daemons, slurmstepd, the jobs'
programs) is killed, daemons by process group first.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BINARIES = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
PACKAGES = ("slurmctld", "slurmd", "slurm-client")
OFFLINE = ("Temporary failure resolving", "Could not resolve", "Failed to fetch", "Network is unreachable",
           "Unable to locate package", "Could not connect")  # apt-get's words when it cannot download

pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Slurm runs on Linux only"),
              pytest.mark.ranks]


def ensure_slurm() -> None:
    """Slurm's binaries on PATH: installed with apt-get when missing and root; else skip, saying how."""
    if all(shutil.which(b) for b in BINARIES):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and this is not root on a Debian-like system: install it with "
                    f"`sudo apt-get install -y {' '.join(PACKAGES)}` and run the test as root (slurmd needs root)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *PACKAGES]):
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        said = done.stdout + done.stderr
        if done.returncode != 0 and any(s in said for s in OFFLINE):  # a machine without the internet
            pytest.skip(f"Slurm is not installed and `{' '.join(cmd)}` could not download it (offline?): "
                        f"{said.strip().splitlines()[-1][:200]}")
        if done.returncode != 0:  # root with apt-get and a network (CI): this must work, so fail, never skip
            pytest.fail(f"{' '.join(cmd)} failed ({done.returncode}):\n{said[-3000:]}")
    missing = [b for b in BINARIES if not shutil.which(b)]
    assert not missing, f"installed {PACKAGES} but {missing} are still not on PATH"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


SLURM_CONF = """\
ClusterName=course
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/none
CredType=cred/none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
MailProg=/bin/true
MinJobAge=4
ReturnToService=2
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool/%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/log/slurmctld.log
SlurmdLogFile={d}/log/slurmd-%n.log
NodeName=n1 NodeAddr=127.0.0.1 Port={n1_port} CPUs=2 State=UNKNOWN
NodeName=n2 NodeAddr=127.0.0.1 Port={n2_port} CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP
"""
# MinJobAge=4: a finished job leaves slurmctld's memory after 4 s; `sbatch --wait` polls until it is gone
# (with the default of 300 s it would poll at 8 s, 32 s, ...). CPUs=2 per node: two jobs can share a node.


class Cluster:
    def __init__(self, root: Path, fake_gpus: bool = False):
        """fake_gpus: each node has one GPU for Slurm to hand out (gres/gpu, its device file /dev/null): jobs may ask
        for --gres=gpu:1 and get CUDA_VISIBLE_DEVICES, on a machine without GPUs (tests/test_hub_slurm.py)."""
        self.root = root
        self.fake_gpus = fake_gpus
        self.conf = root / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.daemons: list[subprocess.Popen] = []

    def start(self) -> None:
        for sub in ("state", "spool/n1", "spool/n2", "log"):  # slurmd does not make its spool folder
            (self.root / sub).mkdir(parents=True)
        conf = SLURM_CONF.format(d=self.root, ctld_port=free_port(), n1_port=free_port(), n2_port=free_port())
        if self.fake_gpus:
            conf = "GresTypes=gpu\n" + conf.replace(" State=UNKNOWN", " Gres=gpu:1 State=UNKNOWN")
            (self.root / "gres.conf").write_text("Name=gpu File=/dev/null\n")  # beside slurm.conf, where slurmd looks
        self.conf.write_text(conf)
        self._daemon("slurmctld", "-D", "-f", str(self.conf))
        for node in ("n1", "n2"):
            self._daemon("slurmd", "-D", "-N", node, "-f", str(self.conf))
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            dead = [d for d in self.daemons if d.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead[0].args[0]} exited with {dead[0].returncode}:\n{self.logs()}")
            states = self.run("sinfo", "-h", "-N", "-o", "%N %T", check=False).stdout.split()
            if states.count("idle") == 2:
                return
            time.sleep(0.3)
        raise RuntimeError(f"the nodes did not come up idle in 60 s (sinfo: {states}):\n{self.logs()}")

    def _daemon(self, *argv: str) -> None:
        name = argv[0] + ("-" + argv[3] if argv[0] == "slurmd" else "")
        out = open(self.root / "log" / f"{name}.out", "wb")  # noqa: SIM115 - closed with the process
        self.daemons.append(subprocess.Popen(argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True))
        out.close()

    def run(self, *argv: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check, timeout=60, **kw)

    def logs(self) -> str:
        parts = []
        for f in sorted((self.root / "log").glob("*")):
            parts.append(f"--- {f.name} ---\n" + "\n".join(f.read_text(errors="replace").splitlines()[-25:]))
        return "\n".join(parts)

    def ours(self) -> list[int]:
        """Every process whose environment names this cluster's slurm.conf (daemons, slurmstepd, jobs)."""
        marker = f"SLURM_CONF={self.conf}".encode()
        pids = []
        for entry in os.listdir("/proc"):
            if entry.isdigit() and int(entry) != os.getpid():
                try:
                    if marker in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                        pids.append(int(entry))
                except OSError:  # gone, or not ours to read
                    pass
        return pids

    def stop(self) -> None:
        """Cancel every job, stop the daemons by process group, then kill whatever of ours is left."""
        if any(d.poll() is None for d in self.daemons):
            self.run("scancel", "--partition=debug", check=False)
        for d in self.daemons:
            if d.poll() is None:
                try:
                    os.killpg(d.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for d in self.daemons:
            try:
                d.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(d.pid, signal.SIGKILL)
                d.wait()
        for _ in range(3):  # slurmstepd and job programs live in sessions of their own
            left = self.ours()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    ensure_slurm()
    if os.geteuid() != 0:
        pytest.skip("slurmd needs root: run this test as root")
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    try:
        c.start()
        yield c
    finally:
        c.stop()
        left = c.ours()
        assert not left, f"processes of the test cluster still running: {left}"


def submit(cluster: Cluster, script: str, out: Path, *args: str, **sbatch_env: str) -> subprocess.Popen:
    """`sbatch --wait SCRIPT ARGS` from the repository root (the job's working directory), as a user would."""
    env = dict(cluster.env, PYTHON=sys.executable, OMP_NUM_THREADS="1", **sbatch_env)
    return subprocess.Popen(["sbatch", "--wait", f"--output={out}", script, *args], cwd=ROOT, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def result_of(text: str) -> dict:
    lines = [ln for ln in text.splitlines() if ln.startswith("RESULT ")]
    assert lines, f"no RESULT line in the job's output:\n{text[-3000:]}"
    return json.loads(lines[-1][len("RESULT "):])


# --cpu: gloo even on a GPU machine (two "nodes" on one host would otherwise both take cuda:0)
QUICK = ("--cpu", "--epochs", "1", "--train-size", "512", "--eval-size", "101")


def test_single_and_multi_node_jobs_train_on_the_cluster(cluster, tmp_path):
    """Both sbatch scripts at once: the one-node job (torchrun --standalone, 2 workers) and the two-node job
    (srun starts one torchrun per node; they meet at the c10d rendezvous on the first node's address)."""
    multi_out, single_out = tmp_path / "multi.out", tmp_path / "single.out"
    jobs = {
        "multi": submit(cluster, "launch/slurm/multi_node.sbatch", multi_out, *QUICK, NPROC_PER_NODE="1",
                        RDZV_PORT=str(free_port())),
        "single": submit(cluster, "launch/slurm/single_node.sbatch", single_out, *QUICK, NPROC_PER_NODE="2"),
    }
    said = {}
    try:
        for name, job in jobs.items():
            said[name] = job.communicate(timeout=240)[0]
    finally:
        for job in jobs.values():
            if job.poll() is None:
                job.kill()
                job.wait()
    for name, out in (("multi", multi_out), ("single", single_out)):
        text = out.read_text() if out.exists() else "(no output file)"
        assert jobs[name].returncode == 0, (f"sbatch --wait ({name}) returned {jobs[name].returncode}: "
                                            f"{said[name]}\n{text[-4000:]}\n{cluster.logs()}")

    multi = multi_out.read_text()
    assert "2 nodes (n[1-2]), rendezvous at 127.0.0.1:" in multi, multi
    # one worker per node: global ranks 0 and 1, each its node's LOCAL_RANK 0, node (group) ranks 0 and 1
    for rank in (0, 1):
        assert f"[rank {rank}] RANK={rank} LOCAL_RANK=0 GROUP_RANK={rank} WORLD_SIZE=2" in multi, multi
    res = result_of(multi)
    assert res["world_size"] == 2 and res["backend"] == "gloo" and res["epochs"][0]["counted"] == 101
    assert res["epochs"][0]["padded_counted"] == 102  # 101 samples padded to 2 x 51

    single = single_out.read_text()
    for rank in (0, 1):  # one node: both workers in node 0, LOCAL_RANK = RANK
        assert f"[rank {rank}] RANK={rank} LOCAL_RANK={rank} GROUP_RANK=0 WORLD_SIZE=2" in single, single
    assert result_of(single)["world_size"] == 2


def test_sbatch_wait_returns_the_jobs_failure(cluster, tmp_path):
    """A job whose training fails (SyncBatchNorm asked for on a CPU) makes `sbatch --wait` fail too."""
    out = tmp_path / "fail.out"
    job = submit(cluster, "launch/slurm/single_node.sbatch", out, "--cpu", "--sync-bn", NPROC_PER_NODE="1")
    said = job.communicate(timeout=240)[0]
    text = out.read_text()
    assert job.returncode != 0, said + text
    assert "--sync-bn needs GPUs" in text, text
