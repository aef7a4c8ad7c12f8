"""The packed decode variants ("mma", "fma"; issue 29) and the page-aware split count.

Each variant runs on 16/32-bit and int8 / fp8 e4m3 caches (codes written by the ref twins, stale slots
poisoned) with one query per sequence and with several (a speculative verify step), against:
- the float64 oracle on the DEQUANTIZED cache (codes x scales in float64): the kernel's own error, TOL[dtype];
- ``ref_decode_attention`` on the same cache: TOL[dtype].
bf16 runs on the GPU only (it is wrong under the interpreter).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import (  # noqa: E402
    DEVICE,
    TOL,
    attention_f64,
    make_paged_case,
    poison_stale_quantized,
    poison_stale_slots,
    quantize_cache,
    rel_err,
)

from roofline.kernels.decode_attention import (  # noqa: E402
    MAX_PACKED_ROWS,
    choose_num_splits,
    default_block_n,
    paged_decode_attention,
    ref_decode_attention,
    split_align,
)


def _dequantized_f64(codes, scale):
    """float64 values of a cache: codes x their scales (per token [nb, bs, H_kv] or per head [H_kv])."""
    c = codes.double()
    if scale is None:
        return c
    s = scale.double()
    return c * (s[:, None] if s.dim() == 1 else s.unsqueeze(-1))


def _check(variant, fmt, dtype, query_len, seq_lens, num_heads, num_kv_heads, head_dim, block_size, seed,
           **kw):
    q, kc, vc, meta = make_paged_case([query_len] * len(seq_lens), seq_lens, num_heads, num_kv_heads, head_dim,
                                      block_size, dtype, seed)
    ks = vs = None
    if fmt is None:
        poison_stale_slots(kc, vc, meta)
    else:
        kc, vc, ks, vs = quantize_cache(kc, vc, fmt)
        poison_stale_quantized(kc, vc, meta, ks, vs)
    scale = 1.0 / math.sqrt(head_dim)
    out = torch.full_like(q, float("nan"))  # poison: unwritten rows fail
    paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale, out=out, k_scale=ks, v_scale=vs,
                           variant=variant, query_len=query_len, **kw)
    ref = ref_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, scale, k_scale=ks, v_scale=vs,
                               query_len=query_len)
    oracle = attention_f64(q, _dequantized_f64(kc, ks), _dequantized_f64(vc, vs), meta, scale)
    err_ref, err_f64 = rel_err(out, ref), rel_err(out.cpu(), oracle)
    assert err_ref < TOL[dtype], f"{variant} {fmt} vs ref_: {err_ref:.2e} >= {TOL[dtype]}"
    assert err_f64 < TOL[dtype], f"{variant} {fmt} vs float64: {err_f64:.2e} >= {TOL[dtype]}"
    return out


@pytest.mark.parametrize("variant", ["mma", "fma"])
@pytest.mark.parametrize("fmt", [None, "int8", "fp8_e4m3"])
@pytest.mark.parametrize("dtype,query_len", [(torch.float32, 1), (torch.float32, 4), (torch.float16, 4)])
def test_packed_variants_match_float64(variant, fmt, dtype, query_len):
    # GQA 4 (group x query_len = 4 or 16 packed rows), 3 splits: empty splits, a split boundary inside the
    # verify rows, block-boundary lengths and a sequence of exactly query_len keys.
    _check(variant, fmt, dtype, query_len, [query_len, 16, 33, 100], 8, 2, 64, 16, seed=7 * query_len + 1,
           num_splits=3, block_n=16)


@pytest.mark.parametrize("variant", ["mma", "fma"])
def test_packed_variants_odd_group_pages_and_head_dim(variant):
    # group 3 (rows 3 / 6 padded), block_size 1 (per-key block-table gather), D 96 (padded to 128).
    _check(variant, "int8", torch.float32, 2, [2, 5, 70], 6, 2, 96, 1, seed=96, num_splits=2, block_n=16)
    # block_size 32 a multiple of block_n: splits cut at page boundaries (split_align = 32).
    _check(variant, "fp8_e4m3", torch.float32, 1, [1, 47, 200], 8, 2, 64, 32, seed=12, num_splits=4, block_n=16)


def test_mma_eager_rescale_and_plain_int8_cast_agree():
    # rescale_log2 = 0 rescales every tile (the old kernel's rule); int8_magic False casts codes directly.
    _check("mma", "int8", torch.float32, 3, [3, 64, 130], 8, 2, 64, 16, seed=5, num_splits=2, block_n=16,
           rescale_log2=0.0, int8_magic=False)


def test_packed_verify_rows_equal_one_query_per_call():
    # A verify step of 3 rows = 3 decode calls on the growing context (the same cache): row t of sequence i is
    # the query at position seq_len - 3 + t, which sees exactly seq_len - 3 + t + 1 keys.
    q, kc, vc, meta = make_paged_case([3, 3], [10, 40], 8, 2, 32, 16, torch.float32, seed=3)
    out = paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.2, num_splits=2, block_n=16,
                                 variant="mma", query_len=3)
    for t in range(3):
        lens = meta.seq_lens - 2 + t
        one = paged_decode_attention(q[t::3].contiguous(), kc, vc, meta.block_tables, lens, 0.2, num_splits=2,
                                     block_n=16, variant="old")
        assert rel_err(out[t::3], one) < 1e-5


def test_packed_zero_length_row_is_zero():
    q, kc, vc, meta = make_paged_case([1, 1], [5, 1], 4, 2, 32, 16, torch.float32)
    seq_lens = meta.seq_lens.clone()
    seq_lens[1] = 0
    for variant in ("mma", "fma"):
        out = paged_decode_attention(q, kc, vc, meta.block_tables, seq_lens, 0.2, num_splits=2, block_n=16,
                                     variant=variant)
        assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_decode_variant_errors():
    q, kc, vc, meta = make_paged_case([2, 2], [5, 9], 4, 2, 32, 16, torch.float32)
    args = (q, kc, vc, meta.block_tables, meta.seq_lens, 0.2)
    with pytest.raises(ValueError, match="unknown decode variant 'tree'; known: old, mma, fma"):
        paged_decode_attention(*args, variant="tree", query_len=2)
    with pytest.raises(ValueError, match="variant 'old' takes query_len 1, got 2"):
        paged_decode_attention(*args, variant="old", query_len=2)
    with pytest.raises(ValueError, match="q has 4 rows; expected num_seqs 2 x query_len 3"):
        paged_decode_attention(*args, variant="mma", query_len=3)
    with pytest.raises(ValueError, match="query_len 0 must be >= 1"):
        paged_decode_attention(*args, query_len=0)
    big = MAX_PACKED_ROWS // 2 + 1  # group 2 x big > MAX_PACKED_ROWS
    qb = torch.zeros(2 * big, 4, 32)
    with pytest.raises(ValueError, match=f"group 2 x query_len {big} = {2 * big} .* at most {MAX_PACKED_ROWS}"):
        paged_decode_attention(qb, kc, vc, meta.block_tables, meta.seq_lens, 0.2, variant="fma", query_len=big)


@pytest.mark.parametrize("args,expected", [
    # (num_seqs, num_kv_heads, max_context, block_size): llama-3-8b's 8 kv heads on the H200's 132 SMs.
    ((8, 8, 32768, 16), 8),      # 64 pairs: 4 programs / SM -> 8 (the measured optimum, unchanged)
    ((64, 8, 4096, 16), 2),      # 512 pairs fill the SMs: >= 512 keys per split (unchanged)
    ((64, 8, 4096, 256), 2),
    ((1, 8, 4096, 16), 32),      # 8 pairs on 132 SMs: splits of 128 keys (2 tiles), was 8
    ((1, 8, 4096, 64), 32),
    ((1, 8, 4096, 128), 32),     # one page per split
    ((1, 8, 4096, 256), 16),     # one 256-key page per split: never less than a page
    ((1, 8, 512, 256), 2),       # capped by the 2 pages of the context
    ((1, 8, 131072, 16), 64),    # max_splits
    ((256, 8, 1024, 16), 1),     # 2048 pairs: one split
])
def test_choose_num_splits_accounts_for_page_size(args, expected):
    num_seqs, num_kv_heads, max_context, block_size = args
    assert choose_num_splits(num_seqs, num_kv_heads, max_context, num_sms=132, block_size=block_size,
                             block_n=64) == expected


def test_default_tiles():
    # MMA tiles: 64 keys (32 past D 128). CUDA-core tiles keep rows x block_n x D <= 16K elements.
    assert [default_block_n(d, v) for d, v in ((128, "old"), (128, "mma"), (256, "mma"))] == [64, 64, 32]
    assert default_block_n(128, "fma", group=4, query_len=1) == 32  # 4 x 32 x 128
    assert default_block_n(128, "fma", group=4, query_len=4) == 8  # 16 x 8 x 128
    assert default_block_n(128, "fma", group=4, query_len=4, code_bytes=1) == 16  # 8-key 1-byte tiles are wrong
    assert default_block_n(256, "fma", group=2, query_len=1) == 32  # 2 x 32 x 256


def test_split_align_and_bad_sizes():
    assert [split_align(bs, 64) for bs in (1, 16, 32, 64, 128, 256)] == [64, 64, 64, 64, 128, 256]
    assert split_align(48, 32) == 32  # 48 is not a whole number of 32-key tiles: tiles, not pages
    with pytest.raises(ValueError, match="block_size 0 and block_n 64 must be >= 1"):
        choose_num_splits(1, 8, 4096, block_size=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("variant", ["old", "mma", "fma"])
@pytest.mark.parametrize("fmt", [None, "int8", "fp8_e4m3"])
@pytest.mark.parametrize("head_dim,block_size,group,query_len", [(128, 16, 4, 1), (128, 256, 4, 1), (128, 64, 4, 4),
                                                                 (64, 32, 1, 1), (256, 16, 2, 1)])
def test_decode_variants_gpu_bf16(variant, fmt, head_dim, block_size, group, query_len):
    # GPU tiles and the default num_splits, contexts up to 9k, bf16 q on bf16 / int8 / fp8 caches.
    if variant == "old" and query_len > 1:
        pytest.skip("'old' serves one query per sequence")
    _check(variant, fmt, torch.bfloat16, query_len, [query_len, 4097, 9000, 300, 2048], 8 * group, 8, head_dim,
           block_size, seed=head_dim + block_size)
    assert DEVICE == "cuda"


def test_fma_refuses_8_key_tiles_on_a_1_byte_cache():
    # Wrong on the H200 under Triton 3.6 (rel err 1.9; bench/results/kvq-fma-20261204): refused before launch.
    q, kc, vc, meta = make_paged_case([4], [40], 8, 2, 64, 16, torch.float32, seed=0)
    kc, vc, ks, vs = quantize_cache(kc, vc, "int8")
    with pytest.raises(ValueError, match=r"'fma' on a 1-byte \(torch.int8\) cache needs block_n >= 16 .*got 8"):
        paged_decode_attention(q, kc, vc, meta.block_tables, meta.seq_lens, 0.125, k_scale=ks, v_scale=vs,
                               variant="fma", query_len=4, block_n=8)
