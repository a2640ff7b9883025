"""The hub's parts that need no root and no server: the roster, the settings, the config, the released sync.

The hub itself, with real accounts and servers, is tests/test_hub.py."""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
from traitlets.config.loader import PyFileConfigLoader

from course_utils.grading.release import BEGIN, STUB, release
from course_utils.workspace import LINKS, reset, sync

ROOT = Path(__file__).resolve().parents[1]
HUB = ROOT / "launch" / "hub"
sys.path.insert(0, str(HUB))

from hub_layout import not_open_to_all  # noqa: E402
from hub_settings import from_env  # noqa: E402
from hub_spawn import sync_command  # noqa: E402

from course_utils.roster import RosterError, parse_admins, parse_names, read_roster  # noqa: E402


def test_the_roster_reads_one_name_a_line_with_comments():
    text = "# week 1\nada\n\n  grace  # late joiner\n_x-1\n"
    assert parse_names(text) == ["ada", "grace", "_x-1"]
    with pytest.raises(RosterError, match=r"roster:3: ada is listed twice"):
        parse_names("ada\ngrace\nada\n")
    assert parse_admins("alan, barbara  claude") == ["alan", "barbara", "claude"]
    assert parse_admins("") == []
    for bad in ("Ada", "ada lovelace", "1ada", "a" * 33, "../etc"):
        with pytest.raises(RosterError, match="roster:1: .* is not a username"):
            parse_names(bad)
    with pytest.raises(RosterError, match="roster /nonexistent/students.txt not found"):
        read_roster("/nonexistent/students.txt")


def test_settings_come_from_make_with_its_defaults(tmp_path):
    s = from_env({"COURSE_HUB_REPO": str(tmp_path), "COURSE_HUB_ROSTER": "class.txt", "COURSE_HUB_PORT": "9000"})
    assert s.roster == tmp_path / "class.txt" and s.port == 9000 and s.ip == "127.0.0.1"
    assert s.state == tmp_path / ".hub" / "state" and s.release == tmp_path / ".hub" / "release" / "notebooks"
    assert s.proxy == tmp_path / ".hub" / "proxy" / "node_modules" / ".bin" / "configurable-http-proxy"
    assert s.auth == "pam" and s.group == "course-instructors" and s.workspace == "workspace"
    assert (s.spawner, s.slurm_gpus, s.slurm_partition, s.api_ip) == ("local", 1, "", "127.0.0.1")
    s = from_env({"COURSE_HUB_SPAWNER": "slurm", "COURSE_HUB_SLURM_GPUS": "2", "COURSE_HUB_API_IP": "10.0.0.5"})
    assert (s.spawner, s.slurm_gpus, s.api_ip) == ("slurm", 2, "10.0.0.5")


def load_config(tmp_path: Path, monkeypatch, auth: str, spawner: str = "local"):
    roster = tmp_path / "students.txt"
    roster.write_text("# class\nada\ngrace\n")
    for key, value in {"COURSE_HUB_REPO": str(ROOT), "COURSE_HUB_ROSTER": str(roster), "COURSE_HUB_ADMINS": "alan",
                       "COURSE_HUB_PORT": "8100", "COURSE_HUB_AUTH": auth, "COURSE_HUB_SPAWNER": spawner}.items():
        monkeypatch.setenv(key, value)
    return PyFileConfigLoader("jupyterhub_config.py", path=str(HUB)).load_config()


@pytest.mark.parametrize("auth", ["pam", "firstuse"])
def test_the_config_lets_in_the_roster_and_instructors_only(tmp_path, monkeypatch, auth):
    c = load_config(tmp_path, monkeypatch, auth)
    assert c.Authenticator.allowed_users == {"ada", "grace", "alan"}
    assert c.Authenticator.admin_users == {"alan"}
    assert c.Authenticator.allow_existing_users is False
    assert c.JupyterHub.bind_url == "http://127.0.0.1:8100"
    assert c.JupyterHub.hub_bind_url == "http://127.0.0.1:8101"
    assert c.ConfigurableHTTPProxy.api_url == "http://127.0.0.1:8102"
    assert c.JupyterHub.spawner_class == "localprocess"
    assert c.Spawner.cmd == [sys.executable, "-m", "jupyterhub.singleuser"]
    assert c.Spawner.environment["COURSE_LAB"] == "1"
    assert str(ROOT / ".hub" / "state") in c.JupyterHub.db_url
    if auth == "firstuse":
        import firstuseauthenticator  # noqa: F401  (what the config names must be installed)

        assert c.JupyterHub.authenticator_class == "firstuseauthenticator.FirstUseAuthenticator"
        assert c.FirstUseAuthenticator.dbm_path.startswith(str(ROOT / ".hub" / "state"))
    else:
        assert c.JupyterHub.authenticator_class == "pam"


