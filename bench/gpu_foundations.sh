#!/usr/bin/env bash
# One device call: before/after figures for the foundations issue on the H200.
# Needs, carried: .whl (gguf), .devcarry/sharegpt1000.json (roofline bench throughput --export-dataset),
# .devcarry/base (git archive of the "before" commit's roofline/). Writes under $OUT.
# Usage: bash bench/gpu_foundations.sh {speed|check}
set -uo pipefail
export PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
ROOT=$(pwd)
DATA=$ROOT/.devcarry/sharegpt1000.json
before() { (cd "$ROOT/.devcarry/base" && PYTHONPATH=.:/tmp/site python3 -m roofline.cli "$@"); }
after() { PYTHONPATH=$ROOT:/tmp/site python3 -m roofline.cli "$@"; }
nvidia-smi --query-gpu=name,driver_version,memory.used,memory.total --format=csv,noheader
case "${1:-speed}" in
speed)
  mkdir -p "$OUT/before" "$OUT/after"
  for who in before after; do
    echo "== throughput $who"
    $who bench throughput --model llama-3-8b --dataset-file "$DATA" --num-prompts 1000 --no-progress \
      --out-dir "$OUT/$who" 2>&1 | grep -E "^(requests|elapsed|wrote)" | tee -a "$OUT/log"
  done
  for who in after before; do
    echo "== decode $who"
    $who bench decode --model llama-3-8b --batch-sizes 1,64 --contexts 128,1k --steps 50 \
      --out-dir "$OUT/$who" 2>&1 | tail -7 | tee -a "$OUT/log"
  done
  ;;
check)
  mkdir -p "$OUT/before" "$OUT/after"
  cat .model/smol.part.* > /tmp/smol.gguf && sha256sum /tmp/smol.gguf | tee -a "$OUT/log"
  export ROOFLINE_TEST_GGUF=/tmp/smol.gguf
  PYTHONPATH=$ROOT:/tmp/site python3 -m pytest -q -x tests/kernels tests/attention tests/test_gpu_backends.py \
    -p no:cacheprovider 2>&1 | tail -4 | tee -a "$OUT/log"
  for dt in float32 bfloat16; do
    PYTHONPATH=$ROOT:/tmp/site python3 bench/gpu_engine_parity.py /tmp/smol.gguf "$OUT/after" --dtype $dt 2>&1 \
      | grep -E "prompts token-identical|FAILED" | tee -a "$OUT/log"
  done
  for who in before after; do
    echo "== host share $who"
    if [ $who = before ]; then cd "$ROOT/.devcarry/base"; else cd "$ROOT"; fi
    PYTHONPATH=.:/tmp/site python3 "$ROOT/bench/gpu_host_share.py" "$OUT/$who/host-share.json" -- --model llama-3-8b \
      --dataset-file "$DATA" --num-prompts 1000 --no-progress --out-dir "$OUT/$who/hs" 2>&1 | grep -E "HOSTSHARE|Error" \
      | tee -a "$OUT/log"
    cd "$ROOT"
  done
  ;;
esac
# hostshare-after: the "after" half of the host-share pair plus a second before/after throughput pair.
if [ "${1:-}" = rerun ]; then
  mkdir -p "$OUT/before" "$OUT/after"
  PYTHONPATH=$ROOT:/tmp/site python3 bench/gpu_host_share.py "$OUT/after/host-share.json" -- --model llama-3-8b \
    --dataset-file "$DATA" --num-prompts 1000 --no-progress --out-dir "$OUT/after/hs" 2>&1 | grep -E "HOSTSHARE|Error" \
    | tee -a "$OUT/log"
  for who in after before; do
    echo "== throughput $who (rerun)" | tee -a "$OUT/log"
    $who bench throughput --model llama-3-8b --dataset-file "$DATA" --num-prompts 1000 --no-progress \
      --out-dir "$OUT/$who" 2>&1 | grep -E "^(elapsed|wrote)" | tee -a "$OUT/log"
  done
fi
# async: the same commit with async scheduling on (default on GPUs) and off, and the host share with it on.
if [ "${1:-}" = async ]; then
  mkdir -p "$OUT/async" "$OUT/sync"
  for mode in async sync async; do
    flag=--async-scheduling; [ $mode = sync ] && flag=--no-async-scheduling
    echo "== throughput $mode" | tee -a "$OUT/log"
    after bench throughput --model llama-3-8b --dataset-file "$DATA" --num-prompts 1000 --no-progress $flag \
      --out-dir "$OUT/$mode" 2>&1 | grep -E "^(elapsed|wrote)|Error" | tee -a "$OUT/log"
  done
  PYTHONPATH=$ROOT:/tmp/site python3 bench/gpu_host_share.py "$OUT/async/host-share.json" -- --model llama-3-8b \
    --dataset-file "$DATA" --num-prompts 1000 --no-progress --out-dir "$OUT/async/hs" 2>&1 | grep -E "HOSTSHARE|Error" \
    | tee -a "$OUT/log"
  echo "== decode" | tee -a "$OUT/log"
  after bench decode --model llama-3-8b --batch-sizes 1,64 --contexts 128,1k --steps 50 --out-dir "$OUT/async" 2>&1 \
    | tail -6 | tee -a "$OUT/log"
fi
