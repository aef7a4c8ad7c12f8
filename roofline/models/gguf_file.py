"""GGUF files (llama.cpp's format): the model config from a file's ``{arch}.*`` metadata and its tensors,
dequantized with the ``gguf`` package and named as Hugging Face does, for ``roofline.models.loader``."""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from roofline.config import ModelConfig


@functools.lru_cache(maxsize=2)
def gguf_reader(path: str) -> Any:
    """One parsed GGUF header per file (parsing the metadata of the default model takes seconds)."""
    import gguf

    try:
        return gguf.GGUFReader(path)
    except (IndexError, KeyError, ValueError) as e:  # a file cut inside its header (Index/KeyError) or its tensor
        # data (gguf-py: "cannot reshape array of size ..."), or not a GGUF file at all
        size = os.path.getsize(path)
        raise ValueError(f"cannot read GGUF file {path!r} ({size:,} bytes: truncated, or not a GGUF file?): "
                         f"{type(e).__name__}: {e}") from e


def _gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


# llama.cpp's ``general.architecture`` -> the HF architecture it was converted from (llama.cpp's
# convert_hf_to_gguf.py). "llama" also holds Mistral and, with ``llama.expert_count`` > 0, Mixtral.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                      "qwen2moe": "Qwen2MoeForCausalLM", "qwen3moe": "Qwen3MoeForCausalLM"}


def gguf_config(path: Path) -> ModelConfig:
    """ModelConfig from a GGUF file's metadata, as llama.cpp's converter writes it: the ``{arch}.*`` keys
    (``gguf.Keys.LLM`` / ``gguf.Keys.Attention``) of the architectures in :data:`GGUF_ARCHITECTURES`.

    Mixture of experts (``{arch}.expert_count`` > 0): ``expert_used_count`` is the top-k, ``expert_feed_forward_length``
    an expert's width (Mixtral: ``feed_forward_length``), ``expert_shared_feed_forward_length`` Qwen2-MoE's shared
    expert (both widths read from the tensors' shapes where they are stacked); a layer is MoE where its router
    tensor (``blk.N.ffn_gate_inp``) is present; top-k renormalization follows ``{arch}.expert_weights_norm`` where
    written, else llama.cpp's rule (Qwen3-MoE and Mixtral yes, Qwen2-MoE no). A ``rope_freqs`` tensor (Llama 3.1's
    per-frequency RoPE divisors, as llama.cpp's converter writes them) becomes ``rope_scaling["freq_factors"]``.

    Raises:
        ValueError: an architecture not in :data:`GGUF_ARCHITECTURES` (names it and the supported ones), a
            required key missing (names it), experts without router tensors, a ``rope.scaling.type`` other than
            none, or an unreadable file.
    """
    reader = gguf_reader(str(path))
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: "
                         f"{', '.join(repr(a) for a in GGUF_ARCHITECTURES)}")
    tensors = {t.name: t for t in reader.tensors}
    names = set(tensors)

    def key(name: str, default: Any = None) -> Any:
        return _gguf_field(reader, f"{arch}.{name}", default)

    def required(name: str) -> int:
        value = key(name)
        if value is None:
            raise ValueError(f"GGUF file {str(path)!r} ({arch}) has no {arch}.{name} key")
        return int(value)

    heads = required("attention.head_count")
    hidden = required("embedding_length")
    eos = _gguf_field(reader, "tokenizer.ggml.eos_token_id", 2)
    vocab = key("vocab_size")
    if vocab is None and "tokenizer.ggml.tokens" in reader.fields:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    if vocab is None and "token_embd.weight" in tensors:
        vocab = int(tensors["token_embd.weight"].shape[1])  # GGUF shapes are innermost-first: [H, vocab]
    if vocab is None:
        raise ValueError(f"GGUF file {str(path)!r} has no {arch}.vocab_size, tokenizer.ggml.tokens or token_embd")
    head_dim = key("attention.key_length") or key("rope.dimension_count") or hidden // heads
    layers = required("block_count")
    intermediate = required("feed_forward_length")
    moe: dict[str, Any] = {}
    architecture = GGUF_ARCHITECTURES[arch]
    experts = int(key("expert_count", 0) or 0)
    if experts:
        if arch == "llama":
            architecture = "MixtralForCausalLM"
        elif arch not in ("qwen2moe", "qwen3moe"):
            raise ValueError(f"GGUF architecture {arch!r} with {arch}.expert_count {experts}: experts are read for "
                             f"'llama' (Mixtral), 'qwen2moe' and 'qwen3moe'")
        top_k = required("expert_used_count")
        sparse = [i for i in range(layers) if f"blk.{i}.ffn_gate_inp.weight" in names]
        if not sparse:
            raise ValueError(f"GGUF file {str(path)!r} has {arch}.expert_count {experts} but no layer's router "
                             f"tensor (blk.N.ffn_gate_inp.weight)")

        def width(tensor: str, fallback: int) -> int:
            # An expert's width from its gate tensor (innermost-first [H, I(, E)]), which is what gets loaded; the
            # keys only where the tensor is stored per expert (older Mixtral files)
            t = tensors.get(f"blk.{sparse[0]}.{tensor}.weight")
            return int(t.shape[1]) if t is not None else fallback

        moe = dict(num_experts=experts, num_experts_per_tok=top_k,
                   moe_intermediate_size=width("ffn_gate_exps", int(key("expert_feed_forward_length", intermediate))),
                   norm_topk_prob=bool(key("expert_weights_norm", arch != "qwen2moe")),
                   shared_expert_intermediate_size=width("ffn_gate_shexp", 0),
                   mlp_only_layers=tuple(i for i in range(layers) if i not in sparse))
    scaling_type = key("rope.scaling.type")
    if scaling_type not in (None, "none"):
        raise ValueError(f"GGUF file {str(path)!r}: {arch}.rope.scaling.type {scaling_type!r} is not supported "
                         f"(llama3-style rope_freqs factors are)")
    rope_scaling = None
    if "rope_freqs.weight" in tensors:  # Llama 3.1's long-context factors, per frequency (llama.cpp's converter)
        import gguf
        import numpy as np

        t = tensors["rope_freqs.weight"]
        factors = np.asarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float64).reshape(-1)
        if not np.all(factors == 1.0):
            rope_scaling = (("freq_factors", tuple(float(f) for f in factors)), ("rope_type", "gguf_rope_freqs"))
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=int(head_dim),
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        max_position_embeddings=int(key("context_length", 4096)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        qk_norm="blk.0.attn_q_norm.weight" in names,
        bos_token_id=_gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_ids=(int(eos),),
        name=path.stem,
        **moe,
    )


