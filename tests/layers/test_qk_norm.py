"""Qwen3's per-head q_norm / k_norm through the Triton RMSNorm kernel (the CPU interpreter here; the layer's
kernel switch forced on), on the exact views ``LlamaAttention`` passes: [T, heads, head_dim] slices of the fused
qkv output, against HF's own ``Qwen3RMSNorm``.

Bounds: fp32 max |diff| <= 1e-5 * max |ref| (only the order of the mean-square sum differs). bf16: at most 2 bf16
ulps of the output (2^-6 relative): the normalized value may round 1 ulp apart before the weight multiply, then the
product rounds once more. Under the interpreter most bf16 values are 1 ulp off, because Triton 3.x's interpreter
casts fp32 -> bf16 by truncation, not round-to-nearest-even (checked: its rmsnorm output equals the truncated
fp32 result on 256 of 256 values); on the GPU the cast rounds to nearest, as torch does.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from roofline.layers import dispatch, norm  # noqa: E402


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_qk_norm_on_qkv_split_views_matches_hf(num_tokens, dtype, monkeypatch):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    kernels = dispatch._load_kernels()
    assert kernels is not None
    num_heads, num_kv_heads, head_dim, eps = 4, 2, 32, 1e-6
    gen = torch.Generator().manual_seed(num_tokens)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    q, k, _ = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    q = q.reshape(num_tokens, num_heads, head_dim)  # not contiguous for T > 1: the row stride is the qkv width
    k = k.reshape(num_tokens, num_kv_heads, head_dim)
    calls = []

    def forced(x):  # the CUDA dispatch, taken on the CPU: records that the kernel ran
        calls.append(tuple(x.shape))
        return kernels

    for x in (q, k):
        ours, hf = norm.RMSNorm(head_dim, eps), Qwen3RMSNorm(head_dim, eps)
        w = 1 + 0.1 * torch.randn(head_dim, generator=gen)
        ours.weight.data.copy_(w)
        hf.weight.data.copy_(w)
        ours, hf = ours.to(dtype), hf.to(dtype)
        with torch.no_grad():
            ref = hf(x)
            monkeypatch.setattr(dispatch, "kernels_for", forced)
            out = ours(x)
            monkeypatch.undo()
        assert calls[-1] == tuple(x.shape) and out.shape == x.shape and out.dtype == ref.dtype == dtype
        err = (out.float() - ref.float()).abs()
        if dtype == torch.float32:
            assert err.max() <= 1e-5 * ref.abs().max()
        else:
            assert (err <= ref.float().abs() * 2 ** -6).all()  # 2 ulp: ulp(r) <= 2^-7 |r| in bf16
            print(f"T={num_tokens}: {(err > 0).sum().item()} of {err.numel()} bf16 values off HF (<= 2 ulp)")
    assert len(calls) == 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5])
def test_one_launch_qk_norm_in_place_matches_hf(num_tokens, dtype, monkeypatch):
    """``roofline.kernels.qk_norm`` (q and k heads in one launch, in place in qkv) through the layer function
    ``qk_norm`` on the qkv views LlamaAttention has: the q / k views see HF's values (bounds above), v is untouched,
    and the torch twin ``ref_qk_rmsnorm_`` agrees. (The model itself now fuses the norm into ``rope_and_cache``:
    tests/kernels/test_rope_cache.py.)"""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from roofline.kernels.qk_norm import qk_rmsnorm_, ref_qk_rmsnorm_

    kernels = dispatch._load_kernels()
    num_heads, num_kv_heads, head_dim, eps = 4, 2, 32, 1e-6
    gen = torch.Generator().manual_seed(10 + num_tokens)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen) * 3).to(dtype)
    norms = []
    for _ in range(2):
        ours, hf = norm.RMSNorm(head_dim, eps), Qwen3RMSNorm(head_dim, eps)
        w = 1 + 0.1 * torch.randn(head_dim, generator=gen)
        ours.weight.data.copy_(w)
        hf.weight.data.copy_(w)
        norms.append((ours.to(dtype), hf.to(dtype)))
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    q0, k0, v0 = (t.reshape(num_tokens, -1, head_dim).clone() for t in qkv.split(sizes, dim=-1))
    twin = ref_qk_rmsnorm_(qkv.clone(), num_heads, num_kv_heads, head_dim, norms[0][0].weight, norms[1][0].weight, eps)
    q, k, v = (t.reshape(num_tokens, -1, head_dim) for t in qkv.split(sizes, dim=-1))
    monkeypatch.setattr(dispatch, "kernels_for", lambda x: kernels)
    with torch.no_grad():
        q_out, k_out = norm.qk_norm(qkv, q, k, norms[0][0], norms[1][0])
    monkeypatch.undo()
    assert q_out is q and k_out is k  # the kernel path: same views, normed in place
    assert torch.equal(v, v0)
    for out, x0, (_, hf) in ((q, q0, norms[0]), (k, k0, norms[1])):
        with torch.no_grad():
            ref = hf(x0)
        err = (out.float() - ref.float()).abs()
        if dtype == torch.float32:
            assert err.max() <= 1e-5 * ref.abs().max()
        else:
            assert (err <= ref.float().abs() * 2 ** -6).all()
    bound = 1e-5 if dtype == torch.float32 else 2 ** -6
    assert ((qkv.float() - twin.float()).abs() <= twin.float().abs() * bound + 1e-6).all()
    with pytest.raises(ValueError, match=r"qkv must be \[T, \(num_heads \+ 2 \* num_kv_heads\) \* head_dim = 256\]"):
        qk_rmsnorm_(qkv[:, :128], num_heads, num_kv_heads, head_dim, norms[0][0].weight, norms[1][0].weight, eps)
    with pytest.raises(ValueError, match=r"k_weight must be \[32\]"):
        qk_rmsnorm_(qkv, num_heads, num_kv_heads, head_dim, norms[0][0].weight, torch.ones(16, dtype=dtype), eps)
