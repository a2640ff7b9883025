"""JupyterHub for a class on one GPU box: `sudo make hub ROSTER=roster.txt ADMINS="ada"` (docs/classroom.md).

Settings come from the COURSE_HUB_* variables that `make hub` sets (launch/hub/hub_settings.py). Each user logs in
with their system account and gets a JupyterLab of their own, run as that account (LocalProcessSpawner; with
HUB_SPAWNER=slurm, a Slurm job per server: launch/hub/hub_slurm.py): students on their own workspace
(~/workspace/notebooks), instructors (admins) on the masters in notebooks/.
Only the roster's students and the instructors may log in. Files students must not read (masters, tests, git
history) are closed to them by launch/hub/hub_layout.py, which start_hub.sh runs first.

Authenticators (COURSE_HUB_AUTH, make's HUB_AUTH):
- pam (default): system passwords, for a lab machine whose students have accounts (make students sets them).
- firstuse: jupyterhub-firstuseauthenticator; each rostered student picks a password at the first login
  (a workshop: no passwords to hand out; whoever logs in first with a name owns it, so start the hub when the
  class is in the room). System accounts are still needed: servers run as them (make students HUB_AUTH=firstuse).
- OAuth (GitHub, a university's login): install oauthenticator and set c.JupyterHub.authenticator_class here,
  with its client id and secret; keep allowed_users from the roster (OAuth names must match system accounts,
  e.g. through Authenticator.username_map).
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from hub_settings import from_env  # noqa: E402
from hub_slurm import check as check_spawner  # noqa: E402
from hub_slurm import configure as configure_slurm  # noqa: E402
from hub_spawn import pre_spawn_hook, server_env  # noqa: E402

from course_utils.roster import parse_admins, read_roster  # noqa: E402

c = get_config()  # noqa: F821  (JupyterHub's config loader provides it)
settings = from_env()
students, admins = read_roster(settings.roster, required=False), parse_admins(settings.admins)

# ---- where it listens: the public port, the hub's own API on port+1 and the proxy's on port+2 (loopback only)
scheme = "https" if settings.ssl_cert else "http"
c.JupyterHub.bind_url = f"{scheme}://{settings.ip}:{settings.port}"
c.JupyterHub.hub_bind_url = f"http://{settings.api_ip}:{settings.port + 1}"  # HUB_API_IP: for a cluster's nodes
c.ConfigurableHTTPProxy.api_url = f"http://127.0.0.1:{settings.port + 2}"
c.ConfigurableHTTPProxy.command = [str(settings.proxy)]
if settings.ssl_cert:
    c.JupyterHub.ssl_cert, c.JupyterHub.ssl_key = settings.ssl_cert, settings.ssl_key

# ---- state, root's alone (hub_layout.py makes HUB_DIR/state 0700)
c.JupyterHub.db_url = f"sqlite:///{settings.state / 'jupyterhub.sqlite'}"
c.JupyterHub.cookie_secret_file = str(settings.state / "jupyterhub_cookie_secret")
c.JupyterHub.pid_file = str(settings.state / "jupyterhub.pid")
c.ConfigurableHTTPProxy.pid_file = str(settings.state / "jupyterhub-proxy.pid")
# Stopping the hub stops every user's server and the proxy: nothing is left running after a class.
c.JupyterHub.cleanup_servers = True
c.JupyterHub.cleanup_proxy = True

# ---- who may log in: the roster and the instructors, nobody else (not even accounts the database remembers)
if settings.auth == "firstuse":
    c.JupyterHub.authenticator_class = "firstuseauthenticator.FirstUseAuthenticator"
    c.FirstUseAuthenticator.dbm_path = str(settings.state / "passwords.dbm")
    c.FirstUseAuthenticator.create_users = False  # only names the hub knows (the roster) may set a password
elif settings.auth == "pam":
    c.JupyterHub.authenticator_class = "pam"
    c.PAMAuthenticator.open_sessions = False  # JupyterHub's own advice: PAM sessions do not fit its lifecycle
else:
    raise ValueError(f"COURSE_HUB_AUTH={settings.auth!r}: choose pam or firstuse (OAuth: edit {__file__})")
c.Authenticator.allowed_users = set(students) | set(admins)
c.Authenticator.admin_users = set(admins)
c.Authenticator.allow_existing_users = False  # a student taken off the roster can no longer log in

# ---- one JupyterLab per user, as that user: a process on this box, or a Slurm job (HUB_SPAWNER=slurm)
if check_spawner(settings):
    raise ValueError("; ".join(check_spawner(settings)))
c.JupyterHub.spawner_class = "localprocess"
# The hub's own Python (make's PY): students' servers and kernels import course_utils and torch from it, so it
# and its interpreter must be readable by all (hub_layout.py checks; a Python under /root is not).
c.Spawner.cmd = [sys.executable, "-m", "jupyterhub.singleuser"]
c.Spawner.default_url = "/lab"
c.Spawner.environment = server_env(settings)
c.Spawner.pre_spawn_hook = pre_spawn_hook(settings)
# A loaded machine (a class starting at once) needs longer than the defaults to start servers.
c.Spawner.start_timeout = 180
c.Spawner.http_timeout = 120
if settings.spawner == "slurm":
    configure_slurm(c, settings)  # one job per server, --gres=gpu:N (launch/hub/hub_slurm.py)

# ---- idle servers are stopped (HUB_CULL_IDLE seconds, 0: never): a GPU box's memory and a cluster's jobs go back
# to the class; a student's files stay, and logging in again starts the server anew. jupyterhub-idle-culler runs
# as a hub service with only the scopes it needs.
if settings.cull_idle:
    c.JupyterHub.services = [{"name": "idle-culler", "command": [
        sys.executable, "-m", "jupyterhub_idle_culler", f"--timeout={settings.cull_idle}"]}]
    c.JupyterHub.load_roles = [{"name": "idle-culler", "services": ["idle-culler"],
                                "scopes": ["list:users", "read:users:activity", "read:servers", "delete:servers"]}]
