"""Quantization methods. Each is a ``LinearMethod``; the model never knows which one is in use."""

from roofline.quant.base import LinearMethod, QuantConfig, UnquantizedLinearMethod

__all__ = ["LinearMethod", "QuantConfig", "UnquantizedLinearMethod"]
