"""Async scheduling (step N+1 scheduled and launched before step N's tokens are processed) on the real
default model, on CPU: the same tokens as synchronous steps, through preemption, aborts, stop strings,
seeds, n > 1, penalties, min_tokens and logprobs; nothing leaked afterwards.

On CPU the worker finishes a step before returning, so the overlap gains nothing here, but every piece of
the mechanism runs: placeholder tokens in the scheduler, the worker reading a sequence's newest input token
from the previous step's sampled ids on the device, and deferred processing in the engine.
"""

from __future__ import annotations

import pytest

from roofline import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three uses of copper:",
           "Hello", "Write a haiku about the sea."]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=20),
    SamplingParams(temperature=0.8, seed=3, max_tokens=15, n=2),
    SamplingParams(temperature=0, max_tokens=12, stop=[" the"]),
    SamplingParams(temperature=1.0, seed=5, max_tokens=10, repetition_penalty=1.3, presence_penalty=0.5,
                   frequency_penalty=0.2, logprobs=2),
    SamplingParams(temperature=0, max_tokens=9, min_tokens=5),
    SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, top_k=5),
]


def _summary(outs):
    """Tokens, finish reasons, texts and each logprob entry's (token id, rank) exactly; the logprob values
    apart (see ``_assert_same``)."""
    def lps(c):
        return None if c.logprobs is None else [{t: lp.rank for t, lp in e.items()} for e in c.logprobs]
    return [[(c.token_ids, c.finish_reason, c.text, lps(c)) for c in o.outputs] for o in outs]


def _logprob_values(outs):
    return [lp.logprob for o in outs for c in o.outputs for e in (c.logprobs or []) for lp in e.values()]


def _assert_same(got, want):
    """Equal summaries, and logprob values within 1e-4: an async step may carry a finished sequence's last
    in-flight row, and a CPU GEMM's rounding depends on its row count (8e-6 measured)."""
    assert _summary(got) == _summary(want)
    assert _logprob_values(got) == pytest.approx(_logprob_values(want), abs=1e-4)


def _assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine._inflight is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    # The worker still holds the last finished sequences only until the next step tells it to forget them.
    assert set(engine.worker.input_batch.row_of) <= set(engine.sent.finished_seq_ids)


@pytest.fixture(scope="module")
def async_llm():
    return LLM(device="cpu", max_model_len=512, max_num_batched_tokens=2048, async_scheduling=True)


def test_async_equals_sync(default_llm, async_llm):
    assert async_llm.engine.config.async_scheduling and not default_llm.engine.config.async_scheduling
    want = default_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    got = async_llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    _assert_same(got, want)
    assert [c.finish_reason for c in got[2].outputs] == ["stop"]
    assert [c.finish_reason for c in got[0].outputs] == ["length"]
    _assert_idle(async_llm)


def test_async_under_preemption(default_llm):
    """A pool too small for the batch: sequences are preempted while their next token is in flight."""
    prompts = [{"prompt_token_ids": list(range(100 + i, 130 + i))} for i in range(6)]
    params = [SamplingParams(temperature=0 if i % 2 else 0.8, seed=i, max_tokens=40, ignore_eos=True)
              for i in range(6)]
    want = [o.outputs[0].token_ids for o in default_llm.generate(prompts, params, use_tqdm=False)]
    llm = LLM(device="cpu", block_size=16, num_kv_blocks=12, max_model_len=192, async_scheduling=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert llm.last_run_stats.num_preemptions > 0
    assert got == want
    _assert_idle(llm)


def test_abort_while_a_step_is_in_flight(async_llm):
    engine = async_llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    alone = async_llm.generate(PROMPTS[:1], greedy, use_tqdm=False)[0].outputs[0].token_ids
    engine.add_request("keep", PROMPTS[0], greedy)
    engine.add_request("drop", PROMPTS[1], greedy)
    assert engine.step() == [] and engine._inflight is not None  # launched, not processed yet
    engine.step()
    assert engine.abort_request("drop")
    final = engine.run_to_completion(["keep"])
    assert final["keep"].outputs[0].token_ids == alone
    _assert_idle(async_llm)


def test_failure_while_a_step_is_in_flight_rolls_back(async_llm, monkeypatch):
    """The worker fails when a step's result is awaited: the call raises, its requests are aborted, and
    the engine serves the next call as if nothing happened."""
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    alone = async_llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
    executor = async_llm.engine.executor
    real = executor.execute_model_async
    calls = []

    def failing(step):
        pending = real(step)
        calls.append(step)
        if len(calls) == 3:
            def boom():
                raise RuntimeError("injected failure")
            pending.result = boom
        return pending

    monkeypatch.setattr(executor, "execute_model_async", failing)
    with pytest.raises(RuntimeError, match="injected failure"):
        async_llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
    monkeypatch.undo()
    again = async_llm.generate(PROMPTS[:2], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in alone]
    _assert_idle(async_llm)
