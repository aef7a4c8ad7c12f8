"""Round-to-nearest quantizers and the canonical (unpacked) forms every other part of ``roofline.quant``
exchanges: calibration (AWQ, GPTQ, SmoothQuant) produces them, checkpoint formats pack and unpack them,
and each ``LinearMethod`` turns them into what its kernel reads.

Conventions (Hugging Face orientation: a weight is ``[N, K]`` = ``[out_features, in_features]``):

- INT4, asymmetric, in groups of ``group_size`` input channels (the GPTQ/AWQ scheme)::

      W[n, k] ~= (q[n, k] - zeros[n, g(k)]) * scales[n, g(k)],   q, zeros in [0, 15]

  with ``g(k) = g_idx[k]`` (GPTQ act-order) or ``k // group_size``.
- INT8 weights: symmetric per output channel, ``W[n, k] ~= q[n, k] * scales[n]``, q in [-127, 127].
- FP8 weights: E4M3 (OCP FP8, max 448) per output channel, ``W[n, k] ~= float(q[n, k]) * scales[n]``.
- Activations (W8A8): dynamic per token (per row of ``x``), the same two element formats.

Scales are float32 here; a method casts them to what its kernel wants.
"""

from __future__ import annotations

import torch

from roofline.kernels.quant_types import (  # noqa: F401  (re-exported: the canonical forms live in kernels/)
    _MIN_SCALE,
    FP8_E4M3_MAX,
    INT4_MAX,
    INT8_MAX,
    ChannelWeight,
    Int4Weight,
    quantize_per_token_fp8,
    quantize_per_token_int8,
)


def check_group_size(k: int, group_size: int, name: str = "layer") -> None:
    """Raises ValueError naming the layer, K and the group size when the group size does not divide K."""
    if group_size <= 0 or k % group_size:
        fits = [str(g) for g in (32, 64, 128) if k % g == 0]
        hint = f"one of {', '.join(fits)} divides it" if fits else "none of 32, 64, 128 divides it"
        raise ValueError(f"{name}: group size {group_size} does not divide its input size K={k} ({hint})")


def int4_params(w: torch.Tensor, group_size: int, name: str = "layer") -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric min/max RTN parameters for each group of ``w`` ``[N, K]``.

    Returns:
        (scales float32 ``[N, K // group_size]``, zeros float32 (integer-valued, in [1, 15]) of the same
        shape). The range always includes 0, so zero is exactly representable. Zeros are kept >= 1 because
        the GPTQ v1 checkpoint format stores ``zero - 1`` in 4 bits (AutoGPTQ's long-standing quirk) and
        cannot hold a zero of 0: a group with no value below ``-scale / 2`` spreads its maximum over 14
        levels instead of 15 (a group of 32+ weights that are all >= 0 is rare).
    """
    n, k = w.shape
    check_group_size(k, group_size, name)
    g = w.float().reshape(n, k // group_size, group_size)
    lo = g.amin(dim=-1).clamp(max=0.0)
    hi = g.amax(dim=-1).clamp(min=0.0)
    scales = ((hi - lo) / INT4_MAX).clamp(min=_MIN_SCALE)
    zeros = torch.round(-lo / scales).clamp(0, INT4_MAX)
    low = zeros < 1
    scales = torch.where(low, (hi / (INT4_MAX - 1)).clamp(min=_MIN_SCALE), scales)
    zeros = torch.where(low, torch.ones_like(zeros), zeros)
    return scales, zeros


def quantize_int4(w: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group_size: int,
                  g_idx: torch.Tensor | None = None) -> Int4Weight:
    """Round ``w`` ``[N, K]`` onto given per-group scales and zeros ``[N, num_groups]``."""
    k = w.shape[1]
    g = g_idx.long() if g_idx is not None else torch.arange(k, device=w.device) // group_size
    q = torch.round(w.float() / scales[:, g] + zeros[:, g]).clamp(0, INT4_MAX)
    return Int4Weight(q.to(torch.uint8), scales.float().contiguous(), zeros.to(torch.uint8).contiguous(),
                      group_size, None if g_idx is None else g_idx.to(torch.int32))


def quantize_int4_rtn(w: torch.Tensor, group_size: int = 128, name: str = "layer") -> Int4Weight:
    """Round-to-nearest INT4 (the ``rtn`` calibration): min/max scales per group, no data.

    Raises:
        ValueError: ``group_size`` does not divide K (names the layer, K and the group size).
    """
    scales, zeros = int4_params(w, group_size, name)
    return quantize_int4(w, scales, zeros, group_size)


def quantize_int8_per_channel(w: torch.Tensor, amax: torch.Tensor | None = None) -> ChannelWeight:
    """Symmetric INT8 per output channel of ``w`` ``[N, K]``: amax maps to 127, ``W ~= q * s``. ``amax`` [N]
    overrides the rows' own (a row-parallel shard passes the whole row's, ``base.channel_amax``)."""
    amax = w.float().abs().amax(dim=1) if amax is None else amax
    scales = (amax / INT8_MAX).clamp(min=_MIN_SCALE)
    q = torch.round(w.float() / scales[:, None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return ChannelWeight(q, scales)


def quantize_fp8_per_channel(w: torch.Tensor, amax: torch.Tensor | None = None) -> ChannelWeight:
    """E4M3 per output channel of ``w`` ``[N, K]``: amax maps to 448 (round-to-nearest-even cast). ``amax``
    [N] overrides the rows' own (as in ``quantize_int8_per_channel``)."""
    amax = w.float().abs().amax(dim=1) if amax is None else amax
    scales = (amax / FP8_E4M3_MAX).clamp(min=_MIN_SCALE)
    q = (w.float() / scales[:, None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return ChannelWeight(q, scales)
