"""The model's attention layer: hands q/k/v to the backend together with this layer's KV cache and, for Qwen3,
its q/k norm (the backend applies it, fused into RoPE + the KV store where it can)."""

from __future__ import annotations

import torch
from torch import nn

from roofline.attention.backend import AttentionBackend, AttentionMetadata, QKNorm


class Attention(nn.Module):
    """``forward``: q [T, H, D], k/v [T, H_kv, D] (before the q/k norm and RoPE), positions [T] -> [T, H, D].

    ``qk_norm``: Qwen3's q_norm / k_norm modules, or None. They stay the owning layer's submodules (checkpoint
    names ``self_attn.q_norm``): held here in a plain tuple, not registered twice."""

    def __init__(self, backend: AttentionBackend, layer_id: int, qk_norm: QKNorm | None = None):
        super().__init__()
        self.backend = backend
        self.layer_id = layer_id
        self.qk_norm = qk_norm

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, k, v, positions, self.backend.kv_cache(self.layer_id), meta, self.qk_norm)
