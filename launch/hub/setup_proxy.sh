#!/usr/bin/env bash
# Installs configurable-http-proxy, the proxy JupyterHub starts in front of the students' servers, from npm into
# PREFIX (default .hub/proxy, git-ignored). `make hub` and `make test` call it; it does nothing when the proxy is
# there. Node.js and npm come from apt when they are missing and we are root on a Debian-like machine.
#   bash launch/hub/setup_proxy.sh [PREFIX]
set -euo pipefail
cd "$(dirname "$0")/../.."
PREFIX=${1:-.hub/proxy}
VERSION=${CHP_VERSION:-4}  # configurable-http-proxy's major version that JupyterHub 5 and 6 are tested with
BIN="$PREFIX/node_modules/.bin/configurable-http-proxy"
[ -x "$BIN" ] && exit 0
if ! command -v npm >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "setup: installing Node.js and npm (apt) for JupyterHub's proxy"
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends nodejs npm >/dev/null
  else
    echo "setup: JupyterHub's proxy needs npm: sudo apt-get install nodejs npm" >&2
    exit 1
  fi
fi
echo "setup: installing configurable-http-proxy@$VERSION into $PREFIX"
mkdir -p "$PREFIX"
npm install --silent --no-audit --no-fund --prefix "$PREFIX" "configurable-http-proxy@$VERSION" >/dev/null
"$BIN" --version >/dev/null  # fail here, not at the hub's start, if it cannot run
