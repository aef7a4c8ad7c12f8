"""`roofline bench decode` and `roofline bench throughput` on the CPU at tiny sizes: the code paths the H200
runs, with the JSON they write checked field by field (speed itself is not asserted: benchmarks are not
timed tests)."""

from __future__ import annotations

import json
import re

import pytest

from roofline.cli import build_parser, main


def test_bench_decode_writes_rows_beside_the_floor(tmp_path):
    rc = main(["bench", "decode", "--model", "smollm2-135m", "--batch-sizes", "1,2", "--contexts", "8,24",
               "--steps", "2", "--warmup", "1", "--kv-cache-memory", "64MiB", "--out-dir", str(tmp_path)])
    assert rc == 0
    [path] = tmp_path.glob("decode-smollm2-135m-*.json")
    result = json.loads(path.read_text())
    assert result["model"] == "smollm2-135m"
    assert result["device"] == "cpu" and result["cuda_graphs"] is False
    assert result["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4  # layers x kv heads x head_dim x fp32, k and v
    assert [(r["batch"], r["context"]) for r in result["rows"]] == [(1, 8), (2, 8), (1, 24), (2, 24)]
    for r in result["rows"]:
        assert r["async_scheduling"] is False  # the CPU default: one step at a time
        assert r["step_ms"] > 0 and r["floor_ms"] > 0
        assert abs(r["fraction_of_floor"] - r["floor_ms"] / r["step_ms"]) < 1e-9
        assert abs(r["tok_per_s"] - r["batch"] / (r["step_ms"] / 1e3)) < 1e-6 * r["tok_per_s"]
    for key in ("git_commit", "date", "torch", "read_bandwidth_bytes_per_s", "peak_flops", "weight_bytes"):
        assert result[key], key


def test_bench_throughput_generates_exact_output_lengths(tmp_path):
    dataset = tmp_path / "reqs.json"
    reqs = [{"prompt_token_ids": [100 + i, 200, 300 + i], "output_len": 3 + i} for i in range(3)]
    dataset.write_text(json.dumps({"requests": reqs}))
    rc = main(["bench", "throughput", "--model", "smollm2-135m", "--dataset-file", str(dataset), "--num-prompts",
               "3", "--max-model-len", "64", "--max-num-seqs", "4", "--kv-cache-memory", "64MiB",
               "--no-progress", "--no-warmup", "--out-dir", str(tmp_path)])
    assert rc == 0
    [path] = tmp_path.glob("throughput-smollm2-135m-seqs4-*.json")
    result = json.loads(path.read_text())
    assert result["output_tokens"] == result["expected_output_tokens"] == 3 + 4 + 5
    assert result["prompt_tokens"] == 9
    assert abs(result["output_tok_per_s"] - 12 / result["elapsed_s"]) < 1e-6 * result["output_tok_per_s"]


def test_bench_decode_compares_kv_formats_in_one_process(tmp_path):
    rc = main(["bench", "decode", "--model", "smollm2-135m", "--batch-sizes", "2", "--contexts", "16",
               "--steps", "2", "--warmup", "1", "--kv-cache-memory", "64MiB", "--kv-cache-dtype", "auto,int8",
               "--async-scheduling", "--out-dir", str(tmp_path)])
    assert rc == 0
    [path] = tmp_path.glob("decode-smollm2-135m-*.json")
    result = json.loads(path.read_text())
    # int8 codes plus one fp32 scale per token and KV head, for K and V in each of 30 layers (3 KV heads, D 64)
    assert result["kv_formats"]["int8"]["kv_bytes_per_token"] == 2 * 30 * 3 * (64 + 4)
    assert result["kv_formats"]["auto"]["kv_bytes_per_token"] == result["kv_bytes_per_token"] == 2 * 30 * 3 * 64 * 4
    # the same 64 MiB holds more int8 tokens (whole blocks)
    assert result["kv_formats"]["int8"]["pool_tokens"] > 3.5 * result["kv_formats"]["auto"]["pool_tokens"]
    assert [r["kv_cache_dtype"] for r in result["rows"]] == ["auto", "int8"]
    assert [r["quantization"] for r in result["rows"]] == ["none", "none"]
    assert [r["config"] for r in result["rows"]] == ["auto", "int8"]
    first, second = result["rows"]
    # Timed as the engine runs on a GPU: step N+1 launched before step N's ids are read.
    assert first["async_scheduling"] is True and second["async_scheduling"] is True
    assert first["step_ms_p10"] <= first["step_ms"] <= first["step_ms_p90"]
    assert first["speedup_vs_first"] == 1.0
    assert abs(second["speedup_vs_first"] - second["tok_per_s"] / first["tok_per_s"]) < 1e-9


def test_bench_spec_repeats_alternate_engines_and_sum_them(tmp_path, capsys):
    """`bench spec --repeats 2`: each engine runs the workload twice, in turn; a row's tokens are the sum over
    repeats, its speedup the ratio of summed rates, and each repeat's own ratio is kept beside it."""
    import pytest

    cfg = '{"method": "ngram", "num_speculative_tokens": 2, "adaptive": false}'
    rc = main(["bench", "spec", "--workloads", "sharegpt", "--num-prompts", "2", "--max-tokens", "6", "--repeats",
               "2", "--kv-cache-memory", "64MiB", "--max-model-len", "1024", "--speculative-configs", cfg,
               "--out-dir", str(tmp_path)])
    assert rc == 0
    [path] = tmp_path.glob("spec-batch1-*.json")
    base, row = json.loads(path.read_text())["rows"]
    assert base["config"] == "none" and base["repeats"] == 2 and base["output_tokens"] == 2 * 2 * 6
    assert row["output_tokens"] == 24 and row["greedy_identical"] == "4/4"
    assert row["speedup"] == pytest.approx(row["tok_per_s"] / base["tok_per_s"])
    assert len(row["speedup_per_repeat"]) == 2 and all(r > 0 for r in row["speedup_per_repeat"])
    assert "(repeats " in capsys.readouterr().out
    for flag, value in (("--repeats", "0"), ("--repeats", "x"), ("--num-prompts", "0")):
        with pytest.raises(SystemExit):
            main(["bench", "spec", flag, value])
        assert f"argument {flag}: must be an integer >= 1, got {value}" in capsys.readouterr().err
    with pytest.raises(SystemExit, match="unknown workload 'foo'; choose from humaneval, "):
        main(["bench", "spec", "--workloads", "sharegpt,foo", "--speculative-configs", cfg])


def test_git_sha_marks_a_tree_that_differs_from_head(tmp_path, monkeypatch):
    """A result names the commit it ran; where tracked files differ from HEAD (a device copy whose git metadata
    lags the tree it runs, as on 2026-12-05) the name says ``-dirty``, in the JSON and the file name."""
    import subprocess

    from roofline.bench.common import git_sha, write_result

    monkeypatch.delenv("ROOFLINE_GIT_SHA", raising=False)
    monkeypatch.chdir(tmp_path)
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(["git", "init", "-q"], check=True)
    (tmp_path / "f.txt").write_text("a\n")
    subprocess.run([*git, "add", "f.txt"], check=True)
    subprocess.run([*git, "commit", "-qm", "c"], check=True)
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (tmp_path / "untracked.txt").write_text("ignored\n")  # untracked files do not count
    assert git_sha() == head
    (tmp_path / "f.txt").write_text("b\n")
    assert git_sha() == f"{head}-dirty"
    path = write_result(tmp_path / "out", "x", {})
    assert path.name.endswith(f"-{head[:8]}-dirty.json")
    assert json.loads(path.read_text())["git_commit"] == f"{head}-dirty"
    monkeypatch.setenv("ROOFLINE_GIT_SHA", "abc123")
    assert git_sha() == "abc123"


@pytest.mark.parametrize("flags,message", [
    (["--attention-reduce", "fused,bogus"], "--attention-reduce 'bogus': expected fused or kernel"),
    (["--pdl", "1,x"], "--pdl '1,x': expected modes 0, 1 or 2"),
    (["--int4-kernel", "marlin"], "--int4-kernel 'marlin': expected mma or triton"),
    (["--steps", "0"], "--steps must be >= 1 and --warmup >= 0, got 0 and"),
    (["--warmup", "-1"], "--warmup >= 0, got"),
    # GPU kernel knobs on the CPU would change nothing: refused, not printed as a 1.000x ratio
    (["--device", "cpu", "--attention-reduce", "fused,kernel"], "--attention-reduce fused,kernel: GPU kernel knobs"),
    (["--device", "cpu", "--pdl", "0,1", "--int4-kernel", "mma"], "--pdl 0,1, --int4-kernel mma: GPU kernel knobs"),
])
def test_bench_decode_bad_flags_are_named_before_the_model_loads(flags, message, monkeypatch):
    import roofline.bench.decode as decode

    monkeypatch.setattr(decode, "build_engine", lambda *a, **k: pytest.fail("the engine was built first"))
    args = build_parser().parse_args(["bench", "decode", "--model", "smollm2-135m", "--batch-sizes", "1",
                                      "--contexts", "8", *flags])
    with pytest.raises(ValueError, match=re.escape(message)):
        decode.run_decode_bench(args)
