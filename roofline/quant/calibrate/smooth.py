"""SmoothQuant (Xiao et al. 2023, "SmoothQuant: Accurate and Efficient Post-Training Quantization for Large
Language Models", ICML) and the input-scale folding that it and AWQ share.

A per-input-channel scale ``s`` ``[K]`` moves difficulty between activations and weights without changing
the function: ``x W^T = (x / s) (W * s)^T``. The division by ``s`` is folded into the op that produces
``x``, so it costs nothing at runtime: the RMSNorm weight (``y = norm(h) * gamma`` -> ``gamma / s``) or the
rows of the linear whose output is ``x`` (v_proj for o_proj without GQA, up_proj for down_proj, whose
input ``silu(gate) * up`` is linear in up's rows).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from roofline.quant.calibrate.capture import InputStats, LinearGroup

SMOOTHQUANT_ALPHA = 0.5  # the migration strength the paper uses for most models (Xiao et al. 2023, sec. 4)
_MIN = 1e-5  # SmoothQuant's reference clamp for weight maxima and scales


def smoothquant_scales(act_abs_max: torch.Tensor, weights: Sequence[torch.Tensor],
                       alpha: float = SMOOTHQUANT_ALPHA) -> torch.Tensor:
    """SmoothQuant's per-input-channel scale ``s_j = max|X_j|^alpha / max|W_j|^(1 - alpha)`` (Xiao et al.
    2023, eq. 4), ``max|W_j|`` over the rows of all ``weights`` sharing the input.

    Args:
        act_abs_max: float ``[K]``, max over calibration tokens of ``|x[:, j]|``.
        weights: each ``[N_i, K]`` (Hugging Face orientation).
        alpha: migration strength in [0, 1].

    Returns:
        float32 ``[K]``, clamped to >= 1e-5 as the reference implementation does. A channel never seen
        active (max|X_j| = 0) or with all-zero weights gets ``s_j = 1``: any other value would only blow
        up that channel's folded norm weight for inputs the calibration never saw.

    Raises:
        ValueError: ``alpha`` outside [0, 1], or shapes that disagree.
    """
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"SmoothQuant alpha must be in [0, 1], got {alpha}")
    k = act_abs_max.shape[0]
    if any(w.shape[1] != k for w in weights):
        raise ValueError(f"weights {[tuple(w.shape) for w in weights]} do not all have K={k} input channels")
    w_max = torch.cat([w.float().abs() for w in weights]).amax(0)  # [K]
    a = act_abs_max.float()
    s = (a.clamp(min=_MIN).pow(alpha) / w_max.clamp(min=_MIN).pow(1.0 - alpha)).clamp(min=_MIN)
    return torch.where((a > 0) & (w_max > 0), s, torch.ones_like(s))


def fold_input_scales(state: dict[str, torch.Tensor], group: LinearGroup, s: torch.Tensor) -> None:
    """Apply ``x W^T = (x / s) (W * s)^T`` to ``state`` (Hugging Face names -> dense tensors), in place.

    Each weight of ``group.linears`` gets its columns multiplied by ``s``; ``group.prev`` (an RMSNorm weight
    ``[K]``, or the rows of a linear weight ``[K, K_prev]`` and its bias ``[K]``) is divided by ``s``.
    Computed in float64, stored back in each tensor's dtype.

    Raises:
        ValueError: the group has no ``prev`` (no exact place for 1/s), or a shape disagrees with ``s``.
    """
    if group.prev is None:
        raise ValueError(f"{group.module}: no preceding op absorbs an input scale (GQA o_proj)")
    s64 = s.double()
    k = s64.shape[0]
    for lin in group.linears:
        w = state[f"{lin}.weight"]
        if w.shape[1] != k:
            raise ValueError(f"{lin}.weight has {w.shape[1]} input channels, the scale has {k}")
        state[f"{lin}.weight"] = (w.double() * s64[None, :]).to(w.dtype)
    names = [f"{group.prev}.weight"] + ([] if group.prev_is_norm else [f"{group.prev}.bias"])
    for name in names:
        t = state.get(name)
        if t is None:
            continue  # a linear without bias
        if t.shape[0] != k:
            raise ValueError(f"{name} has {t.shape[0]} rows, the scale has {k}")
        view = s64 if t.dim() == 1 else s64[:, None]
        state[name] = (t.double() / view).to(t.dtype)


def smoothquant_smooth(state: dict[str, torch.Tensor], groups: Sequence[LinearGroup],
                       stats: dict[str, InputStats], alpha: float = SMOOTHQUANT_ALPHA) -> dict[str, torch.Tensor]:
    """Migrate activation outliers into the weights for every group with a ``prev`` op (a GQA o_proj keeps
    its weight), before INT8 per-channel weight quantization and dynamic per-token activations.

    All scales are computed from the original weights and activations, then folded (a linear that is
    both a smoothed layer and a ``prev``, such as up_proj, gets both: its columns times its group's
    scale, its rows over down_proj's).

    Args:
        state: Hugging Face name -> dense tensor; not modified.
        stats: ``{group.module: InputStats}`` with ``abs_max``.

    Returns:
        A new dict with the smoothed tensors (the others shared with ``state``).
    """
    out = dict(state)
    scales = {}
    for g in groups:
        if g.prev is None:
            continue
        st = stats[g.module]
        if st.abs_max is None:
            raise ValueError(f"{g.module}: SmoothQuant needs the abs_max statistic")
        scales[g.module] = smoothquant_scales(st.abs_max, [state[f"{lin}.weight"] for lin in g.linears], alpha)
    for g in groups:
        if g.module in scales:
            fold_input_scales(out, g, scales[g.module])
    return out
