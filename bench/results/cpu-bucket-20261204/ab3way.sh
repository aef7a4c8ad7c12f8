#!/usr/bin/env bash
# usage: ab3way.sh OUTDIR TAG ROUNDS: main (fp32 KV, run.sh's args) / 86d2c91 (buckets + sampler, fp32 KV) / branch HEAD (bf16 KV, bf16 SDPA on AMX)
set -u
out=$1; tag=$2; rounds=$3
run() {  # name dir pythonpath args...
  local name=$1 dir=$2 pp=$3; shift 3
  local f="$out/${tag}-r${r}-${name}.txt"
  (cd "$dir" && { echo "# $(date -u +%H:%M:%S) load: $(cat /proc/loadavg)"; echo "# roofline: $(cd /tmp && PYTHONPATH=$pp /work/main/.venv/bin/python -c 'import roofline; print(roofline.__file__)') args: $*"; PYTHONPATH=$pp /work/main/.venv/bin/roofline "$@"; echo "# end load: $(cat /proc/loadavg)"; } > "$f" 2>&1)
  echo "$f: $(grep '^decode step' "$f")"
}
for r in $(seq 1 "$rounds"); do
  run main /work/main "" generate --dtype bfloat16 --kv-cache-dtype float32 --show 32 --no-progress
  run buckets /tmp/cpub/wt86 /tmp/cpub/wt86 generate --dtype bfloat16 --kv-cache-dtype float32 --show 32 --no-progress
  run amxbf16 /work/wt/cpubucket /work/wt/cpubucket generate --dtype bfloat16 --show 32 --no-progress
done
