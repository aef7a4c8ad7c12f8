"""The prefix cache's counters on a live server's /metrics (the engine has the cache on by default).

A prompt sent twice: the second request finds the first one's whole blocks cached. ``*_total`` counters
rise by exactly the prompt tokens looked up and found; the exposition is also checked on a fixed snapshot.
"""

from __future__ import annotations

import re
import time

import httpx
import pytest

from roofline.server.async_engine import EngineSnapshot, EngineState
from roofline.server.metrics import ServerMetrics

MODEL = "SmolLM2-135M-Instruct"
PROMPT = ("Summarize the following: the quick brown fox jumps over the lazy dog while the cat watches from "
          "the warm windowsill and the rain keeps falling on the old tin roof of the barn.")


def _counter(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def _scrape(server, names: list[str], until=lambda values: True, timeout_s: float = 10.0) -> dict[str, float]:
    """The counters, once ``until`` holds: the snapshot is published just after the step that answered."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(server.url + "/metrics").text
        values = {n: _counter(text, n) for n in names}
        if until(values) or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


@pytest.fixture(scope="module")
def server(async_engine):
    from roofline.server.app import BackgroundServer, build_app

    with BackgroundServer(build_app(async_engine)) as srv:
        yield srv


def test_counters_rise_by_the_tokens_looked_up_and_found(server, async_engine):
    engine = async_engine.engine
    assert engine.prefix_cache is not None
    bs = engine.config.cache_config.block_size
    num_prompt = len(engine.tokenizer(PROMPT, add_special_tokens=True).input_ids)
    assert num_prompt > 2 * bs
    names = ["roofline:prefix_cache_queries_total", "roofline:prefix_cache_hits_total",
             "roofline:prefix_cache_evictions_total"]
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}
    start = _scrape(server, names)
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200
    before = _scrape(server, names, lambda v: v[names[0]] >= start[names[0]] + num_prompt)
    r = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200
    after = _scrape(server, names, lambda v: v[names[0]] >= before[names[0]] + num_prompt)
    assert after[names[0]] - before[names[0]] == num_prompt
    assert after[names[1]] - before[names[1]] == (num_prompt - 1) // bs * bs  # whole blocks, one token computed
    assert after[names[2]] >= before[names[2]]


def test_exposition_of_a_snapshot():
    snap = EngineSnapshot(prefix_cache_queries=120, prefix_cache_hits=96, prefix_cache_evictions=7)
    metrics = ServerMetrics("m", lambda: EngineState(snap, 0, 0, 0.0))
    text = metrics.render().decode()
    assert 'roofline:prefix_cache_queries_total{model_name="m"} 120.0' in text
    assert 'roofline:prefix_cache_hits_total{model_name="m"} 96.0' in text
    assert 'roofline:prefix_cache_evictions_total{model_name="m"} 7.0' in text
    assert "# TYPE roofline:prefix_cache_hits_total counter" in text
