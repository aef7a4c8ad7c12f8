#!/usr/bin/env bash
# Issue 28's "never slower" for INT4 at batch 128 / 256, one device call: which of the two large-M paths each
# INT4 projection should take there, measured end to end. bench decode (none, int4) at BATCHES with this GPU's
# table as committed, then with every int4 projection's fused_max_m set to 64 (dequantize-then-cuBLAS above 64) and
# to 256 (our tiled INT4 kernel up to 256). OUT must be set; run from the repo root.
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
name=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
T=roofline/kernels/dispatch_tables/$name.json
cp "$T" /tmp/int4_committed.json
for variant in committed 64 256; do
  if [ "$variant" != committed ]; then
    python3 - "$variant" "$T" <<'PY'
import json, sys
limit, path = int(sys.argv[1]), sys.argv[2]
t = json.load(open("/tmp/int4_committed.json"))
for row in t["fused_max_m"]["int4"]:
    row["fused_max_m"] = limit
json.dump(t, open(path, "w"), indent=1)
PY
  fi
  timeout ${DECODE_S:-90} python3 -m roofline.cli bench decode --model llama-3-8b --batch-sizes ${BATCHES:-64,128,256} \
    --contexts 1k --quantization none,int4 --out-dir /tmp/int4_decode > "$OUT/decode-$variant.log" 2>&1
  echo "== fused_max_m $variant rc $?" | tee -a "$OUT/log"; grep -E "x$" "$OUT/decode-$variant.log" | grep int4 | tee -a "$OUT/log"
  cp /tmp/int4_committed.json "$T"
done
