#!/usr/bin/env bash
# One device call that refreshes this GPU's measured dispatch table (issue 28), whichever card comes:
# - an H200 (unless MODE=sweep): the INT4 mma rows, chained, with the persistent and wgmma configs
#   (`gpu_w4_persist.sh sweep`), then `bench decode` (bf16 + int4, batch 1/8/64) with the committed table and with
#   the new one;
# - another card, or MODE=sweep: the GPU tests of the formats swept, then `gpu_quant_sweep.py` for FORMATS (the
#   small-M GEMV configs, the fastest tiled config per M, swap-AB included for the 8-bit weight-only formats, and
#   the largest M where our kernel beats the other path), merged with the card's committed rows of the other
#   formats (int4_mma included), then `bench decode` for QUANTS at BATCHES with the new table.
# STEPS (default "sweep decode"): "sweep" (or "probe": INT8's 128-row swap tiles at M = 128 / 256 alone,
# bench/gpu_w8_swap_probe.py) leaves the new table in /tmp/table_new.json too, so that "decode" can run in the next
# call on the same warm machine (a call is at most 600 s). E.g. MODE=sweep STEPS="probe decode" QUANTS=none,int8
# BATCHES=64,128,256.
# $OUT gets the tables and logs. Run from the repo root.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
name=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
echo "device $name" | tee -a "$OUT/log"
if [ "$name" = NVIDIA_H200 ] && [ "${MODE:-}" != sweep ]; then
  SWEEP_S=${SWEEP_S:-320} DECODE_S=${DECODE_S:-90} ROUNDS=1 DECODE_TABLES="base persist" BATCHES=1,8,64 \
    bash bench/gpu_w4_persist.sh sweep decode
  exit
fi
T=roofline/kernels/dispatch_tables/$name.json
[ -f "$T" ] || echo '{}' > "$T"
for step in ${STEPS:-sweep decode}; do
  case $step in
  sweep)
    cp "$T" "$OUT/table_before.json"
    timeout ${TESTS_S:-120} python3 -m pytest -q -p no:cacheprovider tests/kernels/test_quant_gemm.py \
      -k "${TESTS_K:-w8a16 or fp8 or swap or dispatch}" > "$OUT/tests.log" 2>&1
    echo "tests rc $?: $(tail -1 "$OUT/tests.log")" | tee -a "$OUT/log"
    timeout ${SWEEP_S:-300} python3 bench/gpu_quant_sweep.py --formats ${FORMATS:-dense,int8,int8_int8,fp8,fp8_w8a16,int4} \
      --out "$OUT/sweep.json" --table "$OUT/table_new.json" --merge-into "$T" > "$OUT/sweep.log" 2>&1
    echo "sweep rc $?" | tee -a "$OUT/log"; grep -E "^\[fused|^\[layer|copy|FAIL|wrote" "$OUT/sweep.log" | tee -a "$OUT/log"
    python3 - "$T" "$OUT/table_new.json" <<'PY'
import json, sys
old, new = (json.load(open(p)) for p in sys.argv[1:])
for key, rows in old.items():  # keep what the sweep does not measure (the int4_mma rows)
    new.setdefault(key, rows)
json.dump(new, open(sys.argv[2], "w"), indent=1)
PY
    cp "$OUT/table_new.json" /tmp/table_new.json ;;
  probe)  # INT8's 128-row swap tiles at M = 128 / 256 only (bench/gpu_w8_swap_probe.py), merged into the table
    timeout ${PROBE_S:-240} python3 bench/gpu_w8_swap_probe.py --out "$OUT/probe.json" --merge-into "$T" \
      --table "$OUT/table_new.json" > "$OUT/probe.log" 2>&1
    echo "probe rc $?" | tee -a "$OUT/log"; grep -vi warning "$OUT/probe.log" | tail -12 | tee -a "$OUT/log"
    cp "$OUT/table_new.json" /tmp/table_new.json ;;
  decode)
    cp "$T" /tmp/table_committed.json; cp /tmp/table_new.json "$T"
    timeout ${DECODE_S:-200} python3 -m roofline.cli bench decode --model llama-3-8b --batch-sizes ${BATCHES:-1,8,64} \
      --contexts 1k --quantization ${QUANTS:-none,int4,int8,fp8,smoothquant} --out-dir "$OUT/decode" > "$OUT/decode.log" 2>&1
    echo "decode rc $?" | tee -a "$OUT/log"; grep -E "measured|^ +[0-9]|x$" "$OUT/decode.log" | tee -a "$OUT/log"
    cp /tmp/table_committed.json "$T" ;;
  esac
done
