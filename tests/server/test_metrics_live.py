"""``/metrics`` while an engine step is in progress: the live gauges move, the snapshot ones hold still.

A fake engine (no model, no torch) stands in for ``LLMEngine``: its ``step`` moves the waiting requests to
running, then blocks on an ``Event`` until the test releases it, so the test controls exactly when a step
is in progress. The engine thread is inside ``step`` for the whole middle part of the test.
"""

from __future__ import annotations

import re
import threading
import time
from collections import deque
from types import SimpleNamespace

import httpx
import pytest

from roofline.outputs import CompletionOutput, RequestOutput

VOCAB_SIZE = 100
REJECTED_TOKEN = 99  # the fake engine's add_request refuses prompts that start with it
STEP_TIMEOUT_S = 30.0  # a blocked step gives up after this long, so a failing test cannot hang


class BlockingEngine:
    """The parts of ``LLMEngine`` that ``AsyncLLMEngine`` and the API use; every step blocks on ``release``.

    Each step schedules all waiting requests and finishes each with one token (``finish_reason="length"``).
    """

    def __init__(self) -> None:
        self.tokenizer = None
        self.model_config = SimpleNamespace(name="fake-model", vocab_size=VOCAB_SIZE)
        self.config = SimpleNamespace(scheduler_config=SimpleNamespace(max_model_len=64, max_num_seqs=8))
        self.scheduler = SimpleNamespace(waiting=deque(), running=[], num_preemptions=0)
        self.block_manager = SimpleNamespace(num_free_blocks=10, num_blocks=10, usage=0.0)
        self.stats = SimpleNamespace(num_prefix_cache_queries=0, num_prefix_cache_hits=0,
                                     num_prefix_cache_evictions=0)
        self.prompts: dict[str, list[int]] = {}
        self.in_step = threading.Event()
        self.release = threading.Event()

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.prompts)

    def has_unfinished_requests(self) -> bool:
        return bool(self.prompts)

    def add_request(self, request_id: str, prompt: list[int], params, arrival_time: float) -> None:
        if prompt[0] == REJECTED_TOKEN:
            raise ValueError(f"prompt token {REJECTED_TOKEN} is refused by the fake engine")
        self.prompts[request_id] = list(prompt)
        self.scheduler.waiting.append(SimpleNamespace(request_id=request_id))

    def abort_request(self, request_id: str) -> bool:
        self.prompts.pop(request_id, None)
        self.scheduler.waiting = deque(s for s in self.scheduler.waiting if s.request_id != request_id)
        self.scheduler.running = [s for s in self.scheduler.running if s.request_id != request_id]
        return True

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler
        sched.running.extend(sched.waiting)
        sched.waiting.clear()
        self.block_manager.usage = 0.5
        self.in_step.set()
        try:
            if not self.release.wait(STEP_TIMEOUT_S):
                raise TimeoutError("the test never released the step")
        finally:
            self.in_step.clear()
        outputs = []
        for seq in sched.running:
            prompt = self.prompts.pop(seq.request_id)
            done = CompletionOutput(index=0, text="x", token_ids=[5], finish_reason="length", text_delta="x",
                                    num_new_tokens=1)
            outputs.append(RequestOutput(request_id=seq.request_id, prompt=None, prompt_token_ids=prompt,
                                         outputs=[done], finished=True))
        sched.running = []
        self.block_manager.usage = 0.0
        return outputs


