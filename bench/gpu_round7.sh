#!/usr/bin/env bash
# Issue 33 (and 28) on the H200, round 7: steps run in the order given, each under `timeout`, a shared deadline
# of DEADLINE s (default 570) so that one call returns what it measured. Run from the repo root:
#   bash bench/gpu_round7.sh moetests tune decode moe profile
# Steps:
#   moetests  every GPU test under tests/moe (bf16/int8/fp8 kernels vs float64, graphs, a dummy model)
#   tune      bench/gpu_moe_tune.py at the Qwen3-30B-A3B shape, M = TUNE_TOKENS (1,2,4,8), bf16/int8/fp8, merged
#             into the committed table (the new down kernel's slot groups are phase 3); the table lands in $OUT
#             and replaces roofline/kernels/moe_configs/NVIDIA_H200.json for the steps after it
#   decode    roofline bench decode --model qwen3-30b-a3b --batch-sizes $BATCHES (1) --contexts 512
#   moe       roofline bench moe --model qwen3-30b-a3b --tokens 1,8 --quantization none,int8,fp8
#   profile   bench/gpu_decode_profile.py --model qwen3-30b-a3b --batch 1 (kernels per step)
#   timelines bench/gpu_decode_profile.py (kernels and timeline charges per step) for each MODEL:QUANT of $TIMELINES
#             (qwen3-30b-a3b:none llama-3-8b:none llama-3-8b:int4), batch 1, one process each
#   gputests  pytest -m gpu on $TESTS (default: tests/moe and the attention/RoPE/PDL kernel tests), slowest 15 listed
#   ab        roofline bench decode at batch 1 for each of $AB_MODELS (qwen3-30b-a3b,llama-3-8b), alternating the
#             code in $AB_BASE (a `git archive` of the baseline commit, carried as an ignored path) and this tree,
#             twice each, in one process tree on one warm GPU; on a card other than the H200 both sides get the
#             H200 dispatch and MoE tables (copied to the card's name)
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)
OUT=${OUT:-/tmp/round7}
mkdir -p "$OUT"
T0=$SECONDS
DEADLINE=${DEADLINE:-570}
left() { local l=$((DEADLINE - (SECONDS - T0))); [ $l -lt 5 ] && l=5; [ $l -gt ${1:-9999} ] && l=$1; echo $l; }
TABLE=roofline/kernels/moe_configs/NVIDIA_H200.json
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} 2>&1 | tee -a "$OUT/log"
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S) at $((SECONDS - T0)) s" | tee -a "$OUT/log"
  case "$step" in
  moetests)
    timeout $(left 300) python3 -m pytest -q -m gpu --tb=short -p no:cacheprovider tests/moe > "$OUT/moetests.log" 2>&1
    echo "rc $?" | tee -a "$OUT/log"; grep -E "^E |passed|failed|error" "$OUT/moetests.log" | tail -12 | tee -a "$OUT/log" ;;
  tune)
    timeout $(left 260) python3 bench/gpu_moe_tune.py --models qwen3-30b-a3b --formats bfloat16,int8,fp8 \
      --tokens ${TUNE_TOKENS:-1,2,4,8} --budget-s ${TUNE_BUDGET:-190} --merge $TABLE --out "$OUT/moe_tune.json" \
      --table "$OUT/NVIDIA_H200.json" > "$OUT/tune.log" 2>&1
    echo "rc $?" | tee -a "$OUT/log"; grep -E "M=|budget|wrote|Error" "$OUT/tune.log" | tail -20 | tee -a "$OUT/log"
    [ -s "$OUT/NVIDIA_H200.json" ] && cp "$OUT/NVIDIA_H200.json" $TABLE ;;
  decode)
    timeout $(left 120) python3 -m roofline.cli bench decode --model qwen3-30b-a3b --batch-sizes ${BATCHES:-1} \
      --contexts 512 --steps 16 --out-dir "$OUT" > "$OUT/decode.log" 2>&1
    echo "rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/decode.log" | grep -E "^model|^ +[0-9]|Error|floor" | tail -8 | tee -a "$OUT/log" ;;
  moe)
    timeout $(left 90) python3 -m roofline.cli bench moe --model qwen3-30b-a3b --tokens 1,8 \
      --quantization none,int8,fp8 --iters 10 --out-dir "$OUT" > "$OUT/moe.log" 2>&1
    echo "rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/moe.log" | grep -E "^ +[0-9]|^experts|Error" | tail -12 | tee -a "$OUT/log" ;;
  profile)
    timeout $(left 120) python3 bench/gpu_decode_profile.py --model qwen3-30b-a3b --batch 1 ${PROFILE_ARGS:-} \
      --out "$OUT/profile.json" > "$OUT/profile.log" 2>&1
    echo "rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/profile.log" | grep -E "^model|^ +[0-9]" | head -30 | tee -a "$OUT/log" ;;
  timelines)
    for mq in ${TIMELINES:-qwen3-30b-a3b:none llama-3-8b:none llama-3-8b:int4}; do
      m=${mq%%:*}; q=${mq##*:}; qa=(); [ "$q" = none ] || qa=(--quantization "$q")
      timeout $(left ${TIMELINE_S:-80}) python3 bench/gpu_decode_profile.py --model "$m" --batch 1 "${qa[@]}" --top 30 \
        --out "$OUT/timeline-$m-$q.json" > "$OUT/timeline-$m-$q.log" 2>&1
      echo "$mq rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/timeline-$m-$q.log" | grep -E "^model|^timeline" | tee -a "$OUT/log"
    done ;;
  gputests)
    timeout $(left 400) python3 -m pytest -q -m gpu --tb=short -p no:cacheprovider --durations=15 \
      ${TESTS:-tests/moe tests/kernels/test_pdl.py tests/kernels/test_rope_cache.py tests/kernels/test_triton_attention_backend.py} \
      > "$OUT/gputests.log" 2>&1
    echo "rc $?" | tee -a "$OUT/log"; grep -E "^E |passed|failed|error|^[0-9.]+s " "$OUT/gputests.log" | tail -30 | tee -a "$OUT/log" ;;
  ab)
    name=$(python3 -c "import torch; print(torch.cuda.get_device_name().replace(' ', '_'))")
    if [ "$name" != NVIDIA_H200 ]; then  # the tables are keyed by device name: apply the H200 ones on both sides
      for tree in . "${AB_BASE:-.ab/base}"; do for d in dispatch_tables moe_configs; do
        f=$tree/roofline/kernels/$d/NVIDIA_H200.json; [ -f "$f" ] && cp "$f" "$tree/roofline/kernels/$d/$name.json"
      done; done; echo "H200 tables applied on $name (both sides)" | tee -a "$OUT/log"
    fi
    for model in ${AB_MODELS:-qwen3-30b-a3b llama-3-8b}; do
      for rep in 1 2; do
        for side in base head; do
          path=$(pwd); [ $side = base ] && path=$(cd "${AB_BASE:-.ab/base}" && pwd)
          # Run from the tree's own directory: `python -m` puts the cwd ahead of PYTHONPATH on sys.path, so from
          # the repo root the base side would import this tree (the A/Bs before 2026-12-05 17:00 did).
          (cd "$path" && PYTHONPATH=$path timeout $(left 90) python3 -m roofline.cli bench decode --model $model \
            --batch-sizes 1 --contexts 512 --steps 16 --out-dir "$OUT/ab-$side" > "$OUT/ab.log" 2>&1)
          echo "$model $side rep $rep rc $?: $(grep -E '^ +1 +512' "$OUT/ab.log" | tail -1)" | tee -a "$OUT/log"
        done
      done
    done ;;
  *) echo "unknown step $step" | tee -a "$OUT/log" ;;
  esac
done
echo "=== done at $((SECONDS - T0)) s" | tee -a "$OUT/log"
