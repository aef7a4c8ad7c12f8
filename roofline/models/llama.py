"""One decoder for the Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5 (QKV bias), Qwen3 (q/k RMSNorm),
SmolLM2 (tied embeddings), and its mixture-of-experts members: Mixtral, Qwen2-MoE (shared expert with a
sigmoid gate), Qwen3-MoE, whose MLP is a routed MoE block on the layers the config names. GQA and any head_dim.

Module names match Hugging Face checkpoints (``model.layers.0.self_attn.qkv_proj`` holds HF's q/k/v), so
loading is a name mapping plus each parameter's ``weight_loader``. The model holds no kernel code and no
device branch: attention (RoPE, the KV store and the kernels) is the backend's, linear layers delegate to
their ``LinearMethod`` (the weight format), and norms/activations choose their kernel in ``layers``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from roofline.attention import Attention, AttentionBackend, AttentionMetadata, QKNorm
from roofline.config import ModelConfig
from roofline.distributed.parallel_state import get_parallel_state
from roofline.layers.activation import silu_and_mul
from roofline.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from roofline.layers.moe import FusedMoE
from roofline.layers.norm import RMSNorm
from roofline.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from roofline.quant.base import QuantConfig

if TYPE_CHECKING:
    from roofline.kernels.act_quant import QuantizedActivation


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer_id: int,
                 quant_config: QuantConfig | None, prefix: str):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = QKVParallelLinear(config.hidden_size, config.head_dim, config.num_attention_heads,
                                          config.num_key_value_heads, bias=config.attention_bias,
                                          quant_config=quant_config, prefix=f"{prefix}.qkv_proj")
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads  # this rank's
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.o_proj = RowParallelLinear(config.num_attention_heads * config.head_dim, config.hidden_size,
                                        bias=False, quant_config=quant_config, prefix=f"{prefix}.o_proj")
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            # Qwen3: applied by the attention backend, before RoPE (fused into its RoPE + KV store on Triton).
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.attn = Attention(backend, layer_id, QKNorm(self.q_norm, self.k_norm) if config.qk_norm else None)

    def forward(self, positions: torch.Tensor, x: torch.Tensor | QuantizedActivation, meta: AttentionMetadata
                ) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attn(q, k, v, positions, meta)  # [T, H, D]; the backend applies Qwen3's q/k norm
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str,
                 intermediate_size: int | None = None):
        super().__init__()
        width = intermediate_size or config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(
            config.hidden_size, [width] * 2, bias=False, quant_config=quant_config,
            prefix=f"{prefix}.gate_up_proj")
        self.down_proj = RowParallelLinear(width, config.hidden_size, bias=False,
                                           quant_config=quant_config, prefix=f"{prefix}.down_proj")

    def forward(self, x: torch.Tensor | QuantizedActivation) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), quant_for=self.down_proj))


def moe_checkpoint_names(architecture: str) -> tuple[str, tuple[str, str, str]]:
    """The HF checkpoint's name of an MoE layer's block and of an expert's gate, up and down projections: Mixtral's
    ``block_sparse_moe`` with ``w1`` / ``w3`` / ``w2``, Qwen-MoE's ``mlp`` with ``gate_proj`` / ``up_proj`` /
    ``down_proj``."""
    if architecture == "MixtralForCausalLM":
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


class LlamaSparseMoeBlock(nn.Module):
    """The MLP of an MoE layer: router ``gate`` (16-bit, replicated) -> ``experts`` (``FusedMoE``: top-k
    routing, in one launch with the gate at decode sizes on a GPU (``FusedMoE.route``), the experts, the
    reduction across ranks), plus, for Qwen2-MoE, ``shared_expert`` (a dense MLP)
    scaled by ``sigmoid(shared_expert_gate(x))``. Module names are HF's, so loading is a name mapping."""

    def __init__(self, config: ModelConfig, quant_config: QuantConfig | None, prefix: str):
        super().__init__()
        self.gate = ReplicatedLinear(config.hidden_size, config.num_experts, bias=False, prefix=f"{prefix}.gate")
        self.experts = FusedMoE(config.num_experts, config.num_experts_per_tok, config.hidden_size,
                                config.moe_intermediate_size, renormalize=config.norm_topk_prob,
                                quant_config=quant_config, prefix=f"{prefix}.experts",
                                checkpoint_names=moe_checkpoint_names(config.architecture)[1])
        self.has_shared_expert = config.shared_expert_intermediate_size > 0
        if self.has_shared_expert:
            self.shared_expert = LlamaMLP(config, quant_config, f"{prefix}.shared_expert",
                                          intermediate_size=config.shared_expert_intermediate_size)
            self.shared_expert_gate = ReplicatedLinear(config.hidden_size, 1, bias=False,
                                                       prefix=f"{prefix}.shared_expert_gate")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.experts.run_experts(x, *self.experts.route(x, self.gate))  # [T, H]
        if self.has_shared_expert:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, layer_id: int,
                 quant_config: QuantConfig | None, prefix: str):
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, layer_id, quant_config, f"{prefix}.self_attn")
        tail = prefix.rsplit(".", 1)[-1]  # "model.layers.7": the checkpoint's layer index (PP stages offset it)
        hf_layer_id = int(tail) if tail.isdigit() else layer_id  # a drafter's lone layer ("layer") has none
        if config.is_moe_layer(hf_layer_id):
            self.mlp_name = moe_checkpoint_names(config.architecture)[0]
            self.add_module(self.mlp_name, LlamaSparseMoeBlock(config, quant_config, f"{prefix}.{self.mlp_name}"))
        else:
            self.mlp_name = "mlp"
            self.mlp = LlamaMLP(config, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # A norm feeding a W8A8 linear above decode sizes writes that linear's per-token codes itself
        # (``RMSNorm.forward``'s ``quant_for``); the MoE block's router reads the 16-bit x, so it gets that.
        if residual is None:
            residual = x
            x = self.input_layernorm(x, quant_for=self.self_attn.qkv_proj)
        else:
            x, residual = self.input_layernorm(x, residual, quant_for=self.self_attn.qkv_proj)
        x = self.self_attn(positions, x, meta)
        mlp = getattr(self, self.mlp_name)
        x, residual = self.post_attention_layernorm(
            x, residual, quant_for=mlp.gate_up_proj if isinstance(mlp, LlamaMLP) else None)
        return mlp(x), residual


class PPMissingLayer(nn.Identity):
    """A module another pipeline stage holds (vLLM's name): no parameters here, never called."""


class LlamaModel(nn.Module):
    """The decoder. Under pipeline parallelism (``parallel_state.layer_range``) a stage builds only its layers
    [start, end) (the others are ``PPMissingLayer``), the embedding only on the first stage and the final norm
    only on the last; its attention layers index the stage's own KV pool from 0."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend, quant_config: QuantConfig | None,
                 prefix: str = "model"):
        super().__init__()
        ps = get_parallel_state()
        self.start_layer, self.end_layer = ps.layer_range or (0, config.num_hidden_layers)
        self.is_first_stage, self.is_last_stage = ps.is_first_stage, ps.is_last_stage
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size,
                                                    prefix=f"{prefix}.embed_tokens")
                             if self.is_first_stage else PPMissingLayer())
        self.layers = nn.ModuleList([
            LlamaDecoderLayer(config, backend, i - self.start_layer, quant_config, f"{prefix}.layers.{i}")
            if self.start_layer <= i < self.end_layer else PPMissingLayer()
            for i in range(config.num_hidden_layers)
        ])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps) if self.is_last_stage else PPMissingLayer()
        self.aux_layers: tuple[int, ...] = ()  # set_aux_layers
        self.aux_slots: torch.Tensor | None = None
        self.aux_out: torch.Tensor | None = None

    def set_aux_layers(self, layers: tuple[int, ...] | list[int], max_tokens: int) -> None:
        """Keep the residual stream entering each of ``layers`` (decoder layer indices) at every forward: written
        into the static ``aux_out`` [max_tokens, len(layers) H] (model dtype; rows [0, T) of a T-token forward,
        layer ``layers[j]`` in columns [j H, (j + 1) H)), which a CUDA graph's replay rewrites in place;
        ``aux_slots`` int64 [num_layers] (CPU) holds each layer's j, or -1 (the CPU decode plan's form). The
        features EAGLE-3's fusion reads (``roofline.spec_decode.heads.fuse_features``). A forward of more than
        ``max_tokens`` tokens writes none. The first pipeline stage only (it holds the embedding, whose dtype the
        buffer takes)."""
        w = self.embed_tokens.weight
        self.aux_layers = tuple(int(i) for i in layers)
        self.aux_slots = torch.full((len(self.layers),), -1, dtype=torch.int64)
        self.aux_slots[list(self.aux_layers)] = torch.arange(len(self.aux_layers))
        self.aux_out = torch.zeros(max_tokens, len(layers) * w.shape[1], dtype=w.dtype, device=w.device)

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None, num_layers: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """The first stage embeds ``input_ids``; a later one continues from the previous stage's
        ``intermediate`` (hidden [T, H], residual [T, H]). The last stage returns the normed hidden states
        [T, H]; the others return their (hidden, residual) for the next stage.

        ``num_layers`` k: run only the first k decoder layers, then the final norm (the layer-skip self-draft;
        the whole model on one stage, 1 <= k <= num_hidden_layers)."""
        if intermediate is None:
            x, residual = self.embed_tokens(input_ids), None
        else:
            x, residual = intermediate
        end = self.end_layer if num_layers is None else self.start_layer + num_layers
        aux = self.aux_out if self.aux_layers and num_layers is None and positions.shape[0] <= len(self.aux_out) \
            else None
        for i, layer in enumerate(self.layers[self.start_layer:end], self.start_layer):
            if aux is not None and i in self.aux_layers:
                j, h = self.aux_layers.index(i), x.shape[-1]
                aux[:x.shape[0], j * h:(j + 1) * h] = x if residual is None else x + residual
            x, residual = layer(positions, x, residual, meta)
        if not self.is_last_stage:
            return x, residual
        x, _ = self.norm(x, residual)
        return x

    def checkpoint_name(self, name: str, tied: bool) -> str | None:
        """Where checkpoint tensor ``name`` goes on this stage: ``name``, another parameter's name, or None
        (another stage holds it). A tied LM head on a last stage without the embedding loads the embedding."""
        if name.startswith("model.layers."):
            i = int(name.split(".")[2])
            if i >= len(self.layers):  # no stage has it: the loader names it as unexpected
                return name
            return name if self.start_layer <= i < self.end_layer else None
        if name.startswith("model.embed_tokens."):
            if self.is_first_stage:
                return name
            return name.replace("model.embed_tokens.", "lm_head.") if tied and self.is_last_stage else None
        if name.startswith(("model.norm.", "lm_head.")):
            return name if self.is_last_stage else None
        return name


class LlamaForCausalLM(nn.Module):
    """forward: input_ids [T] int64, positions [T] int64 -> hidden states [T, hidden_size].

    Args:
        backend: the attention backend (it owns the KV cache); shared by every layer.
        quant_config: the weight format of the linear layers (None: 16-bit weights).
    """

    # Our fused module -> the Hugging Face modules it holds, in shard order (vLLM's name for this map).
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    # Hugging Face name -> (our module, shard id) for the fused projections.
    stacked_params = (
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", 0),
        ("up_proj", "gate_up_proj", 1),
    )
    # MoE: an expert's HF projection -> (our stacked parameter of ``FusedMoE``, projection index), for
    # ``<prefix>.experts.<e>.<name>.weight`` (matched before ``stacked_params``; vLLM's expert_params_mapping).
    expert_params_mapping = {"w1": ("w13_weight", 0), "w3": ("w13_weight", 1), "w2": ("w2_weight", 2),
                             "gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1),
                             "down_proj": ("w2_weight", 2)}

    def __init__(self, config: ModelConfig, backend: AttentionBackend, quant_config: QuantConfig | None = None):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend, quant_config)
        self.lm_head = (ParallelLMHead(config.vocab_size, config.hidden_size, prefix="lm_head",
                                       quant_config=quant_config)
                        if self.model.is_last_stage else PPMissingLayer())
        if config.tie_word_embeddings and self.model.is_first_stage and self.model.is_last_stage:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self, input_ids: torch.Tensor | None, positions: torch.Tensor, meta: AttentionMetadata,
        intermediate: tuple[torch.Tensor, torch.Tensor] | None = None, num_layers: int | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """See ``LlamaModel.forward`` (one pipeline stage; the whole model at pipeline size 1)."""
        return self.model(input_ids, positions, meta, intermediate, num_layers)

    def checkpoint_name(self, name: str) -> str | None:
        """This stage's name for checkpoint tensor ``name`` (None: another stage's; ``LlamaModel``)."""
        return self.model.checkpoint_name(name, self.config.tie_word_embeddings)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab_size] in fp32."""
        return self.lm_head.compute_logits(hidden)
