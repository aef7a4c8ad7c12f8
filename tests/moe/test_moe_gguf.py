"""GGUF checkpoints of MoE and Qwen models load to the model their HF checkpoint gives.

Each tiny HF model (the MoE cases of ``test_moe_models`` and dense Qwen2 / Qwen3) is saved as safetensors, then
written as a GGUF the way llama.cpp's ``convert_hf_to_gguf.py`` writes it: gguf-py's tensor names and ``{arch}.*``
keys, experts stacked into ``ffn_*_exps`` [E, ...] (or one tensor per expert, the older Mixtral files), q / k rows
permuted for the "llama" architecture only, Qwen2-MoE's shared-expert gate stored as [H], no vocabulary. Loaded
through ``LLM(path.gguf)`` in fp32 on the CPU, greedy tokens equal HF's and prefill logits agree within the dense
architectures' tolerance.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_moe_models import COMMON, LOGIT_TOL, NUM_NEW, PROMPTS, SEED, make_hf_model, save  # noqa: E402
from test_parity import hf_greedy, prefill_logits  # noqa: E402

from roofline import LLM, SamplingParams  # noqa: E402
from roofline.models.gguf_file import gguf_config  # noqa: E402
from roofline.models.loader import iter_safetensors  # noqa: E402

gguf = pytest.importorskip("gguf")

GGUF_ARCH = {"LlamaForCausalLM": "llama", "MixtralForCausalLM": "llama", "Qwen2MoeForCausalLM": "qwen2moe",
             "Qwen3MoeForCausalLM": "qwen3moe",
             "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}
T = gguf.MODEL_TENSOR
_LAYER = {"self_attn.q_proj": T.ATTN_Q, "self_attn.k_proj": T.ATTN_K, "self_attn.v_proj": T.ATTN_V,
          "self_attn.o_proj": T.ATTN_OUT, "self_attn.q_norm": T.ATTN_Q_NORM, "self_attn.k_norm": T.ATTN_K_NORM,
          "input_layernorm": T.ATTN_NORM, "post_attention_layernorm": T.FFN_NORM, "mlp.gate_proj": T.FFN_GATE,
          "mlp.up_proj": T.FFN_UP, "mlp.down_proj": T.FFN_DOWN, "mlp.gate": T.FFN_GATE_INP,
          "block_sparse_moe.gate": T.FFN_GATE_INP, "mlp.shared_expert.gate_proj": T.FFN_GATE_SHEXP,
          "mlp.shared_expert.up_proj": T.FFN_UP_SHEXP, "mlp.shared_expert.down_proj": T.FFN_DOWN_SHEXP,
          "mlp.shared_expert_gate": T.FFN_GATE_INP_SHEXP}
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.weight$")
_PROJ = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
_STACKED = (T.FFN_GATE_EXP, T.FFN_UP_EXP, T.FFN_DOWN_EXP)
_PER_EXPERT = (T.FFN_GATE, T.FFN_UP, T.FFN_DOWN)


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's ``LlamaModel.permute``: rotate-half rows to interleaved pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


class _Writer:
    """gguf.GGUFWriter that leaves out the keys named in ``omit`` (e.g. "expert_feed_forward_length") and the
    tensors named "tensor:<gguf name>" there."""

    def __init__(self, path: Path, arch: str, omit: frozenset[str]):
        self.w, self.arch, self.omit = gguf.GGUFWriter(str(path), arch), arch, omit

    def __getattr__(self, name):
        if name == "add_tensor":  # "tensor:<gguf name>" in omit leaves that tensor out
            return lambda t, *a, **k: None if f"tensor:{t}" in self.omit else self.w.add_tensor(t, *a, **k)
        if name.startswith("add_") and name[4:] in self.omit:
            return lambda *a, **k: None
        return getattr(self.w, name)


def _llama3_rope_factors(c) -> torch.Tensor:
    """llama.cpp's ``rope_freqs`` for a Llama 3.1 rope_scaling (LlamaModel.generate_extra_tensors): per frequency,
    1 for short wavelengths, ``factor`` for long ones, 1 / ((1 - s) / factor + s) between."""
    import math

    rs = c.rope_parameters if getattr(c, "rope_parameters", None) else c.rope_scaling
    base = rs.get("rope_theta", getattr(c, "rope_theta", 10000.0))
    dim = c.hidden_size // c.num_attention_heads
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high, old = (rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"],
                              rs["original_max_position_embeddings"])
    out = []
    for f in freqs.tolist():
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            out.append(1.0)
        elif wavelen > old / low:
            out.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32)


def write_gguf(hf_dir: Path, hf_config, out: Path, per_expert: bool = False, expert_qtype=None,
               omit: frozenset[str] = frozenset()) -> Path:
    """``hf_dir``'s safetensors as a GGUF file (fp32 tensors; stacked experts in ``expert_qtype`` if given, a
    ``gguf.GGMLQuantizationType``), as llama.cpp's converter names and lays them out; ``omit``: keys left out."""
    arch_hf = hf_config.architectures[0]
    arch = GGUF_ARCH[arch_hf]
    c = hf_config
    w = _Writer(out, arch, omit)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"] if getattr(c, "rope_parameters", None) else c.rope_theta)
    w.add_vocab_size(c.vocab_size)
    w.add_eos_token_id(c.eos_token_id)
    w.add_bos_token_id(c.bos_token_id)
    if getattr(c, "head_dim", None):
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
    experts = getattr(c, "num_local_experts", None) or getattr(c, "num_experts", None)
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(c.num_experts_per_tok)
        if arch != "llama":
            w.add_expert_feed_forward_length(c.moe_intermediate_size)
        if getattr(c, "shared_expert_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(c.shared_expert_intermediate_size)
    rs = c.rope_parameters if getattr(c, "rope_parameters", None) else getattr(c, "rope_scaling", None)
    if rs and rs.get("rope_type") == "llama3":
        w.add_tensor(gguf.TENSOR_NAMES[T.ROPE_FREQS] + ".weight", _llama3_rope_factors(c).numpy())
    stacks: dict[tuple[int, int], dict[int, torch.Tensor]] = {}
    for name, t in iter_safetensors(hf_dir):
        t = t.float()
        if (m := _EXPERT.match(name)) is not None:
            layer, e, proj = int(m.group(1)), int(m.group(2)), _PROJ[m.group(3)]
            if per_expert:
                w.add_tensor(f"{gguf.TENSOR_NAMES[_PER_EXPERT[proj]].format(bid=layer)}.{e}.weight", t.numpy())
            else:
                stacks.setdefault((layer, proj), {})[e] = t
            continue
        if name == "model.embed_tokens.weight":
            gname = gguf.TENSOR_NAMES[T.TOKEN_EMBD] + ".weight"
        elif name == "model.norm.weight":
            gname = gguf.TENSOR_NAMES[T.OUTPUT_NORM] + ".weight"
        elif name == "lm_head.weight":
            gname = gguf.TENSOR_NAMES[T.OUTPUT] + ".weight"
        else:
            m = re.match(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)$", name)
            layer, module, kind = int(m.group(1)), m.group(2), m.group(3)
            gname = f"{gguf.TENSOR_NAMES[_LAYER[module]].format(bid=layer)}.{kind}"
            if arch == "llama" and module in ("self_attn.q_proj", "self_attn.k_proj"):
                heads = c.num_attention_heads if module == "self_attn.q_proj" else c.num_key_value_heads
                t = _permute(t, heads)
            if module == "mlp.shared_expert_gate":
                t = t.reshape(-1)  # [1, H] -> [H], as llama.cpp stores it
        w.add_tensor(gname, t.contiguous().numpy())
    for (layer, proj), by_e in sorted(stacks.items()):
        stacked = torch.stack([by_e[e] for e in range(len(by_e))]).numpy()
        name = f"{gguf.TENSOR_NAMES[_STACKED[proj]].format(bid=layer)}.weight"
        if expert_qtype is None:
            w.add_tensor(name, stacked)
        else:
            w.add_tensor(name, gguf.quants.quantize(stacked, expert_qtype), raw_dtype=expert_qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def make_dense_qwen(name: str):
    import transformers as tf

    cfg_cls, model_cls, extra = {"qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM, {}),
                                 "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM, dict(head_dim=32))}[name]
    torch.manual_seed(SEED)
    model = model_cls(cfg_cls(**{**COMMON, **extra})).float().eval()
    gen = torch.Generator().manual_seed(SEED + 1)
    with torch.no_grad():  # non-trivial norms and biases
        for pname, p in model.named_parameters():
            if pname.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "norm" in pname:
                p.copy_(1.0 + torch.randn(p.shape, generator=gen) * 0.3)
    return model


@pytest.fixture(scope="module", params=["mixtral", "mixtral-per-expert", "qwen2_moe", "qwen3_moe", "qwen2", "qwen3"])
def gguf_case(request, tmp_path_factory):
    name = request.param
    hf = make_dense_qwen(name) if name in ("qwen2", "qwen3") else make_hf_model(name.split("-")[0])
    d = tmp_path_factory.mktemp(name)
    save(hf, d / "hf")
    path = write_gguf(d / "hf", hf.config, d / f"{name}.gguf", per_expert=name.endswith("per-expert"))
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="torch", max_model_len=128,
              num_kv_blocks=32)
    return name, hf, llm, path


def test_gguf_config_matches_the_hf_config(gguf_case):
    name, hf, llm, path = gguf_case
    cfg, c = gguf_config(path), hf.config
    assert cfg.architecture == c.architectures[0]
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads,
            cfg.vocab_size) == (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
                                c.vocab_size)
    assert cfg.head_dim == (getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads)
    assert cfg.attention_bias == (name in ("qwen2", "qwen2_moe"))
    assert cfg.qk_norm == (name in ("qwen3", "qwen3_moe"))
    if name.startswith("mixtral"):
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == \
            (8, 2, c.intermediate_size, True)
    elif name == "qwen2_moe":
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob,
                cfg.shared_expert_intermediate_size) == (8, 2, 32, False, 48)
    elif name == "qwen3_moe":  # layer 1 is dense (mlp_only_layers): no router tensor there
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.norm_topk_prob, cfg.mlp_only_layers) == (6, 3, True, (1,))
    else:
        assert cfg.num_experts == 0


