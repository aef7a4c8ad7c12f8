#!/usr/bin/env bash
# usage: abclean.sh OUTDIR TAG ROUNDS: base 01fbfde / buckets 86d2c91 (power-of-two buckets + sampler) / sampler 9c5cccb
# (sampler only), each a detached worktree imported through PYTHONPATH, `scripts/run.sh`'s arguments on this CPU.
set -u
out=$1; tag=$2; rounds=$3
run() {  # name dir
  local name=$1 dir=$2
  local f="$out/${tag}-r${r}-${name}.txt"
  (cd "$dir" && { echo "# $(date -u +%H:%M:%S) load: $(cat /proc/loadavg)"; echo "# roofline: $(cd /tmp && PYTHONPATH=$dir /work/main/.venv/bin/python -c 'import roofline; print(roofline.__file__)') commit $(git -C "$dir" rev-parse --short HEAD)"; PYTHONPATH=$dir /work/main/.venv/bin/roofline generate --dtype bfloat16 --kv-cache-dtype float32 --show 32 --no-progress; echo "# end load: $(cat /proc/loadavg)"; } > "$f" 2>&1)
  echo "$f: $(grep '^decode step' "$f")"
}
for r in $(seq 1 "$rounds"); do
  run base /tmp/cpub/wtbase
  run buckets /tmp/cpub/wt86
  run sampler /tmp/cpub/wtsamp
done
