"""The quantization methods by name (vLLM's ``get_quantization_config``): ``--quantization`` values and
checkpoint ``quant_method`` names, each to its ``QuantConfig`` class, imported on first use.

A new format is one file (its ``LinearMethod`` and ``QuantConfig`` with ``from_config``) plus one line
here (and its name in ``roofline.config.QUANTIZATION_METHODS``, the CLI's choices).
"""

from __future__ import annotations

import importlib

from roofline.quant.base import QuantConfig

QUANTIZATION_CONFIGS: dict[str, str] = {
    "int8": "roofline.quant.int8:Int8Config",
    "int4": "roofline.quant.int4:Int4Config",
    "fp8": "roofline.quant.fp8:Fp8Config",
    "smoothquant": "roofline.quant.smoothquant:SmoothQuantConfig",
    "gptq": "roofline.quant.int4:GPTQConfig",
    "awq": "roofline.quant.int4:AWQConfig",
    "compressed-tensors": "roofline.quant.compressed_tensors:CompressedTensorsConfig",
}


def get_quantization_config(name: str) -> type[QuantConfig]:
    """The ``QuantConfig`` class registered as ``name``.

    Raises:
        ValueError: an unregistered name (lists the registered ones).
    """
    if name not in QUANTIZATION_CONFIGS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CONFIGS)} (or None), got {name!r}")
    module, _, cls = QUANTIZATION_CONFIGS[name].partition(":")
    return getattr(importlib.import_module(module), cls)