def test_gguf_moe_logits_and_greedy_tokens_match_transformers(gguf_case):
    name, hf, llm, _ = gguf_case
    assert llm.engine.tokenizer is None  # a GGUF without a vocabulary: token ids only
    worst = 0.0
    for ids in PROMPTS:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        worst = max(worst, (prefill_logits(llm, ids) - ref).abs().max().item())
    assert worst < LOGIT_TOL, (name, worst)
    outs = llm.generate([{"prompt_token_ids": ids} for ids in PROMPTS],
                        SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True), use_tqdm=False)
    for ids, ro in zip(PROMPTS, outs, strict=True):
        assert ro.outputs[0].token_ids == hf_greedy(hf, ids, NUM_NEW), (name, len(ids))


def test_unsupported_gguf_architecture_is_named(tmp_path):
    w = gguf.GGUFWriter(str(tmp_path / "x.gguf"), "gpt2")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'.*'qwen3moe'"):
        gguf_config(tmp_path / "x.gguf")


def test_gguf_missing_keys_are_named(tmp_path):
    def write(name, **keys):
        w = gguf.GGUFWriter(str(tmp_path / name), "qwen3moe")
        w.add_embedding_length(64)
        w.add_head_count(4)
        w.add_block_count(1)
        w.add_vocab_size(256)
        for k, v in keys.items():
            w.add_uint32(k, v)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return tmp_path / name

    with pytest.raises(ValueError, match="has no qwen3moe.feed_forward_length key"):
        gguf_config(write("a.gguf"))
    with pytest.raises(ValueError, match="has no qwen3moe.expert_used_count key"):
        gguf_config(write("b.gguf", **{"qwen3moe.feed_forward_length": 96, "qwen3moe.expert_count": 4}))


