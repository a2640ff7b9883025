#!/usr/bin/env bash
# Starts JupyterLab bound to 127.0.0.1 only, with a fresh random token, and prints its URL once it answers.
#   bash launch/start_lab.sh [PY] [PORT] [student|instructor]
# student (`make lab`): the student's own workspace, $COURSE_WORKSPACE (default workspace/, git-ignored), made
#   from the masters by the release tool (solutions replaced by `raise NotImplementedError()`): lessons missing
#   there are added, lessons already there are never overwritten (`make reset-notebook NB=...` starts one over).
# instructor (`make lab-instructor`): the masters in notebooks/, solutions included; saving there changes git files.
# From a laptop, reach a remote GPU box through an SSH tunnel:  ssh -L 8888:127.0.0.1:8888 gpu-box
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-.venv/bin/python}
PORT=${2:-8888}
MODE=${3:-student}
case "$MODE" in
  student)
    WORKSPACE=${COURSE_WORKSPACE:-workspace}
    "$PY" -m course_utils.workspace --masters notebooks --workspace "$WORKSPACE" sync
    ROOT_DIR="$WORKSPACE/notebooks"
    echo "Student lab: your own copies of the lessons, in $ROOT_DIR (instructors: make lab-instructor)"
    ;;
  instructor)
    ROOT_DIR=notebooks
    echo "Instructor lab: the masters in notebooks/, solutions included (students: make lab)"
    ;;
  *)
    echo "start_lab.sh: mode must be student or instructor, not '$MODE'" >&2
    exit 2
    ;;
esac
# In the lab, an unsolved exercise's check cell says "not attempted yet" and Run All goes on (course_utils.checks);
# the self-check (make check) and the grader still count it.
export COURSE_LAB=1
token=$("$PY" -c "import secrets; print(secrets.token_hex(24))")
# The URL is printed by a helper that reads the port and token from the server itself (Jupyter moves to the
# next free port if PORT is taken) and waits until the server answers; `exec` keeps this shell's pid for Jupyter.
"$PY" launch/lab_url.py $$ &
# Jupyter refuses to run as root unless told; containers and cloud GPU boxes often log in as root.
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-root)
# Log level WARN: Jupyter's own start-up lines (URLs with the token hidden) would only compete with ours.
exec "$PY" -m jupyter lab "${extra[@]}" --no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port="$PORT" \
  --ServerApp.root_dir="$ROOT_DIR" --IdentityProvider.token="$token" --ServerApp.open_browser=False \
  --ServerApp.log_level=WARN --LabApp.log_level=WARN
