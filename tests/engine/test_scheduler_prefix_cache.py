"""Scheduler with the prefix cache: exact schedules, block ids and ref counts (block_size 4).

Admission matches whole cached blocks (and leaves at least one token to compute), prefill chunks are cached
when their step completes (not while it is in flight), eviction comes before preemption, ``n > 1`` samples
fork the prompt's blocks, ``prompt_logprobs`` skips the match, and policy lpm admits the longest cached
prefix first within its starvation bound.
"""

from __future__ import annotations

import pytest

from roofline.config import SchedulerConfig
from roofline.engine.block_pool import BlockPool
from roofline.engine.radix_cache import RadixCache
from roofline.engine.scheduler import Scheduler, SchedulerOutput
from roofline.engine.sequence import Sequence, SequenceStatus
from roofline.sampling_params import SamplingParams

P = list(range(100, 108))  # 8 tokens: two whole blocks


def make(num_blocks: int = 10, budget: int = 16, max_num_seqs: int = 4, policy: str = "fcfs",
         starvation_rounds: int = 16) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=40,
                             schedule_policy=policy, lpm_starvation_rounds=starvation_rounds)
    pool = BlockPool(num_blocks, 4)
    return Scheduler(config, pool, RadixCache(pool))


def seq(name: str, tokens: list[int], arrival: float, index: int = 0) -> Sequence:
    return Sequence(name, list(tokens), SamplingParams(max_tokens=64), index=index, arrival_time=arrival)


def plan(out: SchedulerOutput) -> list[tuple[str, int, bool]]:
    return [(s.seq.request_id + (f"/{s.seq.index}" if s.seq.index else ""), s.num_scheduled_tokens, s.samples)
            for s in out.scheduled]


def step(sched: Scheduler, token: int = 7) -> list[tuple[str, int, bool]]:
    out = sched.schedule()
    p = plan(out)
    sched.update(out, {s.seq.seq_id: [token] for s in out.scheduled if s.samples}, now=1.0)
    check(sched)
    return p


def check(sched: Scheduler) -> None:
    live = list(sched.running) + list(sched.waiting)
    sched.block_pool.check_invariants(live)
    assert sched.prefix_cache is not None
    sched.prefix_cache.check_invariants()


def test_a_repeated_prompt_shares_whole_blocks_and_computes_the_partial_tail():
    sched = make()
    cache, pool = sched.prefix_cache, sched.block_pool
    a = seq("A", P + [108, 109], 0.0)  # 10 tokens: blocks 0, 1 full, block 2 partial
    sched.add(a)
    assert step(sched) == [("A", 10, True)]
    assert a.block_table == [0, 1, 2] and a.num_cached_tokens == 0
    assert (cache.num_cached_blocks, cache.num_evictable_blocks) == (2, 0)  # cached as the prefill completed
    b = seq("B", P + [108, 109], 1.0)
    sched.add(b)
    assert step(sched) == [("A", 1, True), ("B", 2, True)]  # B computes only tokens 8 and 9
    assert (b.block_table, b.num_cached_tokens, b.num_computed_tokens) == ([0, 1, 3], 8, 10)
    assert pool.ref_counts[:4] == [3, 3, 1, 1]  # A, B and the cache
    assert (cache.num_query_tokens, cache.num_hit_tokens) == (20, 8)
    # A prompt of exactly two blocks recomputes its last block, so that its step samples.
    c = seq("C", P, 2.0)
    sched.add(c)
    assert step(sched) == [("A", 1, True), ("B", 1, True), ("C", 4, True)]
    assert (c.block_table, c.num_cached_tokens) == ([0, 4], 4)
    # A prompt diverging inside block 1 shares block 0 only.
    d = seq("D", P[:6] + [5, 5, 5], 3.0)
    sched.add(d)
    assert step(sched) == [("A", 1, True), ("B", 1, True), ("C", 1, True), ("D", 5, True)]
    assert (d.block_table, d.num_cached_tokens) == ([0, 7, 8], 4)  # blocks 5 and 6: A's and C's decodes