def test_quantized_stacked_experts_dequantize_per_expert(tmp_path):
    # Q8_0 experts [E, I, H] (real MoE GGUFs quantize them): each yielded expert tensor is that expert's slice
    # dequantized, at the HF shape the loader expects.
    import numpy as np

    from roofline.models.gguf_file import iter_gguf

    hf = make_hf_model("qwen3_moe")
    save(hf, tmp_path / "hf")
    q8 = gguf.GGMLQuantizationType.Q8_0
    path = write_gguf(tmp_path / "hf", hf.config, tmp_path / "q8.gguf", expert_qtype=q8)
    want = dict(iter_safetensors(tmp_path / "hf"))
    got = dict(iter_gguf(path, gguf_config(path)))
    experts = [n for n in want if ".experts." in n]
    assert len(experts) == 3 * 6 and set(experts) <= set(got)
    for n in experts:
        ref = gguf.quants.dequantize(gguf.quants.quantize(want[n].float().numpy(), q8), q8)
        assert got[n].shape == want[n].shape
        assert np.array_equal(got[n].numpy(), ref), n
        assert 0 < (got[n] - want[n].float()).abs().max() < 0.02 * want[n].abs().max()  # really quantized


def test_llama31_rope_freqs_match_transformers(tmp_path):
    # A Llama 3.1-style rope_scaling (original context 64, so the tiny head's frequencies span all three bands):
    # the GGUF carries it as the rope_freqs tensor, which must give HF's angles.
    import transformers as tf

    torch.manual_seed(SEED)
    rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64, rope_theta=10000.0)
    cfg = tf.LlamaConfig(**{**COMMON, "hidden_size": 64, "num_attention_heads": 4}, rope_scaling=rope)
    hf = tf.LlamaForCausalLM(cfg).float().eval()
    save(hf, tmp_path / "hf")
    factors = _llama3_rope_factors(hf.config)
    assert factors.min() == 1.0 and factors.max() == 8.0 and ((factors > 1) & (factors < 8)).any()
    path = write_gguf(tmp_path / "hf", hf.config, tmp_path / "l31.gguf")
    assert dict(gguf_config(path).rope_scaling)["freq_factors"] == tuple(factors.double().tolist())
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="torch", max_model_len=128,
              num_kv_blocks=32)
    ids = PROMPTS[1]
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0].float()
    assert (prefill_logits(llm, ids) - ref).abs().max().item() < LOGIT_TOL


