"""Scheduler: exact schedules and block ids on a tiny cache (block_size 4, 10 blocks, budget 8).

Each test drives ``schedule()`` and then ``update()`` with fake sampled tokens, as the engine does with
the runner's output, and asserts the plan of every step as ``(request_id, num_tokens, samples)``.
"""

from __future__ import annotations

from roofline.config import SchedulerConfig
from roofline.engine.block_pool import BlockPool
from roofline.engine.scheduler import Scheduler, SchedulerOutput
from roofline.engine.sequence import Sequence, SequenceStatus
from roofline.sampling_params import SamplingParams

Plan = list[tuple[str, int, bool]]


def make_scheduler(num_blocks: int = 10, block_size: int = 4, budget: int = 8, max_num_seqs: int = 4,
                   chunked: bool = True, max_model_len: int = 40) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                             max_model_len=max_model_len, enable_chunked_prefill=chunked)
    return Scheduler(config, BlockPool(num_blocks, block_size))


def make_seq(name: str, num_prompt_tokens: int, arrival: float) -> Sequence:
    return Sequence(name, list(range(100, 100 + num_prompt_tokens)), SamplingParams(max_tokens=64),
                    arrival_time=arrival)


def plan(out: SchedulerOutput) -> Plan:
    return [(s.seq.request_id, s.num_scheduled_tokens, s.samples) for s in out.scheduled]


def step(sched: Scheduler, token: int = 7) -> Plan:
    """schedule() + update() with ``token`` for every sampling chunk; returns the plan of the step."""
    out = sched.schedule()
    p = plan(out)  # before update: ``samples`` depends on num_computed_tokens
    assert out.num_batched_tokens <= sched.config.max_num_batched_tokens
    sampled = {s.seq.seq_id: [token] for s in out.scheduled if s.samples}
    got = sched.update(out, sampled, now=1.0)
    assert [s.request_id for s in got] == [name for name, _, samples in p if samples]
    return p


def free_list(sched: Scheduler) -> list[int]:
    return list(sched.block_pool.free_block_ids)


def test_prefill_then_decode_one_token_per_step():
    sched = make_scheduler()
    a = make_seq("A", 3, 0.0)
    sched.add(a)
    assert a.status == SequenceStatus.WAITING
    assert step(sched, token=11) == [("A", 3, True)]
    assert a.status == SequenceStatus.RUNNING
    assert (a.block_table, a.num_computed_tokens, a.output_token_ids) == ([0], 3, [11])
    assert step(sched, token=12) == [("A", 1, True)]
    assert (a.block_table, a.num_computed_tokens, a.output_token_ids) == ([0], 4, [11, 12])
    # Token 4 (0-based) starts the second block.
    assert step(sched, token=13) == [("A", 1, True)]
    assert (a.block_table, a.num_computed_tokens, a.output_token_ids) == ([0, 1], 5, [11, 12, 13])
    assert a.token_times == [1.0, 1.0, 1.0]
    assert a.first_token_time == 1.0


def test_chunked_prefill_splits_a_long_prompt_and_samples_on_the_last_chunk():
    sched = make_scheduler()
    a = make_seq("A", 20, 0.0)
    sched.add(a)
    assert step(sched) == [("A", 8, False)]
    assert (a.block_table, a.num_computed_tokens, a.output_token_ids) == ([0, 1], 8, [])
    assert step(sched) == [("A", 8, False)]
    assert (a.block_table, a.num_computed_tokens, a.output_token_ids) == ([0, 1, 2, 3], 16, [])
    assert a.first_token_time is None
    assert step(sched, token=9) == [("A", 4, True)]
    assert (a.block_table, a.num_computed_tokens, a.output_token_ids) == ([0, 1, 2, 3, 4], 20, [9])
    assert step(sched) == [("A", 1, True)]
    assert a.block_table == [0, 1, 2, 3, 4, 5]


def test_decodes_are_scheduled_first_and_never_starved_by_a_long_prefill():
    sched = make_scheduler()
    a = make_seq("A", 2, 0.0)
    b = make_seq("B", 30, 1.0)
    sched.add(a)
    assert step(sched) == [("A", 2, True)]
    sched.add(b)
    # While B's 30-token prompt is prefilled in chunks, A still decodes one token every step.
    assert step(sched) == [("A", 1, True), ("B", 7, False)]
    assert step(sched) == [("A", 1, True), ("B", 7, False)]
    assert step(sched) == [("A", 1, True), ("B", 7, False)]
    assert step(sched) == [("A", 1, True), ("B", 7, False)]
    assert step(sched) == [("A", 1, True), ("B", 2, True)]
    assert step(sched) == [("A", 1, True), ("B", 1, True)]
    assert a.output_token_ids == [7] * 7
    assert b.output_token_ids == [7, 7]
    # A crossed into its second block at its 5th token, between B's chunks.
    assert a.block_table == [0, 5]
    assert b.block_table == [1, 2, 3, 4, 6, 7, 8, 9]


