"""Bytes: weight formats (bits per weight, scales included) and KV-cache element and scale bytes.

The bound model speaks the engine's names (vLLM's ``--dtype``, ``--kv-cache-dtype`` and ``--quantization``):
``bfloat16``, ``float16``, ``float32``, ``fp8``, ``int4`` ... are accepted wherever a format or KV dtype is,
beside the short names the tables print (``bf16``, ``fp8_e4m3``, ``int4_g128``), so no caller keeps a
bridge of its own (:func:`canonical_dtype`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

from roofline.costmodel.common import _check_non_negative, _check_positive

# Bits per stored weight, including quantization metadata.
# int4_g128: 4 bits + a 16-bit scale per 128 weights (0.125) + zero-point overhead, 4.15 as GPTQ
# (Frantar et al. 2023) estimates; the worksheet uses 4.15 exactly.
WEIGHT_FORMAT_BITS: dict[str, float] = {
    "bf16": 16.0,
    "fp16": 16.0,
    "fp8_e4m3": 8.0,
    "int8": 8.0,
    "int4_g128": 4.15,
}
DEFAULT_FORMATS: tuple[str, ...] = ("bf16", "fp8_e4m3", "int4_g128")

# Bytes per KV-cache element.
KV_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8_e4m3": 1.0,
    "fp8": 1.0,
    "int8": 1.0,
}
# Scale bytes per token per KV head, for K and again for V (roofline.attention.kv_cache):
# int8 keeps one float32 scale per token and KV head (symmetric, amax / 127); fp8_e4m3 keeps one static
# scale per (layer, KV head), a constant [layers, H_kv] table that adds nothing per token.
KV_SCALE_BYTES: dict[str, float] = {"int8": 4.0}


# The engine's names (vLLM's ``--dtype``, ``--kv-cache-dtype``, torch's dtype names) for the short names
# above; ``canonical_dtype`` applies them, so callers pass what they hold ("bfloat16", ``torch.float16``).
DTYPE_ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "float32": "fp32",
    "fp8": "fp8_e4m3",
    "float8_e4m3fn": "fp8_e4m3",
}
# vLLM's ``--quantization`` methods quantized at load, as weight formats (int4's default group of 128,
# smoothquant's int8 codes). Checkpoint formats (gptq, awq, compressed-tensors) carry their own bits.
QUANTIZATION_FORMATS: dict[str, str] = {
    "int8": "int8",
    "int4": "int4_g128",
    "fp8": "fp8_e4m3",
    "smoothquant": "int8",
}


def canonical_dtype(dtype: object) -> str:
    """The short name the bound model prints for an engine dtype name (:data:`DTYPE_ALIASES`):
    ``"bfloat16"`` or ``torch.bfloat16`` -> ``"bf16"``, ``"fp8"`` -> ``"fp8_e4m3"``; other names unchanged.
    Pure string work: a torch dtype is read through ``str()``, so torch is never imported."""
    name = str(dtype).removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)


def rate_unit(dtype: object, prefix: str = "T") -> str:
    """The unit of a GEMM rate in ``dtype``'s arithmetic: ``"TOP/s"`` for integer products (int8: operations,
    not floating-point ones), ``"TFLOP/s"`` otherwise; ``prefix`` is the SI prefix of the printed number."""
    return f"{prefix}{'OP' if canonical_dtype(dtype).startswith(('int', 'uint')) else 'FLOP'}/s"


@dataclass(frozen=True)
class WeightFormat:
    """A weight storage format: bits per weight including scales and zero points.

    ``grouped(bits, group_size)`` models group-wise quantization (GPTQ/AWQ style): each group of
    ``group_size`` weights carries one ``scale_bits`` scale and one ``zero_bits`` zero point.
    """

    name: str
    bits_per_weight: float

    def __post_init__(self) -> None:
        if not (isinstance(self.bits_per_weight, int | float) and 0 < self.bits_per_weight <= 64):
            raise ValueError(f"bits_per_weight must be in (0, 64], got {self.bits_per_weight!r}")

    @classmethod
    def grouped(cls, bits: int, group_size: int, scale_bits: int = 16, zero_bits: int | None = None,
                name: str | None = None) -> WeightFormat:
        """``bits + (scale_bits + zero_bits) / group_size`` bits per weight; ``zero_bits`` defaults to ``bits``."""
        if not 1 <= bits <= 16:
            raise ValueError(f"bits must be in [1, 16], got {bits!r}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size!r}")
        zb = bits if zero_bits is None else zero_bits
        return cls(name or f"int{bits}_g{group_size}", bits + (scale_bits + zb) / group_size)


def parse_weight_format(spec: str | float | WeightFormat) -> WeightFormat:
    """A format by name (``bf16``, ``fp8_e4m3``, ``int8``, ``int4_g128``, ``fp16``), ``intN_gG`` for a
    custom group size (see :meth:`WeightFormat.grouped`), or a number of bits (``"5.5"``). The engine's
    names are accepted too and return the short name: a ``--dtype`` (``bfloat16``, ``float16``,
    :data:`DTYPE_ALIASES`) or a load-time ``--quantization`` method (``int4`` is ``int4_g128``, ``fp8``
    ``fp8_e4m3``, ``smoothquant`` ``int8``; :data:`QUANTIZATION_FORMATS`).

    Raises:
        ValueError: the spec names no format; the message lists the known names.
    """
    if isinstance(spec, WeightFormat):
        return spec
    if isinstance(spec, int | float) and not isinstance(spec, bool):
        return WeightFormat(f"{float(spec):g}bit", float(spec))
    given = str(spec).strip()
    text = QUANTIZATION_FORMATS.get(given, canonical_dtype(given))
    if text in WEIGHT_FORMAT_BITS:
        return WeightFormat(text, WEIGHT_FORMAT_BITS[text])
    if text.startswith("int") and "_g" in text:
        b, _, g = text[3:].partition("_g")
        if b.isdigit() and g.isdigit():
            return WeightFormat.grouped(int(b), int(g), name=text)
    try:
        bits = float(text.removesuffix("bit").removesuffix("bits"))
    except ValueError:
        bits = None
    if bits is not None and math.isfinite(bits):
        return WeightFormat(f"{bits:g}bit", bits)
    raise ValueError(
        f"unknown weight format {given!r}; known: {', '.join(WEIGHT_FORMAT_BITS)}, intN_gG "
        "(N in [1, 16] bits, group size G >= 1), or bits per weight as a number in (0, 64]"
    )


def weight_bytes(num_params: float, fmt: str | float | WeightFormat = "bf16") -> float:
    """Bytes of weights: ``num_params x bits_per_weight / 8`` (Pope et al. 2022, section 3.1)."""
    _check_positive("num_params", num_params)
    return num_params * parse_weight_format(fmt).bits_per_weight / 8


def weight_bytes_per_tensor(tensors: Iterable[tuple[float, float]]) -> float:
    """Bytes of a checkpoint given its real per-tensor widths: ``sum(numel x bits / 8)``.

    Args:
        tensors: ``(numel, bits_per_element)`` pairs, e.g. Q4_1 blocks at 5.0 bits and F32 norms at 32.
    """
    total = 0.0
    for numel, bits in tensors:
        _check_non_negative("numel", numel)
        _check_positive("bits_per_element", bits)
        total += numel * bits / 8
    return total


def kv_dtype_bytes(kv_dtype: str) -> float:
    """Bytes per KV element for ``kv_dtype``, a short name or the engine's (``bfloat16``, ``fp8``,
    ``torch.float8_e4m3fn``: :func:`canonical_dtype`); raises ``ValueError`` listing the known dtypes."""
    name = canonical_dtype(kv_dtype)
    if name not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; known: {', '.join(KV_DTYPE_BYTES)}")
    return KV_DTYPE_BYTES[name]


def kv_scale_bytes(kv_dtype: str) -> float:
    """Scale bytes per token per KV head (for each of K and V) of ``kv_dtype``: 4 for int8, else 0.

    Raises:
        ValueError: an unknown ``kv_dtype`` (lists the known ones).
    """
    kv_dtype_bytes(kv_dtype)
    return KV_SCALE_BYTES.get(canonical_dtype(kv_dtype), 0.0)


def kv_bytes_per_sequence(num_layers: int, num_kv_heads: int, head_dim: int,
                          context_tokens: int, kv_bytes_per_element: float = 2.0,
                          scale_bytes_per_head: float = 0.0) -> float:
    """KV-cache bytes of one sequence:
    ``2 (K and V) x layers x kv_heads x (head_dim x bytes + scale bytes) x tokens`` (Pope et al. 2022,
    section 3.3; the per-token, per-head scale of a quantized cache is counted too)."""
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("kv_bytes_per_element", kv_bytes_per_element)):
        _check_positive(name, v)
    _check_non_negative("context_tokens", context_tokens)
    _check_non_negative("scale_bytes_per_head", scale_bytes_per_head)
    return 2 * num_layers * num_kv_heads * (head_dim * kv_bytes_per_element + scale_bytes_per_head) * context_tokens


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> float:
    """Bytes one token adds to the KV cache across all layers (K and V), scales included:
    ``kv_bytes_per_sequence`` at one token for the named ``kv_dtype``. The engine's KV pool sizes itself
    with this very function, so ``roofline cost --kv-dtype`` and the pool agree.

    E.g. SmolLM2-135M (30 layers, 3 KV heads, D 64): fp32 46,080; bf16 23,040; fp8_e4m3 11,520;
    int8 12,240 (= 2 x 30 x 3 x (64 + 4)).

    Raises:
        ValueError: an unknown ``kv_dtype`` (lists the known ones).
    """
    return kv_bytes_per_sequence(num_layers, num_kv_heads, head_dim, 1, kv_dtype_bytes(kv_dtype),
                                 kv_scale_bytes(kv_dtype))
