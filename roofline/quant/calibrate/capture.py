"""Activation capture: the inputs of every linear layer, reduced to what a calibration algorithm needs.

The calibration samples run through our own engine (``LLM.score_logprobs``: one sequence as a chunked
prefill through the real model); forward pre-hooks on the fused linear modules see each layer's input
``x`` ``[num_tokens, K]`` and fold it into running statistics. The q/k/v projections share one input (our
``qkv_proj``), gate/up share one (``gate_up_proj``), so each group of Hugging Face linears sharing an input
is captured once (``LinearGroup``).

Every layer's statistics come from the unquantized model in one pass (non-sequential calibration); see
``roofline.quant.calibrate`` for why.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from roofline.config import ModelConfig

# What a capture pass can collect, per input channel j of a group's input x [num_tokens, K]:
#   abs_mean: mean_t |x[t, j]|  (AWQ's activation scale)
#   abs_max:  max_t |x[t, j]|   (SmoothQuant's activation scale)
#   hessian:  H = 2/n * sum_t x[t]^T x[t]  [K, K] (GPTQ; Frantar et al. 2023, eq. 1's second derivative),
#             each row's norm first capped at HESSIAN_ROW_NORM_CAP x the median row norm of its chunk
#             (``cap_row_norms``: massive-activation tokens would otherwise dominate H)
#   rows:     a seeded random subsample of the rows x[t] (AWQ's loss searches)
STAT_KINDS = ("abs_mean", "abs_max", "hessian", "rows")
DEFAULT_MAX_ROWS = 2048
# A row of x may weigh at most this many times the median row's norm in H (so at most its square in x^T x).
# Measured on SmolLM2-135M (bench/gptq_layer_error.py): the first token of each window (the attention sink)
# reaches ~400x the median norm at layer 11's down_proj input and carries 99.7% of tr(H) there, and GPTQ then
# fits that token and loses to RTN on the other ones (the only layer where GPTQ lost on held-out inputs).
HESSIAN_ROW_NORM_CAP = 10.0


def cap_row_norms(x: torch.Tensor, cap: float = HESSIAN_ROW_NORM_CAP) -> torch.Tensor:
    """``x`` [T, K] with every row whose L2 norm exceeds ``cap`` x the median row norm scaled down to that
    norm (direction kept), so that no token dominates ``x^T x``; rows at or under the cap are unchanged.

    Massive activations (Sun et al. 2024, "Massive Activations in Large Language Models"): a few tokens (the
    first of a sequence, some delimiters) carry activations 100-1000x the rest in a few channels. In
    GPTQ's Hessian ``sum_t x_t^T x_t`` such a token outweighs thousands of ordinary ones, and the error
    feedback then spends every other column on it.

    Raises:
        ValueError: ``cap`` <= 0.
    """
    if cap <= 0:
        raise ValueError(f"the row norm cap must be > 0, got {cap}")
    norms = x.norm(dim=1)  # [T]
    limit = cap * norms.median()
    if not bool((norms > limit).any()):
        return x
    return x * torch.where(norms > limit, limit / norms, torch.ones_like(norms))[:, None]


@dataclass(frozen=True)
class LinearGroup:
    """Hugging Face linear layers that multiply the same input, and the op that produces that input.

    Attributes:
        module: our module whose input is captured (``model.layers.0.self_attn.qkv_proj``); ``lm_head``'s
            input is the final norm's output.
        linears: the HF module names (``model.layers.0.self_attn.q_proj``, ...), in shard order; their
            weights ``[N_i, K]`` share the K input channels.
        prev: the HF module name whose weight absorbs an input scaling 1/s exactly (an RMSNorm's weight,
            or the rows of a linear whose output is this input), or None when none does (o_proj under GQA).
        prev_is_norm: True when ``prev`` is an RMSNorm (scale its weight ``[K]``), False for a linear (scale
            the rows of its weight ``[K, K_prev]`` and its bias).
    """

    module: str
    linears: tuple[str, ...]
    prev: str | None
    prev_is_norm: bool = True


def linear_groups(config: ModelConfig, quantize_lm_head: bool = False) -> list[LinearGroup]:
    """The input-sharing groups of a Llama-family model (``roofline.models.llama``), layer by layer:

    - q/k/v after ``input_layernorm``; o_proj after v_proj only without GQA (each o_proj input channel is
      then one v_proj output channel; with GQA one v channel feeds several query heads' channels, so no
      per-channel scale folds into it, and AutoAWQ skips it too);
    - gate/up after ``post_attention_layernorm``; down_proj after up_proj (its input is
      ``silu(gate) * up``, linear in up's rows);
    - with ``quantize_lm_head``, lm_head after the final ``model.norm``.
    """
    groups = []
    no_gqa = config.num_attention_heads == config.num_key_value_heads
    for i in range(config.num_hidden_layers):
        p = f"model.layers.{i}"
        attn, mlp = f"{p}.self_attn", f"{p}.mlp"
        groups += [
            LinearGroup(f"{attn}.qkv_proj", (f"{attn}.q_proj", f"{attn}.k_proj", f"{attn}.v_proj"),
                        f"{p}.input_layernorm"),
            LinearGroup(f"{attn}.o_proj", (f"{attn}.o_proj",), f"{attn}.v_proj" if no_gqa else None, False),
            LinearGroup(f"{mlp}.gate_up_proj", (f"{mlp}.gate_proj", f"{mlp}.up_proj"),
                        f"{p}.post_attention_layernorm"),
            LinearGroup(f"{mlp}.down_proj", (f"{mlp}.down_proj",), f"{mlp}.up_proj", False),
        ]
    if quantize_lm_head:
        groups.append(LinearGroup("lm_head", ("lm_head",), "model.norm"))
    return groups


@dataclass
class InputStats:
    """What a capture pass collected about one group's input ``x`` ``[num_rows, K]`` (float32 on CPU;
    a field is None when the pass did not collect it)."""

    num_rows: int
    abs_mean: torch.Tensor | None = None  # [K]
    abs_max: torch.Tensor | None = None  # [K]
    hessian: torch.Tensor | None = None  # [K, K], 2/n * x^T x, rows norm-capped (cap_row_norms)
    rows: torch.Tensor | None = None  # [min(max_rows, num_rows), K], in token order


class _Accumulator:
    def __init__(self, needs: frozenset[str], keep: torch.Tensor):
        self.needs = needs
        self.keep = keep  # sorted int64 global row indices to keep
        self.num_rows = 0
        self.abs_sum: torch.Tensor | None = None  # float64 [K]
        self.abs_max: torch.Tensor | None = None
        self.xtx: torch.Tensor | None = None  # float32 [K, K]
        self.rows: list[torch.Tensor] = []

    def add(self, x: torch.Tensor) -> None:
        x = x.detach().reshape(-1, x.shape[-1]).to("cpu", torch.float32)  # [T, K]
        t = x.shape[0]
        if "abs_mean" in self.needs or "abs_max" in self.needs:
            a = x.abs()
            if "abs_mean" in self.needs:
                s = a.sum(0, dtype=torch.float64)
                self.abs_sum = s if self.abs_sum is None else self.abs_sum + s
            if "abs_max" in self.needs:
                m = a.amax(0)
                self.abs_max = m if self.abs_max is None else torch.maximum(self.abs_max, m)
        if "hessian" in self.needs:
            xc = cap_row_norms(x)
            g = xc.T @ xc  # [K, K]
            self.xtx = g if self.xtx is None else self.xtx.add_(g)
        if "rows" in self.needs:
            lo, hi = torch.searchsorted(self.keep, torch.tensor([self.num_rows, self.num_rows + t])).tolist()
            if hi > lo:
                self.rows.append(x[self.keep[lo:hi] - self.num_rows].clone())
        self.num_rows += t

    def finish(self) -> InputStats:
        n = self.num_rows
        st = InputStats(num_rows=n)
        if self.abs_sum is not None:
            st.abs_mean = (self.abs_sum / n).float()
        if self.abs_max is not None:
            st.abs_max = self.abs_max.clone()
        if self.xtx is not None:
            st.hessian = self.xtx.mul(2.0 / n)
        if "rows" in self.needs:
            st.rows = torch.cat(self.rows) if self.rows else None
        return st


def capture_input_stats(
    llm: Any, samples: list[list[int]], groups: list[LinearGroup], needs: set[str] | frozenset[str], *,
    max_rows: int = DEFAULT_MAX_ROWS, seed: int = 0, use_tqdm: bool = True,
) -> dict[str, InputStats]:
    """Run ``samples`` through ``llm``'s model and reduce each group's input to the statistics in ``needs``.

    Each sample runs on its own from position 0 (``LLM.score_logprobs``); statistics are over all tokens
    of all samples. ``rows`` keeps the same ``max_rows`` token positions for every group, drawn uniformly
    without replacement (``torch.randperm`` seeded with ``seed``) from all calibration tokens.

    State memory (float32): ``hessian`` is ``4 * K^2`` bytes per group (Llama: ``4 * (3 h^2 + i^2)`` per
    layer, 400 MB for SmolLM2-135M's 30 layers); ``rows`` is ``4 * max_rows * K`` per group (800 MB at the
    default 2048 rows for SmolLM2-135M).

    Args:
        llm: a ``roofline.LLM`` on an unquantized, unsharded model (tensor-parallel size 1).
        samples: token id lists, each 1 <= len <= max_model_len.
        groups: from ``linear_groups``.
        needs: a subset of ``STAT_KINDS``.

    Returns:
        ``{group.module: InputStats}``, float32 on CPU.

    Raises:
        ValueError: an unknown statistic, no samples, max_rows < 1, or a sample the engine rejects.
    """
    needs = frozenset(needs)
    bad = sorted(needs - set(STAT_KINDS))
    if bad:
        raise ValueError(f"unknown statistics {bad}; choose from {list(STAT_KINDS)}")
    if not samples:
        raise ValueError("capture needs at least one calibration sample")
    if max_rows < 1:
        raise ValueError(f"max_rows must be >= 1, got {max_rows}")
    model = llm.engine.worker.model
    total = sum(len(s) for s in samples)
    gen = torch.Generator().manual_seed(seed)
    keep = torch.randperm(total, generator=gen)[:max_rows].sort().values
    accs = {g.module: _Accumulator(needs, keep) for g in groups}
    handles = []
    try:
        for g in groups:
            acc = accs[g.module]
            if g.module == "lm_head":
                # compute_logits is not a forward: take the final norm's output ((x, residual) with a residual).
                def post_hook(_m: Any, _args: Any, out: Any, acc: _Accumulator = acc) -> None:
                    acc.add(out[0] if isinstance(out, tuple) else out)

                handles.append(model.model.norm.register_forward_hook(post_hook))
            else:
                def pre_hook(_m: Any, args: tuple[Any, ...], acc: _Accumulator = acc) -> None:
                    acc.add(args[0])

                handles.append(model.get_submodule(g.module).register_forward_pre_hook(pre_hook))
        progress = None
        if use_tqdm:
            from tqdm.auto import tqdm

            progress = tqdm(total=len(samples), desc="Calibration samples", dynamic_ncols=True)
        try:
            for ids in samples:
                llm.score_logprobs(ids)
                if progress is not None:
                    progress.update(1)
        finally:
            if progress is not None:
                progress.close()
    finally:
        for h in handles:
            h.remove()
    # The hooks ran under inference mode; finish() builds ordinary tensors from the accumulators.
    return {name: acc.finish() for name, acc in accs.items()}


def hessian_bytes(config: ModelConfig, quantize_lm_head: bool = False) -> int:
    """Bytes of float32 Hessians a GPTQ capture holds at once (all layers: non-sequential)."""
    h, i = config.hidden_size, config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    per_layer = 2 * h * h + q * q + i * i
    return 4 * (config.num_hidden_layers * per_layer + (h * h if quantize_lm_head else 0))