def _unpermute_gguf(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (interleaved RoPE) back to the rotate-half (HF) layout."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_GGUF_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj", "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj", "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# An MoE layer's tensors: the router, and each expert's gate / up / down (index into moe_checkpoint_names), either
# stacked [E, ...] (``ffn_*_exps``, llama.cpp's layout since 2024) or one tensor per expert (``ffn_gate.<e>``,
# the older Mixtral files).
_GGUF_EXPERT_PROJ = {"ffn_gate_exps": 0, "ffn_up_exps": 1, "ffn_down_exps": 2}
_GGUF_PER_EXPERT = re.compile(r"^(ffn_gate|ffn_up|ffn_down)\.(\d+)$")


_HF_TO_GGUF = {hf: g for g, hf in _GGUF_NAMES.items()}
_HF_EXPERT = re.compile(r"^model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts\.(\d+)\.(\w+)\.(weight|bias)$")
_HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)\.(weight|bias)(:\w+)?$")


def gguf_tensor_name(name: str) -> str | None:
    """The GGUF (llama.cpp) name of the tensor that a Hugging Face checkpoint name, or a loader label of ours
    (``model.layers.0.self_attn.qkv_proj.weight:q``), stands for: ``blk.0.attn_q.weight``; an expert's is its
    stacked tensor with the index, ``blk.3.ffn_up_exps.weight[5]``. None where there is none (a name not from a
    decoder of the architectures in :data:`GGUF_ARCHITECTURES`)."""
    from roofline.models.llama import LlamaForCausalLM, moe_checkpoint_names

    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if name in top:
        return top[name]
    m = _HF_EXPERT.match(name)
    if m is not None:  # an expert's projection (either architecture's names) -> its stacked tensor
        stacked = {moe_checkpoint_names(arch)[1][i]: kind for kind, i in _GGUF_EXPERT_PROJ.items()
                   for arch in ("MixtralForCausalLM", "Qwen3MoeForCausalLM")}
        kind = stacked.get(m.group(3))
        return f"blk.{m.group(1)}.{kind}.{m.group(4)}[{m.group(2)}]" if kind else None
    m = _HF_LAYER.match(name)
    if m is None:
        return None
    layer, part, suffix, shard = m.groups()
    if shard:  # our fused parameter's shard -> the HF projection it holds (the loader's stacked_params)
        part = next((part[:-len(ours)] + hf for hf, ours, sid in LlamaForCausalLM.stacked_params
                     if part.endswith(ours) and shard == f":{sid}"), None)
        if part is None:
            return None
    kind = {"mlp.gate": "ffn_gate_inp", "block_sparse_moe.gate": "ffn_gate_inp"}.get(part) or _HF_TO_GGUF.get(part)
    return f"blk.{layer}.{kind}.{suffix}" if kind else None


