"""compressed-tensors checkpoints (llm-compressor): each scheme reads into the per-channel 8-bit method that
runs it (``roofline.quant.formats.compressed_tensors`` has the tensor layouts)."""

from __future__ import annotations

from roofline.quant.base import ChannelQuantConfig, QuantConfig, checkpoint_only
from roofline.quant.fp8 import Fp8Config
from roofline.quant.int8 import Int8Config
from roofline.quant.smoothquant import SmoothQuantConfig

# The load-time config each compressed-tensors scheme (``formats.CT_SCHEMES``) reads into.
CONFIG_OF_SCHEME: dict[str, type[ChannelQuantConfig]] = {
    "fp8-dynamic": Fp8Config, "int8-dynamic": SmoothQuantConfig, "w8a16-int8": Int8Config}


class CompressedTensorsConfig(QuantConfig):
    """FP8 W8A8, INT8 W8A8 (dynamic per token) and INT8 W8A16 compressed-tensors checkpoints."""

    name = "compressed-tensors"

    @classmethod
    def from_config(cls, checkpoint=None, group_size: int = 128) -> ChannelQuantConfig:
        spec = checkpoint_only(cls.name, checkpoint)
        return CONFIG_OF_SCHEME[spec.scheme].from_config(spec)
