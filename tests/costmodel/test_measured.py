"""``roofline cost --quantization``: the engine's bytes per step (the floor) and the decode step predicted from the
kernels measured on the H200, checked against the decode steps ``roofline bench decode`` measured there (the
committed JSONs under ``bench/results/``)."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import pytest

from roofline import costmodel as cm
from roofline.cost_cli import add_cost_parser
from roofline.costmodel import measured as ms
from roofline.costmodel.measured_build import H200_MODEL, H200_SOURCES, build_table

ROOT = Path(__file__).resolve().parents[2]
INT4_RUN = "bench/results/int4-mma-20261204/decode-int4-mma-vs-triton-call2.json"  # the table's calibration run
QUANT_RUN = "bench/results/decode-kernels-20261204/decode-quant-2d.json"  # int8, fp8 (and an older INT4 kernel)
KV_1K = 131072 * 1024  # llama-3-8b bf16 KV bytes of one sequence at context 1024


@pytest.fixture(scope="module")
def llama8b() -> cm.ModelShape:
    from roofline.config import model_preset

    return cm.ModelShape.from_model_config(model_preset("llama-3-8b"))


@pytest.fixture(scope="module")
def table() -> dict:
    t = ms.measured_table("h200")
    assert t is not None and t["device"] == "NVIDIA H200"
    return t


def _run(path: str) -> dict:
    return json.loads((ROOT / path).read_text())


def _steps(run: dict, config: str) -> dict[int, float]:
    """``{batch: step seconds}`` of one configuration of a bench decode run."""
    return {r["batch"]: r["step_ms"] * 1e-3 for r in run["rows"] if r["config"] == config}


@pytest.mark.parametrize("path", [INT4_RUN, QUANT_RUN])
def test_engine_bytes_per_step_equal_the_workers_count_on_the_h200(llama8b, path):
    """The bound's weight bytes are the engine's real tensors, to the byte: ``Worker.weight_bytes_per_step`` as
    ``bench decode`` recorded it on the H200 (INT4: codes + bf16 scales + bf16 zeros, the mma copy not counted)."""
    for key, fmt in _run(path)["kv_formats"].items():
        q = fmt["quantization"] or "none"
        assert ms.quantized_weight_bytes_per_step(llama8b, q) == fmt["weight_bytes_per_step"], key
    # int4 by hand: codes 6,979,321,856 / 2, scales + zeros 4 bytes per 128 weights, LM head and norms in bf16
    linear = 32 * (6144 * 4096 + 4096 * 4096 + 28672 * 4096 + 4096 * 14336)
    assert linear == 6_979_321_856
    head_and_norms = 2 * (128256 * 4096 + 32 * 2 * 4096 + 4096)
    assert ms.quantized_weight_bytes_per_step(llama8b, "int4") == linear // 2 + linear // 128 * 4 + head_and_norms


def test_projection_bytes_and_errors():
    assert ms.projection_bytes(4096, 14336, "int4") == 4096 * 14336 // 2 + 14336 // 128 * 4096 * 4
    assert ms.projection_bytes(4096, 4096, "fp8") == 4096 * 4096 + 4096 * 4
    assert ms.projection_bytes(8, 16, "none") == 8 * 16 * 2
    with pytest.raises(ValueError, match=r"K = 100 is not a multiple of the int4 group size 128"):
        ms.projection_bytes(8, 100, "int4")
    with pytest.raises(ValueError, match=r"unknown --quantization 'gguf'; known: none, int4, int8, fp8"):
        ms.projection_bytes(8, 128, "gguf")
    with pytest.raises(ValueError, match=r"model 'dense-70b-fixture-r1' has no vocab_size"):
        ms.quantized_weight_bytes_per_step(cm.DENSE_70B_FIXTURE, "int4")
    with pytest.raises(ValueError, match=r"model 'dense-70b-fixture-r1' has no intermediate_size"):
        cm.DENSE_70B_FIXTURE.projection_shapes()


def test_committed_table_is_what_the_builder_makes_from_the_benchmark_jsons(table):
    """The shipped table cannot drift from its sources: rebuilt from the committed sweep, dispatch-table and bench
    decode JSONs, it is identical; and its kernels are the dispatch's (INT4 mma where the table says it won)."""
    assert json.loads(json.dumps(build_table(H200_SOURCES, H200_MODEL))) == table
    k = table["kernels_us"]
    assert [p[2] for p in k["int4"]["qkv"]] == ["mma"] * 5 + ["triton"]  # mma loses qkv at M = 64 (26.4 vs 35.1 us)
    assert k["int4"]["down"][-1][2] == "mma"  # ... and wins down by 1%
    assert k["none"]["qkv"][0][2] == "cublas" and k["none"]["o"][0][2] == "gemv"  # fused_max_m dense: 0 and 1
    assert k["fp8"]["o"][-1][2] == "w8a8 scaled_mm"  # above fused_max_m["fp8_w8a16"] = 16


