#!/usr/bin/env bash
# Issue 29, round 1 of the Gluon decode kernel for int8 / fp8 KV (roofline/kernels/gluon_decode*.py), on the H200.
# One call, about 4-5 minutes, every step under `timeout`; results under $OUT:
#   smoke  a few (batch, ctx, block, splits, fmt) cases: gluon vs float64 oracle and vs the Triton 'mma' kernel,
#          max abs / rel error, plus which kernel the default dispatch picks (log line) -> $OUT/smoke.log
#   tests  the GPU tests of tests/kernels/test_gluon_decode.py (+ the Triton backend's decode tests)
#   bench  roofline bench attention --decode-only: bf16 / int8 / fp8 x variants old, mma, gluon in one process at
#          batch 8, 64 x ctx 4k, 32k, block 64 then block 16. Columns of the final table: B, ctx, bs (block size),
#          ql (query_len), KV format, var (stage-1 kernel), splits, us (median, L2 flushed), of read (KV bytes /
#          time / measured read bandwidth), vs bf16 (time / bf16 cache's 'old' kernel, same point), vs old (time /
#          same format's 'old'). Target of issue 29: int8/fp8 gluon 'vs bf16' <= 0.6 at 32k, 'of read' >= 0.85.
#   tiles  (last, ~1 min) gluon only, int8 / fp8 at 8 and 64 x 32k, block 64: the default
#          tile (64 keys x 4 warps, prefetch) beside --configs BLOCK_NxWARPSxSTAGES (STAGES 1 = no register
#          prefetch of the next tile, 2 = prefetch) and more splits (the default split count already scales with 4 / num_warps)
# Usage (repo root; $OUT set by the device tool): bash bench/gpu_kvq.sh [smoke] [tests] [bench] [tiles]
#   (default: all four, about 4-5 minutes; the tiles step is last so a cut run keeps the main table)
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-bench/results/kvq}
mkdir -p "$OUT"
STEPS=${*:-smoke tests bench tiles}
nvidia-smi --query-gpu=name,driver_version,clocks.sm,temperature.gpu --format=csv,noheader | tee -a "$OUT/log"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/log"
R() { PYTHONPATH=$(pwd) python3 -m roofline.cli "$@"; }
for step in $STEPS; do
  echo "=== $step $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
  case "$step" in
  smoke)
    PYTHONPATH=$(pwd):$(pwd)/tests/kernels timeout 45 python3 - <<'PY' 2>&1 | tee "$OUT/smoke.log" | grep -v -i warn
import logging, math, time, torch
from kernel_cases import attention_f64, make_paged_case, poison_stale_quantized, quantize_cache
from roofline.kernels.decode_attention import paged_decode_attention
logging.basicConfig(level=logging.INFO, format="  log: %(name)s: %(message)s")
def deq(c, s):
    s = s.double(); return c.double() * (s[:, None] if s.dim() == 1 else s.unsqueeze(-1))
print(f"{'fmt':>8} {'B':>3} {'ctx':>6} {'bs':>4} {'spl':>4} {'H/Hkv/D':>10}  {'gluon max|err|':>14} {'rel':>8}  "
      f"{'mma max|err|':>12} {'rel':>8}  (both vs float64 on the dequantized cache; bf16 q)")
bad = 0
for fmt in ("int8", "fp8_e4m3"):
    for (B, ctx, bs, spl, H, Hkv, D) in ((2, 1000, 16, 3, 32, 8, 128), (4, 4097, 64, 8, 32, 8, 128),
                                         (3, 333, 128, 2, 16, 4, 64), (1, 70, 16, 1, 16, 2, 128)):
        lens = [ctx - 37 * i for i in range(B)]
        q, kc, vc, meta = make_paged_case([1] * B, lens, H, Hkv, D, bs, torch.bfloat16, seed=B + bs)
        kc, vc, ks, vs = quantize_cache(kc, vc, fmt)
        poison_stale_quantized(kc, vc, meta, ks, vs)
        sc = 1 / math.sqrt(D)
        oracle = attention_f64(q, deq(kc, ks), deq(vc, vs), meta, sc)
        res = []
        for var in ("gluon", "mma"):
            o = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, sc, num_splits=spl,
                                       k_scale=ks, v_scale=vs, variant=var).cpu().double()
            e = (o - oracle).abs().max().item(); r = ((o - oracle).norm() / oracle.norm()).item()
            res += [e, r]
        bad += not (res[1] < 1e-2)
        print(f"{fmt:>8} {B:>3} {ctx:>6} {bs:>4} {spl:>4} {f'{H}/{Hkv}/{D}':>10}  {res[0]:>14.2e} {res[1]:>8.1e}  "
              f"{res[2]:>12.2e} {res[3]:>8.1e}")
print("default dispatch (variant None, ROOFLINE_DECODE_KERNEL unset): the last fp8 case (gluon: no log line), "
      "then an int8 cache at head_dim 96 (a fallback log line expected):")
paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, sc, k_scale=ks, v_scale=vs)
q2 = torch.randn(1, 8, 96, device="cuda", dtype=torch.bfloat16)
k2 = torch.zeros(2, 16, 2, 96, device="cuda", dtype=torch.int8); s2 = torch.ones(2, 16, 2, device="cuda")
paged_decode_attention(q2, k2, k2, torch.zeros(1, 1, dtype=torch.int32, device="cuda"),
                       torch.tensor([5], dtype=torch.int32, device="cuda"), 0.1, k_scale=s2, v_scale=s2)
print("SMOKE", "FAIL" if bad else "OK", f"({bad} cases above rel 1e-2)")
PY
    ;;
  tests)
    PYTHONPATH=$(pwd) timeout 90 python3 -m pytest -q -m gpu --tb=short -rf -p no:cacheprovider \
      tests/kernels/test_gluon_decode.py tests/kernels/test_triton_attention_backend.py -k "gluon or decode or quantized" 2>&1 \
      | tee "$OUT/gputests.log" | grep -E "^E |^FAILED|passed|failed|error" | tail -30
    ;;
  bench)
    for bs in 64 16; do
      timeout 80 bash -c "$(declare -f R); R bench attention --decode-only --kv-cache-dtype auto,int8,fp8_e4m3 \
        --batches 8,64 --ctxs 4k,32k --variants old,mma,gluon --block-size $bs --out-dir $OUT" \
        > "$OUT/bench-bs$bs.log" 2>&1
      echo "bench block $bs rc $? (124 = timed out; the per-point lines above the table are in bench-bs$bs.log)" \
        | tee -a "$OUT/log"
      grep -vi warn "$OUT/bench-bs$bs.log" | grep -A60 "^ *B  *ctx" | tee -a "$OUT/log"
    done
    ;;
  tiles)
    timeout 80 bash -c "$(declare -f R); R bench attention --decode-only --kv-cache-dtype int8,fp8_e4m3 \
      --batches 8,64 --ctxs 32k --variants gluon --block-size 64 \
      --configs 64x4x1,16x1x2,32x1x2,32x1x1,64x1x1,32x2x2,128x8x2 --out-dir $OUT" \
      > "$OUT/tiles.log" 2>&1
    echo "tiles rc $?" | tee -a "$OUT/log"; grep -vi warn "$OUT/tiles.log" | grep -A80 "^ *B  *ctx" | tee -a "$OUT/log"
    ;;
  *) echo "unknown step $step" | tee -a "$OUT/log" ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S)" | tee -a "$OUT/log"
