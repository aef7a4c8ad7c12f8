"""``roofline bench attention``: our Triton attention kernels against their bounds, measured in one run.

(a) Prefill: paged varlen causal prefill (``paged_prefill_attention``) against
    ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` on the same shapes, in TFLOP/s
    with causal FLOPs = 4 * S^2 * H * D / 2 per sequence (QK^T and PV, half the square).
    32 query heads, 8 kv heads (SDPA gets k/v repeated to 32 heads, its fastest MHA path; the GQA
    ``enable_gqa`` variant is timed too where it runs), head_dim 128, bf16, batch so tokens ~ 16k.
(b) Decode: ``paged_decode_attention`` achieved bandwidth on KV reads against the read bandwidth of a
    large ``x.sum()`` measured in the same process (llama-3-8b shape: 32/8 heads, D 128, bf16 q), for each
    KV-cache format of ``--kv-cache-dtype`` in the same run (default bf16, int8, fp8_e4m3). Bytes are those
    the kernel actually reads: ctx * batch * ``kv_cache_bytes_per_token`` of one layer, i.e.
    2 (K and V) * H_kv * (D * element bytes + scale bytes): int8 adds its float32 scale per token and KV
    head; fp8's per-head scales are one float per (kv head, split) program and are not counted. Each
    quantized row also reports its time against the bf16 row of the same (batch, ctx).
    Quantized caches are made from the bf16 random cache with the store's ref twins (fp8 scales from the
    engine's calibration rule, 2 x amax / 448), so the spot check against the torch twin is meaningful.
All times are ``triton.testing.do_bench`` medians (it flushes L2 between calls).
Writes ``<out-dir>/attention-<date>-<gitsha>.json`` with device, versions, commit, date and all figures.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any

from roofline.bench.attention_inputs import (  # noqa: F401 - re-exported
    KV_FORMATS,
    _decode_inputs,
    _parse_ints,
    decode_kv_bytes,
    logged_bandwidth,
    measure_read_bandwidth_cuda,
)
from roofline.bench.common import git_sha


def _paged_prefill_inputs(batch: int, seq: int, heads: int, kv_heads: int, head_dim: int, block_size: int,
                          dtype, device):
    """q [B*S, H, D], shuffled paged caches holding each sequence's S keys, metadata for full prefill."""
    import torch

    from roofline.attention.backend import AttentionMetadata

    nb = math.ceil(seq / block_size)
    total = batch * nb
    perm = torch.randperm(total, device=device).to(torch.int32)
    tables = perm.view(batch, nb)
    kc = torch.randn(total, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    q = torch.randn(batch * seq, heads, head_dim, device=device, dtype=dtype)
    pos = torch.arange(seq, device=device)
    slots = (tables.long()[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
    meta = AttentionMetadata(
        slot_mapping=slots,
        query_start_loc=torch.arange(batch + 1, device=device, dtype=torch.int32) * seq,
        seq_lens=torch.full((batch,), seq, device=device, dtype=torch.int32),
        block_tables=tables, max_query_len=seq,
        seq_lens_cpu=[seq] * batch, query_lens_cpu=[seq] * batch)
    return q, kc, vc, meta


def _dense_kv(cache, meta, batch, seq):
    """[B, H_kv, S, D] contiguous copy of the paged cache (for SDPA)."""
    flat = cache.view(-1, *cache.shape[2:])
    return flat[meta.slot_mapping].view(batch, seq, *cache.shape[2:]).transpose(1, 2).contiguous()


def bench_prefill(seqs, tokens, heads, kv_heads, head_dim, block_size, configs, log) -> list[dict[str, Any]]:
    import torch

    rows = []
    for seq in seqs:
        rows.append(_prefill_point(seq, max(1, tokens // seq), heads, kv_heads, head_dim, block_size, configs, log))
        torch.cuda.empty_cache()
    return rows


def _prefill_point(seq, batch, heads, kv_heads, head_dim, block_size, configs, log) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from roofline.kernels.prefill_attention import default_prefill_config, paged_prefill_attention

    dtype = torch.bfloat16
    scale = 1.0 / math.sqrt(head_dim)
    q, kc, vc, meta = _paged_prefill_inputs(batch, seq, heads, kv_heads, head_dim, block_size, dtype, "cuda")
    flops = batch * 4 * seq * seq * heads * head_dim / 2
    qd = q.view(batch, seq, heads, head_dim).transpose(1, 2).contiguous()  # [B, H, S, D]
    kd, vd = _dense_kv(kc, meta, batch, seq), _dense_kv(vc, meta, batch, seq)  # [B, H_kv, S, D]
    group = heads // kv_heads
    kr, vr = kd.repeat_interleave(group, 1), vd.repeat_interleave(group, 1)
    ref = F.scaled_dot_product_attention(qd, kr, vr, is_causal=True)
    t_sdpa = do_bench(lambda: F.scaled_dot_product_attention(qd, kr, vr, is_causal=True), return_mode="median")
    try:
        t_gqa = do_bench(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True),
                         return_mode="median")
    except Exception as e:  # noqa: BLE001 - older torch or no GQA kernel: record and go on
        t_gqa = float("nan")
        log(f"  sdpa enable_gqa failed: {type(e).__name__}")
    out = torch.empty_like(q)
    row = dict(seq=seq, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, block_size=block_size,
               flops=flops, sdpa_ms=t_sdpa, sdpa_tflops=flops / t_sdpa / 1e9,
               sdpa_gqa_ms=t_gqa, sdpa_gqa_tflops=flops / t_gqa / 1e9, variants=[])
    best = None
    for cfg in configs or [default_prefill_config(head_dim, dtype, True, block_size, seq)]:
        def fn(cfg=cfg):
            return paged_prefill_attention(q, kc, vc, meta, scale, out=out, config=cfg)
        try:
            fn()
            err = float((out.view(batch, seq, heads, head_dim).transpose(1, 2).float() - ref.float()).norm()
                        / ref.float().norm())
            t = do_bench(fn, return_mode="median")
            v = dict(config=cfg, ms=t, tflops=flops / t / 1e9, rel_err_vs_sdpa=err)
        except Exception as e:  # noqa: BLE001 - a config that does not compile (shared memory) is recorded
            v = dict(config=cfg, error=f"{type(e).__name__}: {str(e)[:200]}")
        row["variants"].append(v)
        if "ms" in v and (best is None or v["ms"] < best["ms"]):
            best = v
    if best:
        row.update(ours_ms=best["ms"], ours_tflops=best["tflops"], ours_config=best["config"],
                   rel_err_vs_sdpa=best["rel_err_vs_sdpa"], ratio_vs_sdpa=t_sdpa / best["ms"])
    log(f"prefill S={seq:>6} B={batch:>2} bs={block_size:>3}: ours {row.get('ours_tflops', float('nan')):7.1f} "
        f"TFLOP/s  sdpa {row['sdpa_tflops']:7.1f} (gqa {row['sdpa_gqa_tflops']:6.1f})  "
        f"ratio {row.get('ratio_vs_sdpa', float('nan')):.3f}  cfg {row.get('ours_config')}")
    return row


# The --kv-cache-dtype values this bench runs (the engine's names, which the bound model speaks too).
def bench_decode(batches, ctxs, heads, kv_heads, head_dim, block_size, read_bw, max_bytes, sweep, log,
                 kv_cache_dtypes=("bfloat16",)):
    import torch

    rows = []
    for batch in batches:
        for ctx in ctxs:
            if 2 * ctx * kv_heads * head_dim * 2 * batch > max_bytes:  # the bf16 size, so every format runs alike
                continue
            base = None
            for kv_dtype in kv_cache_dtypes:
                variants = [dict()] + list((sweep or {}).get((batch, ctx), []) if kv_dtype == kv_cache_dtypes[0]
                                           else [])
                row = _decode_point(batch, ctx, heads, kv_heads, head_dim, block_size, read_bw, variants, log,
                                    kv_dtype)
                if base is None:
                    base = row
                elif base.get("ms") and row.get("ms"):
                    row["time_vs_" + base["kv_cache_dtype"]] = row["ms"] / base["ms"]
                rows.append(row)
                torch.cuda.empty_cache()
    return rows


def _decode_point(batch, ctx, heads, kv_heads, head_dim, block_size, read_bw, variants, log,
                  kv_cache_dtype="bfloat16") -> dict[str, Any]:
    import torch
    from triton.testing import do_bench

    from roofline.kernels.decode_attention import paged_decode_attention, ref_decode_attention

    dtype = torch.bfloat16
    scale = 1.0 / math.sqrt(head_dim)
    kv_bytes = decode_kv_bytes(batch, ctx, kv_heads, head_dim, kv_cache_dtype)
    q, kc, vc, tables, seq_lens, ks, vs = _decode_inputs(batch, ctx, heads, kv_heads, head_dim, block_size, dtype,
                                                         kv_cache_dtype)
    out = torch.empty_like(q)
    row = dict(batch=batch, ctx=ctx, block_size=block_size, kv_cache_dtype=kv_cache_dtype, kv_bytes=kv_bytes,
               variants=[])
    best = None
    for var in variants:
        def fn(var=var):
            return paged_decode_attention(q, kc, vc, tables, seq_lens, scale, out=out, k_scale=ks, v_scale=vs, **var)
        try:
            t = do_bench(fn, return_mode="median")
            bps = kv_bytes / (t * 1e-3)
            v = dict(params=var, ms=t, bytes_per_s=bps, frac_of_read=bps / read_bw)
        except Exception as e:  # noqa: BLE001 - a variant that does not compile is recorded
            v = dict(params=var, error=f"{type(e).__name__}: {str(e)[:200]}")
        row["variants"].append(v)
        if "ms" in v and (best is None or v["ms"] < best["ms"]):
            best = v
    if batch <= 8 and ctx <= 32768:  # spot check against the torch twin (on the same quantized cache)
        ref = ref_decode_attention(q, kc, vc, tables, seq_lens, scale, k_scale=ks, v_scale=vs)
        paged_decode_attention(q, kc, vc, tables, seq_lens, scale, out=out, k_scale=ks, v_scale=vs)
        row["rel_err_vs_ref"] = float((out.float() - ref.float()).norm() / ref.float().norm())
    default = row["variants"][0]
    row.update(ms=default.get("ms"), bytes_per_s=default.get("bytes_per_s"),
               frac_of_read=default.get("frac_of_read"), best=best)
    log(f"decode B={batch:>3} ctx={ctx:>6} {kv_cache_dtype:>9}: {default.get('bytes_per_s', float('nan')) / 1e12:5.2f} "
        f"TB/s = {default.get('frac_of_read', float('nan')):.3f} of read, {default.get('ms', float('nan')):.3f} ms"
        + (f"  best {best['frac_of_read']:.3f} {best['params']}" if best and len(variants) > 1 else ""))
    return row


def run_attention_bench(args: argparse.Namespace) -> int:
    """Run both parts, print a table, write the JSON. Needs CUDA and triton."""
    import torch

    if args.decode_only:
        from roofline.bench.attention_decode import run_decode_only

        return run_decode_only(args)
    if not torch.cuda.is_available():
        raise ValueError("bench attention needs a CUDA GPU (torch.cuda.is_available() is False)")
    import triton

    log, lines, bw = logged_bandwidth()
    prefill_cfgs = tma_cfgs = None
    if args.sweep:
        prefill_cfgs = [dict(BLOCK_M=m, BLOCK_N=n, num_warps=w, num_stages=s)
                        for m, n, w, s in [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3),
                                           (128, 128, 8, 2), (128, 32, 4, 4)]]
        prefill_cfgs += [dict(BLOCK_M=128, BLOCK_N=n, num_warps=w, num_stages=3, WARP_SPEC=True)
                         for n, w in [(128, 8), (64, 4)]]
        tma_cfgs = [dict(c, USE_TMA=True) for c in prefill_cfgs[:3] + prefill_cfgs[-2:]] + prefill_cfgs[:1]
    prefill = bench_prefill(_parse_ints(args.seqs), args.tokens, 32, 8, 128, args.block_size, prefill_cfgs, log)
    if args.block_size != 256:  # the block-size-256 (TMA) path at 8k, for reference
        prefill += bench_prefill([8192], args.tokens, 32, 8, 128, 256, tma_cfgs, log)
    sweep = None
    if args.sweep:
        sweep = {(8, 32768): [dict(num_splits=s) for s in (5, 8, 16, 32, 64)]
                 + [dict(block_n=bn, num_warps=w, num_stages=st) for bn, w, st in
                    [(32, 4, 3), (64, 4, 3), (64, 8, 3), (128, 4, 2), (128, 8, 3), (64, 4, 4)]],
                 (1, 32768): [dict(num_splits=s) for s in (16, 32, 64, 128)],
                 (1, 131072): [dict(num_splits=s) for s in (32, 64, 128)]}
    kv_dtypes = tuple(x for x in args.kv_cache_dtype.split(",") if x)
    for name in kv_dtypes:
        if name not in KV_FORMATS:
            raise ValueError(f"unknown --kv-cache-dtype {name!r}; known: {', '.join(KV_FORMATS)}")
    decode = bench_decode(_parse_ints(args.batches), _parse_ints(args.ctxs), 32, 8, 128, args.block_size,
                          bw["read_bytes_per_s"], args.max_gib * 2**30, sweep, log, kv_dtypes)

    log("")
    log(f"{'prefill S':>10} {'B':>3} {'ours TF/s':>10} {'SDPA TF/s':>10} {'ratio':>6}")
    for r in prefill:
        log(f"{r['seq']:>10} {r['batch']:>3} {r.get('ours_tflops', float('nan')):>10.1f} {r['sdpa_tflops']:>10.1f} "
            f"{r.get('ratio_vs_sdpa', float('nan')):>6.3f}" + ("" if r["block_size"] == args.block_size
                                                               else f"  (block_size {r['block_size']})"))
    log(f"{'decode B':>10} {'ctx':>7} {'KV':>9} {'TB/s':>6} {'of read':>8} {'ms':>8} {'time vs first':>13}")
    for r in decode:
        ratio = next((v for k, v in r.items() if k.startswith("time_vs_")), None)
        log(f"{r['batch']:>10} {r['ctx']:>7} {r['kv_cache_dtype']:>9} {(r['bytes_per_s'] or float('nan')) / 1e12:>6.2f} "
            f"{r['frac_of_read'] or float('nan'):>8.3f} {r['ms'] or float('nan'):>8.3f} "
            f"{'' if ratio is None else f'{ratio:.3f}':>13}")

    sha = git_sha()
    now = _dt.datetime.now(_dt.UTC)
    result = dict(
        benchmark="attention", date=now.isoformat(timespec="seconds"), git_commit=sha,
        device=torch.cuda.get_device_name(), num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda,
        bandwidth=bw, prefill=prefill, decode=decode,
        kv_cache_dtypes=list(kv_dtypes),
        targets=dict(prefill_ratio_vs_sdpa_8k=1.0, decode_frac_of_read_b8_32k=0.85),
    )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"attention-{now:%Y%m%d}-{sha[:8]}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    log(f"wrote {path}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("attention", help="Triton prefill vs SDPA (TFLOP/s), decode KV bandwidth vs read")
    p.add_argument("--seqs", default="1k,2k,4k,8k,16k", help="prefill sequence lengths")
    p.add_argument("--tokens", type=int, default=16384, help="prefill batch = tokens // seq")
    p.add_argument("--batches", default="1,8,32,64", help="decode batch sizes")
    p.add_argument("--ctxs", default="1k,4k,16k,32k,64k,128k", help="decode context lengths")
    p.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    p.add_argument("--max-gib", type=float, default=40.0, help="skip decode points whose bf16 KV exceeds this")
    p.add_argument("--kv-cache-dtype", default="bfloat16,int8,fp8_e4m3",
                   help=f"comma-separated KV-cache formats the decode part runs, each in the same run "
                        f"({', '.join(KV_FORMATS)}); the first is the baseline of 'time vs first'")
    p.add_argument("--sweep", action="store_true", help="also sweep kernel tile configs / split counts")
    p.add_argument("--decode-only", action="store_true",
                   help="only the decode kernel: every --variants x --kv-cache-dtype at each point, time vs bf16 "
                        "and fraction of read bandwidth (roofline/bench/attention_decode.py); 'auto' = bfloat16")
    p.add_argument("--variants", default="old,mma,gluon",
                   help="--decode-only: decode stage-1 kernels to time (old, mma, fma, gluon)")
    p.add_argument("--block-sizes", default="", help="--decode-only: KV block sizes to run (default --block-size)")
    p.add_argument("--num-splits", default="", help="--decode-only: split counts to time beside the default")
    p.add_argument("--query-lens", default="1", help="--decode-only: queries per sequence (1 + speculative tokens)")
    p.add_argument("--configs", default="", help="--decode-only: tile configs BLOCK_NxWARPSxSTAGES to time beside "
                                                 "the default, e.g. 128x4x2,64x8x3")
    p.add_argument("--out-dir", default="bench/results")
    p.set_defaults(func=run_attention_bench)
    return p
