#!/usr/bin/env bash
# Device steps (issue 28): the INT4 mma GEMM's persistent grid, A/B on this GPU. Run from the repo root:
#   bash bench/gpu_w4_persist.sh sweep           # per Llama-3-8B projection and M, chained in a CUDA graph
#                                                # (bench/gpu_w4_chain.py), with and without persistent configs:
#                                                # $OUT/table_{flat,persist}.json, each built on this device's
#                                                # committed table if there is one
#   TABLES=DIR bash bench/gpu_w4_persist.sh decode   # `bench decode` (bf16 + int4, one process each) with
#                                                # DIR/table_flat.json, then DIR/table_persist.json, twice, alternated
#                                                # (DECODE_TABLES="base persist": the committed table against the
#                                                # new one, which has every kind, wgmma included)
set -uo pipefail
export PYTHONUNBUFFERED=1
NEW=$(pwd)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$OUT/log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/log"
DEV=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
T=roofline/kernels/dispatch_tables/$DEV.json
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
  case "$step" in
  sweep)
    if [ -f "$T" ]; then cp "$T" "$OUT/table_base.json"; else echo '{}' > "$OUT/table_base.json"; fi
    for t in flat persist; do if [ -f "$T" ]; then cp "$T" "$OUT/table_$t.json"; else echo '{}' > "$OUT/table_$t.json"; fi; done
    timeout ${SWEEP_S:-330} python3 bench/gpu_w4_chain.py --out "$OUT/w4_chain.json" --ms "${MS:-1,8,16,32,64}" \
      --table "$OUT/table_persist.json" --table-flat "$OUT/table_flat.json" > "$OUT/w4_chain.log" 2>&1
    echo "sweep rc $?" | tee -a "$OUT/log"
    sed -n '/best per/,$p' "$OUT/w4_chain.log" | tee -a "$OUT/log"
    ;;
  decode)
    [ -f "$T" ] && cp "$T" /tmp/orig_table.json
    for round in $(seq 1 ${ROUNDS:-2}); do
      for t in ${DECODE_TABLES:-flat persist}; do
        cp "${TABLES:-$OUT}/table_$t.json" "$T"
        echo "=== decode $t round $round" | tee -a "$OUT/log"
        PYTHONPATH=$NEW timeout ${DECODE_S:-120} python3 -m roofline.cli bench decode --model llama-3-8b \
          --batch-sizes ${BATCHES:-1,8} --contexts 1k --quantization none,int4 --out-dir "$OUT/decode_$t$round" 2>&1 \
          | grep -E "measured|^ +[0-9]|x$" | tee -a "$OUT/log"
      done
    done
    if [ -f /tmp/orig_table.json ]; then cp /tmp/orig_table.json "$T"; else rm -f "$T"; fi
    ;;
  esac
done