def test_the_config_refuses_an_unknown_authenticator(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match="choose pam or firstuse"):
        load_config(tmp_path, monkeypatch, "github")


def test_the_config_refuses_an_unknown_spawner(tmp_path, monkeypatch):
    """HUB_SPAWNER=slurm itself is tested on a real Slurm cluster: tests/test_hub_slurm.py."""
    with pytest.raises(ValueError, match="HUB_SPAWNER='kubernetes': choose local or slurm"):
        load_config(tmp_path, monkeypatch, "pam", spawner="kubernetes")


def test_a_workspace_made_from_released_lessons_links_to_the_repository(tmp_path):
    """The hub's students cannot read the masters: their workspace is made from the released copies."""
    released = tmp_path / "release" / "notebooks"
    release([ROOT / "notebooks"], released)
    ws = tmp_path / "ws"
    done = sync(released, ws, released=True, repo=ROOT)
    assert set(done.values()) == {"created"} and len(done) == len(list((ROOT / "notebooks").glob("*.ipynb")))
    text = (ws / "notebooks" / "07_ring_allreduce.ipynb").read_text()
    assert text == (released / "07_ring_allreduce.ipynb").read_text()
    assert BEGIN not in text and STUB in text
    for name in LINKS:
        assert (ws / name).resolve() == (ROOT / name).resolve()
    mine = ws / "notebooks" / "07_ring_allreduce.ipynb"
    mine.write_text(text.replace(STUB, "pass  # mine", 1))
    assert sync(released, ws, released=True, repo=ROOT)["07_ring_allreduce.ipynb"] == "kept"
    assert "pass  # mine" in mine.read_text()
    fresh, backup = reset("07", released, ws, released=True, repo=ROOT)  # a student of the hub starts one over
    assert fresh.read_text() == text and "pass  # mine" in backup.read_text()
    settings = from_env({"COURSE_HUB_REPO": str(ROOT)})
    assert sync_command(settings, ws)[-4:] == ["--released", "--repo", str(ROOT), "sync"]


def test_the_layout_check_names_a_folder_others_cannot_pass():
    base = Path(tempfile.mkdtemp(prefix="course-hub-layout-"))  # /tmp: pytest's own folder is closed to others
    try:
        os.chmod(base, 0o755)
        closed = base / "closed"
        (closed / "env").mkdir(parents=True)
        os.chmod(closed, 0o700)
        problems = not_open_to_all([closed / "env"])
        assert len(problems) == 1 and f"{closed} is drwx------" in problems[0] and "o+x" in problems[0]
        os.chmod(closed, 0o711)
        os.chmod(closed / "env", 0o755)
        assert not_open_to_all([closed / "env"]) == []
        os.chmod(closed / "env", 0o751)  # others may pass but not list: a venv they cannot read
        assert "o+rx" in not_open_to_all([closed / "env"])[0]
    finally:
        shutil.rmtree(base)


def test_the_gpu_policies_hand_out_gpus_by_roster_line(tmp_path):
    from hub_gpus import check_policy, visible_for, write_kernel_spec

    students, gpus = ["ada", "bob", "cy"], ("0", "1")
    assert [visible_for("round-robin", s, students, gpus) for s in students] == ["0", "1", "0"]
    assert [visible_for("each", s, students[:2], gpus) for s in students[:2]] == ["0", "1"]
    assert [visible_for("shared", s, students, gpus) for s in students] == [None] * 3
    assert visible_for("each", "teacher", students, gpus) is None  # instructors see every GPU
    assert visible_for("round-robin", "ada", students, ()) is None  # a box without GPUs
    assert check_policy("each", students[:2], gpus) == [] and check_policy("shared", students, ()) == []
    (why,) = check_policy("each", students, gpus)
    assert "3 students share 2 GPUs: use HUB_GPUS=round-robin" in why
    (why,) = check_policy("one-each", students, gpus)
    assert "choose one of shared, each, round-robin" in why
    spec = json.loads(write_kernel_spec(tmp_path / "jupyter", "/opt/py/bin/python").read_text())
    assert spec["argv"] == ["/opt/py/bin/python", "-m", "ipykernel_launcher", "-f", "{connection_file}",
                            "--ext=course_utils.gpu_lock"]
    assert (tmp_path / "jupyter" / "kernels" / "python3" / "kernel.json").stat().st_mode & 0o777 == 0o644
    settings = from_env({"COURSE_HUB_GPUS": "each", "COURSE_HUB_GPU_IDS": "2, 3"})
    assert (settings.gpus, settings.gpu_ids) == ("each", ("2", "3"))
