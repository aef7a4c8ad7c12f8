"""GPTQ and AutoAWQ INT4 checkpoints: pack and unpack between ``Int4Weight`` (``roofline.quant.quantize``) and
the exact tensors AutoGPTQ / GPTQModel (v1 and v2) and AutoAWQ write.

Orientation: ``N`` = out_features, ``K`` = in_features, ``G = K // group_size`` groups. A 4-bit value sits in
bits ``4j .. 4j+3`` of an int32 word ("nibble j", j = 0 least significant).

GPTQ (checked in AutoGPTQ ``auto_gptq/nn_modules/qlinear/qlinear_exllama.py`` ``pack``, GPTQModel
``gptqmodel/utils/model.py`` ``convert_gptq_v1_to_v2_format_module``, vLLM
``vllm/model_executor/layers/quantization/gptq.py`` and ``gptq_marlin.py``):

- ``qweight`` int32 ``[K/8, N]``, packed along K: nibble j of ``qweight[r, n]`` is ``q[n, 8r + j]``.
- ``qzeros`` int32 ``[G, N/8]``, packed along N: nibble j of ``qzeros[g, c]`` is the zero of output ``8c + j``.
  v1 (``checkpoint_format: "gptq"``) stores ``zero - 1``; readers add 1 back (vLLM's ``gptq_gemm`` unless
  ``use_v2_format``, exllama, GPTQModel's v1->v2 conversion adds 0x11111111 per word). A zero of 0 therefore
  cannot be written in v1 (AutoGPTQ's ``-1`` even spills into the higher nibbles); a stored nibble of 15 reads
  back as 16. v2 (``"gptq_v2"``, GPTQModel) stores the zero as is.
- ``scales`` fp16 ``[G, N]``; ``g_idx`` int32 ``[K]``, the group of each input channel (act-order).
- config keys: quant_method "gptq", bits, group_size (-1 = one group per row), desc_act, sym, damp_percent,
  true_sequential, static_groups, checkpoint_format, lm_head. vLLM's ``gptq_marlin`` takes only
  ``(bits, sym) in {(4, True), (8, True)}`` (its TYPE_MAP: uint4b8 / uint8b128, zeros ignored); an asymmetric
  (``sym: false``) checkpoint falls back to vLLM's ``gptq`` method (exllama ``gptq_gemm``), which reads
  qzeros with the v1 ``+1`` (or as is for ``gptq_v2``).

AWQ GEMM (checked in AutoAWQ ``awq/modules/linear/gemm.py`` ``WQLinear_GEMM.from_linear``,
``awq/utils/packing_utils.py``, ``awq/models/_config.py``, and vLLM ``awq_marlin.py``):

- ``qweight`` int32 ``[K, N/8]`` and ``qzeros`` int32 ``[G, N/8]``, both packed along N in the interleaved
  order ``AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]``: nibble i of word c holds output ``8c + AWQ_ORDER[i]``;
  reading back uses the inverse ``[0, 4, 1, 5, 2, 6, 3, 7]``. Zeros are stored as is (no ``-1``).
- ``scales`` fp16 ``[G, N]``; no g_idx (AWQ has no act-order).
- config.json keys (``to_transformers_dict``): quant_method "awq", bits, group_size, zero_point, version
  "gemm", modules_to_not_convert; AutoAWQ's own quant_config.json spells them w_bit / q_group_size.

Scales of GPTQ/AWQ are rounded to fp16 on pack (the formats store fp16), so a packed weight dequantizes to
``(q - z) * fp16(s)``, which differs from ``Int4Weight.dequantize()`` by that rounding (relative 2^-11).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from roofline.quant.formats.layout import check_layout, expected_layout, pack_nibbles, unpack_nibbles
from roofline.quant.quantize import INT4_MAX, Int4Weight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of 8 sits in nibble AWQ_REVERSE_ORDER[j]
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


def _check_int4(w: Int4Weight, fmt: str, name: str) -> tuple[int, int, int]:
    n, k = w.shape
    gs = w.group_size
    if n % 8 or (fmt == "GPTQ" and k % 8):
        dims = f"N={n} and K={k} must be" if fmt == "GPTQ" else f"N={n} must be"
        raise ValueError(f"{name}: {fmt} packs 8 values per int32; {dims} multiples of 8")
    if gs <= 0 or k % gs:
        raise ValueError(f"{name}: group size {gs} does not divide K={k}")
    if int(w.q.max()) > INT4_MAX or int(w.zeros.max()) > INT4_MAX:
        raise ValueError(f"{name}: q and zeros must be in [0, {INT4_MAX}] to pack as 4-bit")
    return n, k, k // gs


def _trivial_g_idx(k: int, group_size: int, device: torch.device) -> torch.Tensor:
    return (torch.arange(k, device=device) // group_size).to(torch.int32)


def pack_gptq(w: Int4Weight, *, checkpoint_format: str = "gptq", sym: bool = False,
              name: str = "layer") -> dict[str, torch.Tensor]:
    """Pack a canonical INT4 weight ``[N, K]`` into GPTQ's tensors (layout in the module docstring).

    Returns:
        ``qweight`` int32 ``[K/8, N]``, ``qzeros`` int32 ``[G, N/8]`` (v1: ``zero - 1``), ``scales`` fp16
        ``[G, N]`` (rounded from float32), ``g_idx`` int32 ``[K]`` (``w.g_idx`` or ``k // group_size``).

    Raises:
        ValueError: N or K not a multiple of 8; an unknown ``checkpoint_format``; with v1, a zero of 0 (the
            format cannot store it: write "gptq_v2" or requantize with zeros >= 1); with ``sym``, a zero
            other than 8 (the symmetric GPTQ grid, which vLLM's gptq_marlin assumes and ignores qzeros for).
    """
    if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format: expected one of {GPTQ_CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
    n, k, g = _check_int4(w, "GPTQ", name)
    if sym and bool((w.zeros != 8).any()):
        raise ValueError(f"{name}: sym=True needs every zero to be 8 (GPTQ's symmetric 4-bit grid); "
                         f"{int((w.zeros != 8).sum())} of {w.zeros.numel()} are not")
    zeros = w.zeros.to(torch.int64)
    if checkpoint_format == "gptq":
        if bool((zeros == 0).any()):
            raise ValueError(f"{name}: {int((zeros == 0).sum())} zero point(s) are 0, which GPTQ v1 cannot "
                             f"store (it writes zero - 1); use checkpoint_format='gptq_v2' or zeros >= 1")
        zeros = zeros - 1
    qweight = pack_nibbles(w.q.t().reshape(k // 8, 8, n).transpose(1, 2))       # [K/8, N]
    qzeros = pack_nibbles(zeros.t().reshape(g, n // 8, 8))                       # [G, N/8]
    g_idx = w.g_idx if w.g_idx is not None else _trivial_g_idx(k, w.group_size, w.q.device)
    return {"qweight": qweight.contiguous(), "qzeros": qzeros.contiguous(),
            "scales": w.scales.t().to(torch.float16).contiguous(), "g_idx": g_idx.to(torch.int32).contiguous()}


def unpack_gptq(tensors: Mapping[str, torch.Tensor], group_size: int, *, checkpoint_format: str = "gptq",
                name: str = "layer") -> Int4Weight:
    """Read GPTQ tensors (``qweight``, ``qzeros``, ``scales``, optional ``g_idx``) into an ``Int4Weight``.

    ``group_size`` -1 means one group per row (K). v1 zeros come back as stored nibble + 1, exactly as
    vLLM's ``gptq_gemm`` reads them, so a v1 zero may be 16 (a zero of 0 that the writer could not store).
    ``g_idx`` equal to ``k // group_size`` comes back as None.

    Raises:
        ValueError: a tensor is missing or has the wrong shape or dtype (names it and both shapes).
    """
    if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
        raise ValueError(f"checkpoint_format: expected one of {GPTQ_CHECKPOINT_FORMATS}, got {checkpoint_format!r}")
    if "qweight" not in tensors:
        raise ValueError(f"{name}.qweight: missing (found {sorted(tensors)})")
    k, n = tensors["qweight"].shape[0] * 8, tensors["qweight"].shape[1]
    gs = k if group_size == -1 else group_size
    expected = expected_layout("gptq", n, k, gs)
    if "g_idx" not in tensors:
        expected.pop("g_idx")
    check_layout(name, tensors, expected)
    g = k // gs
    q = unpack_nibbles(tensors["qweight"]).transpose(1, 2).reshape(k, n).t()      # [N, K]
    zeros = unpack_nibbles(tensors["qzeros"]).reshape(g, n).t()                  # [N, G]
    if checkpoint_format == "gptq":
        zeros = zeros + 1
    g_idx = tensors.get("g_idx")
    if g_idx is not None:
        g_idx = g_idx.to(torch.int32)
        if torch.equal(g_idx, _trivial_g_idx(k, gs, g_idx.device)):
            g_idx = None
    return Int4Weight(q.contiguous(), tensors["scales"].float().t().contiguous(), zeros.contiguous(), gs, g_idx)


def pack_awq(w: Int4Weight, *, name: str = "layer") -> dict[str, torch.Tensor]:
    """Pack a canonical INT4 weight ``[N, K]`` into AutoAWQ GEMM tensors (layout in the module docstring).

    Returns:
        ``qweight`` int32 ``[K, N/8]``, ``qzeros`` int32 ``[G, N/8]`` (both in ``AWQ_ORDER``), ``scales``
        fp16 ``[G, N]``.

    Raises:
        ValueError: act-order (a ``g_idx`` other than ``k // group_size``): AWQ has no g_idx; N not a
            multiple of 8.
    """
    n, k, g = _check_int4(w, "AWQ", name)
    if w.g_idx is not None and not torch.equal(w.g_idx.to(torch.int32),
                                               _trivial_g_idx(k, w.group_size, w.g_idx.device)):
        raise ValueError(f"{name}: AWQ has no g_idx, so it cannot store act-order (desc_act) groups; "
                         "write GPTQ for this weight")
    order = list(AWQ_ORDER)
    qweight = pack_nibbles(w.q.t().reshape(k, n // 8, 8)[..., order])           # [K, N/8]
    qzeros = pack_nibbles(w.zeros.t().reshape(g, n // 8, 8)[..., order])        # [G, N/8]
    return {"qweight": qweight.contiguous(), "qzeros": qzeros.contiguous(),
            "scales": w.scales.t().to(torch.float16).contiguous()}


def unpack_awq(tensors: Mapping[str, torch.Tensor], group_size: int, *, name: str = "layer") -> Int4Weight:
    """Read AutoAWQ GEMM tensors (``qweight``, ``qzeros``, ``scales``) into an ``Int4Weight``.

    Raises:
        ValueError: a tensor is missing or has the wrong shape or dtype (names it and both shapes).
    """
    if "qweight" not in tensors:
        raise ValueError(f"{name}.qweight: missing (found {sorted(tensors)})")
    k, n = tensors["qweight"].shape[0], tensors["qweight"].shape[1] * 8
    gs = k if group_size == -1 else group_size
    check_layout(name, tensors, expected_layout("awq", n, k, gs))
    rev = list(AWQ_REVERSE_ORDER)
    q = unpack_nibbles(tensors["qweight"])[..., rev].reshape(k, n).t()           # [N, K]
    zeros = unpack_nibbles(tensors["qzeros"])[..., rev].reshape(k // gs, n).t()  # [N, G]
    return Int4Weight(q.contiguous(), tensors["scales"].float().t().contiguous(), zeros.contiguous(), gs)
