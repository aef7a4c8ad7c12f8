"""TritonAttentionBackend against the exact TorchAttentionBackend: RoPE, cache contents and outputs."""

from __future__ import annotations

import math

import numpy as np
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


@pytest.mark.parametrize("form", ["prefill", "decode rows"])
def test_backend_applies_a_tree_mask_in_both_forms(form):
    # 4 new rows after 12 cached tokens, a tree: 0 the root, 1 under 0, 2 under 0, 3 under 2. Metadata carrying
    # tree_mask reaches the prefill kernel; the same step laid out as one decode row per node (tree_lo/tree_bits,
    # what InputPreparer builds for ROOFLINE_TREE_VERIFY=decode) the decode kernel, through forward (which
    # rotates q in place and stores k/v). Both equal the tree-masked reference.
    from roofline.attention.backend import paged_metadata, tree_decode_rows
    from roofline.kernels.prefill_attention import ref_prefill_attention

    q, kc, vc, meta = make_paged_case([4], [16], 4, 2, 32, 16, torch.float32, seed=9)
    g = torch.Generator().manual_seed(10)
    k, v = torch.randn(4, 2, 32, generator=g).to(DEVICE), torch.randn(4, 2, 32, generator=g).to(DEVICE)
    backend = backend_with_cache("triton", 4, 2, 32, kc, vc)
    tm = torch.tensor([[0b1, 0b11, 0b101, 0b1101]], dtype=torch.int64, device=DEVICE)
    meta.tree_mask = tm
    tmeta = backend.build_metadata(meta)
    if form == "decode rows":
        table, lens, lo, bits = tree_decode_rows(meta, 4)
        assert lens.tolist() == [13, 14, 15, 16] and lo.tolist() == [12] * 4 and bits.tolist() == tm[0].tolist()
        tmeta = paged_metadata(meta.slot_mapping.cpu().numpy(), np.arange(5), lens.numpy(), table.cpu().numpy(),
                               torch.device(DEVICE), tree_rows=(lo.numpy(), bits.numpy()))
        assert tmeta.is_decode_only and tmeta.tree_lo.tolist() == [12] * 4
    qr = q.clone()
    out = backend.forward(qr, k, v, positions_of(meta), backend.kv_cache(0), tmeta)
    assert not torch.equal(qr, q)  # rotated in place: qr is what the kernel attended with
    cache = backend.kv_cache(0)
    ref = ref_prefill_attention(qr, cache.k, cache.v, meta, backend.scale, tree_mask=tm)
    plain = ref_prefill_attention(qr, cache.k, cache.v, meta, backend.scale)
    assert rel_err(out, ref) < TOL[torch.float32]
    assert rel_err(out[:2], plain[:2]) < TOL[torch.float32]  # rows 0, 1 see every earlier row anyway
    assert rel_err(out[2:], plain[2:]) > 1e-3  # rows 2, 3 do not see row 1


def test_tree_verify_mode_names_the_allowed_values(monkeypatch):
    from roofline.attention.triton_backend import tree_verify_mode

    monkeypatch.setenv("ROOFLINE_TREE_VERIFY", "graph")
    with pytest.raises(ValueError, match=r"ROOFLINE_TREE_VERIFY='graph': must be one of \('prefill', 'decode'\)"):
        tree_verify_mode()
    monkeypatch.delenv("ROOFLINE_TREE_VERIFY")
    assert tree_verify_mode() == "decode"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("same_eps", [True, False], ids=["fused", "unfused"])
def test_backend_applies_qk_norm(dtype, same_eps):
    """Qwen3's q/k norm handed to the backends (``QKNorm``, as ``Attention`` does): the Triton backend runs it inside
    ``rope_and_cache`` (the RMSNorm modules are never called) where it can, and calls the modules first where it
    cannot (here: q_norm and k_norm with different eps); either way cache and output match the torch backend's,
    which always calls the modules (its CPU path, unchanged)."""
    from roofline.attention import QKNorm
    from roofline.layers.norm import RMSNorm

    num_heads, num_kv_heads, head_dim = 6, 2, 64
    q, kc, vc, meta = make_paged_case([12, 1, 5, 1], [12, 30, 21, 17], num_heads, num_kv_heads, head_dim, 16,
                                      dtype, seed=11)
    g = torch.Generator().manual_seed(12)
    k = (torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g) * 4).to(dtype).to(DEVICE)
    v = torch.randn(q.shape[0], num_kv_heads, head_dim, generator=g).to(dtype).to(DEVICE)
    norms = QKNorm(RMSNorm(head_dim, 1e-6), RMSNorm(head_dim, 1e-6 if same_eps else 1e-5))
    calls = []
    for m in norms:
        m.weight.data.copy_(1 + 0.2 * torch.randn(head_dim, generator=g))
        m.to(device=DEVICE, dtype=dtype)
        m.register_forward_hook(lambda mod, args, out: calls.append(mod))
    pos = positions_of(meta)
    triton_b = backend_with_cache("triton", num_heads, num_kv_heads, head_dim, kc, vc)
    torch_b = backend_with_cache("torch", num_heads, num_kv_heads, head_dim, kc, vc)
    with torch.no_grad():
        out = triton_b.forward(q.clone(), k.clone(), v, pos, triton_b.kv_cache(0), triton_b.build_metadata(meta),
                               norms)
        assert len(calls) == (0 if same_eps else 2)
        ref = torch_b.forward(q.clone(), k.clone(), v, pos, torch_b.kv_cache(0), torch_b.build_metadata(meta), norms)
        assert len(calls) == (2 if same_eps else 4)
        plain_b = backend_with_cache("torch", num_heads, num_kv_heads, head_dim, kc, vc)
        plain = plain_b.forward(q.clone(), k.clone(), v, pos, plain_b.kv_cache(0), plain_b.build_metadata(meta))
    assert torch.equal(triton_b.kv_cache(0).v, torch_b.kv_cache(0).v)
    assert rel_err(triton_b.kv_cache(0).k, torch_b.kv_cache(0).k) < TOL[dtype]
    assert rel_err(out, ref) < TOL[dtype]
    assert rel_err(out, plain) > min(100 * TOL[dtype], 0.1)  # the norm did apply (bf16: 0.58 on the H200)


