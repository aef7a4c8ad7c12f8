"""``--quantization int4`` (and GPTQ / AWQ checkpoints): INT4 weights, 16-bit activations (W4A16).

Asymmetric with zero points, in groups of ``group_size`` input channels (128 by default; 32 and 64 allowed):
``W[n, k] ~= (q[n, k] - z[n, g]) * s[n, g]`` with ``g = k // group_size`` (GPTQ act-order: ``g = g_idx[k]``,
handled here by permuting the input channels once at load so that groups are contiguous, and the
activations' columns by the same permutation at run time, as exllama does). The weights come from
round-to-nearest at load (``--quantization int4``) or from a calibrated checkpoint (``roofline quantize
--method awq|gptq``, or any AutoAWQ/GPTQ checkpoint).

Where the matmul runs: see ``roofline.quant.gemm.w4a16``.
"""

from __future__ import annotations

import torch
from torch import nn

from roofline.quant.base import (
    FormatQuantConfig,
    QuantConfig,
    QuantizedLinearMethod,
    checkpoint_only,
    register_frozen,
)
from roofline.quant.quantize import Int4Weight, quantize_int4_rtn

INT4_GROUP_SIZES = (32, 64, 128)


def contiguous_groups(w: Int4Weight, name: str = "layer") -> tuple[Int4Weight, torch.Tensor | None]:
    """An act-order weight (``g_idx``) with its input channels permuted so groups are contiguous.

    Returns:
        (the permuted weight with ``g_idx`` None, the int64 [K] permutation ``perm`` such that
        ``x[:, perm] @ W_perm.T == x @ W.T``), or (``w``, None) when ``g_idx`` is already ``k // group_size``.

    Raises:
        ValueError: a group that does not hold exactly ``group_size`` channels (not a GPTQ assignment).
    """
    k = w.q.shape[1]
    if w.g_idx is None:
        return w, None
    g = w.g_idx.long()
    if torch.equal(g, torch.arange(k, device=g.device) // w.group_size):
        return Int4Weight(w.q, w.scales, w.zeros, w.group_size), None
    groups = k // w.group_size
    if bool((g < 0).any()) or bool((g >= groups).any()):
        raise ValueError(f"{name}.g_idx: group ids must lie in [0, {groups}) (K={k}, group_size={w.group_size}), got "
                         f"[{int(g.min())}, {int(g.max())}]")
    counts = torch.bincount(g, minlength=groups)
    bad = (counts != w.group_size).nonzero().flatten()
    if bad.numel():
        j = int(bad[0])
        raise ValueError(f"{name}.g_idx assigns {int(counts[j])} input channels to group {j} ({bad.numel()} groups "
                         f"are off); every group needs exactly group_size={w.group_size}")
    perm = torch.sort(g, stable=True).indices
    return Int4Weight(w.q[:, perm].contiguous(), w.scales, w.zeros, w.group_size), perm


class Int4LinearMethod(QuantizedLinearMethod):
    """W4A16 with per-group scales and zero points.

    What ``apply`` reads depends on the device (built once by ``set_weights``):
    - CPU: torch's int4 weight-packed layout (``qweight`` from ``_convert_weight_to_int4pack_for_cpu``) and
      ``scales_and_zeros`` float32 [K / G, N, 2] holding ``s`` and ``(8 - z) * s`` (its kernel computes
      ``(q - 8) * s + zf``, which equals ``(q - z) * s``);
    - GPU: the Triton kernel's layout (``roofline.kernels.quant_gemm``).
    ``input_perm`` (int64 [K]) is present only for act-order checkpoints.
    """

    def __init__(self, group_size: int, checkpoint=None):
        super().__init__(checkpoint)
        self.group_size = group_size

    @property
    def layout(self) -> str:
        return self.checkpoint.format  # "gptq" or "awq"

    def quantize(self, weight: torch.Tensor, layer: nn.Module) -> Int4Weight:
        return quantize_int4_rtn(weight, self.group_size, getattr(layer, "prefix", "layer") or "layer")

    def set_weights(self, layer: nn.Module, canonical: Int4Weight) -> None:
        from roofline.kernels import linear_dispatch as gemm

        w, perm = contiguous_groups(canonical, getattr(layer, "prefix", "") or "layer")
        if perm is not None:
            register_frozen(layer, "input_perm", perm.to(w.q.device))
        layer.int4_group_size = w.group_size
        prepared = gemm.prepare_w4a16(w, layer.params_dtype)
        for name, tensor in prepared.items():
            register_frozen(layer, name, tensor)
        if w.q.device.type == "cuda":  # decode-sized M on tensor cores: a second layout, read instead of qweight
            for name, tensor in gemm.prepare_w4a16_mma(prepared["qweight"], w.group_size, layer.params_dtype).items():
                layer.register_buffer(name, tensor, persistent=False)
        if w.q.device.type == "cpu":
            for name, tensor in gemm.prepare_w4a16_cpu_prefill(w).items():
                layer.register_buffer(name, tensor, persistent=False)

    def apply(self, layer, x, bias=None):
        from roofline.kernels import linear_dispatch as gemm

        perm = getattr(layer, "input_perm", None)
        if perm is not None:
            x = x.index_select(-1, perm)
        return gemm.w4a16(x, layer, bias)


def int4_group_sizes(mc, tp: int = 1) -> list[int]:
    """The load-time INT4 group sizes (of 32, 64, 128) that divide every linear layer's input size K of model
    config ``mc`` on one of ``tp`` tensor-parallel ranks: hidden_size (qkv, gate_up), the attention width /
    tp (o_proj) and intermediate_size / tp (down; dense MLPs only: a MoE model's experts are checked as they
    load). The default model (hidden 576) takes 32 and 64."""
    return [g for g in INT4_GROUP_SIZES if all(k % g == 0 for k in _input_sizes(mc, tp).values())]


def _input_sizes(mc, tp: int) -> dict[str, int]:
    sizes = {"hidden_size": mc.hidden_size, "attention width / tp": mc.num_attention_heads * mc.head_dim // tp}
    if not getattr(mc, "is_moe", False):
        sizes["intermediate_size / tp"] = mc.intermediate_size // tp
    return sizes


def check_int4_group_size(mc, group_size: int, tp: int = 1) -> None:
    """Raises ValueError naming ``--quantization-group-size`` (``quantization_group_size``), its value, the K it
    does not divide and the values that work for this model (``int4_group_sizes``), before any weight loads."""
    fits = int4_group_sizes(mc, tp)
    if group_size in fits:
        return
    bad = next((f"{name} = {k}" for name, k in _input_sizes(mc, tp).items() if k % group_size), "a layer's K")
    works = (f"values that work for this model: {', '.join(map(str, fits))} (e.g. --quantization-group-size "
             f"{max(fits)})") if fits else "none of 32, 64, 128 divides every layer's K: use another --quantization"
    raise ValueError(f"--quantization int4: --quantization-group-size (quantization_group_size) {group_size} does "
                     f"not divide the input size K of every linear layer ({bad}); {works}")


class Int4Config(FormatQuantConfig):
    """INT4 weight-only for every linear layer (lm_head and embeddings stay 16-bit).

    Raises:
        ValueError: a group size other than 32, 64 or 128.
    """

    name = "int4"

    def __init__(self, group_size: int = 128, checkpoint=None):
        if checkpoint is None and group_size not in INT4_GROUP_SIZES:
            raise ValueError(f"int4 group size must be one of {', '.join(map(str, INT4_GROUP_SIZES))}, "
                             f"got {group_size!r}")
        super().__init__(checkpoint)
        self.group_size = group_size

    @classmethod
    def from_config(cls, checkpoint=None, group_size: int = 128) -> Int4Config:
        if checkpoint is not None:
            return cls(checkpoint.group_size, checkpoint=checkpoint)
        return cls(group_size)

    def linear_method(self) -> Int4LinearMethod:
        return Int4LinearMethod(self.group_size, self.checkpoint)


class GPTQConfig(QuantConfig):
    """GPTQ checkpoints (AutoGPTQ / GPTQModel, v1 and v2, act-order included): read into ``Int4Config``."""

    name = "gptq"

    @classmethod
    def from_config(cls, checkpoint=None, group_size: int = 128) -> Int4Config:
        return Int4Config.from_config(checkpoint_only(cls.name, checkpoint))


class AWQConfig(GPTQConfig):
    """AutoAWQ GEMM checkpoints: read into ``Int4Config``."""

    name = "awq"
