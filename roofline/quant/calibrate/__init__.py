"""Offline calibration for ``roofline quantize``: RTN, AWQ and GPTQ for INT4 weight-only, SmoothQuant for
INT8 W8A8, producing canonical quantized weights (``roofline.quant.quantize``) under Hugging Face tensor
names, for ``roofline.quant.formats`` to pack.

- ``capture``: linear-layer input statistics from forward pre-hooks on an engine's model;
- ``awq``, ``gptq``, ``smooth``: the algorithms, pure functions on tensors;
- ``quantize_state``: one method applied to a whole model's state dict, given the captured statistics.

The driver that runs a model over calibration text (``roofline.calibration.calibrate_model``) and the text
itself (ShareGPT, disjoint from the eval's held-out slice) live above this package: ``quant/`` imports
neither the engine's ``LLM`` nor ``bench/`` or ``eval/``.

Calibration is non-sequential: one pass of the unquantized model gives every layer's statistics, and
each layer is then quantized from its own inputs. The GPTQ paper (and AutoGPTQ) calibrate sequentially,
feeding layer i+1 the outputs of the already quantized layers 0..i, so later layers see (and partly
compensate) earlier errors; we trade that for one forward pass through the real engine (no layer-by-layer
model surgery) with the inputs every method agrees on. AutoAWQ is effectively non-sequential already: it
computes layer i+1's inputs from layer i before quantizing it, and its scaling is an exact identity. The
cost is memory: every layer's statistics at once (``capture.capture_input_stats`` gives the figures).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from roofline.quant.calibrate.awq import awq_smooth
from roofline.quant.calibrate.capture import (
    DEFAULT_MAX_ROWS,
    InputStats,
    LinearGroup,
    capture_input_stats,
    linear_groups,
)
from roofline.quant.calibrate.gptq import gptq_quantize, split_rows
from roofline.quant.calibrate.smooth import SMOOTHQUANT_ALPHA, smoothquant_smooth
from roofline.quant.quantize import (
    ChannelWeight,
    Int4Weight,
    quantize_int4_rtn,
    quantize_int8_per_channel,
)

METHODS = ("rtn", "awq", "gptq", "smoothquant")
# The statistics each method's capture pass collects (``capture.STAT_KINDS``).
NEEDS = {"rtn": frozenset(), "awq": frozenset({"abs_mean", "rows"}), "gptq": frozenset({"hessian"}),
         "smoothquant": frozenset({"abs_max"})}

QuantizedTensor = torch.Tensor | Int4Weight | ChannelWeight

__all__ = ["DEFAULT_MAX_ROWS", "METHODS", "NEEDS", "InputStats", "LinearGroup", "capture_input_stats",
           "check_calibration_args", "linear_groups", "quantize_state"]


def check_calibration_args(method: str, alpha: float | None = None, desc_act: bool = False) -> None:
    """Raises ValueError for an unknown method (lists the choices), alpha outside [0, 1] or given to rtn/gptq,
    or desc_act without gptq."""
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}; choose one of {', '.join(METHODS)}")
    if alpha is not None:
        if method not in ("awq", "smoothquant"):
            raise ValueError(f"alpha (--alpha) applies to awq and smoothquant, not {method}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha (--alpha) must be in [0, 1], got {alpha}")
    if desc_act and method != "gptq":
        raise ValueError(f"desc_act (act-order) applies to gptq, not {method}")


def quantize_state(
    state: dict[str, torch.Tensor], groups: Sequence[LinearGroup], stats: dict[str, InputStats], method: str, *,
    group_size: int = 128, alpha: float | None = None, desc_act: bool = False,
) -> dict[str, QuantizedTensor]:
    """Quantize a whole model's dense state with one calibration method (``roofline.calibration.calibrate_model``
    gathers ``state`` and ``stats``; see it for the methods and the result).

    Args:
        state: Hugging Face name -> dense tensor; not modified.
        groups: from ``linear_groups``.
        stats: ``{group.module: InputStats}`` with the statistics ``NEEDS[method]`` names ({} for rtn).
        group_size, alpha, desc_act: as ``calibrate_model``'s (checked by ``check_calibration_args``).

    Returns:
        Hugging Face name -> ``Int4Weight`` / ``ChannelWeight`` for each quantized linear, every other tensor
        dense (norms with scales folded in).
    """
    out: dict[str, QuantizedTensor] = {}
    if method == "gptq":
        for g in groups:
            hessian = stats[g.module].hessian
            assert hessian is not None
            ws = [state[f"{lin}.weight"] for lin in g.linears]
            qw = gptq_quantize(torch.cat(ws).float(), hessian, group_size, desc_act=desc_act, name=g.module)
            for lin, part in zip(g.linears, split_rows(qw, [w.shape[0] for w in ws]), strict=True):
                out[f"{lin}.weight"] = part
    else:
        if method == "awq":
            state, _ = awq_smooth(state, groups, stats, group_size, alpha=alpha)
        elif method == "smoothquant":
            state = smoothquant_smooth(state, groups, stats, SMOOTHQUANT_ALPHA if alpha is None else alpha)
        for g in groups:
            for lin in g.linears:
                w = state[f"{lin}.weight"].float()
                out[f"{lin}.weight"] = (quantize_int8_per_channel(w) if method == "smoothquant"
                                        else quantize_int4_rtn(w, group_size, lin))
    for name, t in state.items():
        out.setdefault(name, t)
    return out
