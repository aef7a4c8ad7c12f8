#!/usr/bin/env bash
# Device call steps for round 6 (H200): the INT4 tensor-core decode GEMM (issue 28) and the helpers' GPU steps.
# Run from the repo root of the device copy: bash bench/gpu_round6.sh STEP...  Everything under $OUT is packed
# into $OUT/round6.tgz at the end (a call brings back at most 8 files), beside the plain log.
set -uo pipefail
export PYTHONUNBUFFERED=1
NEW=$(pwd)
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$OUT/log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/log"
git log --oneline -1 2>/dev/null | tee -a "$OUT/log"
R() { PYTHONPATH="$NEW" python3 -m roofline.cli "$@"; }
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
  case "$step" in
  w4tests)  # the Gluon INT4 mma GEMM against float64, in a CUDA graph with PDL, through the layer dispatch
    PYTHONPATH=$NEW timeout 240 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/kernels/test_w4a16_mma.py ${W4K:+-k "$W4K"} \
      2>&1 | tee "$OUT/w4tests.log" | grep -E "^E |passed|failed|error" | tail -25 | tee -a "$OUT/log"
    ;;
  w4sweep)  # per projection and M: mma tiles/splits vs the Triton INT4 path vs bf16 cuBLAS
    PYTHONPATH=$NEW timeout ${W4SWEEP_TIMEOUT:-240} python3 bench/gpu_w4a16_mma.py --out "$OUT/w4a16_mma.json" \
      --ms "${W4MS:-1,4,8,16,32,64}" --stages "${W4STAGES:-1,2}" --splits "${W4SPLITS:-none,1,2,4,8,16}" --table roofline/kernels/dispatch_tables/NVIDIA_H200.json > "$OUT/w4sweep.log" 2>&1; cp roofline/kernels/dispatch_tables/NVIDIA_H200.json "$OUT/NVIDIA_H200.json"
    echo "w4sweep rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/w4sweep.log" | grep -E "M=|WRONG|FAIL|Error|done|TB/s" | tail -45 | tee -a "$OUT/log"
    ;;
  w4decode)  # end to end, one process: bf16, INT4 with the mma kernel, INT4 with the Triton kernels
    timeout ${DECODE_TIMEOUT:-300} bash -c "$(declare -f R); NEW=$NEW; R bench decode --model llama-3-8b --batch-sizes ${BATCHES:-1,8,64} --contexts 1k --quantization ${QUANTS:-none,int4} --int4-kernel ${INT4K:-mma,triton} --out-dir $OUT" \
      > "$OUT/w4decode.log" 2>&1
    echo "w4decode rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/w4decode.log" | grep -E "x$|^ +[0-9]|^model|rc|Error|measured" | tail -30 | tee -a "$OUT/log"
    ;;
  prefillgemm)  # prefill-sized GEMMs per format through the engine's linear paths vs bf16 cuBLAS (issue 28)
    PYTHONPATH=$NEW timeout ${PGEMM_TIMEOUT:-200} python3 bench/gpu_prefill_gemm.py --out "$OUT/prefill_gemm.json" ${PGEMM_MS:+--ms $PGEMM_MS} \
      > "$OUT/prefill_gemm.log" 2>&1; echo "prefillgemm rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/prefill_gemm.log" | tail -60 | tee -a "$OUT/log"
    ;;
  profile)  # where a decode step's GPU time goes (PROFILE="model:batch[:quant] ...")
    for spec in ${PROFILE:-qwen3-30b-a3b:1 llama-3-8b:1}; do IFS=: read -r pm pb pq <<< "$spec"
      PYTHONPATH=$NEW timeout ${PROFILE_TIMEOUT:-150} python3 bench/gpu_decode_profile.py --model $pm --batch $pb ${pq:+--quantization $pq} \
        --out "$OUT/profile-$pm-b$pb${pq:+-$pq}.json" > "$OUT/profile-$pm-b$pb${pq:+-$pq}.log" 2>&1; echo "profile $spec rc $?" | tee -a "$OUT/log"
      grep -vi warn "$OUT/profile-$pm-b$pb${pq:+-$pq}.log" | grep -A22 "^model" | tee -a "$OUT/log"; done
    ;;
  throughput)  # ShareGPT 1000 (carried .devcarry/sharegpt1000.json), one engine per model (TPUT_MODELS) and weight format (TPUT_QUANTS)
    for m in ${TPUT_MODELS:-llama-3-8b}; do for q in ${TPUT_QUANTS:-none fp8}; do
      timeout ${TPUT_TIMEOUT:-200} bash -c "$(declare -f R); NEW=$NEW; R bench throughput --model $m --dataset-file .devcarry/sharegpt1000.json --num-prompts 1000 --no-progress ${TPUT_ARGS:-} $([ $q != none ] && echo --quantization $q) --out-dir $OUT" \
        > "$OUT/throughput-$m-$q.log" 2>&1; echo "throughput $m $q rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/throughput-$m-$q.log" | tail -4 | tee -a "$OUT/log"; done; done
    ;;
  w8)  # the 8-bit weight-only mma GEMM: GPU tests, per-format sweep into the dispatch table, then end to end
    PYTHONPATH=$NEW timeout 200 python3 -m pytest -q --tb=short -p no:cacheprovider -m gpu tests/kernels/test_w8a16_mma.py tests/kernels/test_w4a16_mma.py -x \
      2>&1 | tee "$OUT/w8tests.log" | grep -E "^E |passed|failed|error" | tail -20 | tee -a "$OUT/log"
    for f in ${W8FORMATS:-int8 fp8}; do
      PYTHONPATH=$NEW timeout ${W8SWEEP_TIMEOUT:-170} python3 bench/gpu_w4a16_mma.py --format $f --out "$OUT/w8_mma_$f.json" \
        --ms "${W8MS:-1,4,8,16,32,64}" --splits "${W8SPLITS:-none,1,2,4,8}" --table roofline/kernels/dispatch_tables/NVIDIA_H200.json > "$OUT/w8sweep-$f.log" 2>&1
      echo "w8sweep $f rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/w8sweep-$f.log" | grep -E "M=|WRONG|FAIL|Error|done|TB/s" | tail -30 | tee -a "$OUT/log"
    done
    cp roofline/kernels/dispatch_tables/NVIDIA_H200.json "$OUT/NVIDIA_H200.json"
    timeout ${DECODE_TIMEOUT:-200} bash -c "$(declare -f R); NEW=$NEW; R bench decode --model llama-3-8b --batch-sizes ${BATCHES:-1,8,64} --contexts 1k --quantization ${QUANTS:-none,int8,fp8,int4} --out-dir $OUT" \
      > "$OUT/w8decode.log" 2>&1
    echo "w8decode rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/w8decode.log" | grep -E "x$|^ +[0-9]|^model|rc|Error|measured" | tail -30 | tee -a "$OUT/log"
    ;;
  fa3) timeout 330 bash bench/gpu_fa3.sh 2>&1 | tail -40 | tee -a "$OUT/log" ;;
  fa3quick) timeout ${FA3_TIMEOUT:-170} bash bench/gpu_fa3.sh quick 2>&1 | tail -40 | tee -a "$OUT/log" ;;
  moedecode)  # decode at the MoE shapes (dummy weights, built on the GPU): fractions of the MoE floor
    timeout ${MOE_DECODE_TIMEOUT:-170} bash -c "$(declare -f R); NEW=$NEW; R bench decode --model mixtral-8x7b --batch-sizes 1,64 --contexts 512 --steps 16 --out-dir $OUT" \
      > "$OUT/moe-decode-mixtral.log" 2>&1; echo "decode mixtral rc $?" | tee -a "$OUT/log"
    grep -vi warn "$OUT/moe-decode-mixtral.log" | grep -E "^model|^ +[0-9]|Error|floor" | tail -8 | tee -a "$OUT/log"
    [ -n "${MOE_QWEN:-}" ] && { timeout 100 bash -c "$(declare -f R); NEW=$NEW; R bench decode --model qwen3-30b-a3b --batch-sizes 1,64 --contexts 512 --steps 16 --out-dir $OUT" \
      > "$OUT/moe-decode-qwen3.log" 2>&1; echo "decode qwen3 rc $?" | tee -a "$OUT/log"
      grep -vi warn "$OUT/moe-decode-qwen3.log" | grep -E "^model|^ +[0-9]|Error|floor" | tail -6 | tee -a "$OUT/log"; }
    ;;
  enginetests)  # the engine-level GPU tests on the default model (its GGUF carried in two parts, .model/smol.part.*)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl 2>&1 | tail -2
    cat .model/smol.part.a? > /tmp/smol.gguf && sha256sum /tmp/smol.gguf | tee -a "$OUT/log"
    ROOFLINE_TEST_GGUF=/tmp/smol.gguf PYTHONPATH=$NEW:/tmp/site timeout ${ENGINE_TESTS_TIMEOUT:-240} python3 -m pytest -q -m gpu --tb=short -rf -p no:cacheprovider \
      ${ENGINE_TESTS:-tests/test_gpu_backends.py tests/test_prefix_cache.py tests/spec_decode} 2>&1 | tee "$OUT/enginetests.log" \
      | grep -E "^E |passed|failed|error|FAILED" | tail -25 | tee -a "$OUT/log"
    ;;
  moe) timeout 380 bash bench/gpu_moe.sh 2>&1 | tail -40 | tee -a "$OUT/log" ;;
  gputests)
    PYTHONPATH=$NEW timeout ${GPUTESTS_TIMEOUT:-420} python3 -m pytest -q -m gpu --continue-on-collection-errors --tb=line -rf -p no:cacheprovider ${GPUTESTS:-tests} 2>&1 | tee "$OUT/gputests.log" \
      | grep -E "^/|^E |passed|failed|error" | tail -40 | tee -a "$OUT/log"
    ;;
  longkv)  # issue 29: a long-context workload where the bf16 pool binds (carried .devcarry/$LONG_DATA.json, default long256: 256 random
    # prompts of 7680 tokens, 256 out each), bf16 KV then FP8 KV, one engine each (LONG_QUANT: the weight format)
    for kv in ${LONG_KVS:-auto fp8}; do
      timeout ${LONG_TIMEOUT:-270} bash -c "$(declare -f R); NEW=$NEW; R bench throughput --model llama-3-8b --dataset-file .devcarry/${LONG_DATA:-long256}.json --num-prompts 256 --max-model-len 8192 --max-num-seqs 256 --kv-cache-dtype $kv ${LONG_QUANT:+--quantization $LONG_QUANT} --no-progress --out-dir $OUT" \
        > "$OUT/${LONG_DATA:-long256}-$kv.log" 2>&1; echo "longkv ${LONG_DATA:-long256} $kv rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/${LONG_DATA:-long256}-$kv.log" | grep -iE "tok/s|KV|preempt|pool|Error" | tail -8 | tee -a "$OUT/log"; done
    ;;
  gpushards)  # the whole GPU suite as SHARDS parallel pytest processes (files dealt round-robin; the suite is
    # mostly Triton compiles on the host's 16 cores, which one process leaves idle), one log each
    # files that mark tests gpu, directly or through kernel_cases' gpu_only / DTYPES (GPUFILES: a given list)
    files=${GPUFILES:-$(grep -rlE "mark.gpu|gpu_only|kernel_cases" tests --include='test_*.py' | sort)}; n=${SHARDS:-4}; i=0
    for f in $files; do echo "$f" >> "$OUT/shard$((i % n)).txt"; i=$((i + 1)); done
    for s in $(seq 0 $((n - 1))); do
      ( PYTHONPATH=$NEW timeout ${GPUTESTS_TIMEOUT:-520} python3 -m pytest -q -m gpu --tb=short -rf -p no:cacheprovider \
          --durations=5 $(cat "$OUT/shard$s.txt") > "$OUT/gpushard$s.log" 2>&1; echo "shard $s rc $?" >> "$OUT/log" ) &
    done; wait
    for s in $(seq 0 $((n - 1))); do echo "-- shard $s: $(tr '\n' ' ' < "$OUT/shard$s.txt")" | tee -a "$OUT/log"
      grep -E "^FAILED|^ERROR|passed|failed" "$OUT/gpushard$s.log" | tail -8 | tee -a "$OUT/log"; done
    ;;
  *) echo "unknown step $step" | tee -a "$OUT/log" ;;
  esac
done
cd "$OUT" && tar czf /tmp/round6.tgz --exclude log . && mv /tmp/round6.tgz . && find . -mindepth 1 ! -name round6.tgz ! -name log -delete
ls -la "$OUT"
