#!/usr/bin/env bash
# Device call steps for round 4 (H200): the refactor's no-regression check against 87a5992 in one process session,
# the quantized decode table, and the GPU test suite. Run from the repo root of the device copy.
# Carried: .devcarry (base/ = git archive 87a5992 roofline bench; sharegpt1000.json).
# Usage: ROOFLINE_GIT_SHA=<sha> bash bench/gpu_round4.sh STEP...
set -uo pipefail
export PYTHONUNBUFFERED=1
NEW=$(pwd); BASE=$(pwd)/.devcarry/base
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$OUT/log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/log"
R() { local tree=$1; shift; (cd "$tree" && PYTHONPATH="$tree" python3 -m roofline.cli "$@"); }
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
  case "$step" in
  ab-decode)  # bf16 batch 1 and 64, base / new / base / new
    for i in 1 2; do for t in base new; do
      [ $t = base ] && tree=$BASE || tree=$NEW
      mkdir -p "$OUT/decode-$t"
      timeout 150 bash -c "$(declare -f R); R $tree bench decode --model llama-3-8b --batch-sizes 1,64 --contexts 1k --out-dir $OUT/decode-$t" \
        > "$OUT/decode-$t-$i.log" 2>&1
      echo "decode $t run $i rc $?" | tee -a "$OUT/log"
      grep -vi warn "$OUT/decode-$t-$i.log" | grep -E "^ *(1|64) |batch|tok/s" | tail -6 | tee -a "$OUT/log"
    done; done
    ;;
  ab-throughput)
    for t in base new; do
      [ $t = base ] && tree=$BASE || tree=$NEW
      mkdir -p "$OUT/tp-$t"
      timeout 170 bash -c "$(declare -f R); R $tree bench throughput --model llama-3-8b --dataset-file $NEW/.devcarry/sharegpt1000.json --num-prompts 1000 --no-progress --out-dir $OUT/tp-$t" \
        > "$OUT/throughput-$t.log" 2>&1
      echo "throughput $t rc $?" | tee -a "$OUT/log"
      grep -vi warn "$OUT/throughput-$t.log" | tail -4 | tee -a "$OUT/log"
    done
    ;;
  quant-decode)
    mkdir -p "$OUT/quant"
    timeout 300 bash -c "$(declare -f R); R $NEW bench decode --model llama-3-8b --batch-sizes 1,8,64 --contexts 1k --quantization none,int8,int4,fp8,smoothquant --out-dir $OUT" \
      > "$OUT/quant-decode.log" 2>&1
    echo "quant-decode rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/quant-decode.log" | tail -30 | tee -a "$OUT/log"
    ;;
  gputests)
    PYTHONPATH=$NEW timeout 420 python3 -m pytest -q -m gpu --continue-on-collection-errors --tb=line -rf -p no:cacheprovider tests 2>&1 | tee "$OUT/gputests.log" \
      | grep -E "^/|^E |passed|failed|error" | tail -40
    ;;
  *) echo "unknown step $step" | tee -a "$OUT/log" ;;
  esac
done
