"""Hardware presets, the probe JSON round trip and the in-process read-bandwidth measurement (CPU)."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest

from roofline.cost_cli import add_cost_parser, add_probe_parser
from roofline.hardware import HARDWARE_PRESETS, HardwareSpec, load_hardware, measure_read_bandwidth, probe


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="roofline")
    sub = parser.add_subparsers(dest="command", required=True)
    add_cost_parser(sub)
    add_probe_parser(sub)
    args = parser.parse_args(argv)
    return args.func(args)


@pytest.mark.parametrize(
    "name, bw, bf16, capacity, source",
    [
        ("h100-sxm", 3.35e12, 989e12, 80e9, "datasheet"),
        ("h200", 4.8e12, 989e12, 141e9, "datasheet"),
        ("a100-80gb", 2.039e12, 312e12, 80e9, "datasheet"),
        ("worksheet", 3.0e12, 1000e12, None, "hypothetical"),
    ],
)
def test_presets(name, bw, bf16, capacity, source):
    hw = load_hardware(name)
    assert (hw.memory_bandwidth, hw.peak("bf16"), hw.memory_capacity, hw.source) == (bw, bf16, capacity, source)
    assert hw.peak("fp16") == bf16
    assert hw.citation


def test_spec_is_frozen_and_validated():
    hw = HARDWARE_PRESETS["h200"]
    with pytest.raises(dataclasses.FrozenInstanceError):
        hw.memory_bandwidth = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        hw.peak_flops["bf16"] = 1.0  # type: ignore[index]
    with pytest.raises(ValueError, match=r"source must be one of datasheet, hypothetical, measured; got 'guess'"):
        HardwareSpec("x", 1e12, {"bf16": 1e15}, None, "guess", "")
    with pytest.raises(ValueError, match=r"memory_bandwidth must be .* > 0, got -1.0"):
        HardwareSpec("x", -1.0, {"bf16": 1e15}, None, "hypothetical", "")
    with pytest.raises(ValueError, match=r"peak_flops\['fp8'\] must be a finite FLOP/s > 0, got 0"):
        HardwareSpec("x", 1e12, {"fp8": 0}, None, "hypothetical", "")
    with pytest.raises(ValueError, match=r"a100-80gb has no peak FLOP/s for dtype 'fp8'; known: bf16, fp16, int8, fp32"):
        HARDWARE_PRESETS["a100-80gb"].peak("fp8")


def test_load_hardware_errors(tmp_path):
    with pytest.raises(ValueError, match=r"unknown hardware 'b200'; known presets: h100-sxm, h200, a100-80gb"):
        load_hardware("b200")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match=r"cannot read hardware JSON"):
        load_hardware(str(bad))
    bad.write_text(json.dumps({"name": "x"}))
    with pytest.raises(ValueError, match=r"hardware JSON lacks key 'memory_bandwidth_bytes_per_s'"):
        load_hardware(str(bad))


def test_round_trip(tmp_path):
    path = tmp_path / "h200.json"
    HARDWARE_PRESETS["h200"].save(path)
    assert load_hardware(str(path)) == HARDWARE_PRESETS["h200"]


def test_measure_read_bandwidth_cpu_defaults():
    # Defaults: 256 MiB (8x a 32 MiB L3), one warm-up + 5 rounds: about 0.3 s on an idle 2-core CPU.
    # Not asserted as a time: CI machines are shared (benchmarks are not timed tests).
    bw = measure_read_bandwidth("cpu")
    assert 1e8 < bw < 1e13  # 0.1 GB/s .. 10 TB/s: a real CPU memory system
    with pytest.raises(ValueError, match=r"rounds must be an integer >= 1, got 0"):
        measure_read_bandwidth("cpu", rounds=0)
    with pytest.raises(ValueError, match=r"device must be 'auto', 'cpu' or 'cuda\[:N\]', got 'tpu'"):
        measure_read_bandwidth("tpu")


def test_probe_cpu_tiny():
    spec = probe("cpu", rounds=2, size_bytes=4 * 2**20, gemm_n=64)
    d = spec.details
    assert spec.source == "measured" and d["device"] == "cpu" and d["rounds"] == 2
    assert len(d["read_round_s"]) == 2 and len(d["copy_round_s"]) == 2
    assert spec.memory_bandwidth == d["read_bytes_per_s"] > 0 and d["copy_bytes_per_s"] > 0
    assert d["buffer_bytes"] == 4 * 2**20 and d["gemm_n"] == 64
    assert {"bf16", "fp16", "fp32"} <= set(spec.peak_flops)
    for dtype in ("fp8", "int8"):  # measured or recorded as unsupported, never silently missing
        assert dtype in spec.peak_flops or "unsupported" in d["gemm"][dtype]
    assert d["versions"]["torch"] and d["date"][:2] == "20"
    assert spec.memory_capacity is None or spec.memory_capacity > 2**30


def test_probe_cli_json_feeds_cost(tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert run_cli(["probe", "--device", "cpu", "--rounds", "2", "--size-mb", "4", "--gemm-n", "64",
                    "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "read" in printed and "GB/s" in printed and f"wrote {out}" in printed
    data = json.loads(out.read_text())
    assert data["format"] == "roofline-hardware/1" and data["source"] == "measured"
    assert data["details"]["device_name"] and data["details"]["versions"]["torch"]
    assert run_cli(["cost", "--model", "smollm2-135m", "--hardware", str(out), "--format", "bf16",
                    "--batch", "1", "--context", "0", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["hardware"]["source"] == "measured"
    p = r["model"]["num_params"]
    expected = max(2 * p / data["memory_bandwidth_bytes_per_s"], 2 * p / data["peak_flops"]["bf16"])
    assert r["formats"][0]["step_lower_bound_s"] == pytest.approx(expected)


def test_probe_cli_bad_rounds(capsys):
    assert run_cli(["probe", "--device", "cpu", "--rounds", "0"]) == 2
    assert "roofline probe: error: rounds must be an integer >= 1, got 0" in capsys.readouterr().err


def test_integer_gemm_rates_print_in_top_per_s(tmp_path, capsys, monkeypatch):
    """int8 products are integer operations: TOP/s, never TFLOP/s (probe printer, run summary, costmodel unit)."""
    import roofline.hardware as hw
    from roofline.costmodel import rate_unit
    from roofline.report import floor_inputs_line

    assert [rate_unit(d) for d in ("int8", "bf16", "fp32", "fp8", "torch.bfloat16")] == \
        ["TOP/s", "TFLOP/s", "TFLOP/s", "TFLOP/s", "TFLOP/s"]
    assert rate_unit("int8", "G") == "GOP/s"
    details = dict(device_name="test CPU", device="cpu", rounds=2, read_bytes_per_s=10e9, copy_bytes_per_s=8e9,
                   buffer_bytes=4 << 20, gemm_n=64, gemm={"bf16": {}, "int8": {}, "fp8": {"unsupported": "no"}})
    spec = HardwareSpec(name="test", memory_bandwidth=10e9, peak_flops={"bf16": 1.5e12, "int8": 3e12},
                        memory_capacity=None, source="measured", citation="test", details=details)
    monkeypatch.setattr(hw, "probe", lambda **kw: spec)
    assert run_cli(["probe", "--device", "cpu", "--output", str(tmp_path / "p.json")]) == 0
    out = capsys.readouterr().out
    assert "  gemm bf16      1.500 TFLOP/s (n=64)" in out
    assert "  gemm int8      3.000 TOP/s (n=64)" in out
    assert "  gemm fp8    unsupported: no" in out
    rep = dict(bandwidth_bytes_per_s=10e9, peak_flops=3e12, bandwidth_source="measured", bound_by="memory")
    assert floor_inputs_line({**rep, "peak_dtype": "int8"}) == \
        "floor inputs:       10.0 GB/s, 3.000 TOP/s (measured); bound by memory"
    assert floor_inputs_line({**rep, "peak_dtype": "fp32"}) == \
        "floor inputs:       10.0 GB/s, 3.000 TFLOP/s (measured); bound by memory"


def test_host_memory_available_reads_meminfo_and_the_cgroup_cap(monkeypatch):
    """MemAvailable in bytes, capped by the process's cgroup headroom (v2 in its own group or the root, v1's
    memory controller; v1's ~2^63 means no limit); None where nothing can be read."""
    from pathlib import Path

    import roofline.hardware as hw

    files = {}

    def read_text(self, *a, **k):
        if str(self) in files:
            return files[str(self)]
        raise FileNotFoundError(str(self))

    monkeypatch.setattr(Path, "read_text", read_text)
    meminfo = {"/proc/meminfo": "MemTotal: 100 kB\nMemAvailable:   2000 kB\n"}
    files.update(meminfo, **{"/proc/self/cgroup": "0::/app.slice/x\n", "/sys/fs/cgroup/app.slice/x/memory.max":
                             "1500000\n", "/sys/fs/cgroup/app.slice/x/memory.current": "500000\n"})
    assert hw.host_memory_available() == 1_000_000  # min(2000 kB, 1.5 MB - 0.5 MB), the group's own files
    files["/sys/fs/cgroup/app.slice/x/memory.max"] = "max\n"
    assert hw.host_memory_available() == 2000 * 1024
    files.clear()
    files.update(meminfo, **{"/proc/self/cgroup": "4:memory:/docker/abc\n0::/\n",
                             "/sys/fs/cgroup/memory/memory.limit_in_bytes": "800000\n",
                             "/sys/fs/cgroup/memory/memory.usage_in_bytes": "300000\n"})
    assert hw.host_memory_available() == 500_000  # v1, the container's view at the mount's root
    files["/sys/fs/cgroup/memory/memory.limit_in_bytes"] = "9223372036854771712\n"
    assert hw.host_memory_available() == 2000 * 1024
    files.clear()
    assert hw.host_memory_available() is None


