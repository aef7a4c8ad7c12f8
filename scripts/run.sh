#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: offline generation with the default model
# (SmolLM2-135M-Instruct) over 32 ShareGPT prompts, ending with the decode step beside its floor.
# On a CPU without --dtype, the job runs the fastest dtype this CPU has (roofline.cpu.fastest_dtype: bfloat16
# where oneDNN has AVX-512 BF16 or AMX, else float32; the start-up line says which and why). The engine's own
# --dtype auto stays float32 on CPU (exact: token-identical to HF fp32); pass --dtype float32 for that here.
# The KV cache takes the model's dtype: the C++ decode attention reads bf16 K/V in place (widened exactly), so
# the float32 cache this script used to pick (it saved a cast per gathered block on the old gather path) only
# doubled the KV bytes. Main job, alternated twice on the Intel Xeon (AMX) of 2026-12-04 after the vectorized
# kernel: bf16 KV 328.3 / 329.3 tok/s vs float32 KV 294.8 / 297.8.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=("$@")
if [[ " $* " != *" --dtype"* ]]; then
    dtype=$(.venv/bin/python -c "
import sys
from roofline.cpu import detect_cpu_features, fastest_dtype
argv = sys.argv[1:]
dev = next((a.split('=', 1)[1] for a in argv if a.startswith('--device=')), None)
dev = dev or next((b for a, b in zip(argv, argv[1:]) if a == '--device'), 'auto')
if dev == 'auto':
    import torch
    dev = 'cuda' if torch.cuda.is_available() else 'cpu'
print(fastest_dtype(detect_cpu_features())[0] if dev == 'cpu' else 'auto')" "$@")
    args=(--dtype "$dtype" "${args[@]}")
fi
exec .venv/bin/roofline generate "${args[@]}"
