#!/usr/bin/env bash
# Issue 33 on the H200: the fused MoE kernel's GPU tests, the tile-config tune, and bench moe before (heuristic
# tiles) and after (the tuned table) at the Mixtral-8x7B and Qwen3-30B-A3B shapes. Run from the repo root:
#   bash bench/gpu_moe.sh                 # tests before tune after   (~5 min)
#   MOE_DECODE=1 bash bench/gpu_moe.sh decode   # bench decode at both MoE shapes (dummy weights; ~3.5 min)
#   bash bench/gpu_moe.sh after           # one step (e.g. after a tune committed in the repo)
# Everything lands in $OUT: logs, bench JSONs, moe_tune.json (every timing), NVIDIA_H200.json (the table: commit it
# as roofline/kernels/moe_configs/NVIDIA_H200.json). Env: TUNE_BUDGET (s, default 150), QUANTS (none,int8,fp8);
# TUNE_TOKENS / TUNE_FORMATS (re-tune only those M / formats) with TUNE_MERGE=1 (keep the committed table's other cells).
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/moe_out}
mkdir -p "$OUT"
NEW=$(pwd)
TABLE=roofline/kernels/moe_configs/NVIDIA_H200.json
QUANTS=${QUANTS:-none,int8,fp8}
TOKENS=${TOKENS:-1,8,64,2048}
STEPS=${*:-tests before tune after}
[ -n "${MOE_DECODE:-}" ] && [ -z "${*:-}" ] && STEPS="$STEPS decode"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$OUT/log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/log"
git log --oneline -1 2>/dev/null | tee -a "$OUT/log"
R() { PYTHONPATH="$NEW" python3 -m roofline.cli "$@"; }
bench() {  # bench moe at both shapes; $1: a tag, the rest: extra flags
  tag=$1; shift
  for model in mixtral-8x7b qwen3-30b-a3b; do
    mkdir -p "$OUT/$tag"
    timeout 100 bash -c "$(declare -f R); NEW=$NEW; R bench moe --model $model --tokens $TOKENS --quantization $QUANTS --iters 10 --out-dir $OUT/$tag $*" \
      > "$OUT/$tag/moe-$model.log" 2>&1
    echo "bench moe $tag $model rc $?" | tee -a "$OUT/log"
    grep -vi warn "$OUT/$tag/moe-$model.log" | grep -E "^ +[0-9]|^experts|^NVIDIA|Error|error" | tee -a "$OUT/log"
  done
}
for step in $STEPS; do
  echo "=== $step $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
  case "$step" in
  tests)  # every MoE GPU test: bf16/int8/fp8 kernels vs float64, config families, CUDA graphs, a dummy model
    PYTHONPATH=$NEW timeout 150 python3 -m pytest -q -m gpu --tb=short -p no:cacheprovider tests/moe -k moe 2>&1 \
      | tee "$OUT/moe-gputests.log" | grep -E "^E |passed|failed|error" | tail -15 | tee -a "$OUT/log"
    ;;
  before)  # the heuristic tiles (no table), the baseline of this run
    bench before --moe-config none
    ;;
  tune)  # the grid of configs per M at both shapes, bf16 then int8 then fp8 (cells past the budget: heuristic)
    PYTHONPATH=$NEW timeout $(( ${TUNE_BUDGET:-150} + 70 )) python3 bench/gpu_moe_tune.py --budget-s "${TUNE_BUDGET:-150}" \
      --out "$OUT/moe_tune.json" --table "$OUT/NVIDIA_H200.json" ${TUNE_TOKENS:+--tokens $TUNE_TOKENS} \
      ${TUNE_FORMATS:+--formats $TUNE_FORMATS} ${TUNE_MERGE:+--merge $TABLE} > "$OUT/moe-tune.log" 2>&1
    echo "tune rc $?" | tee -a "$OUT/log"; grep -E "M=|budget|wrote|Error" "$OUT/moe-tune.log" | tail -90 | tee -a "$OUT/log"
    [ -s "$OUT/NVIDIA_H200.json" ] && mkdir -p "$(dirname $TABLE)" && cp "$OUT/NVIDIA_H200.json" $TABLE
    ;;
  after)  # the table in roofline/kernels/moe_configs/ (the fresh tune, if that step ran)
    bench after
    ;;
  decode)  # bench decode at the MoE shapes, dummy weights (Mixtral bf16 ~93 GB of 141): floor fractions
    timeout 150 bash -c "$(declare -f R); NEW=$NEW; R bench decode --model mixtral-8x7b --batch-sizes 1,64 --contexts 512 --steps 16 --out-dir $OUT" \
      > "$OUT/moe-decode-mixtral.log" 2>&1; echo "decode mixtral rc $?" | tee -a "$OUT/log"
    grep -vi warn "$OUT/moe-decode-mixtral.log" | tail -8 | tee -a "$OUT/log"
    timeout 90 bash -c "$(declare -f R); NEW=$NEW; R bench decode --model qwen3-30b-a3b --batch-sizes 1 --contexts 512 --steps 16 --out-dir $OUT" \
      > "$OUT/moe-decode-qwen3.log" 2>&1; echo "decode qwen3 rc $?" | tee -a "$OUT/log"
    grep -vi warn "$OUT/moe-decode-qwen3.log" | tail -6 | tee -a "$OUT/log"
    ;;
  *) echo "unknown step $step" | tee -a "$OUT/log" ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
