"""The quantized tensors the low-bit kernels read, and the per-token activation quantizers (torch).

``roofline.kernels`` depends on nothing in ``roofline.quant`` or ``roofline.layers``: the canonical weight
forms live here and ``roofline.quant.quantize`` re-exports them (the arrow goes quant -> kernels).
Conventions: a weight is ``[N, K]`` = ``[out_features, in_features]``; INT4 asymmetric in groups of
``group_size`` input channels, ``W ~= (q - zeros[:, g]) * scales[:, g]``; INT8 symmetric per output channel;
FP8 E4M3 (max 448) per output channel; activations (W8A8) dynamic per token (per row of ``x``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn (OCP 8-bit floating point spec, 2023)
INT8_MAX = 127
INT4_MAX = 15
# Keeps a scale positive for an all-zero row or group (its values then quantize to the zero point).
_MIN_SCALE = 1e-10


@dataclass
class Int4Weight:
    """A weight in canonical INT4 form.

    Attributes:
        q: uint8 ``[N, K]``, values in [0, 15] (one per byte, unpacked).
        scales: float32 ``[N, K // group_size]``.
        zeros: uint8 ``[N, K // group_size]``, values in [0, 15].
        group_size: input channels per group (32, 64 or 128 in practice).
        g_idx: int32 ``[K]``, the group of each input channel (GPTQ act-order), or None for
            ``k // group_size``.
    """

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int
    g_idx: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def group_index(self) -> torch.Tensor:
        """int64 ``[K]``: the group of each input channel."""
        k = self.q.shape[1]
        if self.g_idx is not None:
            return self.g_idx.long()
        return torch.arange(k, device=self.q.device) // self.group_size

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[N, K]`` in ``dtype``: ``(q - zeros[:, g]) * scales[:, g]`` computed in float32."""
        g = self.group_index()
        w = (self.q.float() - self.zeros.float()[:, g]) * self.scales.float()[:, g]
        return w.to(dtype)


@dataclass
class ChannelWeight:
    """A weight quantized per output channel (INT8 or FP8 E4M3), in canonical form.

    Attributes:
        q: int8 or float8_e4m3fn ``[N, K]``.
        scales: float32 ``[N]``; ``W[n, k] ~= float(q[n, k]) * scales[n]``.
    """

    q: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return (self.q.float() * self.scales.float()[:, None]).to(dtype)


def quantize_per_token_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric INT8 per row of ``x`` ``[M, K]``: (q int8 ``[M, K]``, scales float32 ``[M, 1]``)."""
    scales = (x.float().abs().amax(dim=-1, keepdim=True) / INT8_MAX).clamp(min=_MIN_SCALE)
    q = torch.round(x.float() / scales).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scales


def quantize_per_token_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic E4M3 per row of ``x`` ``[M, K]``: (q float8_e4m3fn ``[M, K]``, scales float32 ``[M, 1]``)."""
    scales = (x.float().abs().amax(dim=-1, keepdim=True) / FP8_E4M3_MAX).clamp(min=_MIN_SCALE)
    q = (x.float() / scales).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scales
