"""``roofline bench serve`` against a live roofline server (real SmolLM2-135M-Instruct on CPU), plus its math.

The live runs are small (20 ShareGPT prompts, outputs clipped to 12 tokens) so they stay fast on 2 cores.
"""

from __future__ import annotations

import asyncio
import json
import math
import re

import httpx
import pytest

from roofline.bench.serve import compute_metrics, format_table
from roofline.bench.serve_client import RequestResult, _sse_events, build_payload

STATS = ("mean", "median", "std", "p90", "p99")
FIGURES = ("ttft", "tpot", "itl", "e2el")


# ---------------------------------------------------------------------------------------------- pure math


def _result(prompt_len, out, ttft, e2el, itl) -> RequestResult:
    r = RequestResult(prompt_len=prompt_len, output_len=out, success=True, output_tokens=out,
                      output_tokens_source="usage", ttft_s=ttft, e2el_s=e2el, itl_s=list(itl),
                      num_chunks=len(itl) + 1)
    return r


def test_compute_metrics_exact_values_and_goodput():
    results = [
        _result(10, 5, ttft=0.1, e2el=0.5, itl=[0.1, 0.1, 0.1, 0.1]),  # TPOT 0.1 s
        _result(20, 3, ttft=0.3, e2el=0.7, itl=[0.4]),  # 2 tokens in one chunk: TPOT 0.2 s, ITL 0.4 s
        RequestResult(prompt_len=7, output_len=4, success=False, error="HTTP 500"),
    ]
    m = compute_metrics(results, duration_s=2.0, slo_ttft_ms=200, slo_tpot_ms=150)
    assert (m["completed"], m["failed"]) == (2, 1)
    assert (m["total_input_tokens"], m["total_output_tokens"]) == (30, 8)
    assert m["request_throughput"] == pytest.approx(1.0)
    assert m["output_throughput"] == pytest.approx(4.0)
    assert m["total_token_throughput"] == pytest.approx(19.0)
    assert m["mean_ttft_ms"] == pytest.approx(200.0) and m["median_ttft_ms"] == pytest.approx(200.0)
    assert m["mean_tpot_ms"] == pytest.approx(150.0)
    assert m["mean_itl_ms"] == pytest.approx(160.0)  # pooled over chunks: (4 * 100 + 400) / 5
    assert m["p99_itl_ms"] == pytest.approx(388.0)  # numpy linear interpolation over [100]*4 + [400]
    assert m["mean_e2el_ms"] == pytest.approx(600.0)
    assert m["mean_tokens_per_chunk"] == pytest.approx(8 / 7)
    # Only the first request meets TTFT <= 200 ms and TPOT <= 150 ms.
    assert m["num_good_requests"] == 1 and m["request_goodput"] == pytest.approx(0.5)
    assert compute_metrics(results, 2.0)["request_goodput"] is None
    table = format_table(m, 200, 150)
    assert "Request goodput (req/s):" in table and "TTFT <= 200 ms and TPOT <= 150 ms" in table
    assert "Time per Output Token (per token, excl. 1st)" in table
    assert "Inter-token Latency (per streamed chunk)" in table
    assert re.search(r"Mean TPOT \(ms\):\s+150\.00", table)
    assert re.search(r"Mean ITL \(ms\):\s+160\.00", table)


def test_sse_parser_handles_split_events():
    class FakeContent:
        def __init__(self, parts):
            self.parts = parts

        async def iter_any(self):
            for p in self.parts:
                yield p

    class FakeResponse:
        content = FakeContent([b'data: {"a": 1}\n', b'\ndata: {"b"', b': 2}\n\n: comment\n\ndata: [DONE]\n\n'])

    async def collect():
        return [e async for e in _sse_events(FakeResponse())]

    assert asyncio.run(collect()) == ['{"a": 1}', '{"b": 2}', "[DONE]"]


def test_payloads():
    p = build_payload("chat", "m", "hi", 7, ignore_eos=True, temperature=0.0)
    assert p["messages"] == [{"role": "user", "content": "hi"}]
    assert p["max_completion_tokens"] == p["max_tokens"] == 7
    assert p["stream"] is True and p["stream_options"] == {"include_usage": True} and p["ignore_eos"] is True
    p = build_payload("completions", "m", "hi", 3, ignore_eos=False, temperature=0.5)
    assert p["prompt"] == "hi" and p["max_tokens"] == 3 and "ignore_eos" not in p


# ---------------------------------------------------------------------------------------------- live server


@pytest.fixture(scope="module")
def server(request):
    """A live server on the session's default model if tests/conftest.py provides one, else its own."""
    from roofline.server.app import BackgroundServer, build_app
    from roofline.server.async_engine import AsyncLLMEngine

    try:
        llm = request.getfixturevalue("default_llm")  # shared LLM(max_model_len=1024) of tests/conftest.py
        async_engine = AsyncLLMEngine(llm.engine, model_name="SmolLM2-135M-Instruct")
    except pytest.FixtureLookupError:
        from roofline.args import EngineArgs

        async_engine = AsyncLLMEngine.from_engine_args(EngineArgs(max_model_len=1024, device="cpu"))
    assert async_engine.engine.config.scheduler_config.max_model_len >= 1024
    app = build_app(async_engine)
    try:
        with BackgroundServer(app) as srv:
            srv.app = app
            yield srv
    finally:
        async_engine.stop()  # the shared engine is left idle for other tests


