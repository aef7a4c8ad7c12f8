#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: offline generation with the default model
# (SmolLM2-135M-Instruct) over 32 ShareGPT prompts, ending with the decode step beside its floor.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/roofline generate "$@"
