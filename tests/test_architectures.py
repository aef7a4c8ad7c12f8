"""Parity with transformers for every supported architecture, on tiny random configs.

Only one real model is at hand (SmolLM2, a plain Llama), so each architecture feature gets its own tiny
checkpoint (2 layers, hidden 64, 4 heads, 2 KV heads, vocab 256, fp32, same seed), saved by transformers
as safetensors and loaded by our HF-directory loader:
- Llama 3.1: llama3 RoPE scaling, with positions past original_max_position_embeddings (64);
- Mistral;
- Qwen2: q/k/v bias (made non-zero: transformers initializes biases to zero);
- Qwen3: q/k RMSNorm with non-trivial weights, head_dim 32 != hidden / heads (16);
- Llama with tied embeddings.
The directories have no tokenizer files, so prompts are token ids.

Also the loader's errors: unsupported architecture, wrong-shaped tensor, missing path.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_parity import hf_greedy, prefill_logits

from roofline import LLM, SamplingParams

SEED = 0
NUM_NEW = 16
MAX_MODEL_LEN = 256
# fp32 on both sides; only op order differs. Measured max |diff| on these configs: <= 1e-5.
LOGIT_TOL = 1e-4
COMMON = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1, eos_token_id=2,
    rms_norm_eps=1e-6, initializer_range=0.2,  # larger than the default 0.02: well-separated logits
)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64}

# Prompts of token ids: a short one, and one of 90 tokens so that prefill and decode (up to position
# 105) run past original_max_position_embeddings (64), where llama3 scaling changes the rotation.
_gen = torch.Generator().manual_seed(1234)
PROMPTS = [
    [1, 17, 42, 99, 5, 230, 64],
    [1] + torch.randint(3, 256, (89,), generator=_gen).tolist(),
]


def _arch(name: str):
    """(config class, model class, extra config kwargs) for one case."""
    import transformers as tf

    return {
        "llama3.1": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(rope_parameters=dict(LLAMA3_ROPE))),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM, {}),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=32)),
        "llama-tied": (tf.LlamaConfig, tf.LlamaForCausalLM, dict(tie_word_embeddings=True)),
    }[name]


def _perturb(model: torch.nn.Module) -> None:
    """Make biases and norm weights non-trivial (transformers initializes them to 0 and 1), so a
    loader that drops them, or a model that skips them, cannot pass."""
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in name:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.3)


def make_hf_model(name: str, **overrides):
    config_cls, model_cls, extra = _arch(name)
    config = config_cls(**{**COMMON, **extra, **overrides})
    torch.manual_seed(SEED)
    model = model_cls(config).float().eval()
    _perturb(model)
    return model


@pytest.fixture(scope="module", params=["llama3.1", "mistral", "qwen2", "qwen3", "llama-tied"])
def case(request, tmp_path_factory):
    """(name, HF model, our LLM loaded from the HF model saved as safetensors)."""
    name = request.param
    hf = make_hf_model(name)
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(str(path), safe_serialization=True)
    assert list(path.glob("*.safetensors")), "transformers did not write safetensors"
    assert not (path / "tokenizer.json").exists()
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="torch",
              max_model_len=MAX_MODEL_LEN, num_kv_blocks=64)
    return name, hf, llm


def test_config_features_are_read(case):
    """The feature under test really reached our model (guards against a silently plain Llama)."""
    name, hf, llm = case
    mc = llm.engine.model_config
    assert llm.tokenizer is None  # no tokenizer files in the directory
    assert mc.architecture == type(hf).__name__
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.num_hidden_layers) == (4, 2, 2)
    expected = {
        "llama3.1": dict(rope_scaling=tuple(sorted(LLAMA3_ROPE.items())), head_dim=16),
        "mistral": dict(rope_scaling=None, head_dim=16),
        "qwen2": dict(attention_bias=True, qk_norm=False, head_dim=16),
        "qwen3": dict(qk_norm=True, attention_bias=False, head_dim=32),
        "llama-tied": dict(tie_word_embeddings=True, head_dim=16),
    }[name]
    for key, value in expected.items():
        assert getattr(mc, key) == value, key
    if name == "llama-tied":
        model = llm.engine.worker.model
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


def test_prefill_logits_match_transformers(case):
    name, hf, llm = case
    worst = 0.0
    for ids in PROMPTS:
        ours = prefill_logits(llm, ids)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        assert ours.shape == ref.shape == (len(ids), 256)
        worst = max(worst, (ours - ref).abs().max().item())
        assert ref.std() > 0.1  # not a degenerate model: logits spread
    print(f"{name}: max |logit diff| {worst:.2e}")
    assert worst < LOGIT_TOL
    assert llm.engine.block_manager.num_free_blocks == llm.engine.block_manager.num_blocks


def test_greedy_tokens_match_transformers(case):
    name, hf, llm = case
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True), use_tqdm=False)
    for ids, ro in zip(PROMPTS, outs, strict=True):
        assert ro.error is None
        assert ro.outputs[0].token_ids == hf_greedy(hf, ids, NUM_NEW), (name, len(ids))
        assert ro.outputs[0].text == ""  # no tokenizer: ids only
        assert ro.outputs[0].finish_reason == "length"


def test_llama3_scaling_matters():
    """Without the llama3 frequency scaling, the long prompt's logits differ: the parity above is not
    vacuous for the scaling."""
    scaled = make_hf_model("llama3.1")
    plain = make_hf_model("llama3.1", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    ids = torch.tensor([PROMPTS[1]])
    with torch.no_grad():
        diff = (scaled(ids).logits - plain(ids).logits).abs()
    assert diff[0, 0].max() < 1e-5  # position 0: no rotation either way
    assert diff[0, 64:].max() > 1e-2


# ------------------------------------------------------------------------------------ loader errors


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mistral-base")
    make_hf_model("mistral").save_pretrained(str(path), safe_serialization=True)
    return path


def _copy_checkpoint(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_unsupported_architecture_named(base_dir, tmp_path):
    path = _copy_checkpoint(base_dir, tmp_path / "gpt2")
    cfg = json.loads((path / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        LLM(str(path), device="cpu", dtype="float32", attention_backend="torch", max_model_len=64)
    msg = str(e.value)
    assert "GPT2LMHeadModel" in msg
    for arch in ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert arch in msg


def test_wrong_shape_tensor_named(base_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy_checkpoint(base_dir, tmp_path / "bad-shape")
    (st,) = path.glob("*.safetensors")
    tensors = load_file(str(st))
    name = "model.layers.1.mlp.down_proj.weight"
    assert tuple(tensors[name].shape) == (64, 128)
    tensors[name] = torch.zeros(64, 96)
    save_file(tensors, str(st), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        LLM(str(path), device="cpu", dtype="float32", attention_backend="torch", max_model_len=64)
    msg = str(e.value)
    assert name in msg
    assert "(64, 96)" in msg and "(64, 128)" in msg


def test_wrong_shape_fused_shard_named(base_dir, tmp_path):
    """A k_proj of the wrong size lands in the fused qkv_proj: the message names k_proj, not qkv_proj."""
    from safetensors.torch import load_file, save_file

    path = _copy_checkpoint(base_dir, tmp_path / "bad-k")
    (st,) = path.glob("*.safetensors")
    tensors = load_file(str(st))
    name = "model.layers.0.self_attn.k_proj.weight"
    assert tuple(tensors[name].shape) == (32, 64)
    tensors[name] = torch.zeros(64, 64)
    save_file(tensors, str(st), metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        LLM(str(path), device="cpu", dtype="float32", attention_backend="torch", max_model_len=64)
    msg = str(e.value)
    assert name in msg
    assert "(64, 64)" in msg and "(32, 64)" in msg


def test_missing_path_named(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as e:
        LLM(str(missing), device="cpu", attention_backend="torch")
    assert str(missing) in str(e.value)


@pytest.mark.parametrize(("name", "overrides"), [
    ("mistral", dict(sliding_window=16)),
    ("qwen2", dict(use_sliding_window=True, sliding_window=16, max_window_layers=0)),
])
def test_sliding_window_limits_context(name, overrides, tmp_path):
    """Sliding-window attention is not implemented: a checkpoint whose window (16) is shorter than its
    context gets its context capped at the window, where full attention is the same, instead of
    silently attending past the window. (Before the cap, logits differed from transformers by ~10 on a
    90-token prompt.)"""
    hf = make_hf_model(name, **overrides)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    with pytest.raises(ValueError, match=r"max_model_len \(64\) exceeds .*max_position_embeddings \(16\)"):
        LLM(str(tmp_path), device="cpu", dtype="float32", attention_backend="torch", max_model_len=64)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", attention_backend="torch", num_kv_blocks=4)
    assert llm.engine.config.scheduler_config.max_model_len == 16
    ids = PROMPTS[1][:10]
    out = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
                       use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 6  # stopped at the 16-token context
    assert out.outputs[0].token_ids == hf_greedy(hf, ids, 6)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    assert (prefill_logits(llm, ids) - ref).abs().max().item() < LOGIT_TOL


def test_sliding_window_off_keeps_context(tmp_path):
    """Qwen2 configs carry a sliding_window even with use_sliding_window false: no cap then."""
    hf = make_hf_model("qwen2", use_sliding_window=False, sliding_window=16)
    hf.save_pretrained(str(tmp_path), safe_serialization=True)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", attention_backend="torch", max_model_len=128,
              num_kv_blocks=8)
    assert llm.engine.model_config.max_position_embeddings == 512
