"""The quantization registry (``roofline.quant.registry``, vLLM's ``get_quantization_config`` shape) and the
package's layering: every ``--quantization`` name resolves to a config built by ``from_config``, one generic
config serves the per-channel 8-bit family, a new format is one file plus one registry line, and ``quant/``
imports nothing from ``bench/``, ``eval/`` or the ``LLM`` entry point."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

import roofline
from roofline.config import QUANTIZATION_METHODS
from roofline.quant import get_quant_config, registry
from roofline.quant.base import ChannelQuantConfig, FormatQuantConfig, LinearMethod, UnquantizedLinearMethod
from roofline.quant.formats import make_quantization_config
from roofline.quant.fp8 import Fp8Config
from roofline.quant.int4 import Int4Config
from roofline.quant.int8 import Int8Config
from roofline.quant.smoothquant import SmoothQuantConfig

QUANT_DIR = Path(roofline.__file__).parent / "quant"
# Modules above quant/ in the layering: quant/ must not import them.
FORBIDDEN = ("roofline.bench", "roofline.eval", "roofline.llm", "roofline.calibration", "roofline.quantize_cli",
             "roofline.cli", "roofline.commands", "roofline.worker", "roofline.engine", "roofline.server")


def test_registry_names_are_the_cli_choices():
    assert tuple(registry.QUANTIZATION_CONFIGS) == QUANTIZATION_METHODS
    for name in QUANTIZATION_METHODS:
        assert registry.get_quantization_config(name).name == name
    with pytest.raises(ValueError, match="quantization must be one of int8, int4, fp8, smoothquant, gptq, awq, "
                                         r"compressed-tensors \(or None\), got 'hqq'"):
        registry.get_quantization_config("hqq")


@pytest.mark.parametrize("name,cls", [("int8", Int8Config), ("fp8", Fp8Config), ("smoothquant", SmoothQuantConfig)])
def test_one_generic_config_for_the_per_channel_family(name, cls):
    """int8, fp8 and smoothquant differ only in name and method classes (the INT8 ones also have an LM head method,
    W8A8 on CPU); at load and from a compressed-tensors checkpoint of the matching scheme they build the same
    generic config."""
    assert cls.__bases__ == (ChannelQuantConfig,)
    head = {"lm_head_method_cls"} if name in ("int8", "smoothquant") else set()
    assert {k for k in vars(cls) if not k.startswith("_")} == {"name", "linear_method_cls"} | head
    at_load = get_quant_config(name)
    assert type(at_load) is cls and at_load.checkpoint is None
    method = at_load.get_linear_method(nn.Linear(4, 4), "model.layers.0.mlp.down_proj")
    assert type(method) is cls.linear_method_cls and method.checkpoint is None
    scheme = {"int8": "w8a16-int8", "fp8": "fp8-dynamic", "smoothquant": "int8-dynamic"}[name]
    cfg = get_quant_config(None, make_quantization_config("compressed-tensors", scheme=scheme,
                                                          ignore=["lm_head", "re:.*down_proj"]))
    assert type(cfg) is cls and cfg.checkpoint.scheme == scheme
    assert type(cfg.get_linear_method(nn.Linear(4, 4), "model.layers.0.mlp.down_proj")) is UnquantizedLinearMethod
    assert type(cfg.get_linear_method(nn.Linear(4, 4), "model.layers.0.mlp.gate_up_proj")) is cls.linear_method_cls


def test_int4_checkpoint_formats_read_into_int4():
    for fmt in ("gptq", "awq"):
        cfg = get_quant_config(fmt, make_quantization_config(fmt, group_size=32))
        assert type(cfg) is Int4Config and cfg.group_size == 32 and cfg.checkpoint.format == fmt
        with pytest.raises(ValueError, match=f"quantization '{fmt}' reads a checkpoint quantized in that format"):
            get_quant_config(fmt)
    assert get_quant_config("int4", group_size=64).group_size == 64


class _HalfMethod(LinearMethod):
    """A toy format: the weight stored in float16, multiplied in float32."""

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        layer.register_parameter("weight", nn.Parameter(
            torch.empty(sum(output_partition_sizes), input_size_per_partition, dtype=torch.float16),
            requires_grad=False))

    def apply(self, layer, x, bias=None):
        return torch.nn.functional.linear(x, layer.weight.float(), bias)


class _HalfConfig(FormatQuantConfig):
    name = "half"

    @classmethod
    def from_config(cls, checkpoint=None, group_size=128):
        return cls(checkpoint)

    def linear_method(self):
        return _HalfMethod()


def test_a_new_format_is_one_class_and_one_registry_line(monkeypatch):
    monkeypatch.setitem(registry.QUANTIZATION_CONFIGS, "half", f"{__name__}:_HalfConfig")
    cfg = get_quant_config("half")
    assert type(cfg) is _HalfConfig
    from roofline.layers.linear import ColumnParallelLinear

    layer = ColumnParallelLinear(8, 4, quant_config=cfg, prefix="model.layers.0.mlp.down_proj")
    assert layer.weight.dtype == torch.float16 and type(layer.quant_method) is _HalfMethod
    w = torch.randn(4, 8).half()
    layer.weight.data.copy_(w)
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), x @ w.float().T, rtol=0, atol=0)


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return names


def test_quant_imports_nothing_above_it():
    """Module-level and lazy (function-level) imports alike."""
    bad = [(str(p.relative_to(QUANT_DIR)), name) for p in sorted(QUANT_DIR.rglob("*.py")) for name in _imports(p)
           if any(name == f or name.startswith(f + ".") for f in FORBIDDEN)]
    assert bad == []


def test_quant_files_stay_small():
    sizes = {str(p.relative_to(QUANT_DIR)): len(p.read_text().splitlines()) for p in QUANT_DIR.rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n >= 400} == {}
