#!/usr/bin/env bash
# Starts JupyterLab on notebooks/, bound to 127.0.0.1 only, with a fresh random token.
# From a laptop, reach a remote GPU box through an SSH tunnel:  ssh -L 8888:127.0.0.1:8888 gpu-box
set -euo pipefail
PY=${1:-.venv/bin/python}
PORT=${2:-8888}
token=$("$PY" -c "import secrets; print(secrets.token_hex(24))")
echo "Course lab: http://127.0.0.1:${PORT}/lab?token=${token}"
echo "(if that port is taken, Jupyter picks the next free one: use the URL it prints below)"
# Jupyter refuses to run as root unless told; containers and cloud GPU boxes often log in as root.
extra=()
[ "$(id -u)" = 0 ] && extra+=(--allow-root)
exec "$PY" -m jupyter lab "${extra[@]}" --no-browser --ServerApp.ip=127.0.0.1 --ServerApp.port="$PORT" \
  --ServerApp.root_dir=notebooks --IdentityProvider.token="$token" --ServerApp.open_browser=False
