"""GPTQ (Frantar et al. 2023, "GPTQ: Accurate Post-Training Quantization for Generative Pre-trained
Transformers", ICLR): quantize a weight column by column, each column's rounding error fed back into the
columns not yet quantized through the inverse Hessian of the layer's squared output error,
``H = 2/n * sum_t x_t^T x_t``.

As in the reference implementation (IST-DASLab/gptq ``gptq.py``, AutoGPTQ ``quantization/gptq.py``):
- dead inputs (``H_jj = 0``) get ``H_jj = 1`` and a zero weight column;
- damping adds ``damp_percent * mean(diag(H))`` to the diagonal (the reference's ``percdamp``, but 1.0 here
  where the reference uses 0.01: see below);
- the error feedback uses the upper Cholesky factor ``U`` of ``H^-1`` (``H^-1 = U^T U``; paper sec. 3,
  "Cholesky reformulation"): after column j, ``W[:, j+1:] -= (w_j - q_j) / U_jj * U[j, j+1:]``;
- lazy batch updates (paper sec. 3, "Lazy batch-updates"): the feedback runs inside blocks of 128 columns,
  and the rest of the matrix is updated once per block;
- a group's min/max scale and zero are computed when the loop enters the group, from the columns as the
  error feedback has left them (the reference reads the block-start copy of the weights there; here a
  block always holds whole groups, so the current values are at hand);
- act-order (``desc_act``): columns in decreasing ``diag(H)`` order, groups formed in that order, and
  ``g_idx[k]`` = the group of input channel k (GPTQ's ``g_idx``, which checkpoint formats store).

Unlike the reference, the captured H (``capture.capture_input_stats``) caps each token's row norm at
``capture.HESSIAN_ROW_NORM_CAP`` x the median of its chunk before summing ``x^T x``. Without it, the
first token of every calibration window (the attention sink, whose massive activations reach ~400x the
median norm in a few channels) made up 99.7% of tr(H) at SmolLM2-135M's layer-11 down_proj; GPTQ then fit
that token and lost to RTN on the other tokens there (held-out relative output error 9.7e-3 vs RTN's 7.8e-3;
6.8e-3 with the cap; ``bench/gptq_layer_error.py``, ``tests/quant/test_calibrate.py``). It was the one layer of
120 where GPTQ lost on held-out inputs; the cap alone does not move the model's perplexity (measured).

Why ``damp_percent`` is 1.0: with the reference's 0.01, GPTQ beat RTN on its own objective in all 120 layer groups
of SmolLM2-135M (by 2-5x) and on held-out inputs of the unquantized model in 118, yet the quantized model's
perplexity was worse than RTN's (CPU fp32, 8 x 512 calibration tokens, 2,046 held-out tokens, group 64: 9.78 vs
9.28; the H200 table: +32.9% vs +27.8% with 128 x 512). The error feedback moves weights along directions the
calibration inputs barely excite (H's small eigenvalues, where a small sample is also least reliable); the
inputs a layer meets in the quantized model (upstream errors) and on other text do excite them. Damping
``lambda = damp_percent * mean(diag(H))`` bounds those moves: 0.1 did not help at group 64 (9.81), 1.0 gave 9.10
vs RTN's 9.28 at group 64 and 8.81 vs 9.18 at group 32 (``bench/gptq_variants.py``). Hessians from the
quantized model's own inputs (GPTQ's sequential order, ``calibrate_model(sequential=True)``) helped at 0.01
(9.60) but did not reach RTN alone.
"""

from __future__ import annotations

import torch

from roofline.quant.quantize import INT4_MAX, Int4Weight, check_group_size, int4_params

GPTQ_DAMP_PERCENT = 1.0  # fraction of mean(diag(H)) added to the diagonal (the reference's percdamp is 0.01)
GPTQ_BLOCK_SIZE = 128  # the reference's lazy-batch block size


def _inverse_hessian_cholesky(h: torch.Tensor, damp_percent: float) -> torch.Tensor:
    """Upper Cholesky factor of ``(H + damp * I)^-1`` in float32, computed in float64. If the damped H is
    not positive definite (numerically), the damping is raised tenfold, up to three times."""
    k = h.shape[0]
    h = h.double()
    damp = damp_percent * h.diagonal().mean()
    for _ in range(4):
        hd = h + damp * torch.eye(k, dtype=h.dtype)
        lower, info = torch.linalg.cholesky_ex(hd)
        if int(info) == 0:
            inv = torch.cholesky_inverse(lower)
            return torch.linalg.cholesky(inv, upper=True).float()
        damp = damp * 10
    raise ValueError(f"the Hessian is not positive definite even with damping {damp / 10:.3g}")


