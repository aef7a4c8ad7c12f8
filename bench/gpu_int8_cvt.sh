#!/usr/bin/env bash
# Issue 28, one device call: INT8 W8A16 with the codes converted in inline PTX (quant_gemm._int8x4_to_16bit)
# (off by default: ROOFLINE_INT8_PTX_CVT=1) against the magic-float conversion, on whichever card comes. Most informative first (a call may be cut short):
#   1. the int8 GPU tests (the PTX conversion on: bf16 / fp16, extreme codes);
#   2. bench decode (bf16, int8; batch 1-256), committed table, ROOFLINE_INT8_PTX_CVT=0 (before) and on (after);
#   3. bench/gpu_w8_convert_probe.py: one swap-AB kernel per conversion (M 1-256), cuBLAS and the table's kernel;
#   4. gpu_table_refresh.sh MODE=sweep FORMATS=int8: the int8 sweep with the PTX conversion (the table's int8 rows
#      re-picked), then bench decode with the new table.
# OUT must be set; run from the repo root.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
B=${BATCHES:-1,8,64,128,256}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/log"
timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_gemm.py \
  -k "w8a16 or int8 or swap" > "$OUT/tests.log" 2>&1
echo "tests rc $?: $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/log"
# issue 30: a fused EAGLE head's residual streams out of the target's CUDA graphs (tests/spec_decode)
timeout ${FUSED_S:-150} python3 -m pytest -q -p no:cacheprovider tests/spec_decode/test_draft_graphs_gpu.py -k fused \
  > "$OUT/fused.log" 2>&1
echo "fused eagle test rc $?: $(tail -1 "$OUT/fused.log")" | tee -a "$OUT/log"
for side in before after; do
  flag=1; [ $side = before ] && flag=0
  ROOFLINE_INT8_PTX_CVT=$flag timeout ${DECODE_S:-120} python3 -m roofline.cli bench decode --model llama-3-8b \
    --batch-sizes "$B" --contexts 1k --quantization none,int8 --out-dir "$OUT/decode_$side" > "$OUT/decode_$side.log" 2>&1
  echo "decode $side rc $?" | tee -a "$OUT/log"; grep -E "x$" "$OUT/decode_$side.log" | tee -a "$OUT/log"
done
timeout ${PROBE_S:-200} python3 bench/gpu_w8_convert_probe.py --out "$OUT/convert.json" --ms ${PROBE_MS:-1,16,64,128,256} \
  --modes ${PROBE_MODES:-i8_bf16,i8_bf16x4,i8_f16x4,f8_bf16,f8_f16,w16} > "$OUT/convert.log" 2>&1
echo "convert probe rc $?" | tee -a "$OUT/log"; grep -vi warning "$OUT/convert.log" | tee -a "$OUT/log"
MODE=sweep FORMATS=int8 TESTS_S=1 STEPS="sweep decode" QUANTS=none,int8 BATCHES="$B" SWEEP_S=${SWEEP_S:-150} \
  bash bench/gpu_table_refresh.sh
