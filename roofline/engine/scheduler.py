"""Continuous batching under a per-step token budget. Pure Python (no torch).

One rule, as in vLLM v1: each sequence's ``num_computed_tokens`` catches up with its ``num_tokens``
within a per-step budget of ``max_num_batched_tokens``. That covers prefill, chunked prefill, decode and
recompute after preemption in one loop. Order within a step:

1. Running sequences that decode (one token each) go first, so a long prefill never starves them.
2. Running sequences still in prefill take chunks from what is left of the budget.
3. Waiting sequences are admitted first-come first-served while the budget, ``max_num_seqs`` and free
   blocks allow, unless this step already had to preempt.

When a running sequence cannot get a block, the most recently arrived running sequence is preempted by
recompute: its blocks are freed, its progress reset, and it goes back to the front of the queue.

Overlapped scheduling: ``schedule`` advances ``num_computed_tokens`` at once and counts each sampling
chunk's coming token as a placeholder, so step N+1 can be scheduled while step N runs; ``update`` appends
the real token later. A sequence whose in-flight token will end it by length is not scheduled again; one
that ends on a stop token has computed one token too many, which is dropped.

Prefix caching (a ``RadixCache`` over the block pool; on by default in the engine):

- Match at admission: a waiting sequence's known tokens are looked up (at most ``num_tokens - 1`` of them, so
  at least one token is computed and the step samples), floored to whole blocks. The matched blocks start its
  block table (shared, ref-counted), their tree node is locked while the sequence holds them, and
  ``num_computed_tokens`` starts after them. A partially filled block is never shared: its tokens are
  computed again in a block of the sequence's own.
- A sequence whose ``sampling_params.prompt_logprobs`` is set skips the match (the logprobs of every prompt
  token need its logits, so the whole prompt is computed), but its blocks are still inserted.
- Insert as steps complete: when ``update`` processes a prefill chunk, and when a sequence finishes or is
  preempted, its prefix whose KV a *completed* step wrote (``num_completed_tokens``) goes into the tree. A
  chunk still in flight (async scheduling) is never inserted, so no step can read a cache hit whose KV is
  not written yet. Only verified tokens are inserted (``_cache_prefix`` takes their count).
- Eviction before preemption: evictable cached blocks count as free (``BlockPool.num_free_blocks``) and are
  evicted, least recently used leaf first, when the free list runs short; a sequence is preempted only when
  free plus evictable blocks are not enough.
- ``n > 1``: the samples of one request share the prompt's full blocks. Sample 0 prefills the prompt; the
  others (``fork_of``) wait until its prompt is in the cache and then match it, recomputing only the tokens
  of the partial last block (at least one token) in blocks of their own.
- Policy ``lpm`` (``SchedulerConfig.schedule_policy``): waiting sequences are tried longest cached prefix
  first, as in SGLang, instead of first come first served. Bound: a sequence passed over by sequences queued
  behind it in ``lpm_starvation_rounds`` scheduling rounds goes ahead of all others (FCFS among such), and
  admission stops at the first sequence that does not fit, so it is never passed over again. With more than
  ``LPM_MAX_WAITING`` sequences waiting, lpm falls back to FCFS (the matching would cost too much per step).

Speculative decoding: a decoding sequence whose ``spec_token_ids`` the engine filled (its proposer and
policy ran before ``schedule``) gets a chunk of ``1 + k`` tokens, its last known token and ``k`` drafts, with
blocks for all of them; ``k`` shrinks to fit the token budget, and to 0 rather than preempt anything. When the
step completes (``update``), ``num_computed_tokens`` rewinds to the accepted prefix (the KV of rejected drafts
is garbage, overwritten later), blocks past what the next step needs are freed, and only verified tokens are
ever inserted into the prefix cache. The engine appends the emitted tokens itself (checking stops per token).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from roofline.config import SchedulerConfig
from roofline.engine.block_pool import BlockPool
from roofline.engine.radix_cache import PrefixMatch, RadixCache
from roofline.engine.sequence import Sequence, SequenceStatus

# Above this many waiting sequences, policy lpm falls back to FCFS (SGLang does the same above 128).
LPM_MAX_WAITING = 128


@dataclass
class ScheduledSequence:
    """One sequence's chunk in a step, fixed when scheduled.

    ``start_position``: the chunk's first position (``num_computed_tokens`` before this step).
    ``samples``: the chunk reaches the end of the known tokens (placeholders included), so its last logits
    pick the next token. ``num_preemptions``: the sequence's count when scheduled; if it differs when the step
    completes, the sequence lost the blocks this chunk wrote.
    """

    seq: Sequence
    num_scheduled_tokens: int
    start_position: int = -1
    samples: bool = False
    num_preemptions: int = -1
    # Speculative decoding: the drafts this decode chunk verifies (it is 1 + len(spec_token_ids) tokens).
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def is_decode(self) -> bool:
        """The sequence's next token and its drafts, if any: no prefill work."""
        return self.num_scheduled_tokens == 1 + len(self.spec_token_ids)

    def __post_init__(self) -> None:
        if self.start_position < 0:
            self.start_position = self.seq.num_computed_tokens
            self.samples = (self.num_scheduled_tokens - len(self.spec_token_ids)
                            == self.seq.num_uncomputed_tokens)
        if self.num_preemptions < 0:
            self.num_preemptions = self.seq.num_preemptions