def gptq_quantize(
    weight: torch.Tensor, hessian: torch.Tensor, group_size: int = 128, *,
    damp_percent: float = GPTQ_DAMP_PERCENT, block_size: int = GPTQ_BLOCK_SIZE, desc_act: bool = False,
    name: str = "layer",
) -> Int4Weight:
    """GPTQ INT4, asymmetric, in groups of ``group_size`` input channels.

    Args:
        weight: ``[N, K]`` (Hugging Face orientation); rows are independent, so linears sharing an input
            (q/k/v) may be quantized together and split by rows afterwards.
        hessian: ``[K, K]``, ``2/n * sum x^T x`` over calibration inputs (``capture_input_stats``, whose rows
            are norm-capped; any positive semi-definite H works).
        group_size: input channels per scale/zero group; must divide K.
        damp_percent: diagonal damping as a fraction of ``mean(diag(H))``, > 0.
        block_size: columns per lazy batch; rounded to a multiple of ``group_size`` (so a block holds
            whole groups).
        desc_act: act-order: quantize columns by decreasing ``diag(H)``; the result carries ``g_idx``.

    Returns:
        ``Int4Weight`` ``[N, K]``: codes, float32 scales and zeros ``[N, K // group_size]`` (group g =
        the g-th group the loop entered), and ``g_idx`` int32 ``[K]`` with desc_act (else None: ``k // gs``).

    Raises:
        ValueError: ``group_size`` does not divide K (names ``name``, K and the group size), a Hessian of
            the wrong shape, ``damp_percent`` <= 0, ``block_size`` < 1, or a Hessian that damping cannot make
            positive definite.
    """
    n, k = weight.shape
    check_group_size(k, group_size, name)
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"{name}: Hessian is {tuple(hessian.shape)}, expected ({k}, {k})")
    if damp_percent <= 0:
        raise ValueError(f"damp_percent must be > 0, got {damp_percent}")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    block = max(group_size, block_size - block_size % group_size)
    w = weight.float().clone()
    h = hessian.float().clone()
    dead = h.diagonal() == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    perm = None
    if desc_act:
        perm = torch.argsort(h.diagonal(), descending=True, stable=True)
        w = w[:, perm]
        h = h[perm][:, perm]
    u = _inverse_hessian_cholesky(h, damp_percent)  # [K, K] upper

    q = torch.zeros(n, k, dtype=torch.uint8)
    num_groups = k // group_size
    scales = torch.empty(n, num_groups)
    zeros = torch.empty(n, num_groups)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        w1 = w[:, b0:b1].clone()  # [N, B], updated in place by the in-block feedback
        err1 = torch.zeros_like(w1)
        u1 = u[b0:b1, b0:b1]
        for i in range(b1 - b0):
            col = b0 + i
            if col % group_size == 0:
                g = col // group_size
                sc, zr = int4_params(w1[:, i:i + group_size], group_size, name)  # [N, 1] each
                scales[:, g], zeros[:, g] = sc[:, 0], zr[:, 0]
                s, z = sc[:, 0], zr[:, 0]
            c = w1[:, i]
            code = torch.round(c / s + z).clamp(0, INT4_MAX)
            q[:, col] = code.to(torch.uint8)
            e = (c - (code - z) * s) / u1[i, i]  # [N]
            w1[:, i:].addr_(e, u1[i, i:], alpha=-1.0)  # rank-1 feedback, in place
            err1[:, i] = e
        w[:, b1:] -= err1 @ u[b0:b1, b1:]  # the lazy update of the columns after this block

    g_idx = None
    if perm is not None:
        inv = torch.argsort(perm)
        q = q[:, inv]
        g_idx = (inv // group_size).to(torch.int32)  # channel k sat at position inv[k] of the loop
    return Int4Weight(q.contiguous(), scales.contiguous(), zeros.to(torch.uint8).contiguous(), group_size, g_idx)


def split_rows(weight: Int4Weight, sizes: list[int]) -> list[Int4Weight]:
    """An ``Int4Weight`` of stacked linears (q/k/v) split back by output rows (``sizes`` sum to N)."""
    if sum(sizes) != weight.q.shape[0]:
        raise ValueError(f"row sizes {sizes} do not sum to N={weight.q.shape[0]}")
    out, start = [], 0
    for size in sizes:
        rows = slice(start, start + size)
        out.append(Int4Weight(weight.q[rows].contiguous(), weight.scales[rows].contiguous(),
                              weight.zeros[rows].contiguous(), weight.group_size,
                              None if weight.g_idx is None else weight.g_idx.clone()))
        start += size
    return out
