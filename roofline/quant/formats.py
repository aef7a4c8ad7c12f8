"""Published checkpoint formats: pack and unpack between the canonical forms of ``quantize.py`` and the exact
tensors AutoAWQ, GPTQ (AutoGPTQ / GPTQModel, v1 and v2) and compressed-tensors (llm-compressor) write, and
build / parse their ``quantization_config``, so that what we write loads in vLLM and theirs loads here.

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

compressed-tensors (checked in vllm-project/compressed-tensors ``compressors/naive_quantized/base.py``,
``compressors/pack_quantized/{base,helpers}.py``, ``quantization/quant_scheme.py`` (presets FP8_DYNAMIC,
INT8_W8A8), ``quantization/quant_args.py``, ``quantization/lifecycle/initialize.py``,
``compressors/model_compressors/model_compressor.py`` ``update_config``; vLLM
``compressed_tensors/compressed_tensors.py`` ``_get_scheme_from_parts`` and
``schemes/compressed_tensors_wNa16.py``):

- "fp8-dynamic" (format "float-quantized"): ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` ``[N, 1]``;
  activations dynamic per token, so no ``input_scale``.
- "int8-dynamic" (format "int-quantized"): ``weight`` int8 ``[N, K]``, ``weight_scale`` ``[N, 1]``.
- "w8a16-int8" (format "pack-quantized"): vLLM loads INT8 weight-only only from pack-quantized
  (``_is_wNa16_group_channel`` -> ``CompressedTensorsWNA16``, bits 4 or 8); an int-quantized weight-only
  config has no vLLM scheme. ``weight_packed`` int32 ``[N, ceil(K/4)]``: byte j of word c is
  ``q[n, 4c + j] + 128`` (offset binary, uint8b128); ``weight_shape`` int64 ``[2]`` = (N, K);
  ``weight_scale`` ``[N, 1]``. Symmetric, so no ``weight_zero_point``.
- llm-compressor writes scales in the model dtype (bf16/fp16/fp32); vLLM copies them into its own
  parameters, any float dtype loads. We write float32 unless told otherwise, so our scales survive exactly.

Scales of GPTQ/AWQ are rounded to fp16 on pack (the formats store fp16), so a packed weight dequantizes to
``(q - z) * fp16(s)``, which differs from ``Int4Weight.dequantize()`` by that rounding (relative 2^-11).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from roofline.quant.quantize import INT4_MAX, ChannelWeight, Int4Weight

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds column 8c + AWQ_ORDER[i]
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)  # column j of 8 sits in nibble AWQ_REVERSE_ORDER[j]
GPTQ_CHECKPOINT_FORMATS = ("gptq", "gptq_v2")
CT_SCHEMES = ("fp8-dynamic", "int8-dynamic", "w8a16-int8")
CT_FORMAT_OF_SCHEME = {"fp8-dynamic": "float-quantized", "int8-dynamic": "int-quantized",
                       "w8a16-int8": "pack-quantized"}
SUPPORTED_METHODS = ("gptq", "awq", "compressed-tensors")
COMPRESSED_TENSORS_VERSION = "0.20.1"  # the release whose compressors our tests decompress with


# ---------------------------------------------------------------------------------------------------------
# The declarative layout table: per format, each tensor's suffix, dtype and symbolic dims.
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class TensorLayout:
    """How one checkpoint tensor of a quantized linear is laid out.

    ``dims`` names each dimension: "N" (output features), "K" (input features), "G" (groups along K),
    a literal size ("1", "2"), or "N/8" / "K/8" / "K/4" for a dimension packed that many values per int32.
    The loader reads the derived ``output_dim`` / ``input_dim`` / ``packed_dim`` / ``pack_factor`` to place
    the shards of fused q/k/v and gate/up: along a packed output dim a shard's offset and size divide by
    ``pack_factor`` (AWQ's interleave stays inside each 8 columns, so shard sizes must be multiples of 8).
    """

    suffix: str
    dtype: torch.dtype  # what we write; check_layout accepts any float dtype where this is a float
    dims: tuple[str, ...]

    def _find(self, letters: str) -> int | None:
        return next((i for i, d in enumerate(self.dims) if d[0] in letters), None)

    @property
    def output_dim(self) -> int | None:
        return self._find("N")

    @property
    def input_dim(self) -> int | None:
        """The dim along K (counting input channels, or groups when ``is_grouped``); None if replicated."""
        return self._find("KG")

    @property
    def is_grouped(self) -> bool:
        return "G" in self.dims

    @property
    def packed_dim(self) -> int | None:
        return next((i for i, d in enumerate(self.dims) if "/" in d), None)

    @property
    def pack_factor(self) -> int:
        d = self.packed_dim
        return 1 if d is None else int(self.dims[d].split("/")[1])

    def shape(self, n: int, k: int, group_size: int | None = None) -> tuple[int, ...]:
        """Concrete shape for an ``[n, k]`` weight (packed dims rounded up, as compressed-tensors pads)."""
        sizes = {"N": n, "K": k, "G": k // group_size if group_size else 1}
        out = []
        for d in self.dims:
            if d.isdigit():
                out.append(int(d))
            else:
                name, _, div = d.partition("/")
                out.append(math.ceil(sizes[name] / int(div)) if div else sizes[name])
        return tuple(out)


TENSOR_LAYOUTS: dict[str, tuple[TensorLayout, ...]] = {
    "gptq": (TensorLayout("qweight", torch.int32, ("K/8", "N")),
             TensorLayout("qzeros", torch.int32, ("G", "N/8")),
             TensorLayout("scales", torch.float16, ("G", "N")),
             TensorLayout("g_idx", torch.int32, ("K",))),
    "awq": (TensorLayout("qweight", torch.int32, ("K", "N/8")),
            TensorLayout("qzeros", torch.int32, ("G", "N/8")),
            TensorLayout("scales", torch.float16, ("G", "N"))),
    "fp8-dynamic": (TensorLayout("weight", torch.float8_e4m3fn, ("N", "K")),
                    TensorLayout("weight_scale", torch.float32, ("N", "1"))),
    "int8-dynamic": (TensorLayout("weight", torch.int8, ("N", "K")),
                     TensorLayout("weight_scale", torch.float32, ("N", "1"))),
    "w8a16-int8": (TensorLayout("weight_packed", torch.int32, ("N", "K/4")),
                   TensorLayout("weight_shape", torch.int64, ("2",)),
                   TensorLayout("weight_scale", torch.float32, ("N", "1"))),
}


def expected_layout(layout: str, n: int, k: int, group_size: int | None = None
                    ) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """``{suffix: (shape, dtype)}`` of a ``[n, k]`` linear in ``layout`` (a ``TENSOR_LAYOUTS`` key);
    ``group_size`` -1 or None means one group per row."""
    if layout not in TENSOR_LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; known: {sorted(TENSOR_LAYOUTS)}")
    gs = k if group_size in (None, -1) else group_size
    return {t.suffix: (t.shape(n, k, gs), t.dtype) for t in TENSOR_LAYOUTS[layout]}


def check_layout(name: str, tensors: Mapping[str, torch.Tensor],
                 expected: Mapping[str, tuple[tuple[int, ...], torch.dtype | None]]) -> None:
    """Check that each expected tensor is present with its declared shape and dtype.

    Args:
        name: the layer's checkpoint prefix, used in messages (``model.layers.0.self_attn.q_proj``).
        tensors: ``{suffix: tensor}`` as read from the checkpoint.
        expected: ``{suffix: (shape, dtype)}``, e.g. from ``expected_layout``; a float dtype accepts any
            float dtype (scales come in fp16, bf16 or fp32), None accepts any dtype.

    Raises:
        ValueError: naming ``name.suffix`` and both shapes (or dtypes), or the missing tensor.
    """
    for suffix, (shape, dtype) in expected.items():
        if suffix not in tensors:
            raise ValueError(f"{name}.{suffix}: missing (this format stores {sorted(expected)}, "
                             f"found {sorted(tensors)})")
        t = tensors[suffix]
        if tuple(t.shape) != tuple(shape):
            raise ValueError(f"{name}.{suffix}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
        if dtype is None:
            continue
        ok = t.dtype.is_floating_point if (dtype.is_floating_point and dtype.itemsize > 1) else t.dtype == dtype
        if not ok:
            raise ValueError(f"{name}.{suffix}: expected dtype {dtype}, got {t.dtype}")


# ---------------------------------------------------------------------------------------------------------
# Nibble packing
# ---------------------------------------------------------------------------------------------------------

_SHIFTS4 = torch.arange(8, dtype=torch.int64) * 4


def _pack_nibbles(v: torch.Tensor) -> torch.Tensor:
    """``v`` integer ``[..., 8]`` in [0, 15] -> int32 ``[...]``: element j in bits 4j..4j+3."""
    word = (v.to(torch.int64) << _SHIFTS4.to(v.device)).sum(dim=-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # two's-complement view


def _unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[...]`` -> uint8 ``[..., 8]``: element j is bits 4j..4j+3."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w[..., None] >> _SHIFTS4.to(words.device)) & 0xF).to(torch.uint8)


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
    qweight = _pack_nibbles(w.q.t().reshape(k // 8, 8, n).transpose(1, 2))       # [K/8, N]
    qzeros = _pack_nibbles(zeros.t().reshape(g, n // 8, 8))                       # [G, N/8]
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
    q = _unpack_nibbles(tensors["qweight"]).transpose(1, 2).reshape(k, n).t()      # [N, K]
    zeros = _unpack_nibbles(tensors["qzeros"]).reshape(g, n).t()                  # [N, G]
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
    qweight = _pack_nibbles(w.q.t().reshape(k, n // 8, 8)[..., order])           # [K, N/8]
    qzeros = _pack_nibbles(w.zeros.t().reshape(g, n // 8, 8)[..., order])        # [G, N/8]
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
    q = _unpack_nibbles(tensors["qweight"])[..., rev].reshape(k, n).t()           # [N, K]
    zeros = _unpack_nibbles(tensors["qzeros"])[..., rev].reshape(k // gs, n).t()  # [N, G]
    return Int4Weight(q.contiguous(), tensors["scales"].float().t().contiguous(), zeros.contiguous(), gs)


# ---------------------------------------------------------------------------------------------------------
# compressed-tensors
# ---------------------------------------------------------------------------------------------------------

def _check_scheme(scheme: str) -> None:
    if scheme not in CT_SCHEMES:
        raise ValueError(f"scheme: expected one of {CT_SCHEMES}, got {scheme!r}")


def pack_compressed_tensors(w: ChannelWeight, scheme: str, *, scale_dtype: torch.dtype = torch.float32,
                            name: str = "layer") -> dict[str, torch.Tensor]:
    """Write a per-channel INT8/FP8 weight ``[N, K]`` as llm-compressor does for ``scheme``.

    Args:
        scheme: "fp8-dynamic" (float8_e4m3fn weight), "int8-dynamic" (int8 weight, SmoothQuant output) or
            "w8a16-int8" (int8 weight, pack-quantized).
        scale_dtype: dtype of ``weight_scale`` ``[N, 1]``; llm-compressor writes the model dtype, float32
            (the default) keeps our scales exact.

    Returns:
        fp8/int8-dynamic: ``weight`` ``[N, K]`` and ``weight_scale``; w8a16-int8: ``weight_packed`` int32
        ``[N, ceil(K/4)]`` (byte j of word c = ``q[n, 4c+j] + 128``; a K not divisible by 4 is padded
        with q = -128 as compressed-tensors does), ``weight_shape`` int64 ``[2]``, ``weight_scale``.

    Raises:
        ValueError: unknown scheme, or a weight dtype that does not match it.
    """
    _check_scheme(scheme)
    want = torch.float8_e4m3fn if scheme == "fp8-dynamic" else torch.int8
    if w.q.dtype != want:
        raise ValueError(f"{name}: scheme {scheme!r} stores {want} weights, got {w.q.dtype}")
    n, k = w.shape
    scale = w.scales.reshape(n, 1).to(scale_dtype).contiguous()
    if scheme != "w8a16-int8":
        return {"weight": w.q.contiguous(), "weight_scale": scale}
    u = w.q.to(torch.int64) + 128                                                  # [N, K] in [0, 255]
    words = math.ceil(k / 4)
    u = torch.nn.functional.pad(u, (0, 4 * words - k)).reshape(n, words, 4)
    packed = (u << (torch.arange(4, device=u.device) * 8)).sum(dim=-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return {"weight_packed": packed.contiguous(), "weight_shape": torch.tensor([n, k], dtype=torch.int64),
            "weight_scale": scale}


def unpack_compressed_tensors(tensors: Mapping[str, torch.Tensor], scheme: str, *,
                              name: str = "layer") -> ChannelWeight:
    """Read a compressed-tensors linear written with ``scheme`` into a ``ChannelWeight`` (float32 scales).

    Raises:
        ValueError: unknown scheme; a tensor missing or of the wrong shape or dtype (names it and both
            shapes); a ``weight_scale`` that is not per output channel.
    """
    _check_scheme(scheme)
    if scheme == "w8a16-int8":
        if "weight_shape" not in tensors or "weight_packed" not in tensors:
            raise ValueError(f"{name}.weight_shape and weight_packed: expected both, found {sorted(tensors)}")
        # K from weight_shape; N from the packed rows: a fused layer (q/k/v, gate/up) stacks its shards'
        # rows, while each shard's weight_shape names that shard's own N.
        n, k = tensors["weight_packed"].shape[0], int(tensors["weight_shape"][1])
    else:
        if "weight" not in tensors:
            raise ValueError(f"{name}.weight: missing (found {sorted(tensors)})")
        n, k = tensors["weight"].shape
    check_layout(name, tensors, expected_layout(scheme, n, k))
    scales = tensors["weight_scale"].float().reshape(n).contiguous()
    if scheme != "w8a16-int8":
        return ChannelWeight(tensors["weight"].contiguous(), scales)
    words = tensors["weight_packed"].to(torch.int64) & 0xFFFFFFFF
    u = (words[..., None] >> (torch.arange(4, device=words.device) * 8)) & 0xFF    # [N, K/4, 4]
    q = (u.reshape(n, -1)[:, :k] - 128).to(torch.int8)
    return ChannelWeight(q.contiguous(), scales)


# ---------------------------------------------------------------------------------------------------------
# quantization_config
# ---------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class QuantSpec:
    """What a checkpoint's ``quantization_config`` says, in our terms.

    Attributes:
        format: "gptq" | "awq" | "compressed-tensors".
        weight_bits: 4 (GPTQ, AWQ) or 8 (compressed-tensors).
        weight_type: "int" | "float".
        group_size: input channels per group; -1 = one scale per output channel.
        desc_act: GPTQ act-order (the checkpoint carries g_idx).
        sym: symmetric weights (GPTQ zeros all 8 / no zero points).
        checkpoint_format: "gptq" | "gptq_v2" (GPTQ), "gemm" (AWQ), or the compressed-tensors format
            ("float-quantized", "int-quantized", "pack-quantized").
        scheme: the compressed-tensors scheme ("fp8-dynamic", "int8-dynamic", "w8a16-int8"), else None.
        activation: None (weight-only) or "int8" / "fp8": dynamic, per token.
        ignore: modules left in 16 bits (compressed-tensors ``ignore``, AWQ ``modules_to_not_convert``;
            "lm_head" where the format leaves it unquantized).
        targets: the modules quantized (compressed-tensors ``targets``; ("Linear",) for GPTQ/AWQ).
    """

    format: str
    weight_bits: int
    weight_type: str
    group_size: int
    desc_act: bool
    sym: bool
    checkpoint_format: str
    scheme: str | None = None
    activation: str | None = None
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)


def _weights_args(scheme: str) -> dict:
    # QuantizationArgs as compressed-tensors 0.20 serializes llm-compressor's FP8_DYNAMIC / W8A8 presets
    # (quant_scheme.py; quant_args.py ``_serialize`` drops unset observer, actorder, scale_dtype, zp_dtype).
    return {"num_bits": 8, "type": "float" if scheme == "fp8-dynamic" else "int", "symmetric": True,
            "group_size": None, "strategy": "channel", "dynamic": False}


def _input_args(scheme: str) -> dict | None:
    if scheme == "w8a16-int8":
        return None
    return {"num_bits": 8, "type": "float" if scheme == "fp8-dynamic" else "int", "symmetric": True,
            "group_size": None, "strategy": "token", "dynamic": True}


def make_quantization_config(method: str, *, group_size: int = 128, desc_act: bool = False,
                             sym: bool = False, checkpoint_format: str = "gptq", damp_percent: float = 0.01,
                             true_sequential: bool = True, scheme: str | None = None,
                             ignore: list[str] | None = None) -> dict:
    """The ``quantization_config`` dict for config.json, as the reference tool writes it.

    Args:
        method: "gptq" (AutoGPTQ/GPTQModel keys), "awq" (AutoAWQ ``to_transformers_dict``) or
            "compressed-tensors" (llm-compressor / ``ModelCompressor.update_config``).
        group_size, desc_act, sym, checkpoint_format, damp_percent, true_sequential: GPTQ fields
            (group_size also AWQ's; AWQ is always asymmetric, ``zero_point: true``).
        scheme: compressed-tensors scheme, one of ``CT_SCHEMES``.
        ignore: modules left unquantized; default ["lm_head"]. GPTQ has no ignore list (only its
            ``lm_head`` flag), so there it may only be [] or ["lm_head"]; AWQ never quantizes lm_head.

    Raises:
        ValueError: unsupported method (lists the supported ones), unknown scheme / checkpoint_format, a bad
            group size, or an ignore list the format cannot express.
    """
    ignore = ["lm_head"] if ignore is None else list(ignore)
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"quant_method: expected one of {SUPPORTED_METHODS}, got {method!r}")
    if method in ("gptq", "awq") and not (group_size == -1 or group_size > 0):
        raise ValueError(f"group_size: expected a positive int or -1, got {group_size!r}")
    if method == "gptq":
        if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format: expected one of {GPTQ_CHECKPOINT_FORMATS}, "
                             f"got {checkpoint_format!r}")
        if set(ignore) - {"lm_head"}:
            raise ValueError(f"ignore: GPTQ configs can only leave lm_head unquantized, got {ignore}")
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                "damp_percent": damp_percent, "true_sequential": true_sequential, "static_groups": False,
                "checkpoint_format": checkpoint_format, "lm_head": "lm_head" not in ignore}
    if method == "awq":
        if "lm_head" not in ignore:
            raise ValueError("ignore: AWQ never quantizes lm_head; keep 'lm_head' in the ignore list")
        rest = [m for m in ignore if m != "lm_head"]
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": rest or None}
    if scheme not in CT_SCHEMES:
        raise ValueError(f"scheme: expected one of {CT_SCHEMES}, got {scheme!r}")
    fmt = CT_FORMAT_OF_SCHEME[scheme]
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "version": COMPRESSED_TENSORS_VERSION,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": _weights_args(scheme),
                                          "input_activations": _input_args(scheme),
                                          "output_activations": None, "format": fmt}},
            "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
            "sparsity_config": {}, "transform_config": {}}


_MISSING = object()


def _get(cfg: Mapping, keys: tuple[str, ...], path: str, default=_MISSING):
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    if default is _MISSING:
        raise ValueError(f"{path}{keys[0]}: missing")
    return default


def _bool(cfg: Mapping, keys: tuple[str, ...], path: str, default=_MISSING) -> bool:
    v = _get(cfg, keys, path, default)
    if not isinstance(v, bool):
        raise ValueError(f"{path}{keys[0]}: expected true or false, got {v!r}")
    return v


def _int(cfg: Mapping, keys: tuple[str, ...], path: str) -> int:
    v = _get(cfg, keys, path)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{path}{keys[0]}: expected an int, got {v!r}")
    return v


def _group_size(cfg: Mapping, keys: tuple[str, ...], path: str) -> int:
    v = _get(cfg, keys, path)
    if isinstance(v, bool) or not isinstance(v, int) or not (v == -1 or v > 0):
        raise ValueError(f"{path}{keys[0]}: expected a positive int or -1, got {v!r}")
    return v


def _str_list(v, field: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{field}: expected a list of strings, got {v!r}")
    return tuple(v)


def parse_quantization_config(cfg: Mapping) -> QuantSpec:
    """Parse a checkpoint's ``quantization_config`` (from config.json) into a ``QuantSpec``.

    Reads GPTQ (4-bit; v1 "gptq" or "gptq_v2"), AWQ GEMM (4-bit, with zero points; ``bits``/``w_bit`` and
    ``group_size``/``q_group_size`` both accepted) and compressed-tensors with one scheme: FP8 W8A8 dynamic,
    INT8 W8A8 dynamic per token, INT8 W8A16 per channel (pack-quantized).

    Defaults where the reference tools have one: GPTQ ``sym`` true and ``checkpoint_format`` "gptq"
    (AutoGPTQ ``BaseQuantizeConfig``), ``lm_head`` false; AWQ ``version`` "gemm". GPTQ ``desc_act`` with
    ``group_size`` -1 reads as False (one group per row, as vLLM's gptq_marlin treats it).

    Raises:
        ValueError: a missing or malformed field, named by its path (``quantization_config.group_size:
            expected a positive int or -1, got 'abc'``); an unsupported quant_method (lists the supported
            ones); bits, versions, formats or schemes roofline does not read.
    """
    p = "quantization_config."
    if not isinstance(cfg, Mapping):
        raise ValueError(f"quantization_config: expected a JSON object, got {type(cfg).__name__}")
    method = _get(cfg, ("quant_method",), p)
    if not isinstance(method, str) or method.lower() not in SUPPORTED_METHODS:
        raise ValueError(f"{p}quant_method: roofline reads {list(SUPPORTED_METHODS)}, got {method!r}")
    method = method.lower()
    if method == "gptq":
        bits = _int(cfg, ("bits",), p)
        if bits != 4:
            raise ValueError(f"{p}bits: roofline reads 4-bit GPTQ only, got {bits}")
        gs = _group_size(cfg, ("group_size",), p)
        fmt = _get(cfg, ("checkpoint_format", "format"), p, "gptq")
        if fmt not in GPTQ_CHECKPOINT_FORMATS:
            raise ValueError(f"{p}checkpoint_format: roofline reads {list(GPTQ_CHECKPOINT_FORMATS)}, got {fmt!r}")
        desc_act = _bool(cfg, ("desc_act",), p)
        lm_head = _bool(cfg, ("lm_head",), p, False)
        return QuantSpec("gptq", 4, "int", gs, desc_act and gs != -1, _bool(cfg, ("sym",), p, True), fmt,
                         ignore=() if lm_head else ("lm_head",))
    if method == "awq":
        bits = _int(cfg, ("bits", "w_bit"), p)
        if bits != 4:
            raise ValueError(f"{p}bits: roofline reads 4-bit AWQ only, got {bits}")
        gs = _group_size(cfg, ("group_size", "q_group_size"), p)
        if not _bool(cfg, ("zero_point",), p):
            raise ValueError(f"{p}zero_point: roofline reads AWQ with zero points (true) only, got false")
        version = _get(cfg, ("version",), p, "gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise ValueError(f"{p}version: roofline reads AWQ 'gemm' checkpoints only, got {version!r}")
        skip = _str_list(cfg.get("modules_to_not_convert"), f"{p}modules_to_not_convert")
        return QuantSpec("awq", 4, "int", gs, False, False, "gemm", ignore=("lm_head", *skip))
    return _parse_compressed_tensors(cfg, p)


def _scheme_of(weights: Mapping, acts: Mapping | None, fmt: str, path: str) -> str:
    if not isinstance(weights, Mapping):
        raise ValueError(f"{path}weights: expected an object, got {weights!r}")
    wtype = _get(weights, ("type",), f"{path}weights.", "int")
    bits = _int(weights, ("num_bits",), f"{path}weights.")
    gs = weights.get("group_size")
    strategy = weights.get("strategy") or ("channel" if gs == -1 else "group" if gs else "tensor")
    if wtype not in ("int", "float"):
        raise ValueError(f"{path}weights.type: expected 'int' or 'float', got {wtype!r}")
    if bits != 8 or strategy != "channel":
        raise ValueError(f"{path}weights: roofline reads 8-bit per-channel weights ({list(CT_SCHEMES)}), "
                         f"got num_bits={bits}, strategy={strategy!r}")
    if not _bool(weights, ("symmetric",), f"{path}weights.", True):
        raise ValueError(f"{path}weights.symmetric: roofline reads symmetric 8-bit weights, got false")
    if acts is None:
        if wtype != "int" or fmt != "pack-quantized":
            raise ValueError(f"{path}format: a weight-only INT8 scheme must be 'pack-quantized' "
                             f"(the form vLLM loads), got {fmt!r} with type {wtype!r}")
        return "w8a16-int8"
    if not isinstance(acts, Mapping):
        raise ValueError(f"{path}input_activations: expected an object or null, got {acts!r}")
    atype = _get(acts, ("type",), f"{path}input_activations.", "int")
    if (_int(acts, ("num_bits",), f"{path}input_activations.") != 8 or atype != wtype
            or acts.get("strategy") != "token" or acts.get("dynamic") is not True):
        raise ValueError(f"{path}input_activations: roofline reads dynamic per-token 8-bit activations of "
                         f"the weights' type, got {dict(acts)}")
    scheme = "fp8-dynamic" if wtype == "float" else "int8-dynamic"
    if fmt != CT_FORMAT_OF_SCHEME[scheme]:
        raise ValueError(f"{path}format: scheme {scheme} is stored as {CT_FORMAT_OF_SCHEME[scheme]!r}, got {fmt!r}")
    return scheme


def _parse_compressed_tensors(cfg: Mapping, p: str) -> QuantSpec:
    fmt = _get(cfg, ("format",), p)
    status = cfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{p}quantization_status: roofline reads 'compressed' checkpoints, got {status!r}")
    groups = _get(cfg, ("config_groups",), p)
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{p}config_groups: expected a non-empty object, got {groups!r}")
    schemes, targets = set(), []
    for gname, group in groups.items():
        path = f"{p}config_groups.{gname}."
        if not isinstance(group, Mapping):
            raise ValueError(f"{path[:-1]}: expected an object, got {group!r}")
        targets += _str_list(_get(group, ("targets",), path), f"{path}targets")
        schemes.add(_scheme_of(_get(group, ("weights",), path), group.get("input_activations"),
                               group.get("format") or fmt, path))
    if len(schemes) > 1:
        raise ValueError(f"{p}config_groups: roofline reads one scheme per model, got {sorted(schemes)}")
    scheme = schemes.pop()
    return QuantSpec("compressed-tensors", 8, "float" if scheme == "fp8-dynamic" else "int", -1, False, True,
                     CT_FORMAT_OF_SCHEME[scheme], scheme=scheme,
                     activation={"fp8-dynamic": "fp8", "int8-dynamic": "int8"}.get(scheme),
                     ignore=_str_list(cfg.get("ignore"), f"{p}ignore"), targets=tuple(targets))
