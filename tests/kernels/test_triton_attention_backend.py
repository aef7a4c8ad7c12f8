"""TritonAttentionBackend against the exact TorchAttentionBackend: RoPE, cache contents and outputs."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import (  # noqa: E402
    DEVICE,
    DTYPES,
    TOL,
    backend_with_cache,
    gpu_only,
    make_paged_case,
    positions_of,
    rel_err,
)


def _run_both(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    q, kc, vc, meta = make_paged_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    k = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    pos = positions_of(meta)
    triton_b = backend_with_cache("triton", num_heads, num_kv_heads, head_dim, kc, vc)
    torch_b = backend_with_cache("torch", num_heads, num_kv_heads, head_dim, kc, vc)
    assert triton_b.name == "triton" and triton_b.scale == 1.0 / math.sqrt(head_dim)
    out = triton_b.forward(q.clone(), k.clone(), v, pos, triton_b.kv_cache(0), triton_b.build_metadata(meta))
    ref = torch_b.forward(q.clone(), k.clone(), v, pos, torch_b.kv_cache(0), torch_b.build_metadata(meta))
    # Same cache writes: bit for bit for v (a copy), within rounding for the rotated k.
    assert torch.equal(triton_b.kv_cache(0).v, torch_b.kv_cache(0).v)
    assert rel_err(triton_b.kv_cache(0).k, torch_b.kv_cache(0).k) < TOL[dtype]
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_mixed_prefill_and_decode(dtype):
    # chunked prefill sharing the step with two decodes
    _run_both([12, 1, 5, 1], [12, 30, 21, 17], 6, 2, 64, 16, dtype, seed=1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_backend_decode_only(dtype):
    _run_both([1, 1, 1], [1, 16, 45], 8, 2, 64, 16, dtype, seed=2)


def _quantized_backend(name, num_heads, num_kv_heads, head_dim, kq, vq, ks, vs):
    """A backend whose one-layer quantized pool holds copies of the codes and scales."""
    from roofline.attention.backend import get_attention_backend
    from roofline.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(head_dim, 4096, 10000.0, device=kq.device)
    backend = get_attention_backend(name)(num_heads, num_kv_heads, head_dim, rotary)
    cache = backend.allocate_kv_cache(1, kq.shape[0], kq.shape[1], kq.dtype, kq.device)[0]
    for dst, src in ((cache.k, kq), (cache.v, vq), (cache.k_scale, ks), (cache.v_scale, vs)):
        dst.copy_(src)
    return backend


@pytest.mark.parametrize("fmt", ["int8", pytest.param("fp8_e4m3", marks=gpu_only, id="fp8_e4m3")])
@pytest.mark.parametrize("q_lens,seq_lens", [([12, 1, 5, 1], [12, 30, 21, 17]), ([1, 1, 1], [1, 16, 45])],
                         ids=["mixed", "decode"])
def test_backend_quantized_cache_matches_torch_backend(fmt, q_lens, seq_lens):
    # fp8 is GPU-only here: the interpreter's fp32 -> fp8 conversion is wrong (test_kv_quant.py).
    from kernel_cases import quantize_cache

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    q, kc, vc, meta = make_paged_case(q_lens, seq_lens, 6, 2, 64, 16, dtype, seed=4)
    kq, vq, ks, vs = quantize_cache(kc, vc, fmt)
    g = torch.Generator().manual_seed(5)
    k = torch.randn(q.shape[0], 2, 64, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(q.shape[0], 2, 64, generator=g).to(dtype).to(DEVICE)
    pos = positions_of(meta)
    triton_b = _quantized_backend("triton", 6, 2, 64, kq, vq, ks, vs)
    torch_b = _quantized_backend("torch", 6, 2, 64, kq, vq, ks, vs)
    out = triton_b.forward(q.clone(), k.clone(), v, pos, triton_b.kv_cache(0), triton_b.build_metadata(meta))
    ref = torch_b.forward(q.clone(), k.clone(), v, pos, torch_b.kv_cache(0), torch_b.build_metadata(meta))
    tc, rc = triton_b.kv_cache(0), torch_b.kv_cache(0)
    # v is quantized from the same values: identical codes and scales. k is rotated first (fp32 on CPU:
    # identical too; 16-bit on the GPU: a rare one-code difference from a one-ulp rotation difference).
    assert torch.equal(tc.v.view(torch.uint8), rc.v.view(torch.uint8)) and torch.equal(tc.v_scale, rc.v_scale)
    if dtype == torch.float32:
        assert torch.equal(tc.k, rc.k) and torch.equal(tc.k_scale, rc.k_scale)
    else:
        assert (tc.k.view(torch.uint8) != rc.k.view(torch.uint8)).float().mean() < 1e-3
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("variant", ["mma", "fma"])
def test_backend_decode_variant_matches_torch_backend(variant):
    # The backend's decode_variant reaches the kernel: an int8 decode step against the torch backend.
    from kernel_cases import quantize_cache

    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    q, kc, vc, meta = make_paged_case([1, 1, 1], [1, 16, 45], 8, 2, 64, 16, dtype, seed=6)
    kq, vq, ks, vs = quantize_cache(kc, vc, "int8")
    g = torch.Generator().manual_seed(7)
    k = torch.randn(3, 2, 64, generator=g).to(dtype).to(DEVICE)
    v = torch.randn(3, 2, 64, generator=g).to(dtype).to(DEVICE)
    triton_b = _quantized_backend("triton", 8, 2, 64, kq, vq, ks, vs)
    torch_b = _quantized_backend("torch", 8, 2, 64, kq, vq, ks, vs)
    assert triton_b.decode_variant_for(torch.int8) == "mma"  # DEFAULT_VARIANT: the H200 A/B's pick for int8
    triton_b.decode_variant = variant
    assert triton_b.decode_variant_for(torch.int8) == variant
    pos = positions_of(meta)
    out = triton_b.forward(q.clone(), k.clone(), v, pos, triton_b.kv_cache(0), triton_b.build_metadata(meta))
    ref = torch_b.forward(q.clone(), k.clone(), v, pos, torch_b.kv_cache(0), torch_b.build_metadata(meta))
    assert rel_err(out, ref) < TOL[dtype]


@pytest.mark.parametrize("block_size,expected", [(16, 32), (256, 16)])
def test_split_count_follows_the_pool_page(block_size, expected):
    # The backend leaves the split count to the kernel's static choice; batch 1, 4k context, 8 kv heads on the
    # H200's 132 SMs: shorter splits (2 tiles / 1 page each) while the grid is under-filled.
    from roofline.kernels.decode_attention import choose_num_splits

    assert choose_num_splits(1, 8, 4096, num_sms=132, block_size=block_size, block_n=64) == expected


def test_backend_prefill_reads_a_tree_mask_from_the_metadata():
    # 4 new rows after 12 cached tokens, a tree: 0 the root, 1 under 0, 2 under 0, 3 under 2. A metadata object
    # carrying tree_mask reaches the prefill kernel through forward (which rotates q in place and stores k/v).
    from roofline.kernels.prefill_attention import ref_prefill_attention

    q, kc, vc, meta = make_paged_case([4], [16], 4, 2, 32, 16, torch.float32, seed=9)
    g = torch.Generator().manual_seed(10)
    k, v = torch.randn(4, 2, 32, generator=g).to(DEVICE), torch.randn(4, 2, 32, generator=g).to(DEVICE)
    backend = backend_with_cache("triton", 4, 2, 32, kc, vc)
    tm = torch.tensor([[0b1, 0b11, 0b101, 0b1101]], dtype=torch.int64, device=DEVICE)
    tmeta = backend.build_metadata(meta)
    tmeta.tree_mask = tm
    qr = q.clone()
    out = backend.forward(qr, k, v, positions_of(meta), backend.kv_cache(0), tmeta)
    assert not torch.equal(qr, q)  # rotated in place: qr is what the kernel attended with
    cache = backend.kv_cache(0)
    ref = ref_prefill_attention(qr, cache.k, cache.v, meta, backend.scale, tree_mask=tm)
    plain = ref_prefill_attention(qr, cache.k, cache.v, meta, backend.scale)
    assert rel_err(out, ref) < TOL[torch.float32]
    assert rel_err(out[:2], plain[:2]) < TOL[torch.float32]  # rows 0, 1 see every earlier row anyway
    assert rel_err(out[2:], plain[2:]) > 1e-3  # rows 2, 3 do not see row 1
