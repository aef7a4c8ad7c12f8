#!/usr/bin/env bash
# Device calls for the attention lever (issue 9) and the prefix cache (issue 10) on the H200.
# Runs a clean copy of the committed tree (.devcarry/head.tar.gz = git archive HEAD roofline tests ...), so
# uncommitted edits in the checkout never reach the figures. Writes under $OUT.
# Usage: bash bench/gpu_levers.sh {kernels|engine|prefix|tests}
set -uo pipefail
export PYTHONUNBUFFERED=1
ROOT=$(pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
rm -rf /tmp/head && mkdir -p /tmp/head && tar xzf .devcarry/head.tar.gz -C /tmp/head
cd /tmp/head
export PYTHONPATH=/tmp/head:/tmp/site
R() { python3 -m roofline.cli "$@"; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/log"
case "${1:-kernels}" in
kernels)
  R bench attention --seqs 4k,8k,16k --block-size 64 --batches 8,64 --ctxs 4k,32k \
    --kv-cache-dtype bfloat16,int8,fp8_e4m3 --out-dir "$OUT" 2>&1 | grep -v Warn | tail -30 | tee -a "$OUT/log"
  R bench decode --model llama-3-8b --batch-sizes 1,8,64 --contexts 4k --steps 32 \
    --kv-cache-dtype bfloat16,int8,fp8_e4m3 --out-dir "$OUT" 2>&1 | grep -v Warn | tail -22 | tee -a "$OUT/log"
  ;;
tests)
  if [ -f "$ROOT/.model/smol.part.ab" ]; then
    cat "$ROOT"/.model/smol.part.* > /tmp/smol.gguf && sha256sum /tmp/smol.gguf | tee -a "$OUT/log"
    export ROOFLINE_TEST_GGUF=/tmp/smol.gguf
  fi
  timeout 420 python3 -m pytest -q -x tests/kernels tests/attention tests/test_gpu_backends.py -p no:cacheprovider \
    2>&1 | tail -6 | tee -a "$OUT/log"
  ;;
final)
  timeout 120 python3 -m pytest -q tests/kernels/test_kv_quant.py tests/kernels/test_triton_attention_backend.py \
    -k "int8_store or ignore_stale or quantized_cache_matches" -p no:cacheprovider 2>&1 | tail -3 | tee -a "$OUT/log"
  R bench prefix --workload all --model llama-3-8b --load-format dummy --inputs-file "$ROOT/.devcarry/prefix-inputs-gpu.json" \
    --num-conversations 64 --num-turns 4 --max-prompt-len 3072 --num-questions 200 --fewshot-prefix-len 1536 \
    --sc-prompt-len 1024 --max-tokens 64 --max-model-len 4096 --out-dir "$OUT" 2>&1 | grep -v Warn | tail -22 \
    | tee -a "$OUT/log"
  for kv in bfloat16 fp8_e4m3; do
    echo "== throughput kv $kv" | tee -a "$OUT/log"
    R bench throughput --model llama-3-8b --dataset-file "$ROOT/.devcarry/sharegpt1000.json" --num-prompts 1000 \
      --no-progress --kv-cache-dtype $kv --out-dir "$OUT" 2>&1 | grep -E "^(KV|requests|elapsed)|Error" \
      | tee -a "$OUT/log"
  done
  ;;
final2)  # multiturn twice (the first run fills triton's disk cache; the second is the figure), then the
         # foundations settings (block 16, no prefix cache) for the throughput comparison
  timeout 120 python3 -m pytest -q tests/kernels/test_kv_quant.py -k "int8_store" -p no:cacheprovider 2>&1 | tail -2 \
    | tee -a "$OUT/log"
  for pass in compile measured; do
    mkdir -p "$OUT/$pass"
    R bench prefix --workload multiturn --model llama-3-8b --load-format dummy \
      --inputs-file "$ROOT/.devcarry/prefix-inputs-gpu.json" --num-conversations 64 --num-turns 4 --max-prompt-len 3072 \
      --max-tokens 64 --max-model-len 4096 --out-dir "$OUT/$pass" 2>&1 | grep -v Warn | grep multiturn | tee -a "$OUT/log"
  done
  echo "== throughput bf16, block 16, no prefix caching" | tee -a "$OUT/log"
  R bench throughput --model llama-3-8b --dataset-file "$ROOT/.devcarry/sharegpt1000.json" --num-prompts 1000 \
    --no-progress --block-size 16 --no-enable-prefix-caching --out-dir "$OUT" 2>&1 | grep -E "^(KV|elapsed)|Error" \
    | tee -a "$OUT/log"
  ;;
multiturn)  # 16 conversations x 4 turns, replies up to 512 tokens in the history (the engine's own)
  R bench prefix --workload multiturn --model llama-3-8b --load-format dummy \
    --inputs-file "$ROOT/.devcarry/prefix-inputs-gpu-long.json" --num-conversations 16 --concurrency 16 --num-turns 4 \
    --max-prompt-len 3072 --max-tokens 512 --max-model-len 4096 --out-dir "$OUT" 2>&1 | grep -v Warn | grep multiturn \
    | tee -a "$OUT/log"
  ;;
esac