def test_kernel_times_interpolate_linearly_in_m_and_never_extrapolate(table):
    pts = table["kernels_us"]["int8"]["o"]  # M = 1, 4, 16, 64
    (m4, us4, _), (m16, us16, _) = pts[1], pts[2]
    us, path = ms.kernel_us(table, "int8", "o", 8)
    assert us == pytest.approx(us4 + (us16 - us4) * (8 - m4) / (m16 - m4))
    assert path == "tiled"
    assert ms.kernel_us(table, "int8", "o", 65) is None
    assert ms.kernel_us(table, "int4", "gate_up", 1) == (pytest.approx(29.2, abs=0.05), "mma")


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_int4_prediction_agrees_with_bench_decode_within_15_percent(table, llama8b, batch):
    """The issue's criterion: ``roofline cost --quantization int4 --batch 1,8,64`` within 15% of ``bench decode``
    on the H200 (the INT4 run of the same process as the bf16 calibration). Measured: 2.633 / 3.015 / 9.047 ms;
    predicted 2.250 / 2.702 / 9.003 (-14.5% / -10.4% / -0.5%). The Triton-only INT4 run of that process too."""
    run = _run(INT4_RUN)
    for config, q in (("int4/auto+mma", "int4"), ("int4/auto+triton", "int4_triton")):
        measured = _steps(run, config)[batch]
        p = ms.predict_decode_step(table, llama8b, q, batch, 1024, KV_1K)
        assert abs(p["predicted_s"] / measured - 1) < 0.15, (config, p["predicted_s"], measured)
    bf16 = ms.predict_decode_step(table, llama8b, "none", batch, 1024, KV_1K)
    assert bf16["predicted_s"] == pytest.approx(_steps(run, "unquantized/auto")[batch])  # the calibration itself


@pytest.mark.parametrize("batch", [1, 8, 64])
def test_int8_fp8_predictions_calibrated_in_their_own_process(table, llama8b, batch):
    """int8 and fp8 were measured in another process (decode-quant-2d.json), whose bf16 step was 7-9% slower than
    the table's calibration run at batch 1 and 8. Calibrated on that process's own bf16 rows, each is within 15%
    (measured int8 4.102 / 4.294 / 8.491 ms, fp8 4.267 / 4.541 / 7.107; predicted -13% / -10% / -4% and -11% / -10%
    / -3%); on the table's calibration they are 19-23% low at batch 1 and 8 (the device, not the kernels)."""
    run = _run(QUANT_RUN)
    cal = dict(table["calibration"], source=QUANT_RUN, read_bandwidth_bytes_per_s=run["read_bandwidth_bytes_per_s"],
               steps=sorted(_steps(run, "unquantized/auto").items()))
    for q in ("int8", "fp8"):
        measured = _steps(run, f"{q}/auto")[batch]
        p = ms.predict_decode_step(table, llama8b, q, batch, 1024, KV_1K, calibration=cal)
        assert abs(p["predicted_s"] / measured - 1) < 0.15, (q, p["predicted_s"], measured)


