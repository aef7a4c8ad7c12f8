#!/usr/bin/env bash
# Issue 29, the Gluon FP8 prefill kernel (gluon_prefill_kernel_fp8) on an H100/H200, one device call, < 9 min:
#   0. smoke: one small fp8 case per kernel ("fp8", and "fp8pp" with 3 and with 2 V^T buffers) under `timeout 120`
#      (a hang of an mbarrier protocol shows here, not later)
#   1. the FP8 kernel's GPU tests (float64 oracle on the dequantized codes, the Triton kernel, fallbacks), -s:
#      every case prints its error
#   2. the benchmark at 4k/8k/16k (32k tokens, causal, GQA 32/8, D 128), contiguous and paged-16 caches: SDPA,
#      Triton bf16, the Gluon bf16 default (pingpong), Triton on the fp8 cache, the FP8 kernels' configs
#      ($FP8_VARIANTS: the pipelined default and the ping-pong "fp8pp" ones) with and without the q quantization
#   e2e (a second call, ~7 min): end to end, llama-3-8b shape, dummy weights, one engine per row, bf16 KV then FP8
#      KV: (a) 256 x (7,680 in, 256 out) random ids (.devcarry/long256.json, carried; generator in
#      bench/results/longkv-20261204/README.md), the prefill-bound workload; ShareGPT 1000 with FP8 weights
#      (.devcarry/sharegpt1000.json from `roofline bench throughput --export-dataset`, carried)
# Usage (repo root; $OUT set by the device tool): bash bench/gpu_fp8_prefill.sh [bench-only | e2e]
set -uo pipefail
export PYTHONUNBUFFERED=1 PYTHONPATH=$(pwd)  # the FP8 kernel is the default for fp8 caches (=0: off)
OUT=${OUT:-bench/results/fp8-prefill}
mkdir -p "$OUT"
{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, \
'cap', torch.cuda.get_device_capability())"
} 2>&1 | tee -a "$OUT/log"
R() { python3 -m roofline.cli "$@"; }
if [ "${1:-}" = e2e ]; then
  for kv in auto fp8_e4m3; do
    echo "=== long256 $kv $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
    timeout 170 python3 -m roofline.cli bench throughput --model llama-3-8b --dataset-file .devcarry/long256.json \
      --num-prompts 256 --max-model-len 8192 --max-num-seqs 256 --kv-cache-dtype $kv --no-progress --out-dir /tmp/tput \
      > "$OUT/long256-$kv.log" 2>&1
    echo "rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/long256-$kv.log" | grep -iE "tok/s|pool|preempt|Error" | tail -6 | tee -a "$OUT/log"
  done
  for kv in auto fp8_e4m3; do
    echo "=== sharegpt1000 fp8 weights, KV $kv $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
    timeout 110 python3 -m roofline.cli bench throughput --model llama-3-8b --dataset-file .devcarry/sharegpt1000.json \
      --num-prompts 1000 --quantization fp8 --kv-cache-dtype $kv --no-progress --out-dir /tmp/tput > "$OUT/sharegpt-fp8-$kv.log" 2>&1
    echo "rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/sharegpt-fp8-$kv.log" | grep -iE "tok/s|pool|preempt|Error" | tail -6 | tee -a "$OUT/log"
  done
  tar czf "$OUT/json.tgz" -C /tmp/tput . ; exit 0
fi
if [ "${1:-}" != bench-only ]; then
  echo "=== smoke $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
  timeout 120 python3 -m pytest -q -p no:cacheprovider -s tests/kernels/test_gluon_prefill.py \
    -k "test_gluon_fp8_matches_float64 and full_128 and heads0-16 and (n128_s3 or pp_n128_s2_vt1)" > "$OUT/smoke.log" 2>&1
  rc=$?; tail -5 "$OUT/smoke.log" | tee -a "$OUT/log"
  if [ $rc -ne 0 ]; then echo "smoke rc $rc: stop" | tee -a "$OUT/log"; tail -60 "$OUT/smoke.log"; exit 1; fi
  echo "=== tests $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
  timeout ${TESTS_TIMEOUT:-240} python3 -m pytest -q -p no:cacheprovider -s tests/kernels/test_gluon_prefill.py tests/kernels/test_act_quant_fused.py -k "${TESTS_K:-fp8 or config_reason}" \
    > "$OUT/tests.log" 2>&1
  echo "tests rc $?" | tee -a "$OUT/log"; grep -E "^fp8|passed|failed|Error" "$OUT/tests.log" | tail -80 | tee -a "$OUT/log"
fi
echo "=== bench $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
timeout ${BENCH_TIMEOUT:-250} python3 bench/gpu_fa3_bench.py --fp8 --variants gluon_pp_n128_s2 --layouts ${LAYOUTS:-contig,paged16} --seqs ${SEQS:-4096,8192,16384} \
  --fp8-variants ${FP8_VARIANTS:-gluon_fp8_n128_s3,gluon_fp8pp_n128_s2,gluon_fp8pp_n128_s3,gluon_fp8pp_n128_s2_vt3,gluon_fp8pp_n128_s3_c16} \
  --out "$OUT/fa3_fp8.json" > "$OUT/bench.log" 2>&1
echo "bench rc $?" | tee -a "$OUT/log"; sed -n '/^TFLOP/,$p' "$OUT/bench.log" | tee -a "$OUT/log"