def test_finished_prefixes_stay_cached_and_evictable_and_count_as_free():
    sched = make(num_blocks=6)
    cache, pool = sched.prefix_cache, sched.block_pool
    a = seq("A", P, 0.0)
    sched.add(a)
    assert step(sched) == [("A", 8, True)]
    assert step(sched) == [("A", 1, True)]  # token 8 starts block 2
    assert a.block_table == [0, 1, 2] and a.num_completed_tokens == 9
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    # Prompt + the computed output token: 9 tokens, two whole blocks cached; block 2 (partial) is free.
    assert (cache.num_cached_blocks, cache.num_evictable_blocks) == (2, 2)
    assert list(pool.free_block_ids) == [3, 4, 5, 2]
    assert (pool.num_free_blocks, pool.usage) == (6, 0.0)
    check(sched)
    # A 20-token prompt needs 5 blocks: the 4 free ones, then A's deepest cached block (no preemption).
    b = seq("B", list(range(20)), 1.0)
    sched.add(b)
    assert step(sched) == [("B", 16, False)]
    assert step(sched) == [("B", 4, True)]
    assert b.block_table == [3, 4, 5, 2, 1]
    assert (cache.num_evicted_blocks, sched.num_preemptions) == (1, 0)
    assert cache.match(P).block_ids == [0]
    # B's decode needs a sixth block: A's last cached block is evicted rather than anything preempted.
    assert step(sched) == [("B", 1, True)]
    assert b.block_table == [3, 4, 5, 2, 1, 0]
    assert (cache.num_evicted_blocks, sched.num_preemptions) == (2, 0)


def test_preemption_caches_the_victims_prefix_and_it_resumes_from_it():
    sched = make(num_blocks=4)
    cache, pool = sched.prefix_cache, sched.block_pool
    a, b = seq("A", P, 0.0), seq("B", list(range(8)), 1.0)
    sched.add(a)
    sched.add(b)
    assert step(sched) == [("A", 8, True), ("B", 8, True)]
    assert (a.block_table, b.block_table) == ([0, 1], [2, 3])
    assert (cache.num_cached_blocks, cache.num_evictable_blocks) == (4, 0)  # both locked by their users
    # A's decode needs a block; nothing is free or evictable, so B (latest) is preempted. Its prefix stays
    # cached and evictable, and A's new block is B's deepest one.
    out = sched.schedule()
    assert out.preempted == [b] and plan(out) == [("A", 1, True)]
    assert a.block_table == [0, 1, 3]
    assert cache.match(b.token_ids).block_ids == [2]
    sched.update(out, {a.seq_id: [7]}, now=1.0)
    check(sched)
    assert step(sched) == [("A", 1, True)]  # B (9 tokens: 4 cached) needs 2 blocks, 0 are free
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    # B resumes from its cached block 2: 5 tokens computed instead of 9.
    assert step(sched) == [("B", 5, True)]
    assert b.block_table == [2, 3, 1]  # block 3 was free, block 1 is A's deepest cached block
    # Block 0: A's cached prefix; 1: B's partial block; 2, 3: B's cached prefix (B and the cache).
    assert pool.ref_counts == [1, 1, 2, 2]
    assert b.num_cached_tokens == 0  # counted at first admission only (a fresh prompt)
    assert (cache.num_query_tokens, cache.num_hit_tokens) == (16, 0)


def test_a_chunk_in_flight_is_not_a_cache_hit_until_its_step_completes():
    """Async scheduling: step N+1 is scheduled before step N's result is processed."""
    sched = make(budget=8)
    cache = sched.prefix_cache
    a = seq("A", P + [108, 109], 0.0)
    sched.add(a)
    out1 = sched.schedule()
    assert plan(out1) == [("A", 8, False)]
    b = seq("B", P + [108, 109], 1.0)
    sched.add(b)
    out2 = sched.schedule()  # A's first chunk is still in flight: B gets no hit and computes from 0
    assert plan(out2) == [("A", 2, True), ("B", 6, False)]
    assert (b.block_table, b.num_cached_tokens, cache.num_cached_blocks) == ([3, 4], 0, 0)
    sched.update(out1, {}, now=1.0)
    assert cache.num_cached_blocks == 2 and a.num_completed_tokens == 8  # now A's blocks 0 and 1 are shared
    c = seq("C", P + [108, 109], 2.0)
    sched.add(c)
    out3 = sched.schedule()  # A decodes its in-flight token (a placeholder)
    assert plan(out3) == [("A", 1, True), ("B", 4, True), ("C", 2, True)]
    assert (b.block_table, c.block_table, c.num_cached_tokens) == ([3, 4, 5], [0, 1, 6], 8)
    sched.update(out2, {a.seq_id: [7]}, now=1.0)
    sched.update(out3, {a.seq_id: [7], b.seq_id: [7], c.seq_id: [7]}, now=1.0)
    check(sched)
    # B's prompt is cached too, but the range is A's already: B's blocks stay its own.
    assert cache.match(P + [108, 109]).block_ids == [0, 1]


