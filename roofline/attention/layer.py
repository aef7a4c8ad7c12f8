"""The model's attention layer: hands q/k/v to the backend together with this layer's KV cache."""

from __future__ import annotations

import torch
from torch import nn

from roofline.attention.backend import AttentionBackend, AttentionMetadata


class Attention(nn.Module):
    """``forward``: q [T, H, D], k/v [T, H_kv, D] (before RoPE), positions [T] -> [T, H, D]."""

    def __init__(self, backend: AttentionBackend, layer_id: int):
        super().__init__()
        self.backend = backend
        self.layer_id = layer_id

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        return self.backend.forward(q, k, v, positions, self.backend.kv_cache(self.layer_id), meta)
