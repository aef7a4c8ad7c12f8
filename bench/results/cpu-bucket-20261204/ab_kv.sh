#!/usr/bin/env bash
# usage: ab.sh OUTDIR TAG ROUNDS  -- alternates old (/work/main) and new (worktree) main-job runs
set -u
out=$1; tag=$2; rounds=$3
OLD_ARGS=(generate --dtype bfloat16 --kv-cache-dtype float32 --show 32 --no-progress ${EXTRA:-})
NEW_ARGS=(generate --dtype bfloat16 --show 32 --no-progress ${EXTRA:-})
for r in $(seq 1 "$rounds"); do
  for side in old new; do
    f="$out/${tag}-r${r}-${side}.txt"
    if [ $side = old ]; then
      (cd /work/main && { echo "# $(date -u +%H:%M:%S) load: $(cat /proc/loadavg)"; echo "# roofline: $(cd /tmp && /work/main/.venv/bin/python -c 'import roofline; print(roofline.__file__)')"; /work/main/.venv/bin/roofline "${OLD_ARGS[@]}"; echo "# end load: $(cat /proc/loadavg)"; } > "$f" 2>&1)
    else
      (cd /work/wt/cpubucket && { echo "# $(date -u +%H:%M:%S) load: $(cat /proc/loadavg)"; echo "# roofline: $(cd /tmp && PYTHONPATH=/work/wt/cpubucket /work/main/.venv/bin/python -c 'import roofline; print(roofline.__file__)')"; PYTHONPATH=/work/wt/cpubucket /work/main/.venv/bin/roofline "${NEW_ARGS[@]}"; echo "# end load: $(cat /proc/loadavg)"; } > "$f" 2>&1)
    fi
    echo "$f: $(grep '^decode step' "$f")"
  done
done
