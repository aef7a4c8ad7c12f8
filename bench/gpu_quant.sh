#!/usr/bin/env bash
# Device calls for the quantization lever (issue 11) on the H200, from a clean copy of the committed tree
# (.devcarry/head.tar.gz = git archive HEAD roofline tests bench pyproject.toml). Writes under $OUT.
# Usage: bash bench/gpu_quant.sh {kernels|decode|throughput}
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
  timeout 60 python3 bench/gpu_quant_smoke.py 2>&1 | grep -v Warn | tail -12 | tee -a "$OUT/log"
  timeout 300 python3 bench/gpu_quant_gemm.py --out "$OUT/quant_gemm.json" 2>&1 | tail -80 | tee -a "$OUT/log"
  ;;
tests)
  timeout 200 python3 -m pytest -q --tb=line -rf -p no:cacheprovider tests/kernels/test_quant_gemm.py 2>&1 | tail -8 \
    | tee -a "$OUT/log"
  ;;
decode)
  R bench decode --model llama-3-8b --batch-sizes 1,64,256 --contexts 1k --steps 32 \
    --quantization none,int8,int4,fp8,smoothquant --out-dir "$OUT" 2>&1 | grep -v Warn | tail -40 | tee -a "$OUT/log"
  ;;
throughput)
  for q in none fp8 int4; do
    echo "== throughput $q" | tee -a "$OUT/log"
    [ "$q" = none ] && QF="" || QF="--quantization $q"
    R bench throughput --model llama-3-8b --dataset-file "$ROOT/.devcarry/sharegpt1000.json" --num-prompts 1000 \
      --no-progress $QF --out-dir "$OUT" 2>&1 | grep -E "^(weights|KV|requests|elapsed)|Error" | tee -a "$OUT/log"
  done
  ;;
esac
