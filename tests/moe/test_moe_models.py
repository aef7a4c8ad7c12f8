"""MoE parity with transformers: tiny Mixtral, Qwen2-MoE and Qwen3-MoE built with HF's own classes (fixed seed,
fp32, saved as safetensors in a temp dir, per-expert tensors as HF publishes them) and loaded by our
HF-directory loader. Greedy output is token-identical to HF's; prefill logits (hence prompt logprobs) agree
within the dense architectures' tolerance (tests/test_architectures.py).

The configs exercise each routing rule: Mixtral (8 experts, top-2, renormalized), Qwen2-MoE (softmax over
all, top-2 not renormalized, a shared expert behind a sigmoid gate), Qwen3-MoE (top-3 renormalized, q/k norm,
one dense layer through ``mlp_only_layers``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_parity import hf_greedy, prefill_logits  # noqa: E402

from roofline import LLM, SamplingParams  # noqa: E402

SEED = 0
NUM_NEW = 12
LOGIT_TOL = 1e-4  # as for the dense architectures (fp32 both sides; only op order differs)
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
              rms_norm_eps=1e-6, initializer_range=0.2)
_gen = torch.Generator().manual_seed(4321)
PROMPTS = [[1, 17, 42, 99, 5, 230, 64], [1] + torch.randint(3, 256, (40,), generator=_gen).tolist()]


def _arch(name: str):
    import transformers as tf

    return {
        "mixtral": (tf.MixtralConfig, tf.MixtralForCausalLM, dict(num_local_experts=8, num_experts_per_tok=2)),
        "qwen2_moe": (tf.Qwen2MoeConfig, tf.Qwen2MoeForCausalLM,
                      dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                           shared_expert_intermediate_size=48)),
        "qwen3_moe": (tf.Qwen3MoeConfig, tf.Qwen3MoeForCausalLM,
                      dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32, norm_topk_prob=True,
                           head_dim=32, mlp_only_layers=[1])),
    }[name]


def make_hf_model(name: str):
    config_cls, model_cls, extra = _arch(name)
    torch.manual_seed(SEED)
    model = model_cls(config_cls(**{**COMMON, **extra})).float().eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():  # non-trivial norms, biases and routers (HF initializes some to 1, 0 or 0)
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in pname:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.3)
            elif pname.endswith(("gate.weight", "shared_expert_gate.weight")):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model


def save(model, path: Path) -> Path:
    model.save_pretrained(str(path), safe_serialization=True)
    return path


@pytest.fixture(scope="module", params=["mixtral", "qwen2_moe", "qwen3_moe"])
def case(request, tmp_path_factory):
    name = request.param
    hf = make_hf_model(name)
    path = save(hf, tmp_path_factory.mktemp(name))
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="torch", max_model_len=128,
              num_kv_blocks=32)
    return name, hf, llm, path


def test_moe_config_is_read(case):
    name, hf, llm, path = case
    mc = llm.engine.model_config
    cfg = json.loads((path / "config.json").read_text())
    assert mc.architecture == type(hf).__name__
    expected = {"mixtral": (8, 2, 96, True, 0, ()), "qwen2_moe": (8, 2, 32, False, 48, ()),
                "qwen3_moe": (6, 3, 32, True, 0, (1,))}[name]
    assert (mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size, mc.norm_topk_prob,
            mc.shared_expert_intermediate_size, mc.mlp_only_layers) == expected
    assert mc.attention_bias == (name == "qwen2_moe") and mc.qk_norm == (name == "qwen3_moe")
    # The per-expert tensors were stacked once into [E, 2I, H] / [E, H, I] and hold HF's values.
    model = llm.engine.worker.model
    block = "block_sparse_moe" if name == "mixtral" else "mlp"
    ours = getattr(model.model.layers[0], block).experts
    theirs = hf.model.layers[0].mlp.experts  # transformers 5 names it mlp for every family
    assert ours.w13_weight.shape == (expected[0], 2 * expected[2], 64)
    torch.testing.assert_close(ours.w13_weight.data, theirs.gate_up_proj.data, rtol=0, atol=0)
    torch.testing.assert_close(ours.w2_weight.data, theirs.down_proj.data, rtol=0, atol=0)
    assert cfg["architectures"] == [mc.architecture]
    if name == "qwen3_moe":  # layer 1 is dense (mlp_only_layers)
        assert type(model.model.layers[1].mlp).__name__ == "LlamaMLP"


def test_moe_prefill_logits_and_prompt_logprobs_match_transformers(case):
    name, hf, llm, _ = case
    worst = worst_lp = 0.0
    for ids in PROMPTS:
        ours = prefill_logits(llm, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape == (len(ids), 256)
        assert ref.std() > 0.1
        worst = max(worst, (ours - ref).abs().max().item())
        lp, lp_ref = torch.log_softmax(ours, -1), torch.log_softmax(ref, -1)
        tgt = torch.tensor(ids[1:])
        worst_lp = max(worst_lp, (lp[:-1].gather(1, tgt[:, None]) - lp_ref[:-1].gather(1, tgt[:, None])).abs().max()
                       .item())
    print(f"{name}: max |logit diff| {worst:.2e}, max |prompt logprob diff| {worst_lp:.2e}")
    assert worst < LOGIT_TOL and worst_lp < LOGIT_TOL


def test_moe_greedy_tokens_match_transformers(case):
    name, hf, llm, _ = case
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True), use_tqdm=False)
    for ids, ro in zip(PROMPTS, outs, strict=True):
        assert ro.outputs[0].token_ids == hf_greedy(hf, ids, NUM_NEW), (name, len(ids))


def test_moe_greedy_tokens_match_transformers_with_the_fused_gate(case, monkeypatch):
    """The gate GEMV and the router in one launch (``moe_router.gate_select_experts``, what a GPU runs at decode
    sizes; here under the Triton interpreter, forced on the CPU for every batch): still HF's tokens."""
    from roofline.kernels import moe_router
    from roofline.layers import moe

    name, hf, llm, _ = case
    calls = []
    real = moe_router.gate_select_experts
    monkeypatch.setattr(moe, "fused_gate_applies", lambda x, gate: True)
    monkeypatch.setattr(moe_router, "gate_select_experts", lambda *a: calls.append(len(a[0])) or real(*a))
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True), use_tqdm=False)
    assert 1 in calls or 2 in calls  # decode steps went through it
    for ids, ro in zip(PROMPTS, outs, strict=True):
        assert ro.outputs[0].token_ids == hf_greedy(hf, ids, NUM_NEW), (name, len(ids))


