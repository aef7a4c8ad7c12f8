#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole CPU test suite. GPU-only tests skip without CUDA;
# Triton kernels run under TRITON_INTERPRET=1 (tests/kernels/conftest.py sets it on CPU).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
