"""Issue 32's fresh-user defects on the CPU path: the benchmark's one parser, the int4 group-size error, the fp16
floor's compute rate."""

from __future__ import annotations

import json

import pytest

# A tiny Llama whose hidden size (96) only 32 divides: the default model's int4 case (576: 32 and 64) in small.
TINY = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 96, "intermediate_size": 192,
        "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
        "rope_theta": 10000.0, "eos_token_id": 1}
COMMON = dict(load_format="dummy", device="cpu", attention_backend="torch", max_model_len=64, block_size=16,
              kv_cache_memory="4MiB")


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny96")
    (path / "config.json").write_text(json.dumps(TINY))
    return path


@pytest.mark.parametrize("argv,code", [(["--help"], 0), (["--tabel"], 2), (["--table", "--rounds", "x"], 2)])
def test_bench_cpu_help_and_typos_exit_without_running(argv, code, capsys, monkeypatch):
    from roofline.bench import cpu, cpu_table

    ran = []
    monkeypatch.setattr(cpu_table, "table", lambda *a, **k: ran.append("table"))
    monkeypatch.setattr(cpu, "wait_policy_beside_busy", lambda *a, **k: ran.append("wait"))
    monkeypatch.setattr(cpu, "_step_ms", lambda *a, **k: ran.append("step") or 1.0)
    with pytest.raises(SystemExit) as e:
        cpu.main(argv)
    assert e.value.code == code and ran == []
    out = capsys.readouterr()
    assert ("usage: python -m roofline.bench.cpu" in out.out + out.err)
    if argv == ["--tabel"]:
        assert "unrecognized arguments: --tabel" in out.err


def test_bench_cpu_table_options_reach_the_table(monkeypatch):
    from roofline.bench import cpu, cpu_table

    got = []
    monkeypatch.setattr(cpu_table, "table", lambda *a: got.append(a))
    cpu.main(["--table", "--rounds", "2", "--tokens", "8", "--no-hf", "--head-ab", "--prepack-ab"])
    assert got == [(2, 8, None, False, None, True, True)]
    cpu.main(["--table", "--json", "rows.json"])
    assert got[-1] == (3, 64, None, True, "rows.json", False, False)  # the defaults, filled after the checks


@pytest.mark.parametrize("argv, message", [
    (["--table", "--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--table", "--tokens", "3"], "--tokens must be >= 4, got 3"),
    (["--table", "--json", ""], "--json needs a file path, got ''"),
    (["--table", "--json", "  "], "--json needs a file path, got '  '"),
    (["--table", "--json", "/"], "--json '/' is a directory; give a file path"),
    (["--table", "--json", "/no/such/dir/rows.json"],
     "--json '/no/such/dir/rows.json': the directory '/no/such/dir' does not exist"),
    # Without --table these options did nothing, silently (--rounds 0 ran (a)-(c)): refused, naming them.
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--rounds", "5"], "--rounds applies to --table only; add --table or drop it"),
    (["--gemm", "--tokens", "8", "--json", "x.json"], "--tokens, --json apply to --table only; add --table or drop them"),
])
def test_bench_cpu_bad_options_are_argparse_errors_before_anything_runs(argv, message, capsys, monkeypatch):
    from roofline.bench import cpu, cpu_table

    ran = []
    monkeypatch.setattr(cpu_table, "table", lambda *a, **k: ran.append("table"))
    monkeypatch.setattr(cpu_table, "gemm_rates", lambda *a, **k: ran.append("gemm"))
    monkeypatch.setattr(cpu, "wait_policy_beside_busy", lambda *a, **k: ran.append("wait"))
    monkeypatch.setattr(cpu, "_step_ms", lambda *a, **k: ran.append("step") or 1.0)
    with pytest.raises(SystemExit) as e:
        cpu.main(argv)
    assert e.value.code == 2 and ran == []
    err = capsys.readouterr().err
    assert err.rstrip().endswith(f"python -m roofline.bench.cpu: error: {message}"), err


def test_int4_group_size_error_names_the_flag_and_the_sizes_that_work(tiny_dir):
    from roofline import LLM

    with pytest.raises(ValueError, match=r"--quantization int4: --quantization-group-size \(quantization_group_size\) "
                                         r"128 does not divide the input size K of every linear layer \(hidden_size = "
                                         r"96\); values that work for this model: 32 \(e\.g\. "
                                         r"--quantization-group-size 32\)"):
        LLM(str(tiny_dir), quantization="int4", **COMMON)
    llm = LLM(str(tiny_dir), quantization="int4", quantization_group_size=32, **COMMON)
    assert llm.engine.worker.model.model.layers[0].mlp.down_proj.int4_group_size == 32


def test_default_model_int4_sizes():
    from types import SimpleNamespace

    from roofline.quant.int4 import int4_group_sizes

    smollm2 = SimpleNamespace(hidden_size=576, num_attention_heads=9, head_dim=64, intermediate_size=1536)
    assert int4_group_sizes(smollm2) == [32, 64]
    assert int4_group_sizes(smollm2, tp=3) == [32, 64]  # 576 / 3 = 192, 1536 / 3 = 512


def test_fp16_floor_on_cpu_uses_the_better_of_fp16_and_fp32_rates(tiny_dir, monkeypatch):
    """torch's fp16 square GEMM on CPU is a software path (2-3 GFLOP/s) while its GEMV runs at fp32 speed: the
    floor's compute rate for fp16 is the better of the two measured rates, so the floor cannot exceed the step."""
    from roofline import LLM, SamplingParams
    from roofline import hardware as hw

    llm = LLM(str(tiny_dir), dtype="float16", **COMMON)
    llm.generate([{"prompt_token_ids": [3, 4, 5]}], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True),
                 use_tqdm=False)
    asked = []
    rates = {"fp16": 2e9, "fp32": 1e11, "int8": 5e11, "bf16": 4e11}
    monkeypatch.setattr(hw, "measure_read_bandwidth", lambda *a, **k: 4e10)
    monkeypatch.setattr(hw, "measure_gemm_flops", lambda dev, dtype, *a, **k: asked.append(dtype) or rates[dtype])
    rep = llm.decode_floor()
    assert asked == ["fp16", "fp32"] and rep["peak_flops"] == 1e11
    assert "the better of the fp16 and fp32 GEMM rates" in rep["bandwidth_source"]
