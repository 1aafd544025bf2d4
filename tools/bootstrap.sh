#!/usr/bin/env bash
# Create .venv and install DisagMoE-DS with its test and plot extras and torch==${TORCH_VERSION:-2.13.0} (idempotent).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# An installed torch of the pinned version is kept, whichever build (+cpu included); DS_BUILD_OPS=0 skips DeepSpeed's
# op builds.
if ! .venv/bin/python -c "import disagmoe_ds, deepspeed, transformers, peft, pytest, xdist, triton, matplotlib, mypy" 2>/dev/null; then
  DS_BUILD_OPS=0 .venv/bin/pip install -q --disable-pip-version-check "torch==${TORCH_VERSION:-2.13.0}" -e ".[test,plot]"
fi
