#!/usr/bin/env bash
# Issue 28, one device call: the warp-specialized INT8 W8A16 Gluon GEMM (roofline/kernels/gluon_ws_gemm.py,
# GemmConfig.ws; written and AOT-compiled for sm_90 on 2026-12-07, not yet run on a GPU), most informative first:
#   1. its GPU tests (float64 tolerance at M / N / K tails, extreme codes, the sm_90 path really taken);
#   2. bench/gpu_w8_swap_probe.py --ws at M = 128 / 256 (and PROBE_MS): per projection bf16 cuBLAS, the table's
#      kernel, the 128-row swap tiles and the ws tiles, the winners merged into this GPU's table (table_new.json);
#   3. bench decode (bf16, int8) with that table at BATCHES.
# OUT must be set; run from the repo root. Short form: TESTS_S=60 PROBE_MS=256 PROBE_S=60 DECODE_S=40; QUANTS
# (none,int8) the formats decoded.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
name=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
T=roofline/kernels/dispatch_tables/$name.json
echo "device $name" | tee -a "$OUT/log"
timeout ${TESTS_S:-100} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_gemm.py \
  -k "w8a16_ws or ws_is_refused" > "$OUT/ws_tests.log" 2>&1
rc=$?
echo "ws tests rc $rc: $(tail -1 "$OUT/ws_tests.log")" | tee -a "$OUT/log"
WS=; [ $rc = 0 ] && WS=--ws  # a failing kernel is not timed (its configs would be refused by the float64 check anyway)
timeout ${PROBE_S:-150} python3 bench/gpu_w8_swap_probe.py $WS --ms ${PROBE_MS:-128,256} --out "$OUT/probe.json" \
  --merge-into "$T" --table "$OUT/table_new.json" > "$OUT/probe.log" 2>&1
echo "probe rc $?" | tee -a "$OUT/log"; grep -vi warning "$OUT/probe.log" | tail -22 | tee -a "$OUT/log"
if [ -f "$OUT/table_new.json" ]; then
  cp "$T" /tmp/table_committed.json; cp "$OUT/table_new.json" "$T"
  timeout ${DECODE_S:-60} python3 -m roofline.cli bench decode --model llama-3-8b --batch-sizes ${BATCHES:-1,8,64,128,256} \
    --contexts 1k --quantization ${QUANTS:-none,int8} --out-dir /tmp/ws_decode > "$OUT/decode.log" 2>&1
  echo "decode rc $?" | tee -a "$OUT/log"; grep -E "measured|x$" "$OUT/decode.log" | tee -a "$OUT/log"
  cp /tmp/table_committed.json "$T"
fi
