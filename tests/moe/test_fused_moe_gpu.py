"""The fused MoE kernel on a GPU in bf16 (and int8 / fp8 experts) at real layer shapes, against the float64 loop
over the same weights. Skipped without CUDA (run on the H200: ``pytest tests/moe/test_fused_moe_gpu.py``).

Error bound: max |fused - float64| / max |float64| < 2e-2 in bf16. The kernel accumulates in fp32; the error
is the bf16 rounding of its intermediate h (SiLU(gate) * up) and of the output (2^-8 relative each).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16_TOL = 2e-2

SHAPES = {  # (E, k, H, I)
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "odd": (6, 3, 320, 200),  # widths that are not multiples of the tiles
}


def _case(shape, m, dtype=torch.bfloat16, seed=0):
    from roofline.layers.moe import select_experts

    num_experts, top_k, hidden, inter = SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, hidden, device="cuda", generator=gen).to(dtype)
    w13 = (torch.randn(num_experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02).to(dtype)
    w2 = (torch.randn(num_experts, hidden, inter, device="cuda", generator=gen) * 0.02).to(dtype)
    tw, ids = select_experts(torch.randn(m, num_experts, device="cuda", generator=gen), top_k, True)
    return x, w13, w2, tw, ids


def _rel(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


@pytest.mark.parametrize("m", [1, 8, 64, 300])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_fused_moe_bf16_within_bound_of_float64(shape, m):
    from roofline.kernels.fused_moe import fused_moe, ref_fused_moe

    x, w13, w2, tw, ids = _case(shape, m)
    ref = ref_fused_moe(x, w13, w2, tw, ids, compute_dtype=torch.float64)
    for small_m in (True, False):
        out = fused_moe(x, w13, w2, tw, ids, small_m=small_m)
        err = _rel(out, ref)
        print(f"{shape} M={m} small_m={small_m}: rel err {err:.2e}")
        assert out.dtype == torch.bfloat16 and err < BF16_TOL


@pytest.mark.parametrize("quantization", ["int8", "fp8"])
@pytest.mark.parametrize("m", [1, 64])
def test_fused_moe_8bit_experts(quantization, m):
    from roofline.bench.moe import make_experts
    from roofline.kernels.fused_moe import fused_moe, ref_fused_moe

    x, _, _, tw, ids = _case("qwen3-30b-a3b", m)
    w = make_experts(128, 2048, 768, torch.bfloat16, "cuda", quantization)
    ref = ref_fused_moe(x, w["w13"], w["w2"], tw, ids, w["w13_scale"], w["w2_scale"], compute_dtype=torch.float64)
    for small_m in (True, False):
        out = fused_moe(x, w["w13"], w["w2"], tw, ids, w["w13_scale"], w["w2_scale"], small_m=small_m)
        assert _rel(out, ref) < BF16_TOL


def test_fused_moe_under_cuda_graph_and_remote_experts():
    """Captured in a CUDA graph (no host sync inside), with pairs routed to another rank (-1) dropped."""
    from roofline.kernels.fused_moe import fused_moe, ref_fused_moe

    x, w13, w2, tw, ids = _case("odd", 40)
    ids = torch.where(ids == 2, -1, ids)
    ref = ref_fused_moe(x, w13, w2, tw, ids, compute_dtype=torch.float64)
    out = fused_moe(x, w13, w2, tw, ids)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fused_moe(x, w13, w2, tw, ids)
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, ref) < BF16_TOL
    assert torch.equal(captured, out)


def test_moe_model_dummy_decode_on_gpu(monkeypatch):
    """A small Qwen3-MoE shape with dummy weights decodes on the GPU in bf16 through the fused kernel (CUDA graphs
    on): the layer really calls it, and the run returns every token."""
    import roofline.kernels.fused_moe as fm
    from roofline import LLM, SamplingParams
    from roofline.config import MODEL_PRESETS

    calls = []
    real = fm.fused_moe
    monkeypatch.setattr(fm, "fused_moe", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setitem(MODEL_PRESETS, "qwen3-moe-tiny-test", dict(
        architecture="Qwen3MoeForCausalLM", vocab_size=1024, hidden_size=256, intermediate_size=512,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, qk_norm=True,
        num_experts=16, num_experts_per_tok=4, moe_intermediate_size=128, bos_token_id=None, eos_token_ids=(0,)))
    llm = LLM("qwen3-moe-tiny-test", load_format="dummy", dtype="bfloat16", max_model_len=128,
              kv_cache_memory="1GiB")
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (3, 17, 40)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [8, 8, 8]
    assert calls, "the MoE layer did not call the fused kernel on the GPU"


GPU_FAMILIES = [  # (path, block_m, block_n, block_k, group_m, num_warps, num_stages, persistent and down_persistent)
    ("gemv", 64, 4, 512, 1, 4, 1, 0), ("gemv", 64, 16, 256, 1, 4, 1, 0), ("gemv", 64, 8, 1024, 1, 8, 1, 0),
    ("gemv", 64, 8, 512, 1, 4, 1, 1), ("gemv", 64, 8, 1024, 1, 8, 1, 2), ("gemv", 64, 16, 256, 1, 4, 1, 4),
    ("grouped", 16, 64, 256, 1, 4, 3, 0), ("grouped", 32, 128, 64, 1, 4, 4, 0), ("grouped", 64, 128, 128, 8, 4, 3, 0),
    ("grouped", 128, 128, 64, 8, 8, 3, 0), ("grouped", 128, 256, 64, 8, 8, 2, 0), ("grouped", 64, 256, 64, 8, 8, 3, 0),
]


@pytest.mark.parametrize("quantization", [None, "int8", "fp8"])
@pytest.mark.parametrize("shape,m", [("qwen3-30b-a3b", 300), ("odd", 40)])
def test_fused_moe_config_families_bf16(shape, m, quantization):
    """Every tile family the tuner times, in bf16 with 16-bit and 8-bit experts, against the float64 loop (the
    odd shape has K tails for every block_k). A family that does not fit in shared memory is not an error here
    only if Triton says so (OutOfResources): the tuner skips those too."""
    from triton.runtime.errors import OutOfResources

    from roofline.bench.moe import make_experts
    from roofline.kernels.fused_moe import fused_moe, ref_fused_moe
    from roofline.kernels.fused_moe_config import MoeConfig

    x, w13, w2, tw, ids = _case(shape, m)
    num_experts, _, hidden, inter = SHAPES[shape]
    w = make_experts(num_experts, hidden, inter, torch.bfloat16, "cuda", quantization) if quantization else \
        dict(w13=w13, w2=w2)
    args = (w["w13"], w["w2"], tw, ids, w.get("w13_scale"), w.get("w2_scale"))
    ref = ref_fused_moe(x, *args, compute_dtype=torch.float64)
    for path, bm, bn, bk, g, nw, ns, per_sm in GPU_FAMILIES:
        cfg = MoeConfig(path=path, block_m=bm, block_n=bn, block_k=bk, group_m=g, num_warps=nw, num_stages=ns,
                        persistent=per_sm, down_persistent=per_sm, down_slots=8 if per_sm == 2 else 1)
        try:
            out = fused_moe(x, *args, config=cfg)
        except OutOfResources:
            print(f"{cfg}: out of resources (skipped, as the tuner does)")
            continue
        err = _rel(out, ref)
        print(f"{shape} M={m} {quantization} {cfg}: rel err {err:.2e}")
        assert err < BF16_TOL, cfg


def test_committed_table_configs_run():
    """Every config in this device's committed table runs at its shape, format and M (capped at 512 tokens) and
    meets the bf16 bound against the float64 loop."""
    from roofline.bench.moe import make_experts
    from roofline.kernels.fused_moe import fused_moe, ref_fused_moe
    from roofline.kernels.fused_moe_config import load_table
    from roofline.layers.moe import select_experts

    table = load_table(torch.cuda.get_device_name())
    if not table:
        pytest.skip("no committed MoE config table for this device")
    for key, entry in table.items():
        fields = dict(kv.split("=") for kv in key.split(","))
        num_experts, inter, hidden = int(fields["E"]), int(fields["N"]), int(fields["K"])
        quant = None if fields["dtype"] in ("bfloat16", "float16") else fields["dtype"]
        w = make_experts(num_experts, hidden, inter, torch.bfloat16, "cuda", quant)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for m, cfg in entry.items():
            m = min(m, 512)
            x = torch.randn(m, hidden, device="cuda", generator=gen).to(torch.bfloat16)
            top_k = 8 if num_experts == 128 else 2
            tw, ids = select_experts(torch.randn(m, num_experts, device="cuda", generator=gen), top_k, True)
            args = (x, w["w13"], w["w2"], tw, ids, w.get("w13_scale"), w.get("w2_scale"))
            err = _rel(fused_moe(*args, config=cfg), ref_fused_moe(*args, compute_dtype=torch.float64))
            assert err < BF16_TOL, (key, m, cfg)
