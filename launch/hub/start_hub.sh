#!/usr/bin/env bash
# What `make hub` runs, as root: the permission layout (launch/hub/hub_layout.py), then JupyterHub with
# launch/hub/jupyterhub_config.py. Settings come from COURSE_HUB_* (the Makefile's ROSTER, ADMINS, HUB_*).
#   bash launch/hub/start_hub.sh [PY]
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${1:-.venv/bin/python}
if [ "$(id -u)" != 0 ]; then
  echo "make hub: run it as root (sudo make hub ...): the hub starts each student's server as that student" >&2
  exit 1
fi
export COURSE_HUB_REPO="$PWD"
# hub_layout.py and the hub import this checkout's course_utils (the release tool, the workspace), whichever
# checkout installed the environment.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
umask 022  # released lessons and new folders readable by students whatever root's umask is
"$PY" launch/hub/hub_layout.py
# `exec`: the hub keeps this shell's pid, so stopping `make hub` (Ctrl-C, SIGTERM) stops the hub, which stops
# every user's server and the proxy.
exec "$PY" -m jupyterhub -f launch/hub/jupyterhub_config.py
