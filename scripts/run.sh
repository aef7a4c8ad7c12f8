#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job: offline generation with the default model
# (SmolLM2-135M-Instruct) over 32 ShareGPT prompts, ending with the decode step beside its floor.
# On a CPU without --dtype, the job runs the fastest dtype this CPU has (roofline.cpu.fastest_dtype: bfloat16
# where oneDNN has AVX-512 BF16 or AMX, else float32; the start-up line says which and why). The engine's own
# --dtype auto stays float32 on CPU (exact: token-identical to HF fp32); pass --dtype float32 for that here.
# With bfloat16 chosen on a CPU without AMX-BF16, the KV cache is float32 (attention runs in fp32 there; see below).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
args=("$@")
if [[ " $* " != *" --dtype"* ]]; then
    read -r dtype attn_fp32 < <(.venv/bin/python -c "
import sys
from roofline.cpu import attention_in_fp32, detect_cpu_features, fastest_dtype
argv = sys.argv[1:]
dev = next((a.split('=', 1)[1] for a in argv if a.startswith('--device=')), None)
dev = dev or next((b for a, b in zip(argv, argv[1:]) if a == '--device'), 'auto')
if dev == 'auto':
    import torch
    dev = 'cuda' if torch.cuda.is_available() else 'cpu'
dtype = fastest_dtype(detect_cpu_features())[0] if dev == 'cpu' else 'auto'
print(dtype, int(dev == 'cpu' and attention_in_fp32(detect_cpu_features(), dtype)))" "$@")
    args=(--dtype "$dtype" "${args[@]}")
    # Where 16-bit attention runs in fp32 on this CPU (roofline.cpu.attention_in_fp32: no AMX-BF16), a float32
    # KV cache skips the per-step cast of every gathered K/V block, with the same numerics (K/V are bf16 values
    # either way). Main job, bf16, alternated twice (AMD EPYC, 2 cores, issue 32): decode step 113.0 / 123.8 ms
    # vs 132.8 / 144.0 ms, 32/32 greedy outputs identical. The cost is twice the KV bytes per token. With
    # AMX-BF16 attention runs in bf16 and the bf16 cache is gathered as is (half the bytes).
    if [[ "$attn_fp32" == 1 && " $* " != *" --kv-cache-dtype"* ]]; then
        args=(--kv-cache-dtype float32 "${args[@]}")
    fi
fi
exec .venv/bin/roofline generate "${args[@]}"
