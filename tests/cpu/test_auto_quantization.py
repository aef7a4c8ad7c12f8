"""``--quantization auto``: the fastest weight format for this device, chosen at configuration and printed at
start-up with its measured quality (``roofline.cpu.auto_quantization``): INT8 W8A8 with bf16 activations on a
CPU with AVX-512 VNNI and bf16 units, else none; a named dtype other than bf16 keeps full-precision weights, a
quantized checkpoint keeps its own format."""

from __future__ import annotations

import pytest

from roofline.args import EngineArgs
from roofline.cpu import CpuFeatures, auto_quantization, detect_cpu_features

XEON = CpuFeatures("Intel Xeon", 2, True, True, True, True, True)
EPYC = CpuFeatures("AMD EPYC", 2, True, True, True, False, False)  # AVX-512 BF16 + VNNI, no AMX
OLD = CpuFeatures("old", 2, True, False, False, False, False)  # AVX-512F only


def test_picks_int8_with_bf16_where_the_cpu_has_vnni_and_bf16_units():
    for cpu in (XEON, EPYC):
        q, dtype, note = auto_quantization(cpu, "auto", default_model=True)
        assert (q, dtype) == ("int8", "bfloat16")
        assert "perplexity 6.989 vs 6.723 fp32 (+3.95%" in note and "passkey 0.6 vs 1.0" in note
        assert "at 32 rows bf16 is ~2.7x faster here" in note
    q, dtype, note = auto_quantization(XEON, "bfloat16", default_model=False)
    assert (q, dtype) == ("int8", "bfloat16")
    assert "quality not measured for this model here" in note
    assert "roofline eval --model MODEL --device cpu --candidates dtype=bfloat16 dtype=bfloat16,quantization=int8" in note


def test_keeps_full_precision_where_int8_would_not_pay():
    q, dtype, note = auto_quantization(OLD, "auto")
    assert (q, dtype) == (None, "auto") and "lacks AVX-512 VNNI or bf16 units" in note
    q, dtype, note = auto_quantization(XEON, "float32")
    assert (q, dtype) == (None, "float32") and "--dtype is float32" in note


def test_engine_config_resolves_auto_and_names_it():
    from roofline.config import ModelConfig

    MODEL = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,  # noqa: N806
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    want_q, want_dtype, want_note = auto_quantization(detect_cpu_features(), "auto", default_model=True)
    cfg = EngineArgs(device="cpu", quantization="auto").create_engine_config(MODEL)
    assert cfg.quantization == want_q and cfg.quantization_note == want_note
    assert cfg.dtype == (want_dtype if want_dtype != "auto" else "float32")
    named = EngineArgs(device="cpu", quantization="int8").create_engine_config(MODEL)
    assert named.quantization == "int8" and named.quantization_note is None and named.dtype == "float32"
    with pytest.raises(ValueError, match=r"quantization must be one of int8, .*compressed-tensors, auto \(or None\), "
                                         r"got 'fastest'"):
        EngineArgs(quantization="fastest")


def test_cli_accepts_auto_and_generate_prints_the_choice(capsys):
    from roofline.cli import main

    if auto_quantization(detect_cpu_features(), "auto")[0] is None:
        pytest.skip("this CPU keeps full precision under auto (covered above)")
    main(["generate", "--quantization", "auto", "--prompt", "The capital of France is", "--max-tokens", "4",
          "--floor", "none", "--no-progress", "--max-model-len", "256"])
    out = capsys.readouterr().out
    assert "dtype bfloat16, quantization int8" in out
    assert "quantization auto: int8 (W8A8 with bf16 activations" in out and "top-1 agreement 0.915" in out
    assert "generated tokens:   4" in out


def test_a_quantized_checkpoint_keeps_its_format(tmp_path):
    """auto on a checkpoint with a quantization_config adds nothing and keeps the dtype; the note says why."""
    import json

    from roofline.config import ModelConfig

    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 128, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "quantization_config": {"quant_method": "gptq", "bits": 4}}))
    model = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    cfg = EngineArgs(model=str(tmp_path), device="cpu", quantization="auto").create_engine_config(model)
    assert cfg.quantization is None and cfg.dtype == "float32"
    assert cfg.quantization_note == "none added: the checkpoint is quantized (gptq); its own format runs"


@pytest.mark.parametrize("var", ["ROOFLINE_CPU_PLAN", "ROOFLINE_CPU_AMX", "ROOFLINE_CPU_GEMV"])
def test_cpu_switches_take_0_or_1(monkeypatch, var):
    from roofline.config import ModelConfig

    model = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)
    monkeypatch.setenv(var, "off")
    with pytest.raises(ValueError, match=f"{var}='off': must be 0 \\(off\\) or 1 \\(on, the default\\)"):
        EngineArgs(device="cpu").create_engine_config(model)
    monkeypatch.setenv(var, "0")
    EngineArgs(device="cpu").create_engine_config(model)