def _metric(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_bench_sharegpt_20_prompts_json_is_complete_and_consistent(server, tmp_path, capsys):
    from roofline.bench.datasets import sample_sharegpt
    from roofline.cli import main

    out, png = tmp_path / "serve.json", tmp_path / "cdf.png"
    before = httpx.get(server.url + "/metrics").text
    rc = main(["bench", "serve", "--base-url", server.url, "--dataset", "sharegpt", "--num-prompts", "20",
               "--max-output-len", "12", "--request-rate", "inf", "--seed", "0", "--slo-ttft-ms", "1e9",
               "--slo-tpot-ms", "1e9", "--save-result", str(out), "--plot", str(png), "--disable-tqdm",
               "--metadata", "device=cpu"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "Serving Benchmark Result" in printed and "Successful requests:" in printed
    res = json.loads(out.read_text())

    # Every field is there.
    for key in ("date", "config", "metadata", "versions", "duration_s", "completed", "failed",
                "total_input_tokens", "total_output_tokens", "request_throughput", "output_throughput",
                "total_token_throughput", "request_goodput", "num_good_requests", "mean_tokens_per_chunk",
                "requests"):
        assert key in res, key
    for fig in FIGURES:
        for stat in STATS:
            assert isinstance(res[f"{stat}_{fig}_ms"], float), f"{stat}_{fig}_ms"
    assert res["config"]["dataset"] == "sharegpt" and res["config"]["num_prompts"] == 20
    assert res["config"]["request_rate"] == "inf" and res["config"]["model"] == "SmolLM2-135M-Instruct"
    assert res["metadata"] == {"device": "cpu"}
    assert res["versions"]["python"] and res["versions"]["aiohttp"] and res["versions"]["commit"] == res["git_commit"]

    # Counts match the workload: ShareGPT outputs clipped at 12, ignore_eos, server-reported usage.
    tokenizer = server.app.state.serving.tokenizer
    workload = sample_sharegpt(tokenizer, 20, seed=0)
    assert (res["completed"], res["failed"]) == (20, 0)
    reqs = res["requests"]
    assert [r["prompt_len"] for r in reqs] == [w.prompt_len for w in workload]
    assert [r["output_tokens"] for r in reqs] == [min(w.output_len, 12) for w in workload]
    assert all(r["output_tokens_source"] == "usage" for r in reqs)
    assert [r["server_prompt_tokens"] for r in reqs] == [w.prompt_len for w in workload]
    assert res["total_input_tokens"] == sum(w.prompt_len for w in workload)
    assert res["total_output_tokens"] == sum(min(w.output_len, 12) for w in workload)

    # Figures agree with each other.
    d = res["duration_s"]
    assert res["request_throughput"] == pytest.approx(20 / d)
    assert res["output_throughput"] == pytest.approx(res["total_output_tokens"] / d)
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])  # SLOs nobody misses
    for r in reqs:
        decode_s = r["e2el_s"] - r["ttft_s"]
        assert 0 < r["ttft_s"] < r["e2el_s"] <= d
        # TPOT is per token: TPOT x (tokens - 1) is the decode time.
        assert r["tpot_s"] * (r["output_tokens"] - 1) == pytest.approx(decode_s, rel=1e-9)
        # ITL is per chunk: the gaps add up to the decode time, up to the tail after the last chunk
        # (usage chunk and [DONE]).
        assert len(r["itl_s"]) == r["num_chunks"] - 1
        assert 1 <= r["num_chunks"] <= r["output_tokens"]
        assert sum(r["itl_s"]) <= decode_s + 1e-6
        assert sum(r["itl_s"]) == pytest.approx(decode_s, abs=0.05 + 0.05 * decode_s)
    assert res["mean_ttft_ms"] == pytest.approx(1000 * sum(r["ttft_s"] for r in reqs) / 20)
    assert res["mean_tpot_ms"] == pytest.approx(1000 * sum(r["tpot_s"] for r in reqs) / 20)
    all_itl = [x for r in reqs for x in r["itl_s"]]
    assert res["mean_itl_ms"] == pytest.approx(1000 * sum(all_itl) / len(all_itl))
    assert res["mean_tokens_per_chunk"] == pytest.approx(res["total_output_tokens"] / sum(r["num_chunks"] for r in reqs))

    # The server counted the same tokens.
    after = httpx.get(server.url + "/metrics").text
    assert _metric(after, "roofline:generation_tokens_total") - _metric(before, "roofline:generation_tokens_total") \
        == res["total_output_tokens"]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_chat_random_poisson_with_max_concurrency(server, tmp_path):
    from roofline.cli import main

    out = tmp_path / "chat.json"
    rc = main(["bench", "serve", "--base-url", server.url, "--endpoint", "chat", "--dataset", "random",
               "--num-prompts", "6", "--random-input-len", "32", "--random-output-len", "5", "--request-rate", "20",
               "--max-concurrency", "2", "--seed", "3", "--save-result", str(out), "--disable-tqdm"])
    assert rc == 0
    res = json.loads(out.read_text())
    assert (res["completed"], res["total_output_tokens"]) == (6, 30)
    assert res["request_goodput"] is None  # no SLO given
    reqs = res["requests"]
    # Chat prompts carry the template: the server counts more prompt tokens than the raw prompt has.
    assert all(r["server_prompt_tokens"] > r["prompt_len"] for r in reqs)
    # Never more than 2 in flight: at each send time, at most one other request is running.
    spans = [(r["start_s"], r["start_s"] + r["e2el_s"]) for r in reqs]
    for s, _ in spans:
        assert sum(1 for a, b in spans if a <= s < b) <= 2
    assert math.isfinite(res["duration_s"])
