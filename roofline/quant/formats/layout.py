"""The declarative layout table of published checkpoint tensors (per format, each tensor's suffix, dtype and
symbolic dims), the shape/dtype check every loader runs, and the 4-bit nibble packing GPTQ and AWQ share.

Orientation: ``N`` = out_features, ``K`` = in_features, ``G = K // group_size`` groups. A 4-bit value sits in
bits ``4j .. 4j+3`` of an int32 word ("nibble j", j = 0 least significant).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

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


def pack_nibbles(v: torch.Tensor) -> torch.Tensor:
    """``v`` integer ``[..., 8]`` in [0, 15] -> int32 ``[...]``: element j in bits 4j..4j+3."""
    word = (v.to(torch.int64) << _SHIFTS4.to(v.device)).sum(dim=-1)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32)  # two's-complement view


def unpack_nibbles(words: torch.Tensor) -> torch.Tensor:
    """int32 ``[...]`` -> uint8 ``[..., 8]``: element j is bits 4j..4j+3."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    return ((w[..., None] >> _SHIFTS4.to(words.device)) & 0xF).to(torch.uint8)