@pytest.mark.parametrize("name,omit", [("qwen3_moe", "expert_feed_forward_length"),
                                       ("qwen2_moe", "expert_shared_feed_forward_length"),
                                       ("qwen3_moe", "vocab_size")])
def test_gguf_widths_and_vocab_come_from_the_tensors(tmp_path, name, omit):
    # llama.cpp accepts files without these keys; the stacked tensors' shapes say what gets loaded.
    hf = make_hf_model(name)
    save(hf, tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", hf.config, tmp_path / "x.gguf", omit=frozenset({omit}))
    cfg = gguf_config(path)
    assert (cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size, cfg.vocab_size) == \
        (32, 48 if name == "qwen2_moe" else 0, 256)
    llm = LLM(str(path), device="cpu", dtype="float32", attention_backend="torch", max_model_len=128,
              num_kv_blocks=32)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=4,
                                                                          ignore_eos=True), use_tqdm=False)
    assert out[0].outputs[0].token_ids == hf_greedy(hf, PROMPTS[0], 4)


def test_bad_gguf_files_are_named(tmp_path):
    hf = make_hf_model("mixtral")
    save(hf, tmp_path / "hf")
    good = write_gguf(tmp_path / "hf", hf.config, tmp_path / "good.gguf")
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(good.read_bytes()[:100])
    with pytest.raises(ValueError, match="cannot read GGUF file .*cut.gguf' \\(100 bytes: truncated"):
        gguf_config(cut)
    cut.write_bytes(good.read_bytes()[:-4096])  # inside the tensor data: gguf-py's reshape error, named as a cut
    with pytest.raises(ValueError, match="cannot read GGUF file .*cut.gguf' \\([0-9,]+ bytes: truncated, or not a "
                                         "GGUF file\\?\\): ValueError"):
        gguf_config(cut)
    # experts announced, router tensors gone
    w = gguf.GGUFWriter(str(tmp_path / "norouter.gguf"), "qwen3moe")
    for k, v in {"embedding_length": 64, "attention.head_count": 4, "block_count": 1, "vocab_size": 256,
                 "feed_forward_length": 96, "expert_count": 4, "expert_used_count": 2}.items():
        w.add_uint32(f"qwen3moe.{k}", v)
    w.add_tensor("token_embd.weight", torch.zeros(256, 64).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="expert_count 4 but no layer's router tensor"):
        gguf_config(tmp_path / "norouter.gguf")


