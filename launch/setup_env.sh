#!/usr/bin/env bash
# Creates .venv (if missing) and installs the course into it. Called by `make lab` and `make test`.
# CPU-only machines get torch==2.13.0 from the package index (the CPU build where the index serves it; from PyPI
# on Linux that is the CUDA build, which runs on a CPU too: TORCH_CPU_INDEX below gets the small CPU build); a
# CUDA build the machine already has is kept.
#   TORCH_CPU_SPEC   what to install on a machine with no NVIDIA GPU (default torch==2.13.0)
#   TORCH_CPU_INDEX  an index that serves CPU builds, e.g. https://download.pytorch.org/whl/cpu
set -euo pipefail
VENV=${VENV:-.venv}
PYTHON=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  site=""
  # A CUDA torch installed system-wide or by conda stays visible to the venv, so it is not replaced.
  if "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.version.cuda else 1)" 2>/dev/null; then
    site="--system-site-packages"
    echo "setup: keeping this machine's CUDA build of torch ($("$PYTHON" -c 'import torch; print(torch.__version__)'))"
  fi
  if ! "$PYTHON" -m venv $site "$VENV"; then
    rm -rf "$VENV"  # a half-made one (no pip) would be taken as ready next time
    echo "setup: '$PYTHON -m venv' failed; on Debian/Ubuntu install the venv module first:" \
         "sudo apt-get install python3-venv" >&2
    exit 1
  fi
fi
PY="$VENV/bin/python"
if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    echo "setup: NVIDIA GPU found, installing the default (CUDA) build of torch"
    "$PY" -m pip install "torch>=2.4"
  else
    spec=${TORCH_CPU_SPEC:-torch==2.13.0}
    echo "setup: no NVIDIA GPU, installing $spec${TORCH_CPU_INDEX:+ from $TORCH_CPU_INDEX}"
    "$PY" -m pip install "$spec" ${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX"}
  fi
fi
"$PY" -m pip install -q -e ".[dev]"
# The grader runs students' code in bubblewrap (course_utils/grading/sandbox.py); installed here when it is missing
# and we are root on a Debian-like machine (CI is); elsewhere grading says how to install it.
if ! command -v bwrap >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "setup: installing bubblewrap, the sandbox the grader runs students' code in"
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends bubblewrap >/dev/null
fi
touch "$VENV/.installed"
echo "setup: done ($("$PY" -c 'import torch; print("torch", torch.__version__, "CUDA" if torch.cuda.is_available() else "CPU only")'))"
