#!/usr/bin/env bash
# Device call steps for round 5 (H200): the decode-kernel work of issue 28 (one-row INT4 stream, FP8 weight-only,
# PDL) and the helpers' GPU checks. Run from the repo root of the device copy: bash bench/gpu_round5.sh STEP...
set -uo pipefail
export PYTHONUNBUFFERED=1
NEW=$(pwd)
TABLE=roofline/kernels/dispatch_tables/NVIDIA_H200.json
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$OUT/log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/log"
R() { PYTHONPATH="$NEW" python3 -m roofline.cli "$@"; }
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
  case "$step" in
  quanttests)  # the quantized GEMM kernels on the GPU (bf16 and fp32), every config family
    PYTHONPATH=$NEW timeout 300 python3 -m pytest -q -x --tb=short -p no:cacheprovider ${TESTS:-tests/kernels/test_quant_gemm.py tests/quant} 2>&1 | tee "$OUT/quanttests.log" | grep -E "^E |passed|failed|error" | tail -20
    ;;
  sweep)  # re-sweep INT4 and FP8 weight-only, merged into the committed table; the new table is used from here on
    PYTHONPATH=$NEW timeout 400 python3 bench/gpu_quant_sweep.py --formats "${SWEEP_FORMATS:-int4,fp8_w8a16}" \
      --out "$OUT/sweep.json" --table "$OUT/NVIDIA_H200.json" --merge-into $TABLE > "$OUT/sweep.log" 2>&1
    echo "sweep rc $?" | tee -a "$OUT/log"; grep -E "^\[|FAIL|copy" "$OUT/sweep.log" | tail -40 | tee -a "$OUT/log"
    [ -s "$OUT/NVIDIA_H200.json" ] && cp "$OUT/NVIDIA_H200.json" $TABLE
    ;;
  quant-decode)  # batch 1/8/64 per weight format, PDL off and on
    timeout ${DECODE_TIMEOUT:-500} bash -c "$(declare -f R); NEW=$NEW; R bench decode --model llama-3-8b --batch-sizes ${BATCHES:-1,8,64} --contexts 1k --quantization ${QUANTS:-none,int4,int8,fp8} --pdl ${PDL:-0,2} --out-dir $OUT" \
      > "$OUT/quant-decode.log" 2>&1
    echo "quant-decode rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/quant-decode.log" | grep -E "x$|^ +[0-9]|^model|rc|Error" | tail -60 | tee -a "$OUT/log"
    ;;
  moe)  # issue 33 on the GPU: kernels vs float64, then the fused layer and decode at the MoE shapes (dummy weights)
    PYTHONPATH=$NEW timeout 80 python3 -m pytest -q -x --tb=short -p no:cacheprovider tests/moe/test_fused_moe_gpu.py 2>&1 \
      | tee "$OUT/moe-gputests.log" | grep -E "^E |passed|failed|error" | tail -10
    timeout 80 bash -c "$(declare -f R); NEW=$NEW; R bench moe --model mixtral-8x7b --quantization none,int8 --out-dir $OUT" \
      > "$OUT/moe-bench.log" 2>&1; echo "bench moe rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/moe-bench.log" | tail -25
    [ -n "${MOE_DECODE:-}" ] && timeout 110 bash -c "$(declare -f R); NEW=$NEW; R bench decode --model mixtral-8x7b --batch-sizes 1,64 --contexts 512 --steps 16 --out-dir $OUT" \
      > "$OUT/moe-decode-mixtral.log" 2>&1; echo "decode mixtral rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/moe-decode-mixtral.log" | tail -6
    [ -n "${MOE_QWEN:-}" ] && timeout 100 bash -c "$(declare -f R); NEW=$NEW; R bench decode --model qwen3-30b-a3b --batch-sizes 1,8,64 --contexts 512 --steps 16 --out-dir $OUT" \
      > "$OUT/moe-decode-qwen3.log" 2>&1; echo "decode qwen3 rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/moe-decode-qwen3.log" | tail -6
    ;;
  gputests)
    PYTHONPATH=$NEW timeout ${GPUTESTS_TIMEOUT:-420} python3 -m pytest -q -m gpu --continue-on-collection-errors --tb=line -rf -p no:cacheprovider ${GPUTESTS:-tests} 2>&1 | tee "$OUT/gputests.log" \
      | grep -E "^/|^E |passed|failed|error" | tail -40
    ;;
  *) echo "unknown step $step" | tee -a "$OUT/log" ;;
  esac
done