def test_missing_expert_tensor_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    hf = make_hf_model("qwen3_moe")
    path = save(hf, tmp_path / "m")
    f = next(path.glob("*.safetensors"))
    tensors = load_file(str(f))
    del tensors["model.layers.0.mlp.experts.4.up_proj.weight"]
    save_file(tensors, str(f), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"checkpoint is missing 1 tensor: model\.layers\.0\.mlp\.experts\.4\."
                                         r"up_proj\.weight"):
        LLM(str(path), device="cpu", dtype="float32", max_model_len=64, num_kv_blocks=8)


def test_bad_moe_configs_are_refused(tmp_path):
    from roofline.config import ModelConfig

    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=4\], got 5"):
        ModelConfig(architecture="Qwen3MoeForCausalLM", num_experts=4, num_experts_per_tok=5)
    cfg = make_hf_model("mixtral").config.to_dict()
    cfg.update(num_experts_per_tok=9, architectures=["MixtralForCausalLM"])
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=8\], got 9"):
        ModelConfig.from_hf_config(cfg)


def test_expert_token_counts_gauge_and_run_floor(case, capsys):
    """Tokens per expert are counted on the device (CPU: on by default); /metrics exposes them, and the run
    summary's floor counts the experts the measured routing touches, not all of them."""
    from fastapi.testclient import TestClient

    from roofline.layers.moe import expert_token_counts
    from roofline.report import print_run_summary
    from roofline.server.app import build_app

    name, hf, llm, _ = case
    model = llm.engine.worker.model
    mc = llm.engine.model_config
    before = expert_token_counts(model)
    assert before is not None and len(before) == mc.num_moe_layers and len(before[0]) == mc.num_experts
    llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    after = expert_token_counts(model)
    # 7 prompt tokens + 3 decode steps (the 4th token is sampled, not run), k experts each, per layer
    assert [sum(a) - sum(b) for a, b in zip(after, before, strict=True)] == [10 * mc.num_experts_per_tok] * len(after)
    rep = llm.decode_floor(hardware="h200")
    assert rep["moe"]["touched_source"] == "measured routing"
    assert 0 < rep["moe"]["touched_experts_per_layer"] <= mc.num_experts_per_tok + 1e-9  # batch 1
    print_run_summary(llm, hardware="h200")
    assert "MoE floor:          the dense weights + " in capsys.readouterr().out
    with TestClient(build_app(llm.engine)) as client:
        text = client.get("/metrics").text
    per_expert = [sum(col) for col in zip(*expert_token_counts(model), strict=True)]
    for e, n in enumerate(per_expert):
        assert f'roofline:moe_expert_tokens{{expert="{e}",model_name=' in text
        assert any(line.startswith(f'roofline:moe_expert_tokens{{expert="{e}"') and line.endswith(f" {float(n)}")
                   for line in text.splitlines())
    assert "roofline:moe_expert_load_imbalance" in text
