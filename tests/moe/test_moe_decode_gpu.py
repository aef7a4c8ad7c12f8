"""The MoE decode path's small kernels on a GPU: the fused router (``roofline.kernels.moe_router``) against a
float64 softmax / top-k of the same logits, and Qwen3's q_norm / k_norm through the Triton RMSNorm on the qkv
split views against HF's ``Qwen3RMSNorm``. Skipped without CUDA (H200: ``pytest -m gpu tests/moe/test_moe_decode_gpu.py``).

Bounds:
- router ids: exactly the float64 top-k, ties (equal logits, frequent in bf16) to the lowest index; the fp32
  weights within 1e-5 absolute of float64 (the GPU's fast exp is within a few ulp);
- qk-norm bf16: within 2 bf16 ulps of HF (2^-6 relative), fp32 within 1e-5 relative of HF.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def _f64_topk(logits, top_k, renormalize):
    probs = torch.softmax(logits.double().cpu(), dim=-1)
    order = torch.sort(probs, dim=-1, descending=True, stable=True).indices[:, :top_k]
    w = probs.gather(1, order)
    return (w / w.sum(-1, keepdim=True) if renormalize else w), order


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 128, 8), (8, 128, 8), (64, 128, 8), (300, 128, 8), (1, 8, 2), (64, 8, 2),
                                   (5, 60, 4), (3, 1024, 16)])
def test_fused_router_on_gpu_matches_float64(shape, dtype):
    from roofline.kernels.moe_router import ref_select_experts, select_experts

    num_tokens, num_experts, top_k = shape
    gen = torch.Generator(device="cuda").manual_seed(num_tokens + num_experts)
    logits = (torch.randn(num_tokens, num_experts, device="cuda", generator=gen) * 2).to(dtype)
    logits[0, : num_experts // 2] = 0  # a block of exact ties at the top or across the k-th place
    for renormalize in (True, False):
        w, ids = select_experts(logits, top_k, renormalize)
        ref_w, ref_ids = _f64_topk(logits, top_k, renormalize)
        assert ids.dtype == torch.int64 and w.dtype == torch.float32
        assert torch.equal(ids.cpu(), ref_ids)
        assert (w.cpu().double() - ref_w).abs().max().item() < 1e-5
        tw, _ = ref_select_experts(logits, top_k, renormalize)  # torch's CUDA path: the same weights
        assert (w - tw).abs().max().item() < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_qk_norm_kernels_on_gpu_match_hf(num_tokens, dtype):
    """Both GPU paths of Qwen3's q/k norm: the one-launch in-place kernel (``layers.norm.qk_norm``, what
    LlamaAttention runs) and the 3-D RMSNorm dispatch (its fallback), against HF's Qwen3RMSNorm."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from roofline.kernels import switch
    from roofline.layers.norm import RMSNorm, qk_norm

    num_heads, num_kv_heads, head_dim = 32, 4, 128  # Qwen3-30B-A3B's attention
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    qkv = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device="cuda", generator=gen) * 3
           ).to(dtype)
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    norms = []
    for _ in range(2):
        w = 1 + 0.1 * torch.randn(head_dim, device="cuda", generator=gen)
        ours, hf = RMSNorm(head_dim, 1e-6).cuda(), Qwen3RMSNorm(head_dim, 1e-6).cuda()
        ours.weight.data.copy_(w)
        hf.weight.data.copy_(w)
        norms.append((ours.to(dtype), hf.to(dtype)))
    q0, k0, v0 = (t.reshape(num_tokens, -1, head_dim).clone() for t in qkv.split(sizes, dim=-1))
    with torch.no_grad():
        refs = [norms[0][1](q0), norms[1][1](k0)]
    was = switch._enabled
    switch.set_kernels_enabled(True)
    try:
        with torch.no_grad():
            three_d = [norms[0][0](q0), norms[1][0](k0)]
            q, k, v = (t.reshape(num_tokens, -1, head_dim) for t in qkv.split(sizes, dim=-1))
            q, k = qk_norm(qkv, q, k, norms[0][0], norms[1][0])
    finally:
        switch.set_kernels_enabled(was)
    assert torch.equal(v, v0)
    for name, outs in (("one launch", [q, k]), ("3-D rmsnorm", three_d)):
        for out, ref in zip(outs, refs, strict=True):
            err = (out.float() - ref.float()).abs()
            print(f"T={num_tokens} {dtype} {name}: {(err > 0).float().mean().item():.2%} of values differ from HF")
            assert out.dtype == ref.dtype and out.shape == ref.shape
            if dtype == torch.float32:
                assert err.max() <= 1e-5 * ref.abs().max()
            else:
                assert (err <= ref.float().abs() * 2 ** -6).all()