@pytest.mark.parametrize("name,tensor,label", [
    ("qwen3_moe", "blk.0.ffn_up_exps.weight", "model.layers.0.mlp.experts.0.up_proj.weight (GGUF "
                                              "blk.0.ffn_up_exps.weight[0])"),
    ("mixtral", "blk.1.attn_k.weight", "model.layers.1.self_attn.qkv_proj.weight:k (GGUF blk.1.attn_k.weight)"),
])
def test_a_missing_gguf_tensor_is_named_as_the_file_names_it(tmp_path, name, tensor, label):
    hf = make_hf_model(name)
    save(hf, tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", hf.config, tmp_path / "m.gguf", omit=frozenset({f"tensor:{tensor}"}))
    with pytest.raises(ValueError, match=re.escape(f"{path}: checkpoint is missing")) as e:
        LLM(str(path), device="cpu", dtype="float32", attention_backend="torch", max_model_len=64)
    assert label in str(e.value)


def test_generate_cli_takes_token_ids_for_a_gguf_without_vocabulary(tmp_path, capsys):
    # `roofline generate` on a vocabulary-less GGUF: token ids from a JSONL prompts file (vLLM's prompt_token_ids)
    # run (5 tokens each); without prompts (the ShareGPT default) the missing tokenizer is named, no traceback.
    from roofline.cli import build_parser
    from roofline.commands import run_generate

    hf = make_hf_model("qwen3_moe")
    save(hf, tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", hf.config, tmp_path / "q.gguf")
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(f'{{"prompt_token_ids": {p}}}\n' for p in PROMPTS))
    common = ["generate", "--model", str(path), "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch",
              "--floor", "none", "--no-progress", "--temperature", "0", "--max-tokens", "5", "--ignore-eos"]
    assert run_generate(build_parser().parse_args([*common, "--prompts-file", str(ids)])) == 0
    out = capsys.readouterr().out
    assert out.count("output [0] (5 tokens, finish_reason=length)") == len(PROMPTS)
    with pytest.raises(ValueError, match="no tokenizer .*GGUF file without a vocabulary.*prompt_token_ids"):
        run_generate(build_parser().parse_args(common))


def test_moe_quantization_without_expert_kernel_is_refused_first(tmp_path):
    # int4 on an MoE model: the missing expert kernel is named before anything else (it used to ask for another
    # group size first, and only then say that int4 has no expert kernel)
    hf = make_hf_model("mixtral")
    save(hf, tmp_path / "hf")
    path = write_gguf(tmp_path / "hf", hf.config, tmp_path / "m.gguf")
    with pytest.raises(ValueError, match=r"--quantization int4: MixtralForCausalLM has 8 experts, and 'int4' has no "
                                         r"expert \(MoE\) kernel; formats with one: int8, fp8"):
        LLM(str(path), device="cpu", dtype="float32", quantization="int4", max_model_len=128, num_kv_blocks=32)


def test_load_format_and_gguf_detection(tmp_path):
    """A GGUF is known by its suffix or its magic (vLLM's check_gguf_file); --load-format gguf picks the GGUF in a
    directory that also has config.json; a GGUF given load_format safetensors, and a file that is neither, are
    refused by name."""
    from roofline.models.loader import load_config, resolve_model

    hf = make_hf_model("qwen3_moe")
    save(hf, tmp_path / "hf")
    good = write_gguf(tmp_path / "hf", hf.config, tmp_path / "hf" / "m.gguf")
    bare = tmp_path / "model.bin"
    bare.write_bytes(good.read_bytes())
    assert resolve_model(str(bare)).format == "gguf"
    assert resolve_model(str(tmp_path / "hf")).format == "hf"  # config.json wins under auto
    src = resolve_model(str(tmp_path / "hf"), "gguf")
    assert (src.format, src.path) == ("gguf", good)
    with pytest.raises(ValueError, match=r"load_format 'safetensors' but .*model.bin' is a GGUF file"):
        resolve_model(str(bare), "safetensors")
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"notes.txt' is not a GGUF file \(no .gguf suffix, no GGUF magic\)"):
        resolve_model(str(tmp_path / "notes.txt"))
    # dummy weights at a GGUF's shape (its metadata, as vLLM's dummy load of a GGUF)
    assert load_config(resolve_model(str(bare), "dummy")).num_experts == hf.config.num_experts
    only = tmp_path / "only"  # a directory whose only weights are a GGUF, given safetensors
    only.mkdir()
    (only / "w.gguf").write_bytes(good.read_bytes())
    with pytest.raises(ValueError, match=r"load_format 'safetensors' but model directory .*only' is a GGUF file \(its "
                                         r"only weights are w.gguf\)"):
        resolve_model(str(only), "safetensors")
    with pytest.raises(ValueError, match=r"load_format 'hf' but the default model is a GGUF file"):
        resolve_model(None, "hf")
    (tmp_path / "hf" / "m2.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"load_format 'gguf' but model directory .* holds 2 .gguf files"):
        resolve_model(str(tmp_path / "hf"), "gguf")
    # config files that are not configs: named with the file, no traceback
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=r"bad/config.json' lacks the required key 'num_attention_heads'"):
        load_config(resolve_model(str(bad)))
    (bad / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"bad/config.json' is not a JSON object"):
        load_config(resolve_model(str(bad)))
    with pytest.raises(ValueError, match=r"notes.txt' is not a JSON model config \(JSONDecodeError"):
        load_config(resolve_model(str(tmp_path / "notes.txt"), "dummy"))


