"""Speculative decoding from the CLI and from the server (the Python API is test_spec_engine.py)."""

from __future__ import annotations

import re

import httpx
import pytest

from tests.test_cli import roofline

COPY_PROMPT = ("Repeat exactly: alpha beta gamma delta epsilon zeta eta theta. Repeat exactly: alpha beta gamma "
               "delta epsilon zeta eta theta.")
NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "adaptive": false}'


def test_generate_with_a_speculative_config_explains_its_decode_step_beside_the_floor():
    """One ``roofline generate`` run (a subprocess loading the default model) checks both summary lines:
    ``speculative decode:`` (acceptance rate = accepted / drafted, acceptance length = (accepted + passes) /
    passes) and, above the floor line, ``speculative steps:``: the summary's mean decode step mixes drafting steps
    (draft passes + a verify pass) with plain ones while its floor is one plain pass."""
    r = roofline("generate", "--prompt", COPY_PROMPT, "--max-tokens", "24", "--no-progress",
                 "--speculative-config", NGRAM)
    assert r.returncode == 0, r.stderr
    m = re.search(r"^speculative decode: acceptance rate ([0-9.]+), mean acceptance length ([0-9.]+) tokens per "
                  r"verify pass \((\d+) passes, (\d+) of (\d+) draft positions accepted", r.stdout, re.M)
    assert m, r.stdout
    rate, length, passes, acc, drafted = float(m[1]), float(m[2]), int(m[3]), int(m[4]), int(m[5])
    assert 0 <= rate <= 1 and passes > 0 and acc <= drafted
    assert rate == pytest.approx(acc / drafted, abs=1e-3)
    assert length == pytest.approx((acc + passes) / passes, abs=1e-2)
    m = re.search(r"^speculative steps:  (\d+) of (\d+) decode steps drafted; such a step is the draft passes plus "
                  r"one verify pass and yields ([0-9.]+) tokens per request", r.stdout, re.M)
    assert m, r.stdout
    on, total, length = int(m[1]), int(m[2]), float(m[3])
    assert 0 < on <= total and length >= 1.0
    lines = r.stdout.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("speculative steps:"))
    assert first < next(i for i, line in enumerate(lines) if line.startswith("decode step "))


def test_bad_speculative_config_exits_2():
    r = roofline("generate", "--prompt", "x", "--floor", "none", "--no-progress", "--speculative-config",
                 '{"method": "ngram", "num_speculative_tokens": 99}', timeout=120)
    assert r.returncode == 2
    assert "num_speculative_tokens must be an integer in [1, 16], got 99" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def spec_server():
    from roofline.args import EngineArgs
    from roofline.server.app import BackgroundServer, build_app
    from roofline.server.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(max_model_len=512, max_num_seqs=4, device="cpu",
                                                        dtype="float32", speculative_config=NGRAM))
    engine.start()
    try:
        with BackgroundServer(build_app(engine)) as srv:
            yield srv
    finally:
        engine.stop()


def test_server_streams_and_exports_spec_metrics(spec_server):
    body = {"model": "SmolLM2-135M-Instruct", "prompt": COPY_PROMPT, "max_tokens": 24, "temperature": 0,
            "ignore_eos": True}
    r = httpx.post(spec_server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 24
    text = ""
    with httpx.stream("POST", spec_server.url + "/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                import json

                text += json.loads(line[6:])["choices"][0]["text"]
    assert text == r.json()["choices"][0]["text"]
    metrics = httpx.get(spec_server.url + "/metrics").text

    def value(name: str) -> float:
        m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", metrics, re.M)
        assert m, f"{name} missing"
        return float(m.group(1))

    drafted = value("roofline:spec_decode_num_draft_tokens_total")
    accepted = value("roofline:spec_decode_num_accepted_tokens_total")
    passes = value("roofline:spec_decode_num_drafts_total")
    assert drafted > 0 and 0 <= accepted <= drafted
    assert value("roofline:spec_decode_num_emitted_tokens_total") == accepted + passes
    assert 0.0 <= value("roofline:spec_decode_draft_acceptance_rate") <= 1.0
    assert value("roofline:spec_decode_gamma") == 3
    assert 'roofline:spec_decode_num_accepted_tokens_per_pos_total{model_name="SmolLM2-135M-Instruct",position="0"}' \
        in metrics
