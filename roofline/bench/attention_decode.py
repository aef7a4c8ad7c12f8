"""``roofline bench attention --decode-only``: the decode kernel's variants x KV-cache formats in one process.

For each (batch, ctx, block size, query_len) point and each KV format of ``--kv-cache-dtype`` ("auto" is
the model dtype, bf16), every stage-1 variant of ``--variants`` ("old", "mma", "fma", "gluon"; see
``roofline.kernels.decode_attention``; "gluon" runs on int8 / fp8 caches at query_len 1 only) is timed with ``triton.testing.do_bench`` (median, L2 flushed),
the variants of one point back to back so that they share the machine's state. Figures per run:
- fraction of read bandwidth: the bytes the kernel actually reads (``decode_kv_bytes``: codes + int8's
  per-token scales; fp8's per-head scales are one float per program) over the time, against a large
  ``x.sum()`` measured in the same process;
- time vs bf16: against the bf16 cache's "old" kernel at the same point (the engine's path today; for
  query_len > 1, against bf16's first packed variant), and vs "old" on the same format;
- ``rel_err_vs_ref``: each variant's output against ``ref_decode_attention`` on the same cache (batch <= 8).
``--num-splits`` adds split counts and ``--configs`` tile configs (BLOCK_NxWARPSxSTAGES) to time beside the
defaults (``choose_num_splits``, ``default_block_n``, 4 warps, 2 stages), per point and variant.
The summary names, per format, the variant with the least total time (the candidate ``DEFAULT_VARIANT``).
Writes ``<out-dir>/attention-decode-<date>-<sha>.json``.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
from pathlib import Path
from typing import Any

from roofline.bench.common import git_sha


def _time_point(batch, ctx, block_size, query_len, fmt, variants, extras, read_bw, log) -> list[dict[str, Any]]:
    import torch
    from triton.testing import do_bench

    from roofline.bench.attention_inputs import _decode_inputs, decode_kv_bytes
    from roofline.kernels.decode_attention import (
        choose_num_splits,
        default_block_n,
        paged_decode_attention,
        ref_decode_attention,
    )

    heads, kv_heads, head_dim = 32, 8, 128  # llama-3-8b / 70b per-GPU shape: GQA group 4
    scale = 1.0 / math.sqrt(head_dim)
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    q, kc, vc, tables, seq_lens, ks, vs = _decode_inputs(batch, ctx, heads, kv_heads, head_dim, block_size,
                                                         torch.bfloat16, fmt)
    if query_len > 1:
        q = torch.randn(batch * query_len, heads, head_dim, device=q.device, dtype=q.dtype)
    kv_bytes = decode_kv_bytes(batch, ctx, kv_heads, head_dim, fmt)
    ref = None
    if batch <= 8:
        ref = ref_decode_attention(q, kc, vc, tables, seq_lens, scale, k_scale=ks, v_scale=vs, query_len=query_len)
    out = torch.empty_like(q)
    rows = []
    for variant in variants:
        if (variant == "old" and query_len > 1) or (variant == "gluon" and (query_len > 1 or fmt == "bfloat16")):
            continue
        for params in [{}, *extras]:
            def fn(variant=variant, params=params):
                return paged_decode_attention(q, kc, vc, tables, seq_lens, scale, out=out, k_scale=ks, v_scale=vs,
                                              variant=variant, query_len=query_len, **params)
            sms = num_sms * max(1, 4 // params.get("num_warps", 4)) if variant == "gluon" else num_sms
            num_splits = params.get("num_splits") or choose_num_splits(
                batch, kv_heads, tables.shape[1] * block_size, sms, block_size=block_size,
                block_n=params.get("block_n") or default_block_n(head_dim, variant, heads // kv_heads, query_len,
                                                                 kc.element_size()))
            row = dict(batch=batch, ctx=ctx, block_size=block_size, query_len=query_len, kv_cache_dtype=fmt,
                       variant=variant, kv_bytes=kv_bytes, default=not params, params=params, num_splits=num_splits)
            try:
                fn()
                if ref is not None:
                    row["rel_err_vs_ref"] = float((out.float() - ref.float()).norm() / ref.float().norm())
                t = do_bench(fn, return_mode="median")
                row.update(ms=t, bytes_per_s=kv_bytes / (t * 1e-3), frac_of_read=kv_bytes / (t * 1e-3) / read_bw)
            except Exception as e:  # noqa: BLE001 - a variant that does not compile is recorded, the run goes on
                row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            rows.append(row)
            log(f"B={batch:>3} ctx={ctx:>6} bs={block_size:>3} ql={query_len} {fmt:>9} {variant:>5} "
                f"splits={row['num_splits']:>3} {params or 'default'}: "
                + (f"{row['ms'] * 1e3:8.1f} us {row['frac_of_read']:.3f} of read"
                   + (f" err {row['rel_err_vs_ref']:.1e}" if "rel_err_vs_ref" in row else "")
                   if "ms" in row else row["error"]))
    return rows  # the caches go with this frame; the caller empties torch's cache


def attach_ratios(rows: list[dict[str, Any]]) -> None:
    """time_vs_bf16 (against bf16 'old', or bf16's first variant for query_len > 1) and time_vs_old_same_kv,
    at the same (batch, ctx, block_size, query_len) with default launch parameters."""
    base: dict[tuple, float] = {}
    old: dict[tuple, float] = {}
    for r in rows:
        if "ms" not in r or not r["default"]:
            continue
        key = (r["batch"], r["ctx"], r["block_size"], r["query_len"])
        if r["kv_cache_dtype"] == "bfloat16" and key not in base:
            base[key] = r["ms"]
        if r["variant"] == "old":
            old[key + (r["kv_cache_dtype"],)] = r["ms"]
    for r in rows:
        if "ms" not in r:
            continue
        key = (r["batch"], r["ctx"], r["block_size"], r["query_len"])
        if key in base:
            r["time_vs_bf16"] = r["ms"] / base[key]
        if key + (r["kv_cache_dtype"],) in old:
            r["time_vs_old_same_kv"] = r["ms"] / old[key + (r["kv_cache_dtype"],)]


def parse_formats_and_variants(kv_cache_dtype: str, variants: str) -> tuple[list[str], list[str]]:
    """``--kv-cache-dtype`` ("auto" = bfloat16, the model dtype here) and ``--variants`` as lists.

    Raises:
        ValueError: an unknown format or variant (lists the known ones).
    """
    from roofline.bench.attention_inputs import KV_FORMATS
    from roofline.kernels.decode_attention import ALL_VARIANTS as VARIANTS

    fmts = ["bfloat16" if x == "auto" else x for x in kv_cache_dtype.split(",") if x]
    for f in fmts:
        if f not in KV_FORMATS:
            raise ValueError(f"unknown --kv-cache-dtype {f!r}; known: auto, {', '.join(KV_FORMATS)}")
    names = [x for x in variants.split(",") if x]
    for v in names:
        if v not in VARIANTS:
            raise ValueError(f"unknown --variants entry {v!r}; known: {', '.join(VARIANTS)}")
    return fmts, names


def parse_extras(num_splits: str, configs: str) -> list[dict[str, int]]:
    """``--num-splits 8,16`` and ``--configs 128x4x2,64x8x3`` (BLOCK_N x warps x stages) as launch-parameter dicts.

    Raises:
        ValueError: a config that is not three positive integers joined by 'x' (names it).
    """
    extras: list[dict[str, int]] = [dict(num_splits=int(x)) for x in num_splits.split(",") if x]
    for c in (x for x in configs.split(",") if x):
        parts = c.lower().split("x")
        if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
            raise ValueError(f"--configs entry {c!r} is not BLOCK_NxWARPSxSTAGES, e.g. 128x4x2")
        extras.append(dict(block_n=int(parts[0]), num_warps=int(parts[1]), num_stages=int(parts[2])))
    return extras


def run_decode_only(args: argparse.Namespace) -> int:
    """The ``--decode-only`` run: time every (point, format, variant), print a table, write the JSON."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("bench attention needs a CUDA GPU (torch.cuda.is_available() is False)")
    import triton

    from roofline.bench.attention_inputs import _parse_ints, logged_bandwidth
    from roofline.kernels.decode_attention import DEFAULT_VARIANT

    fmts, variants = parse_formats_and_variants(args.kv_cache_dtype, args.variants)
    log, lines, bw = logged_bandwidth()
    block_sizes = _parse_ints(args.block_sizes) if args.block_sizes else [args.block_size]
    extras = parse_extras(args.num_splits, args.configs)
    rows: list[dict[str, Any]] = []
    for batch in _parse_ints(args.batches):
        for ctx in _parse_ints(args.ctxs):
            if 2 * ctx * 8 * 128 * 2 * batch > args.max_gib * 2**30:  # the bf16 size, so every format runs alike
                log(f"skip B={batch} ctx={ctx}: bf16 KV above --max-gib {args.max_gib}")
                continue
            for block_size in block_sizes:
                for query_len in _parse_ints(args.query_lens):
                    for fmt in fmts:
                        rows += _time_point(batch, ctx, block_size, query_len, fmt, variants, extras,
                                            bw["read_bytes_per_s"], log)
                        torch.cuda.empty_cache()
    attach_ratios(rows)

    log("")
    log(f"{'B':>4} {'ctx':>6} {'bs':>4} {'ql':>3} {'KV':>9} {'var':>5} {'splits':>6} {'us':>8} {'of read':>8} "
        f"{'vs bf16':>8} {'vs old':>7}  params")
    for r in rows:
        if "ms" not in r:
            continue
        log(f"{r['batch']:>4} {r['ctx']:>6} {r['block_size']:>4} {r['query_len']:>3} {r['kv_cache_dtype']:>9} "
            f"{r['variant']:>5} {r['num_splits']:>6} "
            f"{r['ms'] * 1e3:>8.1f} {r['frac_of_read']:>8.3f} {r.get('time_vs_bf16', float('nan')):>8.3f} "
            f"{r.get('time_vs_old_same_kv', float('nan')):>7.3f}  {r['params'] or ''}")
    best: dict[str, Any] = {}
    for fmt in fmts:
        totals = {}
        for v in variants:
            pts = [r for r in rows if r["kv_cache_dtype"] == fmt and r["variant"] == v and r["default"]
                   and r["query_len"] == 1]
            if pts and all("ms" in r for r in pts):
                totals[v] = sum(r["ms"] for r in pts)
        if totals:
            win = min(totals, key=totals.get)
            best[fmt] = dict(variant=win, total_ms=totals)
            log(f"{fmt}: least total time at query_len 1: {win} "
                + ", ".join(f"{v} {t * 1e3:.1f} us" for v, t in totals.items()))
    sha = git_sha()
    now = _dt.datetime.now(_dt.UTC)
    result = dict(
        benchmark="attention-decode", date=now.isoformat(timespec="seconds"), git_commit=sha,
        device=torch.cuda.get_device_name(), num_sms=torch.cuda.get_device_properties(0).multi_processor_count,
        torch=torch.__version__, triton=triton.__version__, cuda=torch.version.cuda, bandwidth=bw,
        shape=dict(heads=32, kv_heads=8, head_dim=128, q_dtype="bfloat16"), kv_cache_dtypes=fmts,
        variants=variants, default_variant={str(k): v for k, v in DEFAULT_VARIANT.items()}, decode=rows,
        best_variant=best, targets=dict(quantized_frac_of_read=0.85, quantized_time_vs_bf16_32k=0.6,
                                        quantized_time_vs_bf16_4k=1.0),
        log=lines,
    )
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"attention-decode-{now:%Y%m%d-%H%M%S}-{sha[:8]}.json"
    path.write_text(json.dumps(result, indent=1, default=str))
    log(f"wrote {path}")
    return 0
