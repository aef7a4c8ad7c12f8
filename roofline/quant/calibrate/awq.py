"""AWQ (Lin et al. 2024, "AWQ: Activation-aware Weight Quantization for LLM Compression and Acceleration",
MLSys): protect the weights that meet large activations by scaling their input channels up before
round-to-nearest INT4, folding the inverse scale into the preceding op; then shrink each group's range
where clipping lowers the output error.

Two searches, as AutoAWQ (``awq/quantize/quantizer.py``) runs them, written here on tensors:

1. Scale (``search_awq_scale``, paper sec. 3.2): ``s = mean|x|^alpha``, normalized by
   ``sqrt(max(s) * min(s))``, with alpha on a grid of 20 points ``0, 0.05, ..., 0.95``, minimizing the
   output MSE of the group's quantized linears ``|| x W^T - (x / s) Q(W * s)^T ||^2`` on captured input rows.
   alpha = 0 is plain RTN, so the chosen scale never does worse than RTN on those rows. AutoAWQ measures the
   error at the output of the whole attention / MLP block for q/k/v and gate/up; we measure it at the
   group's own linear outputs (our capture is non-sequential and holds linear inputs only).
2. Clip (``search_awq_clip``, AutoAWQ's ``_search_best_clip``): for each output channel and group, the max
   value ``max|w| * (1 - i/20)``, i in 0..9, whose clamped-then-quantized group gives the smallest MSE of
   that group's partial dot products over (up to) 512 captured tokens. q_proj and k_proj are not clipped
   (their outputs meet in the q.k product, where per-channel errors do not average out; AutoAWQ skips them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from roofline.quant.calibrate.capture import InputStats, LinearGroup
from roofline.quant.calibrate.smooth import fold_input_scales
from roofline.quant.quantize import INT4_MAX, check_group_size, int4_params

AWQ_GRID = 20  # alpha grid points (AutoAWQ's n_grid)
CLIP_GRID = 20  # clip shrink steps of 1/20 (AutoAWQ)
CLIP_MAX_SHRINK = 0.5  # shrink the range by at most half (AutoAWQ)
CLIP_MAX_TOKENS = 512  # tokens the clip search uses (AutoAWQ's n_sample_token)
NO_CLIP = ("q_proj", "k_proj")  # AutoAWQ's avoid_clipping for Llama
_MIN_SCALE = 1e-4  # AutoAWQ's clamp on mean|x|^alpha


def fake_quant_int4(w: torch.Tensor, group_size: int) -> torch.Tensor:
    """``w`` ``[N, K]`` rounded to INT4 RTN and back (float32): what the searches score. Bit-identical to
    ``quantize_int4_rtn(w, group_size).dequantize()`` (the same float ops), with the per-group parameters
    broadcast over ``[N, K // gs, gs]`` instead of gathered per column (several times faster on CPU)."""
    n, k = w.shape
    scales, zeros = int4_params(w, group_size)  # [N, ng]
    s, z = scales[..., None], zeros[..., None]
    q = torch.round(w.float().reshape(n, k // group_size, group_size) / s + z).clamp_(0, INT4_MAX)
    return ((q - z) * s).reshape(n, k)


def awq_scale(x_abs_mean: torch.Tensor, alpha: float) -> torch.Tensor:
    """``s = max(mean|x|, ...)^alpha`` clamped to >= 1e-4, divided by ``sqrt(max(s) * min(s))`` (AutoAWQ's
    normalization, so the scales straddle 1); float32 ``[K]``."""
    s = x_abs_mean.float().pow(alpha).clamp(min=_MIN_SCALE)
    s = s / (s.max() * s.min()).sqrt()
    return torch.where(torch.isfinite(s), s, torch.ones_like(s))


def _output_mse(dw: torch.Tensor, x: torch.Tensor, gram: torch.Tensor | None) -> float:
    """mean over ``[M, N]`` of ``(x dw^T)^2``; through ``gram = x^T x`` when that is cheaper (K < M)."""
    m, n = x.shape[0], dw.shape[0]
    if gram is not None:
        return float(((dw @ gram) * dw).sum()) / (m * n)
    return float((x @ dw.T).pow(2).mean())


def search_awq_scale(
    weight: torch.Tensor, x: torch.Tensor, x_abs_mean: torch.Tensor, group_size: int, *,
    alpha: float | None = None, n_grid: int = AWQ_GRID,
) -> tuple[torch.Tensor, float, list[float]]:
    """AWQ's per-input-channel scale search for linears sharing one input (Lin et al. 2024, sec. 3.2).

    Args:
        weight: ``[N, K]``, the group's weights concatenated along N (q/k/v, or gate/up).
        x: ``[M, K]`` captured input rows (the loss's data).
        x_abs_mean: ``[K]``, mean |x| per channel over all calibration tokens.
        group_size: INT4 group size; must divide K.
        alpha: a fixed exponent in [0, 1] instead of the grid search.

    Returns:
        (s float32 ``[K]``, the chosen alpha, the output MSE at each grid point tried, in grid order).
        Quantize ``W * s`` and divide the input by ``s``.

    Raises:
        ValueError: ``group_size`` does not divide K, alpha outside [0, 1], or shapes that disagree.
    """
    n, k = weight.shape
    check_group_size(k, group_size)
    if x.shape[1] != k or x_abs_mean.shape != (k,):
        raise ValueError(f"x {tuple(x.shape)} / x_abs_mean {tuple(x_abs_mean.shape)} do not match K={k}")
    if alpha is not None and not 0.0 <= alpha <= 1.0:
        raise ValueError(f"AWQ alpha must be in [0, 1], got {alpha}")
    w = weight.float()
    x = x.float()
    gram = x.T @ x if k < x.shape[0] else None  # [K, K]
    alphas = [alpha] if alpha is not None else [i / n_grid for i in range(n_grid)]
    best = (math.inf, 0.0, torch.ones(k))
    losses = []
    for a in alphas:
        s = awq_scale(x_abs_mean, a)
        dw = w - fake_quant_int4(w * s[None, :], group_size) / s[None, :]  # [N, K]
        loss = _output_mse(dw, x, gram)
        losses.append(loss)
        if loss < best[0]:
            best = (loss, a, s)
    return best[2], best[1], losses


def search_awq_clip(
    weight: torch.Tensor, x: torch.Tensor, group_size: int, *, n_grid: int = CLIP_GRID,
    max_shrink: float = CLIP_MAX_SHRINK, max_tokens: int = CLIP_MAX_TOKENS, row_batch: int = 1024,
) -> torch.Tensor:
    """AWQ's clipping search (AutoAWQ ``_compute_best_clip``): per output channel and group, the max value
    ``max|w_group| * (1 - i / n_grid)``, ``i < max_shrink * n_grid``, minimizing the mean over tokens of the
    squared error of the group's partial dot product ``x_group . w_group`` after clamp + RTN.

    Args:
        weight: ``[N, K]`` (already scaled by AWQ's s).
        x: ``[M, K]`` input rows (already divided by s); every ``ceil(M / max_tokens)``-th row is used.

    Returns:
        float32 ``[N, K // group_size]``: clamp each group to ``[-max_val, max_val]`` (``clip_weight``).

    Raises:
        ValueError: ``group_size`` does not divide K.
    """
    n, k = weight.shape
    check_group_size(k, group_size)
    ng = k // group_size
    step = max(1, -(-x.shape[0] // max_tokens))
    xg = x[::step].float().reshape(-1, ng, group_size).transpose(0, 1)  # [ng, T, gs]
    # mean_t (x_g . d)^2 = d^T G_g d with G_g = x_g^T x_g / T: gs/T of the work of forming the products.
    gram = torch.bmm(xg.transpose(1, 2), xg) / xg.shape[1]  # [ng, gs, gs]
    out = []
    for r0 in range(0, n, row_batch):
        wg = weight[r0:r0 + row_batch].float().reshape(-1, ng, group_size)  # [n_b, ng, gs]
        nb = wg.shape[0]
        org_max = wg.abs().amax(-1)  # [n_b, ng]
        best_err = torch.full((nb, ng), math.inf)
        best_max = org_max.clone()
        for i in range(int(max_shrink * n_grid)):
            max_val = org_max * (1 - i / n_grid)  # [n_b, ng]
            cur = torch.clamp(wg, -max_val[..., None], max_val[..., None]).reshape(nb, k)
            d = (fake_quant_int4(cur, group_size).reshape(nb, ng, group_size) - wg).transpose(0, 1)  # [ng, n_b, gs]
            err = (torch.bmm(d, gram) * d).sum(-1).T  # [n_b, ng]
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_max = torch.where(better, max_val, best_max)
        out.append(best_max)
    return torch.cat(out)


def clip_weight(weight: torch.Tensor, max_val: torch.Tensor, group_size: int) -> torch.Tensor:
    """``weight`` ``[N, K]`` with each group clamped to ``[-max_val, max_val]`` (``max_val`` ``[N, K // gs]``)."""
    n, k = weight.shape
    m = max_val.to(weight.dtype)[..., None]
    return torch.clamp(weight.reshape(n, k // group_size, group_size), -m, m).reshape(n, k)


def awq_smooth(
    state: dict[str, torch.Tensor], groups: Sequence[LinearGroup], stats: dict[str, InputStats],
    group_size: int, *, alpha: float | None = None, clip: bool = True, n_grid: int = AWQ_GRID,
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """AWQ on a whole model's dense Hugging Face state dict: search every group's scale on the original
    weights, fold them all (``fold_input_scales``), then search and apply the clipping on the scaled weights
    with the scaled inputs (AutoAWQ's order). The result is quantized with plain RTN.

    A group with no ``prev`` (o_proj under GQA) keeps s = 1 and is only clipped.

    Args:
        state: Hugging Face name -> dense tensor; not modified.
        stats: ``{group.module: InputStats}`` with ``abs_mean`` and ``rows``.
        alpha: a fixed alpha instead of the grid search.
        clip: run the clipping search (off: the weights stay the exact rescaled model).

    Returns:
        (a new state dict, ``{group.module: chosen alpha}`` for the scaled groups).
    """
    out = dict(state)
    scales: dict[str, torch.Tensor] = {}
    alphas: dict[str, float] = {}
    for g in groups:
        if g.prev is None:
            continue
        st = stats[g.module]
        if st.rows is None or st.abs_mean is None:
            raise ValueError(f"{g.module}: AWQ needs the abs_mean and rows statistics")
        w = torch.cat([state[f"{lin}.weight"].float() for lin in g.linears])
        scales[g.module], alphas[g.module], _ = search_awq_scale(w, st.rows, st.abs_mean, group_size,
                                                                 alpha=alpha, n_grid=n_grid)
    for g in groups:
        if g.module in scales:
            fold_input_scales(out, g, scales[g.module])
    if clip:
        for g in groups:
            rows = stats[g.module].rows
            assert rows is not None
            x = rows / scales[g.module][None, :] if g.module in scales else rows
            for lin in g.linears:
                if lin.rsplit(".", 1)[-1] in NO_CLIP:
                    continue
                w = out[f"{lin}.weight"]
                max_val = search_awq_clip(w, x, group_size)
                out[f"{lin}.weight"] = clip_weight(w.float(), max_val, group_size).to(w.dtype)
    return out, alphas
