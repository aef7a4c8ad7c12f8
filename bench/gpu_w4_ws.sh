#!/usr/bin/env bash
# Issue 28, one device call: INT4 through the warp-specialized Gluon GEMM (ws_gemm.w4a16_ws_gemm), for the
# batches where INT4 is slower than bf16 (0.675 / 0.701x at 128 / 256 on the H100, 2026-12-07):
#   1. its GPU tests (float64 and ref_ twin tolerances, M / N tails, groups 64 / 128, split-K, every code exactly);
#   2. bench/gpu_w4_ws_probe.py --fp32 at M = PROBE_MS against dequantize+cuBLAS and our Triton INT4 kernel, with
#      the ws kernel (packed 16-bit dequantization) timed beside its fp32 form (winners merged
#      into this GPU's table: table_new.json);
#   3. bench decode (bf16, int4) at BATCHES with that table.
# OUT must be set; run from the repo root. Knobs: TESTS_K (the pytest -k), TESTS_S, PROBE_S, PROBE_MS, DECODE_S,
# BATCHES, QUANTS (none,int4), DECODE_COMMITTED=1 (also decode with the committed table first).
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
name=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
T=roofline/kernels/dispatch_tables/$name.json
echo "device $name" | tee -a "$OUT/log"
timeout ${TESTS_S:-90} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_gemm.py \
  -k "${TESTS_K:-w4a16_ws or ws_is_refused}" > "$OUT/w4_ws_tests.log" 2>&1
rc=$?
echo "w4 ws tests rc $rc: $(tail -1 "$OUT/w4_ws_tests.log")" | tee -a "$OUT/log"
[ $rc = 0 ] || exit 1
timeout ${PROBE_S:-120} python3 bench/gpu_w4_ws_probe.py --fp32 --ms ${PROBE_MS:-128,256} --out "$OUT/w4_probe.json" \
  --merge-into "$T" --table "$OUT/table_new.json" > "$OUT/w4_probe.log" 2>&1
echo "probe rc $?" | tee -a "$OUT/log"; grep -vi warning "$OUT/w4_probe.log" | tail -20 | tee -a "$OUT/log"
decode() {  # TAG: bench decode with the table now installed
  timeout ${DECODE_S:-60} python3 -m roofline.cli bench decode --model llama-3-8b --batch-sizes ${BATCHES:-64,128,256} \
    --contexts 1k --quantization ${QUANTS:-none,int4} --out-dir /tmp/w4_decode_$1 > "$OUT/decode_$1.log" 2>&1
  echo "decode $1 rc $?" | tee -a "$OUT/log"; grep -E "x$" "$OUT/decode_$1.log" | grep -v "none/" | tee -a "$OUT/log"
}
[ -n "${DECODE_COMMITTED:-}" ] && decode committed
if [ -f "$OUT/table_new.json" ]; then
  cp "$T" /tmp/table_committed.json; cp "$OUT/table_new.json" "$T"
  decode new
  cp /tmp/table_committed.json "$T"
fi
