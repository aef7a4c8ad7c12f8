"""Property tests: random add / step / abort sequences never leak or double-free a KV block.

A hypothesis state machine drives a Scheduler on a small pool (often too small, so preemption happens)
the way the engine does: schedule, run (fake sampled tokens), update, finish on max_tokens /
max_model_len or at random, and abort at random, also between schedule and update. After every
operation the block pool's books must match the live block tables (and the prefix cache) exactly, and at
the end, once every sequence has finished, every block must be free again (or evictable from the cache).

Half the runs turn the prefix cache on (some with policy lpm): prompts share heads, so sequences hit cached
blocks at admission, ``n = 2`` samples fork, and cached blocks are evicted and sequences preempted on the
small pool. A model of the KV cache records, for every slot a chunk writes, the token prefix that produced it
(the KV of position p depends on tokens 0..p): every chunk must read exactly its own prefix at positions
before it, and write only blocks that no one else holds (never a cached or shared block).
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from roofline.config import SchedulerConfig
from roofline.engine.block_pool import BlockPool
from roofline.engine.radix_cache import RadixCache
from roofline.engine.scheduler import Scheduler
from roofline.engine.sequence import Sequence, SequenceStatus
from roofline.sampling_params import SamplingParams

MAX_DRAIN_STEPS = 2000


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        block_size=st.sampled_from([1, 2, 4]),
        max_model_len=st.integers(4, 24),
        extra_blocks=st.integers(0, 4),
        budget=st.integers(1, 16),
        max_num_seqs=st.integers(1, 4),
        chunked=st.booleans(),
        prefix_caching=st.booleans(),
        lpm=st.booleans(),
    )
    def setup(self, block_size, max_model_len, extra_blocks, budget, max_num_seqs, chunked, prefix_caching, lpm):
        if not chunked:
            budget = max(budget, max_model_len)  # SchedulerConfig requires it
        # The engine guarantees the pool holds at least one sequence of max_model_len tokens.
        num_blocks = -(-max_model_len // block_size) + extra_blocks
        self.config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                                      max_model_len=max_model_len, enable_chunked_prefill=chunked,
                                      schedule_policy="lpm" if prefix_caching and lpm else "fcfs",
                                      lpm_starvation_rounds=2)
        self.bm = BlockPool(num_blocks, block_size)
        self.cache = RadixCache(self.bm) if prefix_caching else None
        self.sched = Scheduler(self.config, self.bm, self.cache)
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (block, offset) -> token prefix written there
        self.seqs: list[Sequence] = []
        self.clock = 0.0

    # ------------------------------------------------------------------------------ helpers

    def live(self) -> list[Sequence]:
        return list(self.sched.running) + list(self.sched.waiting)

    def stop_status(self, seq: Sequence) -> SequenceStatus | None:
        """The engine's length rules (``LLMEngine._check_stop``)."""
        if seq.num_output_tokens >= seq.sampling_params.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.config.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def one_step(self, data: st.DataObject | None) -> None:
        before = {s.seq_id: (s.num_computed_tokens, s.num_tokens) for s in self.sched.running}
        out = self.sched.schedule()
        self.run_attention(out)
        assert out.num_batched_tokens <= self.config.max_num_batched_tokens
        assert len(self.sched.running) <= self.config.max_num_seqs
        ids = [s.seq.seq_id for s in out.scheduled]
        assert len(ids) == len(set(ids)), "a sequence scheduled twice in one step"
        assert all(s.num_scheduled_tokens >= 1 for s in out.scheduled)
        for s in out.scheduled:
            seq = s.seq
            assert seq in self.sched.running
            assert seq not in out.preempted
            # Progress advances at scheduling; the chunk's KV slots are allocated before the worker writes them.
            end = s.start_position + s.num_scheduled_tokens
            assert end == seq.num_computed_tokens
            assert end <= seq.num_tokens + seq.num_placeholders
            assert seq.num_placeholders == (1 if s.samples else 0)  # one step in flight at most here
            assert len(seq.block_table) * self.bm.block_size >= end
            if not self.config.enable_chunked_prefill:
                assert s.samples, "without chunked prefill every chunk reaches the end"
        # Decodes (1 token, already running before this step) are scheduled before any prefill chunk.
        kinds = [s.seq.seq_id in before and before[s.seq.seq_id][1] - before[s.seq.seq_id][0] == 1
                 for s in out.scheduled]
        assert kinds == sorted(kinds, reverse=True), "a prefill was scheduled before a decode"
        for victim in out.preempted:
            assert victim.status == SequenceStatus.PREEMPTED
            assert victim.block_table == [] and victim.num_computed_tokens == 0
            assert victim in self.sched.waiting
        samples = {s.seq.seq_id: s.samples for s in out.scheduled}
        if data is not None and out.scheduled and data.draw(st.booleans(), label="abort mid-step"):
            i = data.draw(st.integers(0, len(out.scheduled) - 1), label="abort which")
            self.sched.finish(out.scheduled[i].seq, SequenceStatus.FINISHED_ABORTED)
        sampled = {sid: [data.draw(st.integers(0, 99), label="token") if data is not None else 0]
                   for sid, smp in samples.items() if smp}
        got = self.sched.update(out, sampled, now=self.clock)
        assert all(s.seq.num_placeholders == 0 for s in out.scheduled)
        assert {s.seq_id for s in got} == {s.seq.seq_id for s in out.scheduled
                                           if samples[s.seq.seq_id] and not s.seq.is_finished}
        for seq in got:
            assert seq.output_token_ids[-1:] == sampled[seq.seq_id]
            status = self.stop_status(seq)
            if status is None and data is not None and data.draw(st.integers(0, 9), label="stop") == 0:
                status = SequenceStatus.FINISHED_STOPPED  # e.g. EOS or a stop string
            if status is not None:
                self.sched.finish(seq, status)

    def run_attention(self, out) -> None:
        """The KV model: each chunk reads its own prefix before ``start_position`` and writes its positions."""
        bs = self.bm.block_size
        cached = set(self.cache.all_block_ids()) if self.cache is not None else set()
        for s in out.scheduled:
            seq, tokens = s.seq, s.seq.token_ids
            end = s.start_position + s.num_scheduled_tokens
            assert end <= len(tokens), "a chunk computes a token the host does not know (no step is in flight)"
            for pos in range(s.start_position):
                assert self.kv.get((seq.block_table[pos // bs], pos % bs)) == tuple(tokens[:pos + 1]), \
                    f"{seq.request_id}/{seq.index} reads the wrong KV at position {pos}"
            for pos in range(s.start_position, end):
                block = seq.block_table[pos // bs]
                assert self.bm.ref_counts[block] == 1 and block not in cached, f"writes shared block {block}"
                self.kv[(block, pos % bs)] = tuple(tokens[:pos + 1])

    # ------------------------------------------------------------------------------ rules

    @rule(num_prompt_tokens=st.integers(1, 23), max_tokens=st.integers(1, 8), n=st.integers(1, 2),
          head=st.integers(0, 1))
    def add(self, num_prompt_tokens, max_tokens, n, head):
        num_prompt_tokens = min(num_prompt_tokens, self.config.max_model_len - 1)  # engine validation
        self.clock += 1.0
        prompt = [head * 1000 + i for i in range(1, num_prompt_tokens + 1)]  # two families of shared prefixes
        seqs = [Sequence(f"r{len(self.seqs)}", list(prompt), SamplingParams(max_tokens=max_tokens), index=index,
                         arrival_time=self.clock) for index in range(n)]  # n samples share the arrival time
        if self.cache is not None and n > 1 and (num_prompt_tokens - 1) // self.bm.block_size >= 1:
            for seq in seqs[1:]:
                seq.fork_of = seqs[0]  # as LLMEngine.add_request links them
        for seq in seqs:
            self.sched.add(seq)
            self.seqs.append(seq)

    @rule(data=st.data())
    def step(self, data):
        self.one_step(data)

    @precondition(lambda self: self.sched.has_unfinished())
    @rule(data=st.data())
    def abort(self, data):
        live = self.live()
        seq = live[data.draw(st.integers(0, len(live) - 1), label="abort which")]
        self.sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
        assert seq.is_finished and seq.block_table == []

    # ------------------------------------------------------------------------------ invariants

    @invariant()
    def books_balance(self):
        self.bm.check_invariants(self.live())
        if self.cache is not None:
            self.cache.check_invariants()

    @invariant()
    def queues_are_consistent(self):
        running, waiting = self.sched.running, list(self.sched.waiting)
        assert not set(map(id, running)) & set(map(id, waiting))
        for seq in running:
            assert seq.status == SequenceStatus.RUNNING
            assert seq.num_computed_tokens <= seq.num_tokens
            # The block table covers every computed token (and no more than one partial block past it).
            assert len(seq.block_table) * self.bm.block_size >= seq.num_computed_tokens
            assert len(seq.block_table) == self.bm.num_blocks_needed(seq.num_computed_tokens)
            assert seq.num_uncomputed_tokens >= 1  # a running sequence always has a token to compute
        for seq in waiting:
            assert seq.status in (SequenceStatus.WAITING, SequenceStatus.PREEMPTED)
            assert seq.block_table == [] and seq.num_computed_tokens == 0
        for seq in self.seqs:
            if seq.is_finished:
                assert seq.block_table == []
                assert seq not in running and seq not in waiting
            assert seq.num_tokens <= self.config.max_model_len

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        # Everything drains (no livelock), then every block is free again.
        for _ in range(MAX_DRAIN_STEPS):
            if not self.sched.has_unfinished():
                break
            self.one_step(None)
            self.bm.check_invariants(self.live())
        assert not self.sched.has_unfinished(), "sequences never finished"
        assert all(s.is_finished and s.block_table == [] for s in self.seqs)
        assert self.bm.num_free_blocks == self.bm.num_blocks  # free, or evictable from the prefix cache
        if self.cache is not None:
            self.cache.evict(self.bm.num_blocks)
            assert self.cache.num_cached_blocks == 0
        assert sorted(self.bm.free_block_ids) == list(range(self.bm.num_blocks))
        assert self.bm.ref_counts == [0] * self.bm.num_blocks


SchedulerMachine.TestCase.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
TestScheduler = SchedulerMachine.TestCase