def test_a_checkpoint_tensor_past_the_models_layers_is_refused(tmp_path):
    """A tensor of a layer the model does not have (model.layers.99 in a 2-layer checkpoint) is named as
    unexpected; it used to be skipped as "another pipeline stage's"."""
    from safetensors.torch import save_file

    hf = make_hf_model("qwen3_moe")
    save(hf, tmp_path / "hf")
    save_file({"model.layers.99.input_layernorm.weight": torch.ones(hf.config.hidden_size)},
              str(tmp_path / "hf" / "zz-extra.safetensors"))
    with pytest.raises(ValueError, match=r"checkpoint tensor 'model.layers.99.input_layernorm.weight' has no matching "
                                         r"parameter"):
        LLM(str(tmp_path / "hf"), device="cpu", dtype="float32", attention_backend="torch", max_model_len=64)


def test_paths_that_are_not_models_are_named(tmp_path):
    """A device file is neither a GGUF nor a directory; an HF directory whose weights are one GGUF points to
    --load-format gguf."""
    from roofline.models.loader import _safetensors_files, resolve_model

    with pytest.raises(ValueError, match=r"model path '/dev/null' is neither a file nor a directory"):
        resolve_model("/dev/null")
    (tmp_path / "w.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match=r"its weights are a GGUF \(w.gguf\): use --load-format gguf"):
        _safetensors_files(tmp_path)


def test_gguf_names_are_added_once_beside_hf_names():
    """name_gguf_tensors: quoted and bare names, a shard label, an expert, a sentence's full stop; applying it
    twice changes nothing."""
    from roofline.models.gguf_file import name_gguf_tensors

    cases = {
        "cannot load 'model.layers.0.self_attn.o_proj.weight': shape":
            "cannot load 'model.layers.0.self_attn.o_proj.weight' (GGUF blk.0.attn_output.weight): shape",
        "missing model.layers.2.mlp.gate_up_proj.weight:1.":
            "missing model.layers.2.mlp.gate_up_proj.weight:1 (GGUF blk.2.ffn_up.weight).",
        "missing 2: model.layers.1.mlp.experts.3.down_proj.weight, \"lm_head.weight\"":
            "missing 2: model.layers.1.mlp.experts.3.down_proj.weight (GGUF blk.1.ffn_down_exps.weight[3]), "
            "\"lm_head.weight\" (GGUF output.weight)",
        "model.layers.0.foo.weight has no GGUF name": "model.layers.0.foo.weight has no GGUF name",
    }
    for message, want in cases.items():
        assert name_gguf_tensors(message) == want
        assert name_gguf_tensors(want) == want
