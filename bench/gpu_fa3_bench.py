"""Issue 29 prefill benchmark on the H200: the Gluon sm_90 kernel (each variant) against our Triton prefill kernel
and cuDNN SDPA (repeated KV heads and enable_gqa=True; the faster counts), in one process.

Causal full prefill, bf16, GQA 32/8, head_dim 128, S in 4k/8k/16k with batch = tokens / S (32k tokens),
FLOPs = 2 * 2 * S^2 / 2 * D * H * batch. KV layouts: "contig" (block 256, identity block table: each sequence's
keys in consecutive slots), "paged16" and "paged64" (shuffled blocks of 16 / 64). Every variant is checked
against SDPA's output (relative Frobenius error, must be < 1e-2 to count) and caught on failure, so one broken
variant does not stop the others. Prints a table and writes JSON.

``--fp8``: also an fp8_e4m3 cache (per-head scales, the engine's calibration rule) per layout: the Triton kernel
(codes cast to bf16 in registers, the path before the FP8 kernel) and the Gluon FP8 kernel's configs
(``FP8_VARIANTS``; "+quant" adds the per-token E4M3 quantization of q, which the wrapper runs). Their reference
is fp32 SDPA over the dequantized codes (the kernel's own error; bound ``FP8_REL_TOL``).

    python3 bench/gpu_fa3_bench.py --out $OUT/fa3_bench.json [--seqs 4096,8192,16384] [--tokens 32768]
        [--variants gluon_pp_n128_s2,...] [--layouts contig,paged16]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

import torch
import torch.nn.functional as F
from triton.testing import do_bench

from roofline.bench.attention import _dense_kv, _paged_prefill_inputs
from roofline.kernels.gluon_prefill import FP8_REL_TOL, gluon_prefill_attention, gluon_unsupported_reason
from roofline.kernels.prefill_attention import default_prefill_config, paged_prefill_attention

GLUON_VARIANTS = {
    "gluon_plain_n128_s2": dict(BLOCK_N=128, NUM_STAGES=2),
    "gluon_plain_n64_s2": dict(BLOCK_N=64, NUM_STAGES=2),
    "gluon_plain_n64_s3": dict(BLOCK_N=64, NUM_STAGES=3),
    "gluon_pipe_n64_s3": dict(VARIANT="pipelined", BLOCK_N=64, NUM_STAGES=3),
    "gluon_pipe_n64_s2": dict(VARIANT="pipelined", BLOCK_N=64, NUM_STAGES=2),
    "gluon_pipe_n128_s2": dict(VARIANT="pipelined", BLOCK_N=128, NUM_STAGES=2),
    "gluon_ws_n64_s3": dict(VARIANT="ws", BLOCK_N=64, NUM_STAGES=3),
    "gluon_ws_n64_s4": dict(VARIANT="ws", BLOCK_N=64, NUM_STAGES=4),
    "gluon_ws_n128_s2": dict(VARIANT="ws", BLOCK_N=128, NUM_STAGES=2),
    "gluon_ws_n128_s3": dict(VARIANT="ws", BLOCK_N=128, NUM_STAGES=3),  # 224 KB of shared memory
    # round 2: FA3 ping-pong (two consumer warpgroup partitions, named barriers) and ws2 (same, no barriers)
    "gluon_pp_n128_s2": dict(VARIANT="pingpong", BLOCK_N=128, NUM_STAGES=2),
    "gluon_pp_n128_s3": dict(VARIANT="pingpong", BLOCK_N=128, NUM_STAGES=3),
    "gluon_pp_n64_s3": dict(VARIANT="pingpong", BLOCK_N=64, NUM_STAGES=3),
    "gluon_ws2_n128_s2": dict(VARIANT="ws2", BLOCK_N=128, NUM_STAGES=2),
    "gluon_pst_n128_s2": dict(VARIANT="persistent", BLOCK_N=128, NUM_STAGES=2),  # persistent ping-pong
}
FP8_VARIANTS = {  # "1q": Q_SPLIT False (q as one E4M3 term: one QK product, less exact)
    "gluon_fp8_n64_s3": dict(BLOCK_N=64, NUM_STAGES=3),
    "gluon_fp8_n64_s4": dict(BLOCK_N=64, NUM_STAGES=4),
    "gluon_fp8_n128_s2": dict(BLOCK_N=128, NUM_STAGES=2),
    "gluon_fp8_n128_s3": dict(BLOCK_N=128, NUM_STAGES=3),
    "gluon_fp8_1q_n64_s3": dict(BLOCK_N=64, NUM_STAGES=3, Q_SPLIT=False),
    "gluon_fp8_1q_n128_s2": dict(BLOCK_N=128, NUM_STAGES=2, Q_SPLIT=False),
    # the ping-pong FP8 kernel (producer warpgroup transposes V into NUM_VT buffers, CHUNK keys at a time)
    "gluon_fp8pp_n128_s2": dict(VARIANT="fp8pp", BLOCK_N=128, NUM_STAGES=2),
    "gluon_fp8pp_n128_s3": dict(VARIANT="fp8pp", BLOCK_N=128, NUM_STAGES=3),
    "gluon_fp8pp_n128_s2_vt3": dict(VARIANT="fp8pp", BLOCK_N=128, NUM_STAGES=2, NUM_VT=3),
    "gluon_fp8pp_n128_s3_c16": dict(VARIANT="fp8pp", BLOCK_N=128, NUM_STAGES=3, CHUNK=16),
    "gluon_fp8pp_n64_s3": dict(VARIANT="fp8pp", BLOCK_N=64, NUM_STAGES=3),
}
FP8 = [False]  # --fp8
LAYOUTS = {"contig": 256, "paged16": 16, "paged64": 64}
ACTIVE_LAYOUTS = set(LAYOUTS)  # --layouts; SDPA runs with "contig"
MAX_REL_ERR = 1e-2


def inputs(layout, batch, seq, heads, kv_heads, head_dim):
    block_size = LAYOUTS[layout]
    q, kc, vc, meta = _paged_prefill_inputs(batch, seq, heads, kv_heads, head_dim, block_size, torch.bfloat16,
                                            "cuda")
    if layout == "contig":  # identity table: sequence b's blocks are b * nb .. (b + 1) * nb - 1
        nb = meta.block_tables.shape[1]
        meta.block_tables = torch.arange(batch * nb, device="cuda", dtype=torch.int32).view(batch, nb)
        pos = torch.arange(seq, device="cuda")
        meta.slot_mapping = (meta.block_tables.long()[:, pos // block_size] * block_size
                             + pos % block_size).reshape(-1)
    return q, kc, vc, meta


def _record(row, name, fn, ref_bhsd, to_bhsd, log, max_err=MAX_REL_ERR):
    """Run ``fn`` once, check it against ``ref_bhsd`` ([B, H, S, D]), time it; failures are recorded, not raised."""
    log(f"  run {name}")  # the last "run" line before a timeout names a hung kernel
    try:
        out = fn()
        torch.cuda.synchronize()
        err = float((to_bhsd(out).float() - ref_bhsd.float()).norm() / ref_bhsd.float().norm())
        ms = do_bench(fn, return_mode="median")
        r = dict(ms=ms, tflops=row["flops"] / ms / 1e9, rel_err_vs_sdpa=err, ok=err < max_err)
    except Exception as e:  # noqa: BLE001 - record and go on with the other variants
        traceback.print_exc()
        r = dict(error=f"{type(e).__name__}: {str(e)[:300]}", ok=False)
    row["kernels"][name] = r
    log(f"  S={row['seq']:>6} B={row['batch']:>2} {name:<24} {r.get('tflops', float('nan')):8.1f} TFLOP/s  "
        f"err {r.get('rel_err_vs_sdpa', float('nan')):.2e}  {'' if r['ok'] else 'BAD ' + r.get('error', 'wrong')}")


def _bench_sdpa(row, q, kc, vc, meta, log):
    """cuDNN/flash SDPA on dense [B, H, S, D] copies: repeated KV heads and enable_gqa=True."""
    batch, seq, heads, head_dim = row["batch"], row["seq"], row["heads"], row["head_dim"]
    qd = q.view(batch, seq, heads, head_dim).transpose(1, 2).contiguous()
    kd, vd = _dense_kv(kc, meta, batch, seq), _dense_kv(vc, meta, batch, seq)
    group = heads // row["kv_heads"]
    kr, vr = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    ref = F.scaled_dot_product_attention(qd, kr, vr, is_causal=True)
    _record(row, "sdpa_repeat_kv", lambda: F.scaled_dot_product_attention(qd, kr, vr, is_causal=True), ref,
            lambda o: o, log)
    _record(row, "sdpa_enable_gqa",
            lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True), ref, lambda o: o, log)


def _bench_layout(row, layout, log):
    batch, seq, heads, head_dim = row["batch"], row["seq"], row["heads"], row["head_dim"]
    scale = 1.0 / math.sqrt(head_dim)
    q, kc, vc, meta = inputs(layout, batch, seq, heads, row["kv_heads"], head_dim)
    if layout == "contig":
        _bench_sdpa(row, q, kc, vc, meta, log)

    def to_bhsd(o):
        return o.view(batch, seq, heads, head_dim).transpose(1, 2)

    qd = to_bhsd(q).contiguous()
    ref = F.scaled_dot_product_attention(qd, _dense_kv(kc, meta, batch, seq), _dense_kv(vc, meta, batch, seq),
                                         is_causal=True, enable_gqa=True)
    del qd
    out = torch.empty_like(q)
    cfg = default_prefill_config(head_dim, torch.bfloat16, True, LAYOUTS[layout], seq)
    _record(row, f"triton_{layout}", lambda: paged_prefill_attention(q, kc, vc, meta, scale, out=out, config=cfg),
            ref, to_bhsd, log)
    reason = gluon_unsupported_reason(q, kc, vc)
    if reason is not None:
        log(f"  gluon not run: {reason}")
        return
    for name, gcfg in GLUON_VARIANTS.items():
        _record(row, f"{name}_{layout}",
                lambda gcfg=gcfg: gluon_prefill_attention(q, kc, vc, meta, scale, out=out, config=gcfg),
                ref, to_bhsd, log)
    if FP8[0]:
        del ref
        _bench_fp8(row, layout, q, kc, vc, meta, scale, out, to_bhsd, log)


def _bench_fp8(row, layout, q, kc, vc, meta, scale, out, to_bhsd, log):
    """The same point on an fp8_e4m3 cache: Triton (codes cast in registers) and the Gluon FP8 kernel."""
    from roofline.attention.backend import FP8_CALIBRATION_HEADROOM
    from roofline.kernels.act_quant import per_token_quant_fp8, per_token_quant_fp8_split
    from roofline.kernels.common import FP8_E4M3_MAX, ref_quantize_fp8
    from roofline.kernels.gluon_prefill import default_gluon_fp8_config, launch_gluon_fp8

    batch, seq = row["batch"], row["seq"]
    ks = kc.float().abs().amax(dim=(0, 1, 3)) * FP8_CALIBRATION_HEADROOM / FP8_E4M3_MAX
    vs = vc.float().abs().amax(dim=(0, 1, 3)) * FP8_CALIBRATION_HEADROOM / FP8_E4M3_MAX
    kq, vq = ref_quantize_fp8(kc.float(), ks), ref_quantize_fp8(vc.float(), vs)
    # bf16 SDPA over the dequantized codes (fp32 SDPA would take the math path: S^2 scores in memory)
    kd = (_dense_kv(kq, meta, batch, seq).float() * ks[None, :, None, None]).to(q.dtype)
    vd = (_dense_kv(vq, meta, batch, seq).float() * vs[None, :, None, None]).to(q.dtype)
    ref = F.scaled_dot_product_attention(to_bhsd(q), kd, vd, is_causal=True, enable_gqa=True)
    del kd, vd
    cfg = default_prefill_config(q.shape[2], torch.bfloat16, True, LAYOUTS[layout], seq)
    _record(row, f"triton_fp8_{layout}",
            lambda: paged_prefill_attention(q, kq, vq, meta, scale, out=out, config=cfg, k_scale=ks, v_scale=vs),
            ref, to_bhsd, log, FP8_REL_TOL)
    reason = gluon_unsupported_reason(q, kq, vq)
    if reason is not None:
        log(f"  gluon fp8 not run: {reason}")
        return
    _record(row, f"quant_q_only_{layout}", lambda: per_token_quant_fp8(q) and out, ref, to_bhsd, log, float("inf"))
    _record(row, f"quant_q_split_only_{layout}", lambda: per_token_quant_fp8_split(q) and out, ref, to_bhsd, log,
            float("inf"))
    for name, gcfg in FP8_VARIANTS.items():
        full = {**default_gluon_fp8_config(q.shape[2], LAYOUTS[layout]), **gcfg}
        _record(row, f"{name}+quant_{layout}",
                lambda gcfg=gcfg: gluon_prefill_attention(q, kq, vq, meta, scale, out=out, config=gcfg,
                                                          k_scale=ks, v_scale=vs),
                ref, to_bhsd, log, FP8_REL_TOL)
        # the kernel alone: q already quantized (as a fused RoPE + quant would)
        if full.get("Q_SPLIT", True):
            q_fp8 = per_token_quant_fp8_split(q)
        else:
            hi, qs = per_token_quant_fp8(q)
            q_fp8 = (hi, None, qs)
        _record(row, f"{name}_{layout}",
                lambda full=full, q_fp8=q_fp8: launch_gluon_fp8(q, kq, vq, meta, scale, out, full, ks, vs, q_fp8),
                ref, to_bhsd, log, FP8_REL_TOL)


def bench_point(seq, batch, heads, kv_heads, head_dim, log):
    flops = batch * 4 * seq * seq * heads * head_dim / 2
    row = dict(seq=seq, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, flops=flops, kernels={})
    for layout in LAYOUTS:
        if layout not in ACTIVE_LAYOUTS:
            continue
        _bench_layout(row, layout, log)
        torch.cuda.empty_cache()
    ks = row["kernels"]
    sdpa = max((ks[k].get("tflops", 0.0) for k in ("sdpa_repeat_kv", "sdpa_enable_gqa") if k in ks and ks[k]["ok"]),
               default=0.0)
    row["sdpa_best_tflops"] = sdpa
    for r in ks.values():
        if r["ok"] and sdpa:
            r["ratio_vs_sdpa"] = r["tflops"] / sdpa
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="4096,8192,16384")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default="fa3_bench.json")
    ap.add_argument("--variants", default=",".join(GLUON_VARIANTS),
                    help="Gluon variants to run (comma list; bench/gpu_fa3.sh passes those its smoke step passed)")
    ap.add_argument("--layouts", default=",".join(LAYOUTS), help="KV layouts (comma list of LAYOUTS keys)")
    ap.add_argument("--fp8", action="store_true", help="also the fp8_e4m3 cache (Triton and the Gluon FP8 kernel)")
    ap.add_argument("--fp8-only", action="store_true", help="with --fp8: skip the bf16 Gluon variants")
    ap.add_argument("--fp8-variants", default=",".join(FP8_VARIANTS),
                    help="with --fp8: the FP8 configs to run (comma list of FP8_VARIANTS keys)")
    args = ap.parse_args()
    FP8[0] = args.fp8
    for name in list(FP8_VARIANTS):
        if name not in args.fp8_variants.split(","):
            del FP8_VARIANTS[name]
    t0 = time.time()
    ACTIVE_LAYOUTS.intersection_update(args.layouts.split(","))
    keep = [v for v in args.variants.split(",") if v]
    for name in list(GLUON_VARIANTS):
        if name not in keep or args.fp8_only:
            del GLUON_VARIANTS[name]

    def log(msg):
        print(f"[{time.time() - t0:6.1f}s] {msg}", flush=True)

    log(f"{torch.cuda.get_device_name()} torch {torch.__version__}")
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        rows.append(bench_point(seq, max(1, args.tokens // seq), args.heads, args.kv_heads, args.head_dim, log))
        with open(args.out, "w") as f:  # after every point: a timeout keeps what was measured
            json.dump(dict(rows=rows, device=torch.cuda.get_device_name()), f, indent=1)
    print(f"\nTFLOP/s (ratio vs the faster SDPA); causal, bf16, GQA {args.heads}/{args.kv_heads}, D {args.head_dim}")
    names = sorted({n for r in rows for n in r["kernels"]})
    print(f"{'kernel':<26}" + "".join(f"{'S=' + str(r['seq']):>18}" for r in rows))
    for n in names:
        cells = []
        for r in rows:
            k = r["kernels"].get(n, {})
            cells.append(f"{k['tflops']:8.1f} ({k.get('ratio_vs_sdpa', float('nan')):.2f})" if k.get("ok")
                         else f"{'FAIL' if k else '-':>15}")
        print(f"{n:<26}" + "".join(f"{c:>18}" for c in cells))
    return 0


if __name__ == "__main__":
    sys.exit(main())
