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


# ------------------------------------------------------------------ Qwen3's q/k RMSNorm fused before the rotation

def _qkv_case(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed):
    """q, k, v as LlamaAttention hands them over: [T, heads, D] views of one fused qkv [T, (H + 2 H_kv) D] (rows
    strided by the qkv width), per-head magnitudes 0.1 to 10 and one all-zero k row (normed to exactly 0); Qwen3's
    q_norm / k_norm weights 1 +- 0.2; token 1 is padding (slot -1) when T > 1."""
    g = torch.Generator().manual_seed(seed)
    heads = num_heads + 2 * num_kv_heads
    mag = torch.logspace(-1, 1, heads).repeat_interleave(head_dim)
    qkv = (torch.randn(num_tokens, heads * head_dim, generator=g) * mag).to(dtype)
    qkv[0, num_heads * head_dim:(num_heads + 1) * head_dim] = 0.0
    wq, wk = ((1 + 0.2 * torch.randn(head_dim, generator=g)).to(dtype) for _ in range(2))
    num_blocks = (num_tokens + block_size - 1) // block_size + 2
    positions = torch.randint(0, 4096, (num_tokens,), generator=g)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    if num_tokens > 1:
        slots[1] = -1
    cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    return [t.to(DEVICE) for t in (qkv, wq, wk, positions, slots, cache)]


def _split(qkv, num_heads, num_kv_heads, head_dim):
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    t = qkv.shape[0]
    return q.view(t, num_heads, head_dim), k.view(t, num_kv_heads, head_dim), v.view(t, num_kv_heads, head_dim)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,num_heads,num_kv_heads,head_dim,block_size",
                         [(1, 4, 4, 64, 16), (19, 9, 3, 64, 1), (7, 8, 2, 128, 32), (5, 6, 2, 96, 16)])
def test_rope_and_cache_with_qk_norm(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype):
    """The fused norm + rotation + store on the qkv views, against: its ref twin (TOL), the unfused sequence
    (``ref_qk_rmsnorm_`` then ``ref_rope_and_cache``: the twin exactly; the Triton ``qk_rmsnorm_`` then
    ``rope_and_cache``: TOL) and a float64 norm + rotation (TOL). The cache holds exactly the k written back."""
    from roofline.kernels.qk_norm import qk_rmsnorm_, ref_qk_rmsnorm_

    qkv0, wq, wk, pos, slots, cache = _qkv_case(num_tokens, num_heads, num_kv_heads, head_dim, block_size, dtype,
                                                 num_tokens + head_dim)
    cs64 = _cos_sin(4096, head_dim)
    cs = cs64.float().to(DEVICE)
    eps = 1e-6
    split = lambda t: _split(t, num_heads, num_kv_heads, head_dim)  # noqa: E731
    qkv, kc, vc = qkv0.clone(), cache.clone(), cache.clone()
    q, k, v = split(qkv)
    rope_and_cache(q, k, v, pos, cs, kc, vc, slots, q_norm_weight=wq, k_norm_weight=wk, norm_eps=eps)
    twin, rkc, rvc = qkv0.clone(), cache.clone(), cache.clone()
    rq, rk, rv = split(twin)
    ref_rope_and_cache(rq, rk, rv, pos, cs, rkc, rvc, slots, q_norm_weight=wq, k_norm_weight=wk, norm_eps=eps)
    tol = TOL[dtype]
    assert rel_err(q, rq) < tol and rel_err(k, rk) < tol
    assert torch.equal(v, split(qkv0)[2])  # v is read, never written
    # The unfused sequence, in torch: the twin bit for bit (same ref_rmsnorm, same ref_rotary).
    unf, ukc, uvc = qkv0.clone(), cache.clone(), cache.clone()
    ref_qk_rmsnorm_(unf, num_heads, num_kv_heads, head_dim, wq, wk, eps)
    ref_rope_and_cache(*split(unf), pos, cs, ukc, uvc, slots)
    assert torch.equal(unf, twin) and torch.equal(ukc.nan_to_num(7.0), rkc.nan_to_num(7.0))
    # ... and in Triton (two launches): the same values up to the order of the mean-square sum.
    tri, tkc, tvc = qkv0.clone(), cache.clone(), cache.clone()
    qk_rmsnorm_(tri, num_heads, num_kv_heads, head_dim, wq, wk, eps)
    rope_and_cache(*split(tri), pos, cs, tkc, tvc, slots)
    assert rel_err(qkv, tri) < tol and rel_err(kc.nan_to_num(0.0), tkc.nan_to_num(0.0)) < tol
    # float64: x / sqrt(mean(x^2) + eps) * w, then the rotation.
    half = head_dim // 2
    c, s = cs64[pos.cpu()][:, None, :half], cs64[pos.cpu()][:, None, half:]
    for got, x0, w in ((q, split(qkv0)[0], wq), (k, split(qkv0)[1], wk)):
        x = x0.double().cpu()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double().cpu()
        want = torch.cat((x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s), -1)
        assert rel_err(got.cpu(), want) < tol
    assert (k[0, 0] == 0).all()  # an all-zero row norms to 0, not NaN
    valid = slots >= 0
    flat_k = kc.view(-1, num_kv_heads, head_dim)
    flat_v = vc.view(-1, num_kv_heads, head_dim)
    assert torch.equal(flat_k[slots[valid]], k[valid]) and torch.equal(flat_v[slots[valid]], v[valid])
    untouched = torch.ones(flat_k.shape[0], dtype=torch.bool, device=DEVICE)
    untouched[slots[valid]] = False
    assert torch.isnan(flat_k[untouched]).all() and torch.isnan(flat_v[untouched]).all()
    assert torch.equal(torch.isnan(kc), torch.isnan(rkc))


def test_qk_norm_arguments_are_checked():
    qkv, wq, wk, pos, slots, cache = _qkv_case(3, 4, 2, 32, 16, torch.float32, 3)
    q, k, v = _split(qkv, 4, 2, 32)
    cs = _cos_sin(4096, 32).float().to(DEVICE)
    for fn in (rope_and_cache, ref_rope_and_cache):
        with pytest.raises(ValueError, match="go together"):
            fn(q, k, v, pos, cs, cache, cache.clone(), slots, q_norm_weight=wq, k_norm_weight=wk)
        with pytest.raises(ValueError, match="go together"):
            fn(q, k, v, pos, cs, cache, cache.clone(), slots, q_norm_weight=wq, norm_eps=1e-6)
        with pytest.raises(ValueError, match=r"k_norm_weight must be \[32\] contiguous torch.float32"):
            fn(q, k, v, pos, cs, cache, cache.clone(), slots, q_norm_weight=wq, k_norm_weight=wk.half(),
               norm_eps=1e-6)
        with pytest.raises(ValueError, match=r"q_norm_weight must be \[32\]"):
            fn(q, k, v, pos, cs, cache, cache.clone(), slots, q_norm_weight=wq[:16], k_norm_weight=wk,
               norm_eps=1e-6)
    assert torch.isnan(cache).all()  # nothing ran