def test_qwen3_model_fuses_qk_norm_on_the_triton_backend():
    """A tiny Qwen3 (q/k norm, head_dim 32 != hidden / heads) built on each backend, same weights: a prefill and a
    decode step give the same hidden states (TOL) on the Triton backend, where the layer's q_norm / k_norm modules
    never run (the norm is inside ``rope_and_cache``), as on the torch backend, where they run (its CPU path)."""
    from roofline.attention import AttentionMetadata
    from roofline.attention.backend import get_attention_backend
    from roofline.config import ModelConfig
    from roofline.layers.rotary import RotaryEmbedding
    from roofline.models import loader
    from roofline.models.registry import build_model

    cfg = ModelConfig(vocab_size=96, hidden_size=64, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, max_position_embeddings=64, qk_norm=True)
    gen = torch.Generator().manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    h, q_size, kv_size = cfg.hidden_size, 4 * 32, 2 * 32
    state = {"model.embed_tokens.weight": rand(96, h), "model.norm.weight": 1 + rand(h), "lm_head.weight": rand(96, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}"
        state.update({
            f"{p}.self_attn.q_proj.weight": rand(q_size, h), f"{p}.self_attn.k_proj.weight": rand(kv_size, h),
            f"{p}.self_attn.v_proj.weight": rand(kv_size, h), f"{p}.self_attn.o_proj.weight": rand(h, q_size),
            f"{p}.self_attn.q_norm.weight": 1 + rand(32), f"{p}.self_attn.k_norm.weight": 1 + rand(32),
            f"{p}.mlp.gate_proj.weight": rand(48, h), f"{p}.mlp.up_proj.weight": rand(48, h),
            f"{p}.mlp.down_proj.weight": rand(h, 48),
            f"{p}.input_layernorm.weight": 1 + rand(h), f"{p}.post_attention_layernorm.weight": 1 + rand(h),
        })
    calls = {"triton": 0, "torch": 0}
    models = {}
    for name in calls:
        backend = get_attention_backend(name)(4, 2, 32, RotaryEmbedding.from_config(cfg, DEVICE))
        backend.allocate_kv_cache(cfg.num_hidden_layers, 4, 16, torch.float32, torch.device(DEVICE))
        model = build_model(cfg, backend).eval().to(DEVICE)
        loader.load_weights(model, iter(state.items()))
        for layer in model.model.layers:
            for m in (layer.self_attn.q_norm, layer.self_attn.k_norm):
                m.register_forward_hook(lambda *_, name=name: calls.__setitem__(name, calls[name] + 1))
        models[name] = model
    ids = torch.randint(0, 96, (11,), generator=gen).to(DEVICE)
    outs = {}
    for name, model in models.items():
        backend = model.model.layers[0].self_attn.attn.backend
        steps = [(0, 10, 10), (10, 11, 1)]  # a 10-token prefill, then one decode step (slots = positions)
        for start, end, n in steps:
            meta = AttentionMetadata(
                slot_mapping=torch.arange(start, end, device=DEVICE),
                query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=DEVICE),
                seq_lens=torch.tensor([end], dtype=torch.int32, device=DEVICE),
                block_tables=torch.tensor([[0]], dtype=torch.int32, device=DEVICE),
                max_query_len=n, query_lens_cpu=[n], seq_lens_cpu=[end])
            with torch.inference_mode():
                outs.setdefault(name, []).append(
                    model(ids[start:end], torch.arange(start, end, device=DEVICE), backend.build_metadata(meta)))
    assert calls == {"triton": 0, "torch": 2 * 2 * cfg.num_hidden_layers}
    for got, want in zip(outs["triton"], outs["torch"], strict=True):
        assert want.abs().max() > 0.1 and rel_err(got, want) < TOL[torch.float32]