def test_context_shift_and_reasons_for_no_prediction(table, llama8b):
    p1k = ms.predict_decode_step(table, llama8b, "int4", 8, 1024, KV_1K)
    p4k = ms.predict_decode_step(table, llama8b, "int4", 8, 4096, 4 * KV_1K)
    bw = table["calibration"]["read_bandwidth_bytes_per_s"]
    assert p4k["predicted_s"] - p1k["predicted_s"] == pytest.approx(8 * 3 * KV_1K / bw)
    assert ms.why_not_predicted(table, llama8b, "smoothquant", 8) == "smoothquant kernels measured up to M = 4 only (batch 8)"
    assert ms.why_not_predicted(None, llama8b, "int4", 1).startswith("no measured kernel table")
    from roofline.config import model_preset

    other = cm.ModelShape.from_model_config(model_preset("qwen3-8b"))
    assert ms.why_not_predicted(table, other, "int4", 1).startswith("kernels measured for llama-3-8b only")
    with pytest.raises(ValueError, match=r"int4 kernels measured up to M = 64 only \(batch 128\)"):
        ms.predict_decode_step(table, llama8b, "int4", 128, 1024, KV_1K)


def _cost(argv: list[str], capsys) -> tuple[int, str, str]:
    parser = argparse.ArgumentParser()
    add_cost_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["cost", *argv])
    rc = args.func(args)
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_cli_quantization_prints_bound_and_predicted(capsys):
    rc, out, _ = _cost(["--model", "llama-3-8b", "--quantization", "int4", "--batch", "1,8,64", "--context", "1024"],
                       capsys)
    assert rc == 0
    assert "predicted (measured kernels)" in out and "calibration: " + INT4_RUN in out
    rows = [line.split() for line in out.splitlines() if line.strip().startswith("int4 ")]
    assert [(r[1], r[2], r[6]) for r in rows] == [("1", "4.759", "2.250"), ("8", "4.759", "2.702"),
                                                  ("64", "4.759", "9.003")]
    rc, out, _ = _cost(["--model", "llama-3-8b", "--quantization", "int4", "--batch", "1", "--json"], capsys)
    sec = json.loads(out)["quantization"]
    assert sec["rows"][0]["weight_bytes_per_step"] == 4_758_970_368 and sec["device"] == "NVIDIA H200"
    assert json.loads(out)["formats"][0]["format"] == "int4_g128"  # --quantization sets the formats too
    rc, out, _ = _cost(["--model", "llama-3-8b", "--quantization", "int4,int4", "--batch", "1", "--context", "1024"],
                       capsys)
    assert rc == 0 and len([line for line in out.splitlines() if line.strip().startswith("int4 ")]) == 1


def test_cli_quantization_without_measured_kernels_prints_the_bound_and_why(capsys):
    rc, out, _ = _cost(["--model", "llama-3-8b", "--hardware", "h100-sxm", "--quantization", "none,int4",
                        "--batch", "1"], capsys)
    assert rc == 0
    assert "int4 batch 1: bound only: no measured kernel table for this --hardware" in out
    rc, _, err = _cost(["--model", "llama-3-8b", "--quantization", "int3"], capsys)
    assert rc == 2 and "unknown --quantization 'int3'; known: none, int4, int8, fp8, smoothquant" in err
    rc, _, err = _cost(["--quantization", "int4"], capsys)  # the default model is the 70B fixture
    assert rc == 2 and "--quantization needs a dense model with an intermediate_size" in err


