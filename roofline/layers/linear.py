"""Linear layers. Weights are [out_features, in_features] as in Hugging Face checkpoints.

``MergedLinear`` stores several HF projections in one weight (q/k/v -> qkv_proj, gate/up -> gate_up_proj)
so that a decode step launches one GEMM instead of three; ``shard_offsets`` tells the loader where
each HF tensor goes. Quantized linear methods will swap these modules rather than branch inside them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.in_features = in_features
        self.out_features = out_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class MergedLinear(Linear):
    """Output rows are the concatenation of named shards, e.g. {"q": 576, "k": 192, "v": 192}."""

    def __init__(self, in_features: int, shard_sizes: dict[str, int], bias: bool = False):
        super().__init__(in_features, sum(shard_sizes.values()), bias)
        self.shard_offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name, size in shard_sizes.items():
            self.shard_offsets[name] = (start, size)
            start += size
