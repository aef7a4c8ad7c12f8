"""The bound model reproduces the published worksheet exactly, and ``roofline cost`` prints it.

Worksheet: fixture dense-70b-fixture-r1 on a hypothetical 3.0 TB/s, 1,000 TFLOP/s device, alpha 0.8,
gamma 4, c 0.1, plain step 25 ms. Values are compared at the worksheet's printed precision.
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys

import pytest
from hypothesis import given
from hypothesis import strategies as st

from roofline import costmodel as cm
from roofline.cost_cli import add_cost_parser, add_probe_parser, build_report, resolve_model
from roofline.hardware import load_hardware

FIX = cm.DENSE_70B_FIXTURE
BW, PEAK = 3.0e12, 1000e12
KV = 671_088_640
ALPHA, GAMMA, C, PLAIN = 0.8, 4, 0.1, 0.025


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="roofline")
    sub = parser.add_subparsers(dest="command", required=True)
    add_cost_parser(sub)
    add_probe_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


def bound(fmt: str, batch: int, positions: int = 1, kv: float = KV) -> float:
    w = cm.weight_bytes(FIX.num_params, fmt)
    return cm.step_bound(FIX.num_params, w, kv, batch, BW, PEAK, positions).bound_s


# --------------------------------------------------------------------------------------------------
# Worksheet values
# --------------------------------------------------------------------------------------------------

def test_kv_bytes_per_sequence_worksheet():
    assert FIX.kv_bytes_per_sequence(2048, "bf16") == KV
    assert cm.kv_bytes_per_sequence(80, 8, 128, 2048, 2) == 671_088_640
    assert cm.kv_bytes_per_sequence(80, 8, 128, 2048, cm.kv_dtype_bytes("fp8_e4m3")) == KV / 2


def test_kv_cache_bytes_per_token_counts_int8_scales():
    # int8: one float32 scale per token and KV head, for K and for V; fp8 e4m3: static per-head scales only.
    assert cm.kv_cache_bytes_per_token(80, 8, 128, "int8") == 2 * 80 * 8 * (128 + 4) == 168_960
    assert cm.kv_cache_bytes_per_token(80, 8, 128, "fp8_e4m3") == cm.kv_cache_bytes_per_token(80, 8, 128, "fp8") \
        == 2 * 80 * 8 * 128 == KV / 2048 / 2
    assert cm.kv_cache_bytes_per_token(30, 3, 64, "int8") == 12_240  # SmolLM2-135M, the engine's pool
    assert FIX.kv_bytes_per_sequence(2048, "int8") == 2048 * 168_960
    # 16-bit over int8 at the same bytes: 1.94x the tokens at D 128, 1.88x at D 64 (the scales' share).
    assert cm.kv_cache_bytes_per_token(80, 8, 128, "bf16") / cm.kv_cache_bytes_per_token(80, 8, 128, "int8") \
        == pytest.approx(256 / 132)
    assert cm.kv_scale_bytes("int8") == 4.0 and cm.kv_scale_bytes("bf16") == 0.0
    with pytest.raises(ValueError, match=r"unknown KV dtype 'int4'; known: fp32, bf16, fp16, fp8_e4m3, fp8, int8"):
        cm.kv_scale_bytes("int4")


def test_cli_kv_dtype_int8_counts_scales(capsys):
    assert run_cli(["cost", "--model", "dense-70b-fixture-r1", "--hardware", "worksheet", "--kv-dtype", "int8",
                    "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workload"]["kv_dtype"] == "int8"
    assert r["workload"]["kv_bytes_per_sequence"] == 2048 * 168_960


@pytest.mark.parametrize(
    "fmt, gb, gib, b1_ms, b32_ms, ratio",
    [
        ("bf16", "140.0", "130.39", "46.667", "53.825", "1.0"),
        ("fp8_e4m3", "70.0", "65.19", "23.333", "30.492", "1.0"),
        ("int4_g128", "36.3125", "33.82", "12.104", "19.262", "1.1629"),
    ],
)
def test_worksheet_per_format(fmt, gb, gib, b1_ms, b32_ms, ratio):
    w = cm.weight_bytes(FIX.num_params, fmt)
    decimals = lambda s: len(s.split(".")[1])  # noqa: E731 - printed precision of the worksheet value
    assert f"{w / 1e9:.{decimals(gb)}f}" == gb
    assert f"{w / 2**30:.2f}" == gib
    # The worksheet's batch-1 figure is the weights-only floor (no KV read).
    assert f"{bound(fmt, 1, kv=0) * 1e3:.3f}" == b1_ms
    assert f"{bound(fmt, 32) * 1e3:.3f}" == b32_ms
    r = cm.verify_cost_ratio(FIX.num_params, w, KV, 32, BW, PEAK, GAMMA)
    assert f"{r:.{decimals(ratio)}f}" == ratio


def test_batch1_with_kv_is_above_the_weights_only_figure():
    # 140e9 + 671,088,640 bytes at 3 TB/s: the KV at context 2048 adds 0.224 ms.
    assert f"{bound('bf16', 1) * 1e3:.3f}" == "46.890"
    assert bound("bf16", 1) > bound("bf16", 1, kv=0)


def test_int4_weight_bytes_exact_and_bound_memory_side():
    w = cm.weight_bytes(70e9, "int4_g128")
    assert w == pytest.approx(36_312_500_000, abs=1)
    mem = cm.memory_time(w, KV, 32, BW)
    comp = cm.compute_time(70e9, 32, 5, PEAK)
    assert f"{mem * 1e3:.3f}" == "19.262"
    assert f"{comp * 1e3:.1f}" == "22.4"  # verify of 5 positions is compute-bound, hence 1.1629
    assert cm.compute_time(70e9, 32, 1, PEAK) == pytest.approx(4.48e-3)


def test_int4_speculative_speedup_at_batch():
    w = cm.weight_bytes(70e9, "int4_g128")
    r = cm.verify_cost_ratio(70e9, w, KV, 32, BW, PEAK, GAMMA)
    assert f"{cm.speculative_speedup(ALPHA, GAMMA, C, r):.4f}" == "2.1509"


def test_speculation_worksheet():
    assert f"{cm.expected_tokens_per_step(ALPHA, GAMMA):.4f}" == "3.3616"
    assert f"{cm.speculative_speedup(ALPHA, GAMMA, C):.4f}" == "2.4011"
    assert f"{cm.iteration_time(PLAIN, GAMMA, C) * 1e3:.1f}" == "35.0"
    assert f"{cm.average_tpot(PLAIN, ALPHA, GAMMA, C) * 1e3:.4f}" == "10.4117"


@pytest.mark.parametrize(
    "alpha, c, tokens, speedup",
    [(0.6, 0.1, "2.3056", "1.65"), (0.8, 0.5, None, "1.12"), (0.2, 0.1, None, "0.89")],
)
def test_speculation_sensitivity(alpha, c, tokens, speedup):
    if tokens is not None:
        assert f"{cm.expected_tokens_per_step(alpha, GAMMA):.4f}" == tokens
    s = cm.speculative_speedup(alpha, GAMMA, c)
    assert f"{s:.2f}" == speedup
    assert (s < 1) == (alpha == 0.2)  # alpha 0.2 is slower than plain decoding


def test_int4_gain_is_279_not_386():
    gain = bound("bf16", 32) / bound("int4_g128", 32)
    bit_ratio = 16 / 4.15
    assert f"{gain:.2f}" == "2.79"
    assert f"{bit_ratio:.2f}" == "3.86"
    # Without KV the gain would be the bit ratio: the KV reads are what do not shrink.
    assert bound("bf16", 32, kv=0) / bound("int4_g128", 32, kv=0) == pytest.approx(bit_ratio)


# --------------------------------------------------------------------------------------------------
# Formulas beyond the worksheet
# --------------------------------------------------------------------------------------------------

def test_formats_custom_and_per_tensor():
    assert cm.parse_weight_format("int8").bits_per_weight == 8
    assert cm.parse_weight_format("int4_g64").bits_per_weight == 4 + 20 / 64
    assert cm.parse_weight_format("int4_g128").bits_per_weight == 4.15  # named value wins over the formula
    assert cm.WeightFormat.grouped(3, 32, zero_bits=0).bits_per_weight == 3.5
    assert cm.parse_weight_format("5.5").bits_per_weight == 5.5
    assert cm.weight_bytes(1000, 6.0) == 750
    # Q4_1 blocks (5 bits), an F32 norm, a Q8_0 embedding (8.5 bits).
    assert cm.weight_bytes_per_tensor([(1024, 5.0), (64, 32.0), (2048, 8.5)]) == 640 + 256 + 2176


def test_unknown_format_and_dtype_errors_name_value():
    with pytest.raises(ValueError, match=r"unknown weight format 'nf3'.*bf16, fp16, fp8_e4m3, int8, int4_g128"):
        cm.parse_weight_format("nf3")
    with pytest.raises(ValueError, match=r"bits_per_weight must be in \(0, 64\], got 0.0"):
        cm.parse_weight_format("0")
    with pytest.raises(ValueError, match=r"unknown KV dtype 'fp4'"):
        cm.kv_dtype_bytes("fp4")
    with pytest.raises(ValueError, match=r"alpha \(acceptance rate\) must be in \[0, 1\), got 1.0"):
        cm.expected_tokens_per_step(1.0, 4)
    with pytest.raises(ValueError, match=r"gamma .* integer >= 0, got -1"):
        cm.expected_tokens_per_step(0.5, -1)
    with pytest.raises(ValueError, match=r"batch must be a finite number >= 0, got -2"):
        cm.memory_time(1.0, 1.0, -2, BW)


def test_step_bound_intensity_and_ridge():
    w = cm.weight_bytes(70e9, "bf16")
    sb = cm.step_bound(70e9, w, KV, 32, BW, PEAK)
    assert sb.bound_by == "memory"
    assert sb.hardware_ratio == pytest.approx(1000 / 3)
    assert sb.arithmetic_intensity == pytest.approx(2 * 70e9 * 32 / (140e9 + 32 * KV))
    assert sb.arithmetic_intensity < sb.hardware_ratio
    sb_verify = cm.step_bound(70e9, cm.weight_bytes(70e9, "int4_g128"), KV, 32, BW, PEAK, positions=5)
    assert sb_verify.bound_by == "compute" and sb_verify.arithmetic_intensity > sb_verify.hardware_ratio


def test_min_compute_bound_batch():
    p = 70e9
    w4 = cm.weight_bytes(p, "int4_g128")
    # b (0.7 ms - 0.2237 ms) >= 12.104 ms  ->  b >= 25.41.
    assert cm.min_compute_bound_batch(p, w4, KV, BW, PEAK, positions=5) == 26
    assert cm.compute_time(p, 26, 5, PEAK) >= cm.memory_time(w4, KV, 26, BW)
    assert cm.compute_time(p, 25, 5, PEAK) < cm.memory_time(w4, KV, 25, BW)
    # One position: 0.14 ms of FLOPs per sequence < 0.224 ms of KV reads, never compute-bound.
    assert cm.min_compute_bound_batch(p, w4, KV, BW, PEAK, positions=1) is None
    # Without KV: the ridge point, weights / (2 P / peak) x bandwidth ... = 1000/3 / (16/8) x 2 -> 334.
    assert cm.min_compute_bound_batch(p, cm.weight_bytes(p, "bf16"), 0.0, BW, PEAK) == 334


def test_fits_on_device_with_reserve():
    f = cm.fits_on_device(140e9, KV, 1, 141e9)  # 10% reserve = 14.1 GB
    assert f["fits"] is False and f["max_batch"] == 0 and f["reserve_bytes"] == pytest.approx(14.1e9)
    f = cm.fits_on_device(36.3125e9, KV, 32, 80e9, reserve_bytes=4e9)
    assert f["fits"] is True
    assert f["max_batch"] == int((80e9 - 4e9 - 36.3125e9) // KV) == 59
    assert cm.fits_on_device(36.3125e9, KV, 60, 80e9, reserve_bytes=4e9)["fits"] is False


def test_break_even_and_best_gamma():
    a = cm.break_even_alpha(GAMMA, C)
    assert cm.speculative_speedup(a, GAMMA, C) == pytest.approx(1.0, abs=1e-9)
    assert cm.speculative_speedup(a - 1e-3, GAMMA, C) < 1 < cm.speculative_speedup(a + 1e-3, GAMMA, C)
    assert f"{a:.4f}" == "0.2871"
    assert cm.break_even_alpha(4, 0.0) == 0.0  # free drafts never lose
    assert cm.break_even_alpha(1, 1.0) is None  # 1 + 1 >= gamma + 1: never wins
    g, s = cm.best_gamma(ALPHA, C)
    assert (g, f"{s:.4f}") == (6, "2.4696")
    assert s == max(cm.speculative_speedup(ALPHA, k, C) for k in range(1, 9))
    # At batch the verify ratio grows with gamma, which pulls the best gamma down (int4: 3).
    w4 = cm.weight_bytes(70e9, "int4_g128")
    g4, _ = cm.best_gamma(ALPHA, C, lambda k: cm.verify_cost_ratio(70e9, w4, KV, 32, BW, PEAK, k))
    assert g4 == 3


@given(st.floats(0.0, 0.999), st.integers(0, 12))
def test_expected_tokens_matches_series(alpha, gamma):
    # E = sum_{i=0}^{gamma} alpha^i, the mean of a capped geometric (Leviathan et al. 2023, eq. 1).
    series = sum(alpha**i for i in range(gamma + 1))
    assert cm.expected_tokens_per_step(alpha, gamma) == pytest.approx(series, rel=1e-9)
    assert 1.0 <= cm.expected_tokens_per_step(alpha, gamma) <= gamma + 1 + 1e-9


def test_decode_floor_report_text_and_fraction():
    # 12.3 ms floor from 36.9e9 bytes at 3 TB/s, measured 41.2 ms.
    r = cm.decode_floor_report(36_000_000_000, 0.9e9, 2 * 70e9, 3.0e12, 1000e12, 0.0412)
    assert r["floor_s"] == pytest.approx(0.0123)
    assert r["fraction_of_floor"] == pytest.approx(0.0123 / 0.0412)
    assert r["text"] == "decode step 41.2 ms, floor 12.3 ms (30% of floor)"
    assert r["bound_by"] == "memory" and r["measured_s"] == 0.0412
    # Compute-bound when the FLOPs dominate; memory-only when no peak is given.
    rc = cm.decode_floor_report(1_000, 0.0, 2e13, 1e12, 1e15, 0.05)
    assert rc["bound_by"] == "compute" and rc["floor_s"] == pytest.approx(0.02)
    assert rc["text"] == "decode step 50.0 ms, floor 20.0 ms (40% of floor)"
    rm = cm.decode_floor_report(1_000_000, 0.0, 2e13, 1e9, None, 0.002)
    assert rm["compute_floor_s"] == 0.0 and rm["text"] == "decode step 2.0 ms, floor 1.0 ms (50% of floor)"
    with pytest.raises(ValueError, match=r"measured_step_s must be a finite number > 0, got 0"):
        cm.decode_floor_report(1, 0, 0, 1e9, None, 0)


def test_costmodel_imports_no_torch():
    code = "import sys, roofline.costmodel, roofline.hardware, roofline.cost_cli; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_docstrings_cite_papers_and_say_lower_bound():
    import inspect

    src = inspect.getsource(cm)
    assert "Pope et al. 2022" in src and "Efficiently Scaling Transformer Inference" in src
    assert "Leviathan et al. 2023" in src and "Fast Inference from Transformers via Speculative Decoding" in src
    assert "lower bound" in cm.memory_time.__doc__.lower() and "lower bound" in cm.compute_time.__doc__.lower()


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

WORKSHEET_ARGS = ["cost", "--model", "dense-70b-fixture-r1", "--hardware", "worksheet"]


def test_cli_json_prints_worksheet_values(capsys):
    assert run_cli([*WORKSHEET_ARGS, "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["workload"]["kv_bytes_per_sequence"] == KV
    rows = {x["format"]: x for x in r["formats"]}
    assert list(rows) == ["bf16", "fp8_e4m3", "int4_g128"]
    got = {n: (f"{x['weight_gb']:.4f}", f"{x['weight_gib']:.2f}",
               f"{x['batch1_weights_only_lower_bound_s'] * 1e3:.3f}", f"{x['step_lower_bound_s'] * 1e3:.3f}",
               f"{x['verify_cost_ratio']:.4f}") for n, x in rows.items()}
    assert got == {"bf16": ("140.0000", "130.39", "46.667", "53.825", "1.0000"),
                   "fp8_e4m3": ("70.0000", "65.19", "23.333", "30.492", "1.0000"),
                   "int4_g128": ("36.3125", "33.82", "12.104", "19.262", "1.1629")}
    assert f"{rows['int4_g128']['speculative_speedup_at_batch']:.4f}" == "2.1509"
    assert f"{rows['int4_g128']['gain_vs_bf16']:.2f}" == "2.79"
    assert f"{rows['int4_g128']['bit_ratio_vs_bf16']:.2f}" == "3.86"
    sp = r["speculation"]
    assert f"{sp['expected_tokens_per_step']:.4f}" == "3.3616"
    assert f"{sp['speedup_free_verification']:.4f}" == "2.4011"
    assert f"{sp['iteration_lower_bound_s'] * 1e3:.1f}" == "35.0"
    assert f"{sp['average_tpot_lower_bound_s'] * 1e3:.4f}" == "10.4117"
    assert r["hardware"]["source"] == "hypothetical"
    assert "latency" not in json.dumps(r)
    assert all(k.endswith("lower_bound_s") for k in rows["bf16"] if k.endswith("_s"))


def test_cli_table_labels_lower_bounds(capsys):
    assert run_cli(WORKSHEET_ARGS) == 0
    out = capsys.readouterr().out
    assert "All times are lower bounds" in out
    for line in out.splitlines():
        if " ms" in line and "plain step" not in line:
            assert "lower bound" in line, line
        assert "latency" not in line.lower() or "not latencies" in line
    assert "671,088,640 bytes per sequence" in out
    assert "53.825 ms" in out and "19.262 ms" in out and "1.1629" in out and "2.79x" in out and "3.86x" in out
    assert "10.4117 ms" in out and "35.0000 ms" in out


@pytest.mark.parametrize("kind, n_rows", [("alpha", 20), ("gamma", 8), ("batch", 11)])
def test_cli_sweeps(capsys, kind, n_rows):
    assert run_cli([*WORKSHEET_ARGS, "--sweep", kind, "--json"]) == 0
    sw = json.loads(capsys.readouterr().out)["sweep"]
    assert sw["kind"] == kind and len(sw["rows"]) == n_rows
    if kind == "alpha":
        row = next(x for x in sw["rows"] if x["alpha"] == 0.6)
        assert f"{row['speedup_free_verification']:.2f}" == "1.65"
    elif kind == "gamma":
        row = sw["rows"][3]
        assert row["gamma"] == 4 and f"{row['verify_cost_ratio']['int4_g128']:.4f}" == "1.1629"
    else:
        row = next(x for x in sw["rows"] if x["batch"] == 32)
        assert f"{row['step_lower_bound_s']['bf16'] * 1e3:.3f}" == "53.825"


def test_cli_plot_writes_png(tmp_path, capsys):
    out = tmp_path / "cost.png"
    assert run_cli([*WORKSHEET_ARGS, "--plot", str(out)]) == 0
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image as mpimg

    img = mpimg.imread(out)
    assert img.shape[0] > 300 and img.shape[1] > 600 and img.std() > 0.01  # not blank


def test_cli_hf_config_and_engine_preset(tmp_path, capsys):
    from roofline.config import model_preset

    cfg = model_preset("llama-3-8b").to_hf_config()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for spec in (str(tmp_path), str(tmp_path / "config.json"), "llama-3-8b"):
        shape, _ = resolve_model(spec)
        assert shape.num_params == model_preset("llama-3-8b").num_params == 8_030_261_248
        assert (shape.num_layers, shape.num_kv_heads, shape.head_dim) == (32, 8, 128)
    assert run_cli(["cost", "--model", str(tmp_path), "--hardware", "h100-sxm", "--format", "int8",
                    "--batch", "1", "--context", "0", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    # 8.03e9 bytes at 3.35 TB/s.
    assert r["formats"][0]["step_lower_bound_s"] == pytest.approx(8_030_261_248 / 3.35e12)
    assert r["formats"][0]["fits"]["fits"] is True


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--batch", "-1"], "--batch must be an integer >= 1, got -1"),
        (["--alpha", "1.0"], "--alpha must be in [0, 1), got 1.0"),
        (["--alpha", "-0.1"], "--alpha must be in [0, 1), got -0.1"),
        (["--gamma", "0"], "--gamma must be an integer in [1, 64], got 0"),
        (["--draft-cost", "-1"], "--draft-cost must be a finite number >= 0, got -1.0"),
        (["--format", "int3"], "unknown weight format 'int3'"),
        (["--kv-dtype", "fp4"], "unknown KV dtype 'fp4'"),
        (["--hardware", "tpu-v9"], "unknown hardware 'tpu-v9'; known presets: h100-sxm, h200, a100-80gb, worksheet"),
        (["--model", "gpt-9"], "unknown model 'gpt-9'; known presets: dense-70b-fixture-r1"),
    ],
)
def test_cli_bad_values_exit_2_with_message(capsys, extra, message):
    argv = [*WORKSHEET_ARGS, *extra]
    assert run_cli(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("roofline cost: error: ")
    assert message in err
    assert "Traceback" not in err


def test_module_entry_point_runs():
    out = subprocess.run([sys.executable, "-m", "roofline.cost_cli", *WORKSHEET_ARGS, "--json"],
                         capture_output=True, text=True, check=True).stdout
    assert json.loads(out)["formats"][2]["format"] == "int4_g128"
    bad = subprocess.run([sys.executable, "-m", "roofline.cost_cli", *WORKSHEET_ARGS, "--batch", "-3"],
                         capture_output=True, text=True)
    assert bad.returncode == 2 and "got -3" in bad.stderr and "Traceback" not in bad.stderr


def test_build_report_default_plain_step_is_first_format_bound():
    shape, _ = resolve_model("dense-70b-fixture-r1")
    r = build_report(shape, load_hardware("worksheet"), ["fp8_e4m3"], "bf16", 32, 2048, ALPHA, GAMMA, C, None)
    assert r["speculation"]["plain_step_s"] == pytest.approx(bound("fp8_e4m3", 32))
    assert r["speculation"]["iteration_lower_bound_s"] == pytest.approx(bound("fp8_e4m3", 32) * 1.4)
    assert math.isclose(r["hardware_ratio_flop_per_byte"], 1000 / 3)