def test_decodes_go_first_even_when_a_prefill_arrived_earlier():
    # Y arrived earlier but is queued after X (e.g. its request was tokenized late). Sorting the running
    # sequences by arrival alone would give Y the whole budget and skip X's decode.
    sched = make_scheduler()
    x = make_seq("X", 2, 5.0)
    y = make_seq("Y", 20, 0.0)
    sched.add(x)
    sched.add(y)
    assert step(sched) == [("X", 2, True), ("Y", 6, False)]
    assert step(sched) == [("X", 1, True), ("Y", 7, False)]
    assert step(sched) == [("X", 1, True), ("Y", 7, True)]
    assert step(sched) == [("Y", 1, True), ("X", 1, True)]  # both decode now: FCFS by arrival


def test_max_num_seqs_is_respected():
    sched = make_scheduler(max_num_seqs=2)
    a, b, c = make_seq("A", 2, 0.0), make_seq("B", 2, 1.0), make_seq("C", 2, 2.0)
    for s in (a, b, c):
        sched.add(s)
    assert step(sched) == [("A", 2, True), ("B", 2, True)]
    assert list(sched.waiting) == [c]
    assert step(sched) == [("A", 1, True), ("B", 1, True)]
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    assert a.block_table == [] and a.finished_time is not None
    assert free_list(sched) == [2, 3, 4, 5, 6, 7, 8, 9, 0]
    assert step(sched) == [("B", 1, True), ("C", 2, True)]
    assert c.block_table == [2]


def test_admission_is_first_come_first_served():
    # The head of the queue does not fit in the free blocks, so the smaller request behind it waits too.
    sched = make_scheduler(budget=64)
    a, b, c = make_seq("A", 30, 0.0), make_seq("B", 12, 1.0), make_seq("C", 4, 2.0)
    for s in (a, b, c):
        sched.add(s)
    assert step(sched) == [("A", 30, True)]
    assert a.block_table == [0, 1, 2, 3, 4, 5, 6, 7]
    assert list(sched.waiting) == [b, c]
    assert step(sched) == [("A", 1, True)]  # B needs 3 blocks, 2 are free; C (1 block) must not jump it
    assert list(sched.waiting) == [b, c]
    sched.finish(a, SequenceStatus.FINISHED_LENGTH)
    assert step(sched) == [("B", 12, True), ("C", 4, True)]
    assert b.block_table == [8, 9, 0]
    assert c.block_table == [1]


def test_waiting_prefill_gets_what_is_left_of_the_budget():
    sched = make_scheduler()
    a, b = make_seq("A", 5, 0.0), make_seq("B", 9, 1.0)
    sched.add(a)
    sched.add(b)
    assert step(sched) == [("A", 5, True), ("B", 3, False)]
    assert step(sched) == [("A", 1, True), ("B", 6, True)]
    assert (b.block_table, b.num_computed_tokens) == ([2, 3, 4], 9)


def test_preemption_evicts_the_latest_arrival_and_it_later_resumes():
    sched = make_scheduler(budget=40)
    a, b, c = make_seq("A", 8, 0.0), make_seq("B", 8, 1.0), make_seq("C", 8, 2.0)
    d = make_seq("D", 16, 3.0)
    for s in (a, b, c, d):
        sched.add(s)
    assert step(sched, token=1) == [("A", 8, True), ("B", 8, True), ("C", 8, True), ("D", 16, True)]
    assert [s.block_table for s in (a, b, c, d)] == [[0, 1], [2, 3], [4, 5], [6, 7, 8, 9]]
    assert free_list(sched) == []

    # Every decode needs a third block now; A's request forces the preemption of D, the latest arrival.
    out = sched.schedule()
    assert out.preempted == [d]
    assert plan(out) == [("A", 1, True), ("B", 1, True), ("C", 1, True)]
    assert d.status == SequenceStatus.PREEMPTED
    assert (d.block_table, d.num_computed_tokens, d.output_token_ids) == ([], 0, [1])
    assert list(sched.waiting) == [d]
    assert sched.running == [a, b, c]
    assert (d.num_preemptions, sched.num_preemptions) == (1, 1)
    assert [s.block_table for s in (a, b, c)] == [[0, 1, 6], [2, 3, 7], [4, 5, 8]]
    assert free_list(sched) == [9]
    sched.update(out, {s.seq_id: [2] for s in (a, b, c)}, now=1.0)

    # D needs 5 blocks for its 17 tokens (prompt + its sampled token); only block 9 is free.
    assert step(sched, token=3) == [("A", 1, True), ("B", 1, True), ("C", 1, True)]
    assert list(sched.waiting) == [d]
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    sched.finish(b, SequenceStatus.FINISHED_STOPPED)
    assert free_list(sched) == [9, 0, 1, 6, 2, 3, 7]

    # D resumes: recompute of all 17 tokens in one chunk, which samples its second token.
    assert step(sched, token=4) == [("C", 1, True), ("D", 17, True)]
    assert d.status == SequenceStatus.RUNNING
    assert d.block_table == [9, 0, 1, 6, 2]
    assert (d.num_computed_tokens, d.output_token_ids) == (17, [1, 4])
    assert free_list(sched) == [3, 7]
    sched.block_pool.check_invariants([c, d])


