"""``roofline bench attention --decode-only`` without a GPU: flags, format/variant parsing, the ratios it
prints (computed from given times), and the CPU refusal. The timed run is GPU-only."""

from __future__ import annotations

import argparse

import pytest
import torch

from roofline.bench.attention import add_parser, run_attention_bench
from roofline.bench.attention_decode import attach_ratios, parse_extras, parse_formats_and_variants


def test_decode_only_flags():
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    args = p.parse_args(["attention", "--decode-only", "--kv-cache-dtype", "auto,int8,fp8", "--batches", "8,64",
                         "--ctxs", "4k,32k", "--variants", "old,mma", "--block-sizes", "16,256",
                         "--num-splits", "16,32", "--query-lens", "1,4"])
    assert args.decode_only and args.variants == "old,mma" and args.query_lens == "1,4"
    assert parse_formats_and_variants(args.kv_cache_dtype, args.variants) == (["bfloat16", "int8", "fp8"],
                                                                               ["old", "mma"])
    with pytest.raises(ValueError, match="unknown --variants entry 'new'; known: old, mma, fma"):
        parse_formats_and_variants("auto", "old,new")
    with pytest.raises(ValueError, match="unknown --kv-cache-dtype 'int4'; known: auto, bfloat16"):
        parse_formats_and_variants("int4", "old")
    assert parse_extras(args.num_splits, "128x4x2,64X8x3") == [
        dict(num_splits=16), dict(num_splits=32), dict(block_n=128, num_warps=4, num_stages=2),
        dict(block_n=64, num_warps=8, num_stages=3)]
    with pytest.raises(ValueError, match="--configs entry '128x4' is not BLOCK_NxWARPSxSTAGES"):
        parse_extras("", "128x4")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            run_attention_bench(args)


def test_ratios_against_bf16_old_and_same_format_old():
    def row(fmt, variant, ms, ql=1, default=True):
        return dict(batch=8, ctx=32768, block_size=16, query_len=ql, kv_cache_dtype=fmt, variant=variant, ms=ms,
                    default=default, params={} if default else dict(num_splits=16))

    rows = [row("bfloat16", "old", 0.250), row("bfloat16", "mma", 0.260), row("int8", "old", 0.300),
            row("int8", "mma", 0.150), row("int8", "mma", 0.100, default=False),
            row("bfloat16", "mma", 0.400, ql=4), row("fp8_e4m3", "fma", 0.200, ql=4)]
    attach_ratios(rows)
    assert rows[0]["time_vs_bf16"] == 1.0 and rows[1]["time_vs_bf16"] == pytest.approx(1.04)
    assert rows[2]["time_vs_bf16"] == pytest.approx(1.2) and rows[3]["time_vs_bf16"] == pytest.approx(0.6)
    assert rows[3]["time_vs_old_same_kv"] == pytest.approx(0.5)
    assert rows[4]["time_vs_bf16"] == pytest.approx(0.4)  # a split sweep row, against the default bf16 row
    # query_len 4 has no 'old': its baseline is bf16's first packed variant at that point
    assert rows[6]["time_vs_bf16"] == pytest.approx(0.5) and "time_vs_old_same_kv" not in rows[6]
