#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: offline generation with the default model
# (SmolLM2-135M-Instruct) over 32 ShareGPT prompts, ending with the decode step beside its floor.
# On a CPU without --dtype, the job runs the fastest dtype this CPU has (roofline.cpu.fastest_dtype: bfloat16
# where oneDNN has AVX-512 BF16 or AMX, else float32; the start-up line says which and why). The engine's own
# --dtype auto stays float32 on CPU (exact: token-identical to HF fp32); pass --dtype float32 for that here.
# With bfloat16 chosen, the KV cache is float32 (attention runs in fp32 on CPU; see below).
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
    # 16-bit attention runs in fp32 on CPU (attention/torch_backend.py): a float32 KV cache skips the per-step
    # cast of every gathered K/V block, with the same numerics (K/V are bf16 values either way). Main job, bf16,
    # alternated twice (AMD EPYC, 2 cores, issue 32): decode step 113.0 / 123.8 ms vs 132.8 / 144.0 ms, 32/32
    # greedy outputs identical. The cost is twice the KV bytes per token.
    if [[ "$dtype" == "bfloat16" && " $* " != *" --kv-cache-dtype"* ]]; then
        args=(--kv-cache-dtype float32 "${args[@]}")
    fi
fi
exec .venv/bin/roofline generate "${args[@]}"