def test_n_samples_fork_the_prompt_blocks_and_recompute_the_partial_block():
    sched = make()
    pool = sched.block_pool
    p0, p1, p2 = (seq("R", P + [108, 109], 0.0, index=i) for i in range(3))
    p1.fork_of = p2.fork_of = p0  # the engine links them (n > 1, prefix caching on)
    for s in (p0, p1, p2):
        sched.add(s)
    assert step(sched, token=1) == [("R", 10, True)]  # the other samples wait for sample 0's prompt
    assert step(sched, token=2) == [("R", 1, True), ("R/1", 2, True), ("R/2", 2, True)]
    assert (p0.block_table, p1.block_table, p2.block_table) == ([0, 1, 2], [0, 1, 3], [0, 1, 4])
    assert pool.ref_counts[:5] == [4, 4, 1, 1, 1]
    assert (p1.num_computed_tokens, p1.output_token_ids) == (10, [2])
    # A prompt of whole blocks: each fork recomputes the last block's tokens (at least one token computed).
    sched2 = make()
    q0, q1 = seq("Q", P, 0.0, index=0), seq("Q", P, 0.0, index=1)
    q1.fork_of = q0
    sched2.add(q0)
    sched2.add(q1)
    assert step(sched2) == [("Q", 8, True)]
    assert step(sched2) == [("Q", 1, True), ("Q/1", 4, True)]
    assert (q0.block_table, q1.block_table) == ([0, 1, 2], [0, 3])


def test_prompt_logprobs_skip_the_match_but_still_insert():
    sched = make()
    cache = sched.prefix_cache
    a = seq("A", P + [108], 0.0)
    sched.add(a)
    step(sched)
    b = seq("B", P + [108], 1.0)
    b.sampling_params.prompt_logprobs = 1
    sched.add(b)
    assert step(sched) == [("A", 1, True), ("B", 9, True)]  # the whole prompt, for its logprobs
    assert (b.block_table, b.num_cached_tokens) == ([3, 4, 5], 0)
    assert cache.num_query_tokens == 9  # B did not look up
    c = seq("C", list(range(12)) + [1], 2.0)
    c.sampling_params.prompt_logprobs = 0
    sched.add(c)
    step(sched)
    assert cache.match(list(range(12))).num_tokens == 12  # C's prompt was inserted all the same


def test_lpm_admits_the_longest_cached_prefix_first_within_its_starvation_bound():
    order = {}
    for policy in ("fcfs", "lpm"):
        sched = make(max_num_seqs=1, policy=policy, starvation_rounds=2)
        a = seq("A", P + [1], 0.0)
        sched.add(a)
        step(sched)
        sched.finish(a, SequenceStatus.FINISHED_STOPPED)  # P is cached
        x = seq("X", list(range(9)), 1.0)  # nothing cached, first in the queue
        ys = [seq(f"Y{i}", P + [i, i], 2.0 + i) for i in range(4)]  # 8 tokens cached each
        for s in (x, *ys):
            sched.add(s)
        admitted, computed = [], []
        while sched.waiting:
            out = sched.schedule()
            assert len(out.scheduled) == 1
            admitted.append(out.scheduled[0].seq.request_id)
            computed.append(out.scheduled[0].num_scheduled_tokens)
            sched.update(out, {out.scheduled[0].seq.seq_id: [7]}, now=1.0)
            sched.finish(out.scheduled[0].seq, SequenceStatus.FINISHED_STOPPED)
            check(sched)
        order[policy] = admitted
        if policy == "lpm":
            # X was passed over in two rounds (the bound), then went ahead of Y2 and Y3.
            assert computed == [2, 2, 9, 2, 2]
            assert x.num_bypassed_rounds == 2
    assert order["fcfs"] == ["X", "Y0", "Y1", "Y2", "Y3"]
    assert order["lpm"] == ["Y0", "Y1", "X", "Y2", "Y3"]


def test_lpm_needs_the_prefix_cache():
    config = SchedulerConfig(schedule_policy="lpm")
    with pytest.raises(ValueError, match="needs a prefix cache"):
        Scheduler(config, BlockPool(4, 4))
    with pytest.raises(ValueError, match="schedule_policy must be one of fcfs, lpm, got 'sjf'"):
        SchedulerConfig(schedule_policy="sjf")
    with pytest.raises(ValueError, match="lpm_starvation_rounds must be > 0, got 0"):
        SchedulerConfig(lpm_starvation_rounds=0)
