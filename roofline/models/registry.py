"""Architecture name -> model class. One implementation serves the whole Llama family."""

from __future__ import annotations

from torch import nn

from roofline.attention.backend import AttentionBackend
from roofline.config import SUPPORTED_ARCHITECTURES, ModelConfig
from roofline.quant.base import QuantConfig


def build_model(config: ModelConfig, backend: AttentionBackend, quant_config: QuantConfig | None = None) -> nn.Module:
    """Instantiate the model class for ``config.architecture``.

    Raises:
        ValueError: unsupported architecture (names it and lists the supported ones).
    """
    family = SUPPORTED_ARCHITECTURES.get(config.architecture)
    if family == "llama":
        from roofline.models.llama import LlamaForCausalLM

        return LlamaForCausalLM(config, backend, quant_config)
    raise ValueError(
        f"unsupported architecture {config.architecture!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
    )
