#!/usr/bin/env bash
# Issue 29, Gluon (sm_90) prefill on the H200, one device call, under 5 minutes in all:
#   0. smoke: the Gluon variants on small cases, one process per kernel kind under `timeout` (a hang is named;
#      the benchmark runs only the variants that passed)
#   1. the Gluon prefill GPU tests (vs float64 / ref_ / the Triton kernel; fallbacks)
#   2. the Triton backend's GPU tests with ROOFLINE_PREFILL_KERNEL=gluon (the backend's prefill through the wrapper)
#   3. the benchmark: Gluon variants vs our Triton kernel vs SDPA (repeat-KV and enable_gqa) at 4k/8k/16k,
#      32k tokens, causal, GQA 32/8, D 128, contiguous and paged (block 16 / 64) KV
# Usage (repo root; $OUT set by the device tool): bash bench/gpu_fa3.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
OUT=${OUT:-bench/results/fa3}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cap', torch.cuda.get_device_capability())"
  git log --oneline -1 2>/dev/null
} 2>&1 | tee -a "$OUT/log"

echo "=== 0 smoke: each Gluon kernel kind in its own process (a hang is named and skipped) $(date -u +%H:%M:%S)" \
  | tee -a "$OUT/log"
GOOD=""
for kind in plain pipe ws; do
  names=$(python3 -c "import sys; sys.path.insert(0, 'bench'); from gpu_fa3_bench import GLUON_VARIANTS as G; \
print(' '.join(n for n in G if n.split('_')[1] == '$kind'))")
  timeout 45 python3 bench/gpu_fa3_smoke.py $names > "$OUT/smoke_$kind.log" 2>&1
  echo "smoke $kind rc $?" | tee -a "$OUT/log"
  grep -E "^(smoke|start|PASS|FAIL)|Error" "$OUT/smoke_$kind.log" | tail -20 | tee -a "$OUT/log"
  for v in $(grep "^PASS " "$OUT/smoke_$kind.log" | cut -d" " -f2); do GOOD="$GOOD,$v"; done
done
echo "variants that passed: ${GOOD#,}" | tee -a "$OUT/log"

echo "=== 1 gluon tests $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
timeout 150 python3 -m pytest -v --tb=short -rf -p no:cacheprovider tests/kernels/test_gluon_prefill.py \
  > "$OUT/tests_gluon.log" 2>&1
echo "rc $?" | tee -a "$OUT/log"
grep -E "^(FAILED|ERROR)|^E  | passed| failed|error" "$OUT/tests_gluon.log" | tail -40 | tee -a "$OUT/log"
tail -2 "$OUT/tests_gluon.log" | tee -a "$OUT/log"  # the last test started, if it hung

echo "=== 2 backend tests with ROOFLINE_PREFILL_KERNEL=gluon $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
ROOFLINE_PREFILL_KERNEL=gluon timeout 30 python3 -m pytest -q --tb=short -rf -p no:cacheprovider -m gpu \
  tests/kernels/test_triton_attention_backend.py > "$OUT/tests_backend.log" 2>&1
echo "rc $?" | tee -a "$OUT/log"
grep -E "^(FAILED|ERROR)|^E  |passed|failed|error" "$OUT/tests_backend.log" | tail -20 | tee -a "$OUT/log"

echo "=== 3 bench $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
timeout 110 python3 bench/gpu_fa3_bench.py --out "$OUT/fa3_bench.json" --variants "${GOOD#,}" \
  > "$OUT/bench.log" 2>&1
echo "rc $?" | tee -a "$OUT/log"
grep -vi warn "$OUT/bench.log" | grep -v "^\[" | tail -30 | tee -a "$OUT/log"
grep -E "BAD|Error" "$OUT/bench.log" | head -20 | tee -a "$OUT/log"
echo "=== done $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