def _gauge(text: str, name: str) -> float:
    m = re.search(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert m is not None, f"{name} not in /metrics"
    return float(m.group(1))


def _wait(predicate, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())


@pytest.fixture
def live_server():
    from roofline.server.app import BackgroundServer, build_app
    from roofline.server.async_engine import AsyncLLMEngine

    engine = BlockingEngine()
    async_engine = AsyncLLMEngine(engine)
    server = BackgroundServer(build_app(async_engine)).start()
    try:
        yield server, engine
    finally:
        engine.release.set()  # let any blocked step finish, whatever the test did
        server.stop()
        async_engine.stop()


def test_live_gauges_move_while_a_step_is_in_progress(live_server):
    server, engine = live_server

    def scrape() -> str:
        r = httpx.get(server.url + "/metrics", timeout=5)  # answered while the engine thread is in step()
        assert r.status_code == 200
        return r.text

    responses: list[httpx.Response] = []

    def post(prompt: list[int]) -> None:
        responses.append(httpx.post(server.url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1},
                                    timeout=60))

    idle = scrape()
    assert _gauge(idle, "roofline:num_requests_unfinished") == 0
    assert _gauge(idle, "roofline:num_requests_waiting") == 0
    assert _gauge(idle, "roofline:engine_step_elapsed_seconds") == 0

    first = threading.Thread(target=post, args=([1, 2, 3],))
    first.start()
    assert engine.in_step.wait(10), "the engine never started a step"
    during = scrape()
    # The snapshot was published just before the step, when the first request was still waiting.
    waiting_before = _gauge(during, "roofline:num_requests_waiting")
    running = _gauge(during, "roofline:num_requests_running")
    kv_usage = _gauge(during, "roofline:kv_cache_usage_perc")
    assert (waiting_before, running, kv_usage) == (1, 0, 0)
    assert _gauge(during, "roofline:num_requests_unfinished") == 1

    # A second request arrives while the step is still running: it can only be queued for the engine thread.
    second = threading.Thread(target=post, args=([4, 5],))
    second.start()
    assert _wait(lambda: _gauge(scrape(), "roofline:num_requests_unfinished") == 2), \
        "num_requests_unfinished did not move during the step"
    later = scrape()
    assert engine.in_step.is_set(), "the step ended early; the test proved nothing"
    assert _gauge(later, "roofline:num_requests_waiting") == waiting_before + 1
    # Known only at the end of the step: these hold still although the fake step changed them.
    assert _gauge(later, "roofline:num_requests_running") == running
    assert _gauge(later, "roofline:kv_cache_usage_perc") == kv_usage
    elapsed = _gauge(later, "roofline:engine_step_elapsed_seconds")
    assert elapsed > 0
    assert _wait(lambda: _gauge(scrape(), "roofline:engine_step_elapsed_seconds") > elapsed), \
        "engine_step_elapsed_seconds did not grow during the step"
    assert engine.in_step.is_set()

    engine.release.set()
    first.join(30)
    second.join(30)
    assert [r.status_code for r in responses] == [200, 200]
    assert [r.json()["choices"][0]["text"] for r in responses] == ["x", "x"]
    assert _wait(lambda: _gauge(scrape(), "roofline:num_requests_unfinished") == 0)
    after = scrape()
    assert _gauge(after, "roofline:num_requests_waiting") == 0
    assert _gauge(after, "roofline:num_requests_running") == 0
    assert _gauge(after, "roofline:engine_step_elapsed_seconds") == 0


def test_disconnect_and_rejection_during_a_step_end_requests_at_once(live_server):
    server, engine = live_server

    def unfinished() -> float:
        return _gauge(httpx.get(server.url + "/metrics", timeout=5).text, "roofline:num_requests_unfinished")

    body = {"prompt": [1, 2, 3], "max_tokens": 1, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as r:
        assert r.status_code == 200
        assert engine.in_step.wait(10), "the engine never started a step"
        assert unfinished() == 1
    # The client went away mid-step: the event loop aborts the request and counts it ended at once, although
    # the engine thread will only see the abort after the step.
    assert _wait(lambda: unfinished() == 0), "the aborted request still counts as unfinished during the step"
    assert engine.in_step.is_set()

    # A request the engine refuses (400) is accepted by add_request first, then ends without running.
    engine.release.set()
    r = httpx.post(server.url + "/v1/completions", json={"prompt": [REJECTED_TOKEN], "max_tokens": 1}, timeout=30)
    assert r.status_code == 400 and "refused by the fake engine" in r.json()["error"]["message"]
    assert unfinished() == 0
