"""The bound model speaks the engine's dtype names (vLLM's ``--dtype``, ``--kv-cache-dtype``, ``--quantization``
and torch's dtype names) beside its own short ones, with one vocabulary (``costmodel.formats``), so no caller
keeps a bridge of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest

from roofline import costmodel as cm
from roofline.hardware import HARDWARE_PRESETS


@pytest.mark.parametrize("engine, short", [
    ("bfloat16", "bf16"), ("float16", "fp16"), ("float32", "fp32"), ("fp8", "fp8_e4m3"),
    ("torch.bfloat16", "bf16"), ("torch.float8_e4m3fn", "fp8_e4m3"), ("torch.int8", "int8"),
    ("bf16", "bf16"), ("int8", "int8"), ("fp8_e4m3", "fp8_e4m3"), ("int4_g64", "int4_g64"),
])
def test_canonical_dtype_maps_engine_names_to_the_short_ones(engine, short):
    assert cm.canonical_dtype(engine) == short


def test_canonical_dtype_reads_a_torch_dtype_through_str():
    torch = pytest.importorskip("torch")
    assert [cm.canonical_dtype(d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn)] == [
        "bf16", "fp16", "fp32", "fp8_e4m3"]


@pytest.mark.parametrize("engine, name, bits", [
    ("bfloat16", "bf16", 16.0), ("float16", "fp16", 16.0),  # --dtype
    ("int4", "int4_g128", 4.15), ("int8", "int8", 8.0), ("fp8", "fp8_e4m3", 8.0), ("smoothquant", "int8", 8.0),
])
def test_weight_formats_accept_engine_names(engine, name, bits):
    fmt = cm.parse_weight_format(engine)
    assert (fmt.name, fmt.bits_per_weight) == (name, bits)
    assert cm.weight_bytes(8e9, engine) == cm.weight_bytes(8e9, name) == 8e9 * bits / 8


def test_checkpoint_formats_and_float32_weights_are_not_guessed():
    for spec in ("gptq", "awq", "compressed-tensors", "float32"):
        with pytest.raises(ValueError, match=rf"unknown weight format '{spec}'; known: bf16, fp16, fp8_e4m3, int8"):
            cm.parse_weight_format(spec)


def test_kv_bytes_accept_engine_names():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64 (the numbers of kv_cache_bytes_per_token's docstring).
    per_token = {n: cm.kv_cache_bytes_per_token(30, 3, 64, n) for n in
                 ("float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "int8", "torch.float8_e4m3fn")}
    assert per_token == {"float32": 46080, "bfloat16": 23040, "float16": 23040, "fp8": 11520, "fp8_e4m3": 11520,
                         "int8": 12240, "torch.float8_e4m3fn": 11520}
    assert cm.kv_scale_bytes("torch.int8") == 4.0 and cm.kv_scale_bytes("bfloat16") == 0.0
    with pytest.raises(ValueError, match=r"unknown KV dtype 'int4'; known: fp32, bf16, fp16, fp8_e4m3, fp8, int8"):
        cm.kv_dtype_bytes("int4")  # a weight-only quantization name is not a KV dtype


def test_hardware_peak_accepts_engine_names():
    h200 = HARDWARE_PRESETS["h200"]
    assert h200.peak("bfloat16") == h200.peak("bf16") == 989e12
    assert h200.peak("torch.float16") == 989e12
    assert h200.peak("fp8_e4m3") == h200.peak("fp8") == 1979e12
    with pytest.raises(ValueError, match=r"a100-80gb has no peak FLOP/s for dtype 'fp8_e4m3'; known: bf16, fp16"):
        HARDWARE_PRESETS["a100-80gb"].peak("fp8_e4m3")


def test_measure_gemm_flops_accepts_engine_names():
    pytest.importorskip("torch")
    from roofline.hardware import measure_gemm_flops

    assert measure_gemm_flops("cpu", "float32", n=64, rounds=1) > 0
    assert measure_gemm_flops("cpu", "int8", n=64, rounds=1) > 0  # torch._int_mm, the W8A8 formats' GEMM
    with pytest.raises(ValueError, match=r"dtype must be one of auto, bf16, fp16, fp32, int8; got 'int4'"):
        measure_gemm_flops("cpu", "int4", n=64, rounds=1)


def test_bench_attention_counts_kv_bytes_in_engine_names():
    from roofline.bench.attention import decode_kv_bytes

    assert decode_kv_bytes(2, 16, 8, 128, "float16") == decode_kv_bytes(2, 16, 8, 128, "bfloat16") == 2 * 16 * 2 * 8 * 128 * 2


def test_cost_package_and_its_cli_import_no_torch():
    code = ("import sys, roofline.costmodel, roofline.costmodel.artifact, roofline.costmodel.table, "
            "roofline.costmodel.plot, roofline.costmodel.links, roofline.config; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
