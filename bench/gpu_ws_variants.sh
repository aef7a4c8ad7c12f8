#!/usr/bin/env bash
# Issue 28, one device call: the ws GEMM's 256-row tiles and 8 converter warps (ws_gemm cvt_warps) at M = 128 /
# 256, then, with the winners merged into this GPU's dispatch table, bf16 / int8 / int4 decode at the large batches.
#   1. tests/kernels/test_quant_gemm.py -k ws (the new configs included) on this GPU;
#   2. bench/gpu_ws_variants.py (per projection: bf16 cuBLAS, the table's kernel, dequantize + cuBLAS, each variant);
#   3. bench/ws_variants_merge.py into a copy of the committed table ($OUT/table_new.json, its changes in merge.log);
#   4. bench decode --batch-sizes $BATCHES --quantization none,int8,int4 with that table.
# OUT must be set; run from the repo root. On a cold machine the tests compile for ~2-3 min (110 s was too short,
# bench/results/ws-variants-h100-20261207/call1-tests-timeout/), so the whole call takes ~7-8 min.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
name=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
T=roofline/kernels/dispatch_tables/$name.json
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch, triton; print(torch.__version__, triton.__version__)"; } | tee -a "$OUT/log"
timeout ${TESTS_S:-300} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_gemm.py -k "ws" > "$OUT/ws_tests.log" 2>&1
rc=$?
echo "ws tests rc $rc: $(tail -1 "$OUT/ws_tests.log")" | tee -a "$OUT/log"
[ $rc = 0 ] || { grep -E "FAILED|Error" "$OUT/ws_tests.log" | head -20 | tee -a "$OUT/log"; exit 1; }
timeout ${PROBE_S:-290} python3 bench/gpu_ws_variants.py --out "$OUT/variants.json" > "$OUT/variants.log" 2>&1
echo "variants rc $?" | tee -a "$OUT/log"; grep -A40 "layer sums" "$OUT/variants.log" | tee -a "$OUT/log"
[ -f "$OUT/variants.json" ] || exit 1
cp "$T" "$OUT/table_new.json"
python3 bench/ws_variants_merge.py "$OUT/variants.json" "$OUT/table_new.json" | tee "$OUT/merge.log" | tee -a "$OUT/log"
cp "$T" /tmp/table_committed.json; cp "$OUT/table_new.json" "$T"
timeout ${DECODE_S:-130} python3 -m roofline.cli bench decode --model llama-3-8b --batch-sizes ${BATCHES:-64,128,256} \
  --contexts 1k --quantization none,int8,int4 --out-dir /tmp/ws_decode > "$OUT/decode.log" 2>&1
echo "decode rc $?" | tee -a "$OUT/log"; grep -E "measured|x$" "$OUT/decode.log" | tee -a "$OUT/log"
cp /tmp/table_committed.json "$T"