def test_worker_floor_counts_int4_codes_scales_zeros_once(tmp_path):
    """The run summary's floor (``Worker.weight_bytes_per_step``) for INT4 is codes + scales + zeros + the 16-bit
    rest; the extra layouts a layer holds for other M (the GPU's ``qweight_mma``, the CPU prefill copies) are
    non-persistent buffers, read instead of ``qweight``, and not counted a second time."""
    import torch

    from roofline import LLM

    vocab, hidden, inter, layers, heads, kv_heads = 256, 128, 256, 2, 4, 2
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": layers, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "max_position_embeddings": 512, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", attention_backend="torch", dtype="float32",
              quantization="int4", max_model_len=64, num_kv_blocks=8)
    w = llm.engine.worker
    d = hidden // heads
    shapes = [((heads + 2 * kv_heads) * d, hidden), (hidden, heads * d), (2 * inter, hidden), (hidden, inter)]
    g = 128
    # CPU layout: codes 4 bits; scales_and_zeros float32 [K/G, N, 2] (8 bytes per group and column)
    quant = layers * sum(n * k // 2 + k // g * n * 8 for n, k in shapes)
    rest16 = (vocab * hidden + layers * 2 * hidden + hidden) * 4  # LM head and norms in the model dtype (fp32 here)
    before = w.weight_bytes_per_step
    assert before == quant + rest16
    layer = next(m for m in w.model.modules() if hasattr(m, "int4_group_size"))
    layer.register_buffer("qweight_mma", torch.zeros(1 << 16, dtype=torch.int32), persistent=False)
    assert w.weight_bytes_per_step == before
    # the run summary's floor is this format's: its bytes, named
    from roofline import SamplingParams

    llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    rep = llm.decode_floor(hardware="h200")
    assert rep["memory_floor_s"] >= before / 4.8e12
    assert f"for int4 weights, {before / 1e9:.2f} GB of weights + " in rep["text"]


def test_floor_text_names_the_format_and_its_bytes():
    r = cm.decode_floor_report(4_758_970_368, 0.0, 0.0, 4.383e12, None, 2.633e-3, weights="int4")
    assert r["text"] == ("decode step 2.6 ms, floor 1.1 ms for int4 weights, 4.76 GB of weights + 0.00 GB of KV read "
                         "per step (41% of floor)")
    assert r["fraction_of_floor"] == pytest.approx(4_758_970_368 / 4.383e12 / 2.633e-3)
    # the KV read is named too, so the floor is the sum of the two over the bandwidth (the README's main job line)
    r = cm.decode_floor_report(270_000_000, 330_000_000, 0.0, 30.3e9, None, 75.8e-3, weights="bf16")
    assert "0.27 GB of weights + 0.33 GB of KV read per step" in r["text"]
    assert r["floor_s"] == pytest.approx(600_000_000 / 30.3e9)


def test_engine_bytes_split_and_why_the_int4_bounds_differ_from_the_format_column(llama8b, capsys):
    """A fresh user saw two int4 bounds for one shape (0.924 vs 1.047 ms at batch 1): the int4_g128 column counts
    4.15 bits x every parameter (the LM head and embedding too), the --quantization row the engine's bytes (projections
    in int4 with their scales and zeros, the LM head and norms in 16 bits, the embedding's rows only). The output
    now says so, with both bounds."""
    assert ms.weight_bytes_split(llama8b, "int4") == (3_707_764_736, 1_051_205_632)
    assert sum(ms.weight_bytes_split(llama8b, "int4")) == ms.quantized_weight_bytes_per_step(llama8b, "int4")
    assert ms.weight_bytes_split(llama8b, "int8")[1] == 1_051_205_632  # the same 16-bit rest for every method
    assert 1_051_205_632 == 2 * (llama8b.lm_head_params + 2 * 4096 * 32 + 4096)  # LM head + 2 norms/layer + final
    rc, out, _ = _cost(["--model", "llama-3-8b", "--quantization", "int4", "--batch", "1"], capsys)
    assert rc == 0
    lines = out.splitlines()
    assert re.search(r"^batch-1 lower bound, KV at 2048 +0\.924 ms$", out, re.M)
    assert [line.split()[3] for line in lines if line.strip().startswith("int4 ")] == ["1.047"]
    i = lines.index("why the format columns above and these rows differ:")
    assert lines[i + 1] == (
        "  int4: 4.759 GB/step of weights here = 3.708 GB of projections (int4 codes + scales + zeros) + 1.051 GB in 16 "
        "bits (LM head, norms; the embedding's rows only); the int4_g128 column above counts 4.15 bits x all 8.03e9 "
        "parameters = 4.166 GB (LM head and embedding included at those bits), so its bounds are lower (batch 1: "
        "0.924 ms there, 1.047 ms here)")
    # 4.15 bits x every parameter, vs the engine's bytes: the two weight terms behind the two bounds
    assert 8_030_261_248 * 4.15 / 8 == pytest.approx(4.166e9, rel=1e-3)
    rc, out, _ = _cost(["--model", "llama-3-8b", "--quantization", "int4", "--json", "--batch", "1"], capsys)
    row = json.loads(out)["quantization"]["rows"][0]
    assert (row["projection_bytes"], row["other_16bit_bytes"]) == (3_707_764_736, 1_051_205_632)
    rc, out, _ = _cost(["--model", "llama-3-8b", "--format", "bf16"], capsys)
    assert "why the format columns" not in out  # no --quantization section: nothing to reconcile
