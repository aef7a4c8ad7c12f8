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
esac
