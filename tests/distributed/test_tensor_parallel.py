"""Tensor parallelism on CPU (gloo): TP=3 worker processes on the default model in fp32 give the single-process
engine's greedy tokens, through preemption; start-up errors name the sizes; a killed worker is reported by
rank, never a hang. (The server on a parallel engine, and its 503 once a worker dies, is tested on TP=3 x PP=2
in test_pipeline_parallel.py.)

The default model has 9 attention heads and 3 KV heads, so TP=3 is its smallest parallel size (TP=2 is
refused, naming both numbers). One TP engine serves the module (three processes start in ~25 s on 2 cores).
It runs with async scheduling, as GPUs do by default: the driver sends step N+1 before it waits for step N, and
each rank launches N+1 before it answers N (``_worker_main``), so these tests cover that overlap too.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from roofline import LLM, SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
# A pool of 14 blocks of 16 tokens: six 52-token sequences (20 prompt + 32 output) do not fit at once, so some are preempted.
COMMON = dict(device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=14, block_size=16,
              max_num_batched_tokens=512)
PREEMPT = [{"prompt_token_ids": list(range(100 + 7 * i, 120 + 7 * i))} for i in range(6)]


def _ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def single():
    return LLM(**COMMON)


@pytest.fixture(scope="module")
def tp3():
    llm = LLM(tensor_parallel_size=3, async_scheduling=True, **COMMON)
    assert llm.engine.config.async_scheduling
    yield llm
    llm.engine.executor.shutdown()


def test_tp3_greedy_is_token_identical(single, tp3):
    from roofline.worker.multiproc_executor import MultiprocExecutor

    assert isinstance(tp3.engine.executor, MultiprocExecutor) and len(tp3.engine.executor.procs) == 3
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    assert _ids(tp3.generate(PROMPTS, sp, use_tqdm=False)) == _ids(single.generate(PROMPTS, sp, use_tqdm=False))
    # Each rank holds a third of the KV heads: 1 of 3, so a third of the single engine's bytes per token. On a
    # CPU the ranks share the host's memory, so the decode floor counts all three (the whole model's bytes).
    infos = tp3.engine.executor.rank_infos
    assert [i.kv_bytes_per_token * 3 for i in infos] == [single.engine.worker.kv_bytes_per_token] * 3
    assert tp3.engine.worker.kv_bytes_per_token == single.engine.worker.kv_bytes_per_token
    assert tp3.engine.worker.weight_bytes_per_step == sum(i.weight_bytes_per_step for i in infos)


def test_tp3_under_preemption_and_seeded_sampling(single, tp3):
    greedy = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    before = tp3.engine.scheduler.num_preemptions
    assert _ids(tp3.generate(PREEMPT, greedy, use_tqdm=False)) == _ids(single.generate(PREEMPT, greedy,
                                                                                      use_tqdm=False))
    assert tp3.engine.scheduler.num_preemptions > before
    seeded = SamplingParams(temperature=0.9, seed=7, max_tokens=16)
    assert _ids(tp3.generate(PROMPTS, seeded, use_tqdm=False)) == _ids(single.generate(PROMPTS, seeded,
                                                                                       use_tqdm=False))


def test_startup_errors_name_the_sizes():
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 does not divide the 9 attention heads .*allowed: "
                                         r"1, 3$"):
        LLM(tensor_parallel_size=2, **COMMON)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 9 does not divide the MLP width 1536 .*allowed: 1, 3$"):
        LLM(tensor_parallel_size=9, **COMMON)
    with pytest.raises(ValueError, match=r"tensor_parallel_size 18 does not divide the 9 attention heads"):
        LLM(tensor_parallel_size=18, **COMMON)
    with pytest.raises(ValueError, match=r"tensor_parallel_size must be an integer >= 1, got 0"):
        LLM(tensor_parallel_size=0, **COMMON)
    with pytest.raises(ValueError, match=r"distributed_executor_backend 'uni' runs one worker; tensor_parallel_size 3"):
        LLM(tensor_parallel_size=3, distributed_executor_backend="uni", **COMMON)
    with pytest.raises(ValueError, match=r"speculative decoding with tensor_parallel_size or pipeline_parallel_size > 1 "
                       r"is not built yet \(got tensor_parallel_size=3, pipeline_parallel_size=1\)"):
        LLM(tensor_parallel_size=3, speculative_config={"method": "ngram", "num_speculative_tokens": 2}, **COMMON)


def test_more_gpus_than_visible_is_refused(monkeypatch):
    import torch

    from roofline.args import EngineArgs
    from roofline.config import model_preset

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    ea = EngineArgs(model="llama-3-8b", load_format="dummy", device="cuda", tensor_parallel_size=4)
    with pytest.raises(ValueError, match="tensor_parallel_size 4 x pipeline_parallel_size 1 needs 4 GPUs, but 1 are visible"):
        ea.create_engine_config(model_preset("llama-3-8b"))


def test_a_killed_worker_is_reported_by_rank(tp3):
    """Runs last: it kills rank 1 of the module's engine. The next step raises within seconds, naming the rank
    and its exit signal, and the executor refuses further steps instead of hanging."""
    from roofline.worker.multiproc_executor import ExecutorDeadError

    proc = tp3.engine.executor.procs[1]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(timeout=10)
    t0 = time.monotonic()
    sp = SamplingParams(temperature=0.0, max_tokens=8)
    with pytest.raises(ExecutorDeadError, match=r"worker rank 1 \(pid \d+\) died with exit code -9"):
        tp3.generate(PROMPTS, sp, use_tqdm=False)
    assert time.monotonic() - t0 < 30
    with pytest.raises(ExecutorDeadError, match="the executor is dead"):
        tp3.generate(PROMPTS, sp, use_tqdm=False)