@dataclass
class SchedulerOutput:
    """What the runner executes this step: sequences (decodes first) and how many tokens of each."""

    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def is_decode_only(self) -> bool:
        """One token per sequence: a plain decode step (no drafts, no prefill)."""
        return bool(self.scheduled) and all(s.num_scheduled_tokens == 1 for s in self.scheduled)

    @property
    def is_decode(self) -> bool:
        """No prefill work: every sequence scheduled its next token and its drafts, if any (a plain decode or a
        speculative verify step)."""
        return bool(self.scheduled) and all(s.is_decode for s in self.scheduled)


class Scheduler:
    """Mutates sequences' status, ``num_computed_tokens`` and (through the BlockPool) block tables, and the
    prefix cache (``prefix_cache``; None: no prefix caching) through matches, inserts, locks and evictions."""

    def __init__(self, config: SchedulerConfig, block_pool: BlockPool, prefix_cache: RadixCache | None = None):
        if prefix_cache is not None and prefix_cache.pool is not block_pool:
            raise ValueError("the prefix cache must be built over the scheduler's block pool")
        if config.schedule_policy == "lpm" and prefix_cache is None:
            raise ValueError("schedule_policy 'lpm' needs a prefix cache (prefix caching is off)")
        self.config = config
        self.block_pool = block_pool
        self.prefix_cache = prefix_cache
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------------------ queue management

    def add(self, seq: Sequence) -> None:
        """Queue a validated sequence (the engine checks lengths before this)."""
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """End ``seq`` with a terminal ``status`` and free its blocks at once."""
        assert status.is_finished
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = status
        seq.finished_time = time.monotonic()
        self._free(seq)

    # ------------------------------------------------------------------------------ prefix cache

    def _match(self, seq: Sequence) -> PrefixMatch | None:
        """The cached prefix ``seq`` may start from (None: no cache, or the sequence must compute its whole
        prompt because it asks for prompt logprobs)."""
        if self.prefix_cache is None or getattr(seq.sampling_params, "prompt_logprobs", None) is not None:
            return None
        return self.prefix_cache.match(seq.token_ids, max_tokens=seq.num_tokens - 1)

    def _cache_prefix(self, seq: Sequence, num_verified_tokens: int) -> None:
        """Insert ``seq``'s first ``num_verified_tokens`` tokens (whole blocks of them) into the prefix cache
        and move ``seq``'s lock to the end of that prefix.

        ``num_verified_tokens`` counts tokens whose KV a completed step wrote; it must never include tokens of
        a step still in flight or speculative drafts not yet accepted, and never decreases while ``seq`` holds
        its lock (so the lock only moves down the tree and keeps covering the blocks ``seq`` shares with it).
        """
        cache = self.prefix_cache
        assert cache is not None
        node = cache.insert(seq.token_ids, seq.block_table, num_verified_tokens)
        if node is seq.cache_node:
            return
        cache.lock(node)
        if seq.cache_node is not None:
            cache.unlock(seq.cache_node)
        seq.cache_node = node

    def _free(self, seq: Sequence) -> None:
        """Give up ``seq``'s blocks: its verified prefix goes into the prefix cache first, then its lock and
        its block references are dropped (blocks the cache holds stay there, evictable)."""
        if self.prefix_cache is not None and seq.block_table:
            # A speculative run cut by a stop leaves fewer tokens than its verified KV covers.
            self._cache_prefix(seq, min(seq.num_completed_tokens, seq.num_tokens))
        if seq.cache_node is not None:
            assert self.prefix_cache is not None
            self.prefix_cache.unlock(seq.cache_node)
            seq.cache_node = None
        self.block_pool.free(seq)
        seq.num_completed_tokens = 0

    def _waits_for_fork(self, seq: Sequence) -> bool:
        """A later sample of an ``n > 1`` request waits until sample 0's prompt is in the cache."""
        parent = seq.fork_of
        return parent is not None and not parent.prompt_cached and not parent.is_finished

    def _admission_order(self) -> list[Sequence]:
        """Waiting sequences in the order admission tries them (see the module docstring for lpm)."""
        waiting = list(self.waiting)
        cache = self.prefix_cache
        if self.config.schedule_policy != "lpm" or cache is None or len(waiting) > LPM_MAX_WAITING:
            return waiting
        limit = self.config.lpm_starvation_rounds
        starved = [s for s in waiting if s.num_bypassed_rounds >= limit]
        rest = [s for s in waiting if s.num_bypassed_rounds < limit]
        skip_match = [getattr(s.sampling_params, "prompt_logprobs", None) is not None for s in rest]
        lengths = [0 if skip else cache.match_length(s.token_ids, s.num_tokens - 1)
                   for s, skip in zip(rest, skip_match, strict=True)]
        order = sorted(range(len(rest)), key=lambda i: -lengths[i])  # stable: queue order among equals
        return starved + [rest[i] for i in order]

    # ------------------------------------------------------------------------------ the step

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.PREEMPTED
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        bm = self.block_pool
        # Decodes first (one token each), then running prefills; FCFS within each group.
        order = sorted(self.running, key=lambda s: (s.is_prefill, s.arrival_time, s.seq_id))
        scheduled_ids: set[int] = set()
        preempted_ids: set[int] = set()
        for seq in order:
            if budget == 0:
                break
            if seq.seq_id in preempted_ids or self._finishes_in_flight(seq):
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.config.enable_chunked_prefill and num_new < seq.num_uncomputed_tokens:
                continue
            drafts: list[int] = []
            if seq.spec_token_ids and not seq.is_prefill:
                drafts = seq.spec_token_ids[:budget - 1]
                if drafts and bm.can_allocate(seq, 1 + len(drafts)):
                    num_new = 1 + len(drafts)
                else:
                    drafts = []  # never preempt for drafts
            while not bm.can_allocate(seq, num_new):
                victim = max(
                    (s for s in self.running if s.seq_id not in scheduled_ids),
                    key=lambda s: (s.arrival_time, s.seq_id),
                )
                self._preempt(victim)
                out.preempted.append(victim)
                preempted_ids.add(victim.seq_id)
                if victim is seq:
                    break
            if seq.seq_id in preempted_ids:
                continue
            bm.allocate(seq, num_new)
            out.scheduled.append(ScheduledSequence(seq, num_new, spec_token_ids=drafts))
            scheduled_ids.add(seq.seq_id)
            budget -= num_new

        if not out.preempted and self.waiting:
            self._admit(out, budget)
        # Progress advances now, so the next step can be scheduled before this one's tokens arrive.
        for s in out.scheduled:
            s.seq.num_computed_tokens += s.num_scheduled_tokens
            if s.samples:
                s.seq.num_placeholders += 1
        return out

    def _admit(self, out: SchedulerOutput, budget: int) -> None:
        """Admit waiting sequences (FCFS or lpm order) while the budget, ``max_num_seqs`` and free blocks allow;
        stop at the first that does not fit, so none behind it jumps ahead."""
        bm, cache = self.block_pool, self.prefix_cache
        queued = list(self.waiting)  # arrival order (preempted sequences first)
        admitted: list[Sequence] = []
        for seq in self._admission_order():
            if budget == 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if self._waits_for_fork(seq):
                continue
            match = self._match(seq)
            num_cached = match.num_tokens if match is not None else 0
            num_uncomputed = seq.num_uncomputed_tokens - num_cached
            num_new = min(num_uncomputed, budget)
            if not self.config.enable_chunked_prefill and num_new < num_uncomputed:
                break
            num_shared = len(match.block_ids) if match is not None else 0
            need = bm.num_blocks_needed(num_cached + num_new) - num_shared
            # Locking the matched blocks takes them out of the evictable (free) count.
            shared_evictable = cache.num_evictable_on_path(match.node) if match is not None and cache else 0
            if need > bm.num_free_blocks - shared_evictable:
                break
            self.waiting.remove(seq)
            admitted.append(seq)
            if match is not None:
                assert cache is not None
                if seq.num_preemptions == 0:
                    cache.record_query(seq.num_prompt_tokens, num_cached)
                    seq.num_cached_tokens = num_cached
                cache.lock(match.node)
                seq.cache_node = match.node
                bm.incref(match.block_ids)
                seq.block_table = list(match.block_ids)
                seq.num_computed_tokens = seq.num_completed_tokens = num_cached
            bm.allocate(seq, num_new)
            seq.status = SequenceStatus.RUNNING
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
            self.running.append(seq)
            out.scheduled.append(ScheduledSequence(seq, num_new))
            budget -= num_new
        if self.config.schedule_policy == "lpm" and admitted:
            # Fairness bookkeeping: a sequence passed over by one queued behind it loses a round.
            last = max(queued.index(s) for s in admitted)
            for seq in queued[:last]:
                if seq.status != SequenceStatus.RUNNING and not self._waits_for_fork(seq):
                    seq.num_bypassed_rounds += 1

    def _rewind(self, seq: Sequence, num_computed: int) -> None:
        """After a verify step: KV is valid up to ``num_computed`` tokens (the last known one and the accepted
        drafts); keep the blocks the next step needs (one more position) and free the rest."""
        seq.num_computed_tokens = num_computed
        seq.num_completed_tokens = max(seq.num_completed_tokens, num_computed)
        keep = self.block_pool.num_blocks_needed(num_computed + 1)
        if len(seq.block_table) > keep:
            surplus = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.block_pool.decref(surplus)
            # The worker's copy of the table must be cut here too, even if the next step allocates back to the
            # same length (with other block ids): the engine sends the cut with the next step.
            seq.block_table_cut = keep if seq.block_table_cut is None else min(seq.block_table_cut, keep)

    def _finishes_in_flight(self, seq: Sequence) -> bool:
        """A token in flight will end ``seq`` by length (max_tokens or max_model_len): do not schedule it."""
        if not seq.num_placeholders:
            return False
        total = seq.num_tokens + seq.num_placeholders
        max_tokens = seq.sampling_params.max_tokens
        return total >= self.config.max_model_len or (
            max_tokens is not None and seq.num_output_tokens + seq.num_placeholders >= max_tokens)

    def update(self, out: SchedulerOutput, sampled: dict[int, list[int]], now: float | None = None) -> list[Sequence]:
        """Append the tokens a step sampled (``num_computed_tokens`` already advanced in ``schedule``).

        A sequence preempted after ``out`` was scheduled still gets its token (it recomputes from it).

        Args:
            sampled: seq_id -> new token ids (one per step today), for every scheduled sequence whose
                chunk samples.
        Returns:
            the sequences that received a new token (the engine checks stops on them).
        """
        now = time.monotonic() if now is None else now
        got_token = []
        for s in out.scheduled:
            seq = s.seq
            if s.spec_token_ids:
                seq.num_placeholders -= 1
                if s.num_preemptions == seq.num_preemptions and not seq.is_finished:
                    self._rewind(seq, s.start_position + len(sampled[seq.seq_id]))
                    got_token.append(seq)  # the engine appends its tokens, checking stops one by one
                continue
            if s.num_preemptions == seq.num_preemptions and not seq.is_finished:
                # This chunk's KV is written: it may now be shared (prefill chunks go into the cache at once,
                # so concurrent requests with the same prefix share it before this one finishes).
                end = s.start_position + s.num_scheduled_tokens
                seq.num_completed_tokens = max(seq.num_completed_tokens, end)
                if self.prefix_cache is not None and (s.num_scheduled_tokens > 1
                                                      or s.start_position < seq.num_prompt_tokens):
                    self._cache_prefix(seq, seq.num_completed_tokens)
                if end >= seq.num_prompt_tokens:
                    seq.prompt_cached = True
            if not s.samples:
                continue
            seq.num_placeholders -= 1
            if seq.is_finished:  # finished (stop, abort) while the step ran: the token is dropped
                continue
            for token in sampled[seq.seq_id]:
                seq.append_token(token, now)
            got_token.append(seq)
        return got_token
