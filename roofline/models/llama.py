"""One decoder for the Llama family: Llama 2/3/3.1, Mistral, Qwen2/2.5 (QKV bias), Qwen3 (q/k RMSNorm),
SmolLM2 (tied embeddings). GQA and any head_dim.

Module names match Hugging Face checkpoints (``model.layers.0.self_attn.qkv_proj`` holds HF's q/k/v), so
loading is a name mapping. The model holds no kernel code: attention goes through an
``AttentionBackend``, and norms/activations through ``roofline.layers``.
"""

from __future__ import annotations

import torch
from torch import nn

from roofline.config import ModelConfig
from roofline.layers import dispatch
from roofline.layers.activation import silu_and_mul
from roofline.layers.attention import AttentionBackend, AttentionMetadata
from roofline.layers.linear import Linear, MergedLinear
from roofline.layers.norm import RMSNorm
from roofline.layers.rotary import RotaryEmbedding


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size, self.kv_size = config.q_size, config.kv_size
        self.qkv_proj = MergedLinear(
            config.hidden_size, {"q": self.q_size, "k": self.kv_size, "v": self.kv_size},
            bias=config.attention_bias,
        )
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm
        self.rotary = rotary
        self.backend = backend
        # Bound by the ModelRunner to this layer's cache: [num_blocks, block_size, num_kv_heads, head_dim].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, q_size + 2 * kv_size]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.reshape(num_tokens, self.num_heads, self.head_dim)
        k = k.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q = self.q_norm(q)
            k = self.k_norm(k)
        kernels = dispatch.kernels_for(x)
        if kernels is not None:
            # One fused kernel rotates q/k in place and stores k/v at their slots.
            kernels.rope_and_cache(q, k, v, positions, self.rotary.cos_sin_cache, self.k_cache, self.v_cache,
                                   meta.slot_mapping)
            out = self.backend.attend(q, self.k_cache, self.v_cache, meta)  # [T, H, D]
        else:
            q, k = self.rotary(positions, q, k)
            out = self.backend.forward(q, k, v, self.k_cache, self.v_cache, meta)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = MergedLinear(
            config.hidden_size, {"gate": config.intermediate_size, "up": config.intermediate_size}
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend, rotary: RotaryEmbedding):
        super().__init__()
        self.self_attn = LlamaAttention(config, backend, rotary)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = x
            x = self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(positions, x, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling_dict
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            [LlamaDecoderLayer(config, backend, rotary) for _ in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        residual = None
        for layer in self.layers:
            x, residual = layer(positions, x, residual, meta)
        x, _ = self.norm(x, residual)
        return x


class LlamaForCausalLM(nn.Module):
    """forward: input_ids [T] int64, positions [T] int64 -> hidden states [T, hidden_size]."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, backend)
        self.lm_head = Linear(config.hidden_size, config.vocab_size)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden_size] -> logits [N, vocab_size] in fp32."""
        return self.lm_head(hidden).float()

    def attention_layers(self) -> list[LlamaAttention]:
        return [layer.self_attn for layer in self.model.layers]

    # Hugging Face name -> (our parameter name, shard) for the fused projections.
    stacked_params = (
        ("q_proj", "qkv_proj", "q"),
        ("k_proj", "qkv_proj", "k"),
        ("v_proj", "qkv_proj", "v"),
        ("gate_proj", "gate_up_proj", "gate"),
        ("up_proj", "gate_up_proj", "up"),
    )
