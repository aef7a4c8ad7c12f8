"""Fused RoPE + KV-cache write (Triton) against ref_rope_and_cache and a float64 reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import DEVICE, DTYPES, TOL, rel_err  # noqa: E402

from roofline.kernels.rope_cache import (  # noqa: E402
    ref_rope_and_cache,
    ref_store_kv_cache,
    rope_and_cache,
    store_kv_cache,
)


def _cos_sin(max_pos, head_dim, base=10000.0):
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    ang = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=-1)  # [max_pos, D] float64


def _case(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    num_blocks = (num_tokens + block_size - 1) // block_size + 2
    q = torch.randn(num_tokens, num_heads, head_dim, generator=g).to(dtype)
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    return [t.to(DEVICE) for t in (q, k, v, positions, slots, cache)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim,block_size",
                         [(1, 4, 4, 64, 16), (19, 9, 3, 64, 1), (40, 8, 2, 128, 32), (5, 6, 2, 96, 16)])
def test_rope_and_cache(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    q, k, v, pos, slots, cache = _case(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, num_tokens)
    cs64 = _cos_sin(4096, head_dim)
    cs = cs64.float().to(DEVICE)
    q0, k0 = q.clone(), k.clone()
    kc, vc = cache.clone(), cache.clone()  # poisoned with NaN: only written slots may be finite
    rope_and_cache(q, k, v, pos, cs, kc, vc, slots)
    rq, rk, rkc, rvc = q0.clone(), k0.clone(), cache.clone(), cache.clone()
    ref_rope_and_cache(rq, rk, v, pos, cs, rkc, rvc, slots)
    tol = TOL[dtype]
    assert rel_err(q, rq) < tol and rel_err(k, rk) < tol
    # float64 rotation
    half = head_dim // 2
    c, s = cs64[pos.cpu()][:, None, :half], cs64[pos.cpu()][:, None, half:]
    for got, x0 in ((q, q0), (k, k0)):
        x = x0.double().cpu()
        want = torch.cat((x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s), -1)
        assert rel_err(got.cpu(), want) < tol
    flat_k = kc.view(-1, num_kv_heads, head_dim)
    flat_v = vc.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots], k) and torch.equal(flat_v[slots], v)
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()
    assert torch.equal(torch.isnan(kc), torch.isnan(rkc))


def test_negative_slot_is_skipped_and_store_only():
    q, k, v, pos, slots, cache = _case(6, 2, 2, 32, 16, torch.float32, 1)
    slots[2] = -1
    kc, vc = cache.clone(), cache.clone()
    store_kv_cache(k, v, kc, vc, slots)
    rkc, rvc = cache.clone(), cache.clone()
    ref_store_kv_cache(k, v, rkc, rvc, slots)
    assert torch.equal(torch.nan_to_num(kc, 7.0), torch.nan_to_num(rkc, 7.0))
    assert torch.equal(torch.nan_to_num(vc, 7.0), torch.nan_to_num(rvc, 7.0))
    assert int((~torch.isnan(kc)).sum()) == 5 * 2 * 32


def test_bad_cos_sin_width():
    q, k, v, pos, slots, cache = _case(2, 2, 2, 32, 16, torch.float32, 2)
    with pytest.raises(ValueError, match="must equal even head_dim"):
        rope_and_cache(q, k, v, pos, torch.zeros(4096, 16, device=DEVICE), cache, cache.clone(), slots)