def name_gguf_tensors(message: str) -> str:
    """``message`` with each quoted or listed Hugging Face / loader name followed by its GGUF name, so that a
    loading error about a GGUF file names the tensor as the file does: ``'model.layers.0.self_attn.q_proj.weight'
    (GGUF blk.0.attn_q.weight)``."""
    def sub(m: re.Match) -> str:
        name = m.group(2).rstrip(".")  # a sentence's full stop is not part of the name
        g = gguf_tensor_name(name)
        return m.group(1) + name + m.group(1) + (f" (GGUF {g})" if g else "") + m.group(2)[len(name):]

    # a name already followed by its GGUF name is left alone (applying this twice changes nothing)
    pattern = r"(?<![\w.'\"])(['\"]?)((?:model\.[\w.]+|lm_head\.weight)(?::\w+)?)(?![\w:])\1(?! \(GGUF )"
    return re.sub(pattern, sub, message)


def iter_gguf(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """Dequantize every GGUF tensor (with the ``gguf`` package) and name it as Hugging Face does: an MoE layer's
    stacked experts ``[E, ...]`` become E per-expert tensors, and llama.cpp's q / k row permutation (interleaved
    RoPE, applied by its converter to the "llama" architecture only) is undone."""
    import gguf
    import numpy as np

    from roofline.models.llama import moe_checkpoint_names

    reader = gguf_reader(str(path))
    permuted = _gguf_field(reader, "general.architecture") == "llama"
    block, expert_names = moe_checkpoint_names(config.architecture)
    for t in reader.tensors:
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        # a copy only where needed: an F32 tensor is the file's read-only memmap, a dequantized one a new array
        tensor = torch.from_numpy(np.require(np.asarray(data), dtype=np.float32, requirements=["C", "W"]))
        name = t.name
        if name == "token_embd.weight":
            yield "model.embed_tokens.weight", tensor
        elif name == "output_norm.weight":
            yield "model.norm.weight", tensor
        elif name == "output.weight":
            yield "lm_head.weight", tensor
        elif name.startswith("blk."):
            _, layer, kind, suffix = name.split(".", 3)
            prefix = f"model.layers.{layer}"
            per_expert = _GGUF_PER_EXPERT.match(f"{kind}.{suffix.rsplit('.', 1)[0]}") if config.num_experts else None
            if kind == "ffn_gate_inp":
                yield f"{prefix}.{block}.gate.{suffix}", tensor
            elif kind in _GGUF_EXPERT_PROJ:
                proj = expert_names[_GGUF_EXPERT_PROJ[kind]]
                for e in range(tensor.shape[0]):
                    yield f"{prefix}.{block}.experts.{e}.{proj}.{suffix}", tensor[e]
            elif per_expert is not None:
                proj = expert_names[("ffn_gate", "ffn_up", "ffn_down").index(per_expert.group(1))]
                yield f"{prefix}.{block}.experts.{per_expert.group(2)}.{proj}.{suffix.rsplit('.', 1)[1]}", tensor
            elif kind not in _GGUF_NAMES:
                raise ValueError(f"unexpected GGUF tensor {name!r}")
            else:
                if permuted and kind == "attn_q":
                    tensor = _unpermute_gguf(tensor, config.num_attention_heads)
                elif permuted and kind == "attn_k":
                    tensor = _unpermute_gguf(tensor, config.num_key_value_heads)
                elif kind == "ffn_gate_inp_shexp" and tensor.dim() == 1:
                    tensor = tensor[None, :]  # llama.cpp stores Qwen2-MoE's [1, H] shared-expert gate as [H]
                yield f"{prefix}.{_GGUF_NAMES[kind]}.{suffix}", tensor
        elif name == "rope_freqs.weight":
            continue  # Llama 3.1's scaling factors: gguf_config put them in the config (rope_scaling)
        else:
            raise ValueError(f"unexpected GGUF tensor {name!r}")
