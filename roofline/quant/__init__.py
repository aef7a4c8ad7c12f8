"""Quantization methods. Each is a ``LinearMethod``; the model never knows which one is in use.

``get_quant_config`` turns ``--quantization`` and a checkpoint's ``quantization_config`` into the
``QuantConfig`` the model's linear layers ask for their method:

======================  ==========================================  =====================================
``--quantization``      weights / activations                       on an unquantized model
======================  ==========================================  =====================================
``int8``                INT8 per channel / 16-bit (W8A16; on CPU    round to nearest at load
                        INT8 per token, W8A8: ``cpu_int8``)
``int4``                INT4 groups of 128 (32, 64) with zeros       round to nearest at load
``fp8``                 E4M3 per channel / E4M3 per token (W8A8)    at load (dynamic activation scales)
``smoothquant``         INT8 per channel / INT8 per token (W8A8)    at load, without smoothing
``gptq``, ``awq``       INT4 from a GPTQ / AutoAWQ checkpoint       (needs that checkpoint)
``compressed-tensors``  FP8 / INT8 W8A8 or INT8 W8A16 checkpoints   (needs that checkpoint)
======================  ==========================================  =====================================

A checkpoint with a ``quantization_config`` is read in its own format without the flag (as vLLM does);
a flag that contradicts the checkpoint is an error.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from roofline.config import QUANTIZATION_METHODS
from roofline.quant.base import LinearMethod, QuantConfig, UnquantizedLinearMethod
from roofline.quant.registry import QUANTIZATION_CONFIGS, get_quantization_config


def check_quantization(quantization: str | None) -> None:
    """Raises ValueError listing the choices when ``quantization`` is not None or one of them."""
    if quantization is not None and quantization not in QUANTIZATION_CONFIGS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CONFIGS)} (or None), "
                         f"got {quantization!r}")


def checkpoint_method(spec: Any) -> str:
    """The ``--quantization`` method a parsed checkpoint config (``formats.QuantSpec``) loads as."""
    return get_quantization_config(spec.format).from_config(spec).name


def get_quant_config(quantization: str | None, checkpoint_config: Mapping[str, Any] | None = None,
                     group_size: int = 128) -> QuantConfig | None:
    """The weight format of a model: the registered config's ``from_config`` (``roofline.quant.registry``).

    Args:
        quantization: ``--quantization`` (None: the checkpoint's own format, or 16-bit weights).
        checkpoint_config: the checkpoint's ``quantization_config`` (config.json), or None.
        group_size: INT4 group size for load-time ``int4`` (32, 64 or 128).

    Returns:
        None for 16-bit weights, else the QuantConfig.

    Raises:
        ValueError: an unknown method (lists the choices); a checkpoint-only method without such a
            checkpoint; a method that contradicts the checkpoint's (names both); a malformed
            ``quantization_config`` (names the field).
    """
    from roofline.quant.formats import parse_quantization_config

    check_quantization(quantization)
    if checkpoint_config is None:
        if quantization is None:
            return None
        return get_quantization_config(quantization).from_config(None, group_size)
    spec = parse_quantization_config(checkpoint_config)
    config = get_quantization_config(spec.format).from_config(spec)
    if quantization not in (None, spec.format, config.name):
        raise ValueError(f"the checkpoint is quantized with {spec.format} ({config.name}), which does not match "
                         f"quantization {quantization!r}; drop the flag or pass {spec.format!r}")
    return config


__all__ = ["LinearMethod", "QUANTIZATION_CONFIGS", "QUANTIZATION_METHODS", "QuantConfig", "UnquantizedLinearMethod",
           "check_quantization", "checkpoint_method", "get_quant_config", "get_quantization_config"]
