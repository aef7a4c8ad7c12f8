"""``roofline serve`` and ``roofline bench serve`` flags (no model needed), and the start-up lines `serve` prints."""

from __future__ import annotations

import math

import pytest


def test_serve_flags_defaults_and_env_api_key(monkeypatch):
    from roofline.cli import build_parser

    monkeypatch.setenv("ROOFLINE_API_KEY", "from-env")
    args = build_parser().parse_args(["serve"])
    assert (args.model, args.host, args.port) == (None, "127.0.0.1", 8000)
    assert args.api_key == "from-env"
    assert (args.max_waiting_requests, args.max_request_body_bytes, args.max_stop) == (None, 1 << 20, 4)
    args = build_parser().parse_args(["serve", "my.gguf", "--port", "9001", "--api-key", "k", "--max-model-len",
                                      "512", "--max-waiting-requests", "3", "--served-model-name", "a", "b"])
    assert (args.model, args.port, args.api_key, args.max_model_len) == ("my.gguf", 9001, "k", 512)
    assert args.max_waiting_requests == 3 and args.served_model_name == ["a", "b"]
    monkeypatch.delenv("ROOFLINE_API_KEY")
    assert build_parser().parse_args(["serve"]).api_key is None


def test_bench_serve_flags():
    from roofline.cli import build_parser

    args = build_parser().parse_args(["bench", "serve"])
    assert args.base_url == "http://127.0.0.1:8000" and args.endpoint == "completions"
    assert args.dataset == "sharegpt" and math.isinf(args.request_rate) and args.ignore_eos is True
    args = build_parser().parse_args(["bench", "serve", "--endpoint", "chat", "--dataset", "random",
                                      "--request-rate", "4", "--max-concurrency", "8", "--no-ignore-eos",
                                      "--slo-ttft-ms", "500", "--slo-tpot-ms", "50"])
    assert (args.endpoint, args.dataset, args.request_rate, args.max_concurrency) == ("chat", "random", 4.0, 8)
    assert (args.ignore_eos, args.slo_ttft_ms, args.slo_tpot_ms) == (False, 500.0, 50.0)


def test_server_config_rejects_bad_limits():
    from roofline.server.app import ServerConfig

    with pytest.raises(ValueError, match="max_waiting_requests must be >= 0 or None, got -1"):
        ServerConfig(max_waiting_requests=-1)
    with pytest.raises(ValueError, match="max_body_bytes must be >= 1, got 0"):
        ServerConfig(max_body_bytes=0)


def test_bench_rejects_bad_load_settings():
    from roofline.cli import main

    assert main(["bench", "serve", "--request-rate", "0"]) == 2  # ValueError -> exit status 2
    assert main(["bench", "serve", "--max-concurrency", "0"]) == 2


@pytest.mark.parametrize(("argv", "line"), [
    (["serve", "--kv-cache-dtype", "bogus"],
     "roofline serve: error: argument --kv-cache-dtype: invalid choice: 'bogus' (choose from"),
    (["generate", "--dtype", "nope"], "roofline generate: error: argument --dtype: invalid choice: 'nope'"),
])
def test_argparse_errors_are_one_line_without_the_usage(capsys, argv, line):
    # Issue 31: a choice error printed the 39-line usage before its one line.
    from roofline.cli import main

    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(line), err
    assert err.rstrip().endswith(f"(see roofline {argv[0]} --help)")


@pytest.mark.parametrize("level", ["warning", "info"])
def test_serve_states_the_start_up_lines_generate_prints_once(monkeypatch, capsys, caplog, level):
    """`roofline serve` states the CPU line and the CPU decode plan's state (as `generate` does) before the KV
    pool line: printed at --log-level warning, and at info (the default) in the worker's one log record only,
    not twice on the console; uvicorn is not started here."""
    import logging

    import uvicorn

    from roofline.cli import build_parser

    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    args = build_parser().parse_args(["serve", "--max-model-len", "256", "--kv-cache-memory", "64MiB",
                                      "--log-level", level])
    try:
        assert args.func(args) == 0  # serve sets the "roofline" logger's level from --log-level
    finally:
        logging.getLogger("roofline").setLevel(logging.NOTSET)
    out = capsys.readouterr().out
    assert "roofline serve: model" in out
    logged = [r.getMessage() for r in caplog.records if "CPU decode plan: " in r.getMessage()]
    kv_logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("KV cache: ")]
    if level == "warning":
        assert "CPU decode plan: " in out and out.index("CPU decode plan: ") < out.index("\nKV cache: ")
        assert not logged and not kv_logged
    else:
        assert "CPU decode plan: " not in out and "KV cache: " not in out
        from roofline.cpu import detect_cpu_features, fastest_dtype

        dtype = fastest_dtype(detect_cpu_features())[0]  # serve's CPU default, as scripts/run.sh picks it
        assert len(logged) == 1 and f"dtype {dtype}" in logged[0], logged  # the CPU line and the plan, one record
        assert len(kv_logged) == 1, kv_logged
