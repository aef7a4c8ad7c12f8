#!/usr/bin/env bash
# Issue 29, the Triton parts, on the H200: one step per device call, each under 4 minutes.
#   tests      the GPU tests of the packed decode variants, the tree mask and the backend's decode_variant
#   tests-old  the existing GPU tests of the decode / quantized / prefill kernels (they changed too)
#   bench   decode variants x KV formats vs bf16 in one process (8/64 x 4k/32k, block 64)
#   splits  the page-aware split count: batch 1 x 4k/32k at block 16/64/128/256, default vs 8/16/32/64 splits
#   tiles   tile configs (BLOCK_N x warps x stages) of old / mma on int8 / fp8 beside bf16 (8/64 x 32k)
#   verify  packed verify rows (query_len 4) vs one query, per variant and format (8/64 x 4k/32k)
# Usage (repo root of the device copy; $OUT set by the device tool): ROOFLINE_GIT_SHA=<sha> bash bench/gpu_kvdecode.sh STEP...
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/kvdecode}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$OUT/log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/log"
R() { PYTHONPATH=$(pwd) python3 -m roofline.cli "$@"; }
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
  case "$step" in
  tests)  # the new tests: packed variants (bf16 on bf16/int8/fp8 caches), tree mask, backend, bench flags
    PYTHONPATH=$(pwd) timeout 230 python3 -m pytest -q -m gpu --tb=short -rf -p no:cacheprovider \
      tests/kernels/test_decode_attention_variants.py tests/kernels/test_prefill_attention_tree.py \
      tests/kernels/test_triton_attention_backend.py 2>&1 | tee "$OUT/gputests-new.log" \
      | grep -E "^E |passed|failed|error" | tail -40
    ;;
  tests-old)  # the kernels' existing GPU tests ("old" decode with page-aligned splits, prefill with the tree args)
    PYTHONPATH=$(pwd) timeout 230 python3 -m pytest -q -m gpu --tb=short -rf -p no:cacheprovider \
      tests/kernels/test_decode_attention.py tests/kernels/test_kv_quant.py tests/kernels/test_prefill_attention.py \
      2>&1 | tee "$OUT/gputests-old.log" | grep -E "^E |passed|failed|error" | tail -40
    ;;
  bench)
    timeout 230 bash -c "$(declare -f R); R bench attention --decode-only --kv-cache-dtype auto,int8,fp8_e4m3 \
      --batches 8,64 --ctxs 4k,32k --variants old,mma,fma --block-size 64 --out-dir $OUT" > "$OUT/bench.log" 2>&1
    echo "bench rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/bench.log" | tail -45 | tee -a "$OUT/log"
    ;;
  splits)
    timeout 230 bash -c "$(declare -f R); R bench attention --decode-only --kv-cache-dtype auto --batches 1 \
      --ctxs 4k,32k --block-sizes 16,64,128,256 --variants old --num-splits 8,16,32,64 --out-dir $OUT" \
      > "$OUT/splits.log" 2>&1
    echo "splits rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/splits.log" | tail -45 | tee -a "$OUT/log"
    ;;
  tiles)  # tile configs of the old and mma variants on the quantized caches at 8 x 32k and 64 x 4k
    timeout 230 bash -c "$(declare -f R); R bench attention --decode-only --kv-cache-dtype auto,int8,fp8_e4m3 \
      --batches 8,64 --ctxs 32k --variants old,mma --block-size 64 --configs 128x4x2,64x2x2,64x4x3,128x8x3,32x4x3 \
      --out-dir $OUT" > "$OUT/tiles.log" 2>&1
    echo "tiles rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/tiles.log" | grep -A80 "^ *B " | tee -a "$OUT/log"
    ;;
  verify)
    timeout 230 bash -c "$(declare -f R); R bench attention --decode-only --kv-cache-dtype auto,int8,fp8_e4m3 \
      --batches 8,64 --ctxs 4k,32k --variants mma,fma --query-lens 1,4 --block-size 64 --out-dir $OUT" \
      > "$OUT/verify.log" 2>&1
    echo "verify rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/verify.log" | tail -45 | tee -a "$OUT/log"
    ;;
  *) echo "unknown step $step" | tee -a "$OUT/log" ;;
  esac
done
