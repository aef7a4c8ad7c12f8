"""Rotary position embedding (Su et al. 2021, "RoFormer"), rotate-half (Hugging Face / GPT-NeoX) layout.

Llama 3.1 frequency scaling follows Meta's reference implementation (``apply_scaling`` in
llama-models) and Hugging Face's ``_compute_llama3_parameters``.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1 RoPE scaling: long wavelengths divided by ``factor``, short kept, smooth between."""
    factor = scaling["factor"]
    low = scaling.get("low_freq_factor", 1.0)
    high = scaling.get("high_freq_factor", 4.0)
    old_len = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen = old_len / low
    high_wavelen = old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """The angle table of one model: ``cos_sin_cache`` [max_positions, head_dim] fp32 = cat(cos, sin), each
    [max_positions, head_dim / 2]. The attention backend applies it (fused with the KV-cache store where it
    has a kernel for that; ``roofline.kernels.rope_cache``)."""

    def __init__(self, head_dim: int, max_positions: int, base: float, scaling: dict[str, Any] | None = None,
                 device: torch.device | str | None = None):
        self.head_dim = head_dim
        self.max_positions = max_positions
        with torch.device(device or "cpu"):  # computed where it is used (cos/sin round differently per device)
            inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
            if scaling is not None and "freq_factors" in scaling:  # a GGUF's rope_freqs tensor (llama.cpp)
                factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32)
                if factors.shape != inv_freq.shape:
                    raise ValueError(f"rope freq_factors has {factors.numel()} values; head_dim {head_dim} "
                                     f"needs {inv_freq.numel()}")
                inv_freq = inv_freq / factors
            elif scaling is not None:
                inv_freq = llama3_inv_freq(inv_freq, scaling)
            t = torch.arange(max_positions, dtype=torch.float32)
            freqs = torch.outer(t, inv_freq)  # [max_positions, head_dim/2]
            self.cos_sin_cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1)

    @classmethod
    def from_config(cls, config: Any, device: torch.device | str | None = None) -> RotaryEmbedding:
        """From a ``ModelConfig`` (head_dim, max_position_embeddings, rope_theta, rope_scaling)."""
        return cls(config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling_dict,
                   device)
