"""Offline calibration for ``roofline quantize``: RTN, AWQ and GPTQ for INT4 weight-only, SmoothQuant for
INT8 W8A8, on our own model, producing canonical quantized weights (``roofline.quant.quantize``) under
Hugging Face tensor names, for ``roofline.quant.formats`` to pack.

- ``data``: calibration text (ShareGPT, disjoint from the eval's held-out slice);
- ``capture``: linear-layer input statistics from forward pre-hooks on our engine's model;
- ``awq``, ``gptq``, ``smooth``: the algorithms, pure functions on tensors;
- ``calibrate_model``: the driver.

Calibration is non-sequential: one pass of the unquantized model gives every layer's statistics, and
each layer is then quantized from its own inputs. The GPTQ paper (and AutoGPTQ) calibrate sequentially,
feeding layer i+1 the outputs of the already quantized layers 0..i, so later layers see (and partly
compensate) earlier errors; we trade that for one forward pass through the real engine (no layer-by-layer
model surgery) with the inputs every method agrees on. AutoAWQ is effectively non-sequential already: it
computes layer i+1's inputs from layer i before quantizing it, and its scaling is an exact identity. The
cost is memory: every layer's statistics at once (``capture.capture_input_stats`` gives the figures).
"""

from __future__ import annotations

from typing import Any

import torch

from roofline.quant.calibrate.awq import awq_smooth
from roofline.quant.calibrate.capture import (
    DEFAULT_MAX_ROWS,
    InputStats,
    LinearGroup,
    capture_input_stats,
    linear_groups,
)
from roofline.quant.calibrate.data import calibration_samples
from roofline.quant.calibrate.gptq import gptq_quantize, split_rows
from roofline.quant.calibrate.smooth import SMOOTHQUANT_ALPHA, smoothquant_smooth
from roofline.quant.quantize import (
    ChannelWeight,
    Int4Weight,
    check_group_size,
    quantize_int4_rtn,
    quantize_int8_per_channel,
)

METHODS = ("rtn", "awq", "gptq", "smoothquant")
# The statistics each method's capture pass collects (``capture.STAT_KINDS``).
_NEEDS = {"rtn": frozenset(), "awq": frozenset({"abs_mean", "rows"}), "gptq": frozenset({"hessian"}),
          "smoothquant": frozenset({"abs_max"})}

QuantizedTensor = torch.Tensor | Int4Weight | ChannelWeight

__all__ = ["METHODS", "InputStats", "LinearGroup", "calibrate_model", "calibration_samples",
           "capture_input_stats", "dense_state_dict", "linear_groups"]


def dense_state_dict(llm: Any, quantize_lm_head: bool = False) -> dict[str, torch.Tensor]:
    """The model's Hugging Face-named dense tensors (``roofline.models.export.hf_state_dict``); with
    ``quantize_lm_head`` and tied embeddings, ``lm_head.weight`` is added as a copy of the embedding so the
    head can be quantized (and smoothed) on its own while the embedding stays exact."""
    from roofline.models.export import hf_state_dict

    config = llm.engine.model_config
    state = hf_state_dict(llm.engine.worker.model, config)
    if quantize_lm_head and "lm_head.weight" not in state:
        state["lm_head.weight"] = state["model.embed_tokens.weight"].clone()
    return state


def calibrate_model(
    llm: Any, method: str, *, group_size: int = 128, num_samples: int = 128, seq_len: int = 512,
    alpha: float | None = None, desc_act: bool = False, quantize_lm_head: bool = False, seed: int = 0,
    samples: list[list[int]] | None = None, max_rows: int = DEFAULT_MAX_ROWS, use_tqdm: bool = True,
) -> dict[str, QuantizedTensor]:
    """Quantize ``llm``'s whole model with one calibration method.

    Methods:
        - ``rtn``: INT4 round-to-nearest per group (no data).
        - ``awq``: INT4, AWQ scales folded into the preceding ops, clipping, then RTN (``awq``).
        - ``gptq``: INT4 GPTQ with error feedback; ``desc_act`` adds act-order and ``g_idx`` (``gptq``).
        - ``smoothquant``: SmoothQuant scales folded in, then INT8 per output channel (``smooth``); the
          activations are quantized per token at runtime.

    Args:
        llm: a ``roofline.LLM`` with unquantized weights, tensor-parallel size 1 (fp32 on CPU is the
            intended setting; the capture runs whatever dtype/device the engine has and reduces in fp32).
        group_size: INT4 input channels per group (rtn/awq/gptq); must divide every quantized layer's K.
        num_samples, seq_len: calibration windows (``data.calibration_samples``), unless ``samples``.
        alpha: SmoothQuant's migration strength (default 0.5), or AWQ's exponent fixed instead of searched;
            in [0, 1]. Not for rtn/gptq.
        desc_act: GPTQ act-order.
        quantize_lm_head: also quantize ``lm_head`` (its input stats come from the final norm; with tied
            embeddings the result carries a separate ``lm_head.weight`` and the embedding stays dense).
        seed: the row subsample of the capture (AWQ).
        samples: token-id windows to calibrate on instead of ShareGPT (each <= max_model_len).
        max_rows: input rows kept per layer for AWQ's searches.

    Returns:
        Hugging Face name -> tensor for the whole model: each quantized linear's ``...q_proj.weight`` etc.
        as ``Int4Weight`` (rtn/awq/gptq) or ``ChannelWeight`` (smoothquant); every other tensor
        (embeddings, norms with scales folded in, biases, lm_head unless quantized) dense, in the model's
        dtype, on CPU. With tied embeddings there is no ``lm_head.weight`` unless it is quantized.

    Raises:
        ValueError: an unknown method (lists the choices), a group size that does not divide a layer's K
            (names the layer, K and the group size), alpha outside [0, 1] or given to rtn/gptq, desc_act
            without gptq, bad num_samples/seq_len, or a model without a tokenizer and no ``samples``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown calibration method {method!r}; choose one of {', '.join(METHODS)}")
    if alpha is not None:
        if method not in ("awq", "smoothquant"):
            raise ValueError(f"alpha (--alpha) applies to awq and smoothquant, not {method}")
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha (--alpha) must be in [0, 1], got {alpha}")
    if desc_act and method != "gptq":
        raise ValueError(f"desc_act (act-order) applies to gptq, not {method}")
    config = llm.engine.model_config
    groups = linear_groups(config, quantize_lm_head)
    state = dense_state_dict(llm, quantize_lm_head)
    if method != "smoothquant":
        for g in groups:
            for lin in g.linears:
                check_group_size(state[f"{lin}.weight"].shape[1], group_size, lin)

    stats: dict[str, InputStats] = {}
    if _NEEDS[method]:
        if samples is None:
            if llm.tokenizer is None:
                raise ValueError("calibration needs a tokenizer for the ShareGPT samples, or pass samples=")
            samples = calibration_samples(llm.tokenizer, num_samples, seq_len)
        stats = capture_input_stats(llm, samples, groups, _NEEDS[method], max_rows=max_rows, seed=seed,
                                    use_tqdm=use_tqdm)

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
