"""Preemption by recompute on the real default model.

A KV pool of 12 blocks of 16 tokens holds two of the six sequences at their full length (24 to 29
prompt tokens + 40 new: 5 blocks each), but admission only needs room for the prompts (2 blocks each),
so all six start together. As they grow, sequences are preempted (five times in this run), lose their
blocks, and are recomputed (prompt plus the tokens generated so far) when they come back. Outputs must be
those of an unconstrained run (``default_llm``, 2912 blocks), and every block must be free afterwards (or held
only by the prefix cache, which is on by default, and evictable).
"""

from __future__ import annotations

import json

import pytest
import torch

from roofline import LLM, SamplingParams

NUM_PROMPTS = 6
PROMPT_LEN = 24
NUM_NEW = 40
BLOCK_SIZE = 16
NUM_KV_BLOCKS = 12  # 192 slots; one sequence needs ceil(64 / 16) = 4 to ceil(69 / 16) = 5 blocks
MAX_MODEL_LEN = 192  # <= 192, the pool's capacity, as the engine requires


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(100, 49000, (PROMPT_LEN + i,), generator=gen).tolist() for i in range(NUM_PROMPTS)]


PROMPTS = _prompts()
# Greedy for even prompts; seeded temperature sampling for odd ones, whose random stream must survive the
# recompute (one draw per generated token, wherever the token is sampled).
PARAMS = [
    SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True) if i % 2 == 0
    else SamplingParams(temperature=0.8, seed=100 + i, max_tokens=NUM_NEW, ignore_eos=True)
    for i in range(NUM_PROMPTS)
]


def _run(llm: LLM) -> tuple[list[list[int]], int, int]:
    """Outputs, preemptions during the run, and the number of tokens the model processed."""
    engine = llm.engine
    first_step = engine.stats.num_steps
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], PARAMS, use_tqdm=False)
    assert [o.error for o in outs] == [None] * NUM_PROMPTS
    processed = sum(s.num_tokens for s in engine.stats.steps_since(first_step))
    return [o.outputs[0].token_ids for o in outs], llm.last_run_stats.num_preemptions, processed


@pytest.fixture(scope="module")
def unconstrained(default_llm):
    return _run(default_llm)


@pytest.fixture(scope="module")
def small_pool_llm():
    return LLM(block_size=BLOCK_SIZE, num_kv_blocks=NUM_KV_BLOCKS, max_model_len=MAX_MODEL_LEN,
               dtype="float32", device="cpu", attention_backend="torch")


@pytest.fixture(scope="module")
def constrained(small_pool_llm):
    preempt_before = small_pool_llm.engine.stats.num_preemptions
    result = _run(small_pool_llm)
    assert small_pool_llm.engine.stats.num_preemptions - preempt_before == result[1]
    return result


def test_reference_run_had_no_preemption(unconstrained):
    outs, preemptions, processed = unconstrained
    assert preemptions == 0
    # Without recompute, the model sees each prompt once and each generated token but the last once.
    assert processed == sum(map(len, PROMPTS)) + NUM_PROMPTS * (NUM_NEW - 1)
    assert all(len(o) == NUM_NEW for o in outs)


def test_small_pool_preempts_and_recomputes(small_pool_llm, constrained):
    _, preemptions, processed = constrained
    assert small_pool_llm.engine.block_manager.num_blocks == NUM_KV_BLOCKS
    assert small_pool_llm.engine.stats.num_preemptions >= preemptions > 0
    # Recompute re-reads prompts and already-generated tokens: strictly more work than without.
    assert processed > sum(map(len, PROMPTS)) + NUM_PROMPTS * (NUM_NEW - 1)


def test_outputs_unchanged_by_preemption(unconstrained, constrained):
    ref, _, _ = unconstrained
    outs, _, _ = constrained
    for i in range(NUM_PROMPTS):
        kind = "greedy" if i % 2 == 0 else "seeded"
        assert outs[i] == ref[i], f"prompt {i} ({kind}) differs after preemption"


def test_no_block_leak(small_pool_llm, constrained):
    bm = small_pool_llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks == NUM_KV_BLOCKS
    # Each block once, free or held only by the prefix cache (evictable): no leak, no double free.
    cache = small_pool_llm.engine.prefix_cache
    assert cache.num_evictable_blocks == cache.num_cached_blocks
    assert sorted([*bm.free_block_ids, *cache.all_block_ids()]) == list(range(NUM_KV_BLOCKS))
    assert not small_pool_llm.engine.has_unfinished_requests()
    assert small_pool_llm.engine.num_unfinished_requests == 0


def test_pool_smaller_than_one_sequence_is_rejected(tmp_path):
    """A pool that cannot hold one max_model_len sequence is refused at start-up, not mid-run."""
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError) as e:
        LLM(str(tmp_path), load_format="dummy", device="cpu", attention_backend="torch",
            block_size=16, num_kv_blocks=4, max_model_len=128)
    msg = str(e.value)
    assert "64 tokens" in msg and "4 blocks of 16" in msg and "max_model_len (128)" in msg