def test_a_sequence_that_is_the_latest_arrival_preempts_itself():
    sched = make_scheduler(num_blocks=4, budget=16)
    a, b = make_seq("A", 8, 0.0), make_seq("B", 8, 1.0)
    sched.add(a)
    sched.add(b)
    assert step(sched) == [("A", 8, True), ("B", 8, True)]
    assert free_list(sched) == []
    out = sched.schedule()
    # A is scheduled first and cannot be evicted; B (latest) needs a block and gives its own back.
    assert plan(out) == [("A", 1, True)]
    assert out.preempted == [b]
    assert a.block_table == [0, 1, 2]
    assert (b.block_table, b.num_computed_tokens, b.status) == ([], 0, SequenceStatus.PREEMPTED)
    assert free_list(sched) == [3]
    sched.update(out, {a.seq_id: [5]}, now=1.0)


def test_preempted_sequence_goes_ahead_of_later_waiting_requests():
    sched = make_scheduler(num_blocks=4, budget=16)
    a, b = make_seq("A", 8, 0.0), make_seq("B", 8, 1.0)
    sched.add(a)
    sched.add(b)
    step(sched)
    c = make_seq("C", 2, 2.0)
    sched.add(c)
    # This step preempts B, so nothing is admitted, not even C which would fit in block 3.
    assert step(sched) == [("A", 1, True)]
    assert list(sched.waiting) == [b, c]
    sched.finish(a, SequenceStatus.FINISHED_STOPPED)
    assert step(sched) == [("B", 9, True), ("C", 2, True)]
    assert b.block_table == [3, 0, 1]
    assert c.block_table == [2]


def test_no_preemption_while_blocks_suffice_and_a_waiting_prefill_waits_for_blocks():
    sched = make_scheduler(num_blocks=3, budget=16)
    a, b = make_seq("A", 8, 0.0), make_seq("B", 5, 1.0)
    sched.add(a)
    sched.add(b)
    assert step(sched) == [("A", 8, True)]  # B needs 2 blocks, 1 is free: it waits, nothing is evicted
    assert sched.num_preemptions == 0
    assert list(sched.waiting) == [b]


def test_without_chunked_prefill_a_prompt_waits_until_it_fits_whole():
    sched = make_scheduler(budget=16, max_model_len=16, chunked=False)
    a, b = make_seq("A", 10, 0.0), make_seq("B", 10, 1.0)
    sched.add(a)
    sched.add(b)
    assert step(sched) == [("A", 10, True)]  # B's 10 tokens do not fit in the 6 left; no partial chunk
    assert (b.num_computed_tokens, b.block_table) == (0, [])
    assert step(sched) == [("A", 1, True), ("B", 10, True)]
    assert b.block_table == [3, 4, 5]


def test_without_chunked_prefill_a_prompt_of_the_whole_budget_runs_alone():
    sched = make_scheduler(budget=16, max_model_len=16, chunked=False)
    a = make_seq("A", 16, 0.0)
    sched.add(a)
    assert step(sched) == [("A", 16, True)]
    assert a.block_table == [0, 1, 2, 3]


def test_finish_an_unscheduled_waiting_sequence():
    sched = make_scheduler()
    a, b = make_seq("A", 8, 0.0), make_seq("B", 4, 1.0)
    sched.add(a)
    sched.add(b)
    sched.finish(b, SequenceStatus.FINISHED_ABORTED)
    assert b.finish_reason == "abort"
    assert not sched.waiting.count(b)
    assert step(sched) == [("A", 8, True)]
    assert sched.has_unfinished()
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished()
    assert free_list(sched) == [2, 3, 4, 5, 6, 7, 8, 9, 0, 1]


def test_update_skips_a_sequence_aborted_while_the_step_ran():
    sched = make_scheduler()
    a, b = make_seq("A", 3, 0.0), make_seq("B", 3, 1.0)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    sched.finish(a, SequenceStatus.FINISHED_ABORTED)
    got = sched.update(out, {b.seq_id: [5]}, now=2.0)
    assert got == [b]
    assert (a.output_token_ids, a.num_placeholders) == ([], 0)  # its token is dropped
    assert (b.num_computed_tokens, b.output_token_ids, b.num_placeholders) == (3, [5], 0)


def test_empty_schedule():
    sched = make_scheduler()
    out = sched.schedule()
    assert out.is_empty and not out.is_decode_only and out.num_batched_tokens == 0
