#!/usr/bin/env bash
# Issue 28, the W8A8 activation quantization fused into its producer (RMSNorm, SiLU-and-mul), on a GPU. Steps, in the
# order given, from the repo root ($OUT: where results go; AB_BASE: a `git archive` of the baseline's roofline/):
#   tests    the fused kernels and the model-level identity test, and the per-token quantizer / W8A8 GPU tests
#   prefill  bench/gpu_prefill_gemm.py --producer (each projection with the kernel producing its input)
#   decode   roofline bench decode --model llama-3-8b --quantization $QUANTS at $BATCHES, the baseline tree and this
#            one alternated, ROUNDS times, each from its own directory
#   tput     roofline bench throughput (ShareGPT 1000, carried .devcarry/sharegpt1000.json from --export-dataset):
#            this tree in bf16, then fp8 on the baseline and on this tree, alternated ROUNDS times
set -uo pipefail
export PYTHONUNBUFFERED=1
HERE=$(pwd)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$OUT/log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/log"
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
  case "$step" in
  tests)
    PYTHONPATH=$HERE:$HERE/.site timeout ${TESTS_S:-300} python3 -m pytest -q -m gpu --tb=short -p no:cacheprovider \
      ${TESTS:-tests/kernels/test_act_quant_fused.py tests/kernels/test_quant_gemm.py} -k "${K:-fused or per_token or w8a8 or fp8}" \
      > "$OUT/tests.log" 2>&1
    echo "rc $?" | tee -a "$OUT/log"; grep -E "^E |passed|failed|error" "$OUT/tests.log" | tail -20 | tee -a "$OUT/log" ;;
  prefill)
    PYTHONPATH=$HERE timeout ${PREFILL_S:-200} python3 bench/gpu_prefill_gemm.py --producer --ms ${MS:-2048,8192} \
      --out "$OUT/prefill_producer.json" > "$OUT/prefill_producer.log" 2>&1
    echo "rc $?" | tee -a "$OUT/log"; sed -n '/total time/,$p' "$OUT/prefill_producer.log" | tee -a "$OUT/log" ;;
  decode)
    for round in $(seq 1 ${ROUNDS:-2}); do
      for side in base head; do
        path=$HERE; [ $side = base ] && path=$(cd "${AB_BASE:-.ab/base}" && pwd)
        # from the tree's own directory: `python -m` puts the cwd ahead of PYTHONPATH
        (cd "$path" && PYTHONPATH=$path:$HERE/.site timeout ${DECODE_S:-150} python3 -m roofline.cli bench decode \
          --model llama-3-8b --batch-sizes ${BATCHES:-32,64} --contexts 1k --quantization ${QUANTS:-fp8,smoothquant} \
          --out-dir "$OUT/decode-$side$round" > "$OUT/decode.log" 2>&1)
        echo "$side round $round rc $?:" | tee -a "$OUT/log"
        grep -E "measured|^ +[0-9]|x$" "$OUT/decode.log" | tee -a "$OUT/log"
      done
    done ;;
  tput)
    runs="head:none"; for round in $(seq 1 ${ROUNDS:-2}); do runs="$runs base:fp8 head:fp8"; done
    for run in $runs; do
      side=${run%%:*}; q=${run##*:}
      path=$HERE; [ $side = base ] && path=$(cd "${AB_BASE:-.ab/base}" && pwd)
      (cd "$path" && PYTHONPATH=$path:$HERE/.site timeout ${TPUT_S:-120} python3 -m roofline.cli bench throughput \
        --model llama-3-8b --dataset-file "$HERE/.devcarry/sharegpt1000.json" --num-prompts 1000 --no-progress \
        $([ $q != none ] && echo --quantization $q) --out-dir "$OUT/tput-$side-$q" > "$OUT/tput.log" 2>&1)
      echo "$side $q rc $?: $(grep -i 'tok/s' "$OUT/tput.log" | tail -2 | tr '\n' ' ')" | tee -a "$OUT/log"
    done ;;
  *) echo "unknown step $step" | tee -a "$OUT/log" ;;
  esac
done
