"""``roofline bench attention`` without a GPU: its KV-format inputs, byte counts and flags (a CPU smoke;
the timed run is GPU-only)."""

from __future__ import annotations

import argparse
import math
import os

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from roofline.bench.attention import (  # noqa: E402
    _decode_inputs,
    add_parser,
    decode_kv_bytes,
    run_attention_bench,
)
from roofline.kernels.decode_attention import paged_decode_attention, ref_decode_attention  # noqa: E402


def test_decode_bytes_count_values_and_scales():
    # batch 8 x 32k, llama-3-8b's 8 KV heads x D 128: bf16 1 GiB; int8 half plus 4-byte scales; fp8 half.
    assert decode_kv_bytes(8, 32768, 8, 128, "bfloat16") == 8 * 32768 * 2 * 8 * 128 * 2 == 1 << 30
    assert decode_kv_bytes(8, 32768, 8, 128, "int8") == 8 * 32768 * 2 * 8 * (128 + 4)
    assert decode_kv_bytes(8, 32768, 8, 128, "fp8_e4m3") == decode_kv_bytes(8, 32768, 8, 128, "fp8") == 1 << 29
    with pytest.raises(ValueError, match="unknown kv_cache_dtype 'int4'"):
        decode_kv_bytes(1, 1, 1, 1, "int4")


@pytest.mark.parametrize("kv_dtype", ["bfloat16", "int8", "fp8_e4m3"])
def test_decode_inputs_run_through_the_kernel(kv_dtype):
    q, kc, vc, tables, seq_lens, ks, vs = _decode_inputs(2, 40, 4, 2, 32, 16, torch.float32, kv_dtype, device="cpu")
    want = {"bfloat16": torch.float32, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}[kv_dtype]
    assert kc.dtype == vc.dtype == want and (ks is None) == (kv_dtype == "bfloat16")
    scale = 1 / math.sqrt(32)
    out = paged_decode_attention(q, kc, vc, tables, seq_lens, scale, num_splits=2, block_n=16, k_scale=ks, v_scale=vs)
    ref = ref_decode_attention(q, kc, vc, tables, seq_lens, scale, k_scale=ks, v_scale=vs)
    assert float((out - ref).norm() / ref.norm()) < 1e-5


def test_flags_and_cpu_refusal():
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    args = p.parse_args(["attention"])
    assert args.kv_cache_dtype == "bfloat16,int8,fp8_e4m3"
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs a CUDA GPU"):
            run_attention_bench(args)
