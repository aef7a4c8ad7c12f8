"""The MoE decode path's small kernels on a GPU: the fused router (``roofline.kernels.moe_router``) against a
float64 softmax / top-k of the same logits, the gate GEMV fused with it (``gate_select_experts``) against
cuBLAS's ``F.linear`` then the router kernel, Qwen3's q_norm / k_norm through the Triton RMSNorm on the qkv
split views against HF's ``Qwen3RMSNorm``, and the same norm fused into RoPE + the KV store
(``rope_and_cache(q_norm_weight=...)``) against the unfused launches. Skipped without CUDA (H200:
``pytest -m gpu tests/moe/test_moe_decode_gpu.py``).

Bounds:
- router ids: exactly the float64 top-k, ties (equal logits, frequent in bf16) to the lowest index; the fp32
  weights within 1e-5 absolute of float64 (the GPU's fast exp is within a few ulp);
- gate + router: inputs on the 2^-5 grid of tests/moe/test_moe_router.py (every fp32 sum exact, so cuBLAS's and
  the kernel's logits round to the same bf16/fp16 values): ids identical, weights within 1e-6; a CUDA graph of it
  replays to the same result (the per-token counters re-arm);
- qk-norm bf16: within 2 bf16 ulps of HF (2^-6 relative), fp32 within 1e-5 relative of HF;
- fused qk-norm + RoPE vs unfused (qk_rmsnorm_ then rope_and_cache): the two differ only in the order of the
  fp32 mean-square sum, which can move a normed value by an ulp or so before the rotation: per element within
  4 ulps of the dtype at the row's largest |value| (an ulp: bf16 2^-7, fp16 2^-10, fp32 2^-23 relative), and
  at most 1% of the values differ at all in 16-bit (the CPU interpreter: 0.02% in fp16, 11-15% in fp32); the
  fused output within TOL (1e-2 bf16, 1e-3 fp16, 1e-5 fp32) of a float64 norm + rotation.
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 128, 2048, 8), (3, 128, 2048, 8), (16, 128, 2048, 8), (1, 8, 4096, 2),
                                   (5, 60, 2048, 4)])
def test_gate_router_on_gpu_matches_linear_then_router(shape, dtype):
    import torch.nn.functional as F

    from roofline.kernels.moe_router import gate_select_experts, select_experts

    num_tokens, num_experts, hidden, top_k = shape
    gen = torch.Generator(device="cuda").manual_seed(num_tokens + num_experts)
    x = (torch.randint(-64, 65, (num_tokens, hidden), device="cuda", generator=gen).float() / 32).to(dtype)
    w = (torch.randint(-16, 17, (num_experts, hidden), device="cuda", generator=gen).float() / 32).to(dtype)
    w[3] = w[1]  # exact ties, the lowest index first
    if num_tokens > 1:
        x[0] = 0
    matmul = torch.backends.cuda.matmul
    reduced = (matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction)
    matmul.allow_bf16_reduced_precision_reduction = matmul.allow_fp16_reduced_precision_reduction = False
    try:  # cuBLAS's split-K may otherwise sum partials in 16 bits: the reference's logits would be inexact
        refs = {r: select_experts(F.linear(x, w), top_k, r) for r in (True, False)}
    finally:
        matmul.allow_bf16_reduced_precision_reduction, matmul.allow_fp16_reduced_precision_reduction = reduced
    for renormalize, (ref_w, ref_ids) in refs.items():
        tw, ids = gate_select_experts(x, w, top_k, renormalize)
        assert torch.equal(ids, ref_ids)
        assert (tw - ref_w).abs().max().item() < 1e-6
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gw, gids = gate_select_experts(x, w, top_k, True)
    ref_w, ref_ids = refs[True]
    for _ in range(3):
        gw.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(gids, ref_ids) and (gw - ref_w).abs().max().item() < 1e-6


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 64])
def test_qk_norm_kernels_on_gpu_match_hf(num_tokens, dtype):
    """Two unfused GPU paths of Qwen3's q/k norm: the one-launch in-place kernel (``layers.norm.qk_norm``) and the
    3-D RMSNorm dispatch (the RMSNorm modules, what a backend that cannot fuse the norm runs), against HF's
    Qwen3RMSNorm. LlamaAttention on the Triton backend fuses it into rope_and_cache (next test)."""
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


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("num_tokens", [1, 64, 300])
@pytest.mark.parametrize("cache_dtype", ["model", "int8"])
def test_fused_qk_norm_rope_cache_on_gpu_matches_unfused(num_tokens, dtype, cache_dtype):
    """Qwen3-30B-A3B's attention (32 q / 4 kv heads, D 128) on the qkv views LlamaAttention passes: one
    ``rope_and_cache`` launch with the q/k norm against the two launches it replaces (bounds in the module
    docstring), a float64 oracle, and the int8 cache's codes/scales bit for bit those of the kernel's own k."""
    from roofline.kernels.common import ref_quantize_int8
    from roofline.kernels.qk_norm import qk_rmsnorm_
    from roofline.kernels.rope_cache import rope_and_cache

    num_heads, num_kv_heads, head_dim, block_size, eps = 32, 4, 128, 16, 1e-6
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    qkv0 = (torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, device="cuda", generator=gen) * 3
            ).to(dtype)
    wq, wk = ((1 + 0.2 * torch.randn(head_dim, device="cuda", generator=gen)).to(dtype) for _ in range(2))
    inv_freq = 1.0 / 1e6 ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)  # Qwen3's rope_theta
    ang = torch.arange(40960, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cs64 = torch.cat((ang.cos(), ang.sin()), dim=-1)
    cs = cs64.float().cuda()
    pos = torch.randint(0, 40960, (num_tokens,), device="cuda", generator=gen)
    num_blocks = num_tokens // block_size + 2
    slots = torch.randperm(num_blocks * block_size, device="cuda", generator=gen)[:num_tokens]
    slots[-1] = -1  # a padded row of a captured batch
    sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
    shape = (num_blocks, block_size, num_kv_heads, head_dim)

    def run(fused):
        qkv = qkv0.clone()
        q, k, v = (t.view(num_tokens, -1, head_dim) for t in qkv.split(sizes, dim=-1))
        if cache_dtype == "int8":
            kc = torch.zeros(shape, dtype=torch.int8, device="cuda")
            ks = torch.zeros(shape[:3], device="cuda")
            caches = (kc, kc.clone(), ks, ks.clone())
        else:
            kc = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
            caches = (kc, kc.clone(), None, None)
        if fused:
            rope_and_cache(q, k, v, pos, cs, caches[0], caches[1], slots, caches[2], caches[3],
                           q_norm_weight=wq, k_norm_weight=wk, norm_eps=eps)
        else:
            qk_rmsnorm_(qkv, num_heads, num_kv_heads, head_dim, wq, wk, eps)
            rope_and_cache(q, k, v, pos, cs, caches[0], caches[1], slots, caches[2], caches[3])
        torch.cuda.synchronize()
        return q, k, caches

    q, k, caches = run(True)
    uq, uk, _ = run(False)
    ulp = {torch.bfloat16: 2 ** -7, torch.float16: 2 ** -10, torch.float32: 2 ** -23}[dtype]
    tol = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
    half = head_dim // 2
    c, s = cs64[pos.cpu()][:, None, :half], cs64[pos.cpu()][:, None, half:]
    qkv64 = qkv0.double().cpu()
    for got, unf, x0, w in ((q, uq, qkv64[:, :sizes[0]], wq), (k, uk, qkv64[:, sizes[0]:sizes[0] + sizes[1]], wk)):
        diff = (got.float() - unf.float()).abs()
        row_max = torch.maximum(got.float().abs(), unf.float().abs()).amax(-1, keepdim=True)
        frac = (diff > 0).float().mean().item()
        print(f"T={num_tokens} {dtype} {cache_dtype}: {frac:.3%} of values differ fused vs unfused, "
              f"max {diff.max().item():.3g}")
        assert (diff <= 4 * ulp * row_max).all()
        if dtype != torch.float32:
            assert frac <= 0.01
        x = x0.view(num_tokens, -1, head_dim)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double().cpu()
        want = torch.cat((x[..., :half] * c - x[..., half:] * s, x[..., half:] * c + x[..., :half] * s), -1)
        assert ((got.double().cpu() - want).norm() / want.norm()).item() < tol
    valid = slots >= 0
    flat = lambda t: t.view(-1, *t.shape[2:])  # noqa: E731
    if cache_dtype == "int8":
        codes, scales = ref_quantize_int8(k)
        assert torch.equal(flat(caches[0])[slots[valid]], codes[valid])
        assert torch.equal(flat(caches[2])[slots[valid]], scales[valid])
    else:
        assert torch.equal(flat(caches[0])[slots[valid]], k[valid])
    written = torch.zeros(flat(caches[0]).shape[0], dtype=torch.bool, device="cuda")
    written[slots[valid]] = True
    if cache_dtype != "int8":
        assert torch.isnan(flat(caches[0])[~written].float()).all()  # the padded row wrote nothing