def test_a_cpu_model_larger_than_host_memory_is_refused_before_it_is_built():
    """Llama-3-8B in fp32 (32.1 GB) on a 23 GB host: a MemoryError naming the sizes, not the OOM killer; in bf16
    with oneDNN's prepacked copy (16.1 + 15.0 GB) it is refused too, and without the copy (16.1 GB + 2 GiB of
    headroom) it passes; the CLI turns it into 'roofline: error: ...' and exit 2."""
    import torch

    from roofline.config import model_preset
    from roofline.models.loader import check_host_memory, host_weight_bytes

    cfg = model_preset("llama-3-8b")
    with pytest.raises(MemoryError, match=r"llama-3-8b: its 8\.03 B parameters in float32 need 32\.1 GB \+ 2 GiB for "
                                          r"the KV cache and activations = 34\.3 GB of host memory and 23\.0 GB is "
                                          r"available; use a smaller model, a 16-bit --dtype, or a GPU"):
        check_host_memory(cfg, torch.float32, available=23 * 10**9)
    # the packed copy: every linear weight and the LM head (8.03 B - 0.53 B input embedding - norms) once more
    assert host_weight_bytes(cfg, torch.bfloat16, prepacked=True) - 2 * cfg.num_params == 2 * (
        cfg.num_params - cfg.vocab_size * 4096 - 65 * 4096)
    with pytest.raises(MemoryError, match=r"in bfloat16 need 16\.1 GB \+ 15\.0 GB prepacked for oneDNN \+ 2 GiB .* "
                                          r"= 33\.2 GB .* use a smaller model, or a GPU"):
        check_host_memory(cfg, torch.bfloat16, available=23 * 10**9, prepacked=True)
    check_host_memory(cfg, torch.bfloat16, available=23 * 10**9, prepacked=False)
    tied = model_preset("smollm2-135m")  # a tied embedding is the LM head, which is packed
    h = tied.hidden_size
    assert host_weight_bytes(tied, torch.bfloat16, prepacked=True) == 2 * (2 * tied.num_params - (2 * 30 + 1) * h)


def test_cli_reports_a_model_too_large_for_host_memory(monkeypatch, capsys):
    import roofline.hardware as hw
    from roofline.cli import main

    monkeypatch.setattr(hw, "host_memory_available", lambda: 10**9)
    rc = main(["bench", "decode", "--model", "llama-3-8b", "--device", "cpu", "--batch-sizes", "1", "--steps", "1"])
    err = capsys.readouterr().err
    assert rc == 2 and "roofline: error: llama-3-8b: its 8.03 B parameters" in err and "1.0 GB is available" in err
