#!/usr/bin/env bash
# Issue 33, Qwen3-30B-A3B decode at batch 1 (the fused router, q/k norm through the Triton RMSNorm), on the H200,
# one device call, <= 4 minutes in all (a shared deadline; every step under `timeout`, a failed step does not stop
# the others):
#   1. the GPU tests of the new kernels (router vs float64, q/k norm vs HF);
#   2. roofline bench decode --model qwen3-30b-a3b --batch-sizes 1,8,64 --contexts 512 (fractions of the floor;
#      before this branch: b1 0.262, b64 0.730 of floor, bench/results/moe-decode-20261204/);
#   3. the batch-1 decode-step kernel profile (launches per step as the script counts them: 1820 before; expected
#      about 740: 13 per MoE layer instead of ~34, the script counting 9 steps per 8);
#   4. mixtral-8x7b at batch 1, 64 (before: 0.750 / 0.868 of floor; it builds 93 GB of dummy weights: last).
# Usage (repo root; $OUT set by the device tool): bash bench/gpu_moe_decode.sh [STEP...]  (default: 1 2 3 4; a
# step run alone gets the whole 4 minutes, e.g. `bash bench/gpu_moe_decode.sh 4` if mixtral ran out of time)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
OUT=${OUT:-bench/results/moe-decode}
mkdir -p "$OUT"
T0=$SECONDS
STEPS=" ${*:-1 2 3 4} "
ALONE=$([ $# -eq 1 ] && echo 1 || echo 0)
left() { local d=$1; [ $ALONE = 1 ] && d=236; local l=$((d - (SECONDS - T0))); [ $l -lt 5 ] && l=5; echo $l; }  # to deadline $1
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
  git log --oneline -1 2>/dev/null
} 2>&1 | tee -a "$OUT/log"

if [[ "$STEPS" == *" 1 "* ]]; then
echo "=== 1 gpu tests $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
timeout $(left 40) python3 -m pytest -q -m gpu --tb=short -rf -p no:cacheprovider -s \
  tests/moe/test_moe_decode_gpu.py > "$OUT/gputests.log" 2>&1
echo "gpu tests rc $? at $((SECONDS - T0)) s" | tee -a "$OUT/log"
grep -E "passed|failed|FAILED|Error|differ from HF" "$OUT/gputests.log" | tail -14 | tee -a "$OUT/log"
fi

if [[ "$STEPS" == *" 2 "* ]]; then
echo "=== 2 qwen3-30b-a3b decode $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
timeout $(left 125) python3 -m roofline.cli bench decode --model qwen3-30b-a3b --batch-sizes 1,8,64 --contexts 512 \
  --steps 16 --out-dir "$OUT" > "$OUT/decode-qwen3.log" 2>&1
echo "decode qwen3 rc $? at $((SECONDS - T0)) s" | tee -a "$OUT/log"
grep -vi warn "$OUT/decode-qwen3.log" | grep -E "^model|^ +[0-9]|Error|floor" | tail -8 | tee -a "$OUT/log"
fi

if [[ "$STEPS" == *" 3 "* ]]; then
echo "=== 3 profile qwen3-30b-a3b b1 $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
timeout $(left 175) python3 bench/gpu_decode_profile.py --model qwen3-30b-a3b --batch 1 \
  --out "$OUT/profile-qwen3-30b-a3b-b1.json" > "$OUT/profile-qwen3-30b-a3b-b1.log" 2>&1
echo "profile rc $? at $((SECONDS - T0)) s" | tee -a "$OUT/log"
grep -vi warn "$OUT/profile-qwen3-30b-a3b-b1.log" | grep -E "^model|^ +[0-9]" | head -18 | tee -a "$OUT/log"
fi

if [[ "$STEPS" == *" 4 "* ]]; then
echo "=== 4 mixtral-8x7b decode $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
timeout $(left 236) python3 -m roofline.cli bench decode --model mixtral-8x7b --batch-sizes 1,64 --contexts 512 \
  --steps 16 --out-dir "$OUT" > "$OUT/decode-mixtral.log" 2>&1
echo "decode mixtral rc $? at $((SECONDS - T0)) s" | tee -a "$OUT/log"
grep -vi warn "$OUT/decode-mixtral.log" | grep -E "^model|^ +[0-9]|Error|floor" | tail -6 | tee -a "$OUT/log"
fi
echo "done at $((SECONDS - T0)) s" | tee -a "$OUT/log"
