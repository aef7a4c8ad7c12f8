#!/usr/bin/env bash
# Issue 28, one device call: INT8 W8A16 with the codes converted in inline PTX (quant_gemm._int8x4_to_16bit)
# against the magic-float conversion, on whichever card comes.
#   1. bench decode (bf16, int8; batch 1-256) with the committed table and ROOFLINE_INT8_PTX_CVT=0 (before);
#   2. bench/gpu_w8_convert_probe.py: one swap-AB kernel per conversion (M 1-256), cuBLAS and the table's kernel;
#   3. gpu_table_refresh.sh MODE=sweep FORMATS=int8: the int8 GPU tests, the int8 sweep with the PTX conversion
#      (the table's int8 rows re-picked), then bench decode with the new table (after).
# OUT must be set; run from the repo root.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
B=${BATCHES:-1,8,64,128,256}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/log"
ROOFLINE_INT8_PTX_CVT=0 timeout ${DECODE_S:-200} python3 -m roofline.cli bench decode --model llama-3-8b \
  --batch-sizes "$B" --contexts 1k --quantization none,int8 --out-dir "$OUT/decode_before" > "$OUT/decode_before.log" 2>&1
echo "decode before rc $?" | tee -a "$OUT/log"; grep -E "x$" "$OUT/decode_before.log" | tee -a "$OUT/log"
timeout ${PROBE_S:-240} python3 bench/gpu_w8_convert_probe.py --out "$OUT/convert.json" > "$OUT/convert.log" 2>&1
echo "convert probe rc $?" | tee -a "$OUT/log"; grep -vi warning "$OUT/convert.log" | tee -a "$OUT/log"
MODE=sweep FORMATS=int8 TESTS_K="w8a16 or int8 or swap" STEPS="sweep decode" QUANTS=none,int8 BATCHES="$B" \
  bash bench/gpu_table_refresh.sh
