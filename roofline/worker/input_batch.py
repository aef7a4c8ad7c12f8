"""The persistent input batch (vLLM v1's InputBatch): per-request state kept across steps in host arrays.

Each live sequence owns one row. Adding a request writes its prompt, block table and sampling parameters
into its row once; afterwards a step only appends new block ids and the token it sampled. Building a
step's flat batch is then a handful of vectorized gathers over these arrays (``Worker.prepare_inputs``),
with no per-token Python loop.

Penalty state (occurrence counts of generated tokens, the prompt's token set) lives on the device as
[max_num_reqs, vocab] tensors, allocated the first time a request uses a penalty and updated in place
from each step's sampled ids.
"""

from __future__ import annotations

import heapq

import numpy as np
import torch

from roofline.sampling_params import SamplingParams
from roofline.step import NewRequest


class InputBatch:
    """Rows of per-sequence state.

    Arrays (row-indexed): ``token_ids`` [R, max_model_len] int64, ``num_tokens`` / ``num_prompt_tokens`` /
    ``num_computed_tokens`` [R] int64, ``block_table`` [R, max_blocks_per_seq] int32 with ``num_blocks``
    [R], and the sampling parameters as columns (``temperature``, ``top_k``, ``top_p``, ``min_p``,
    ``repetition_penalty``, ``presence_penalty``, ``frequency_penalty``).
    """

    def __init__(self, max_num_reqs: int, max_model_len: int, max_blocks_per_seq: int, vocab_size: int,
                 device: torch.device):
        self.max_num_reqs = max_num_reqs
        self.vocab_size = vocab_size
        self.device = device
        r = max_num_reqs
        self.token_ids = np.zeros((r, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(r, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(r, dtype=np.int64)
        self.num_computed_tokens = np.zeros(r, dtype=np.int64)
        self.block_table = np.zeros((r, max_blocks_per_seq), dtype=np.int32)
        self.num_blocks = np.zeros(r, dtype=np.int64)
        self.temperature = np.zeros(r, dtype=np.float32)
        self.top_k = np.zeros(r, dtype=np.int64)
        self.top_p = np.ones(r, dtype=np.float32)
        self.min_p = np.zeros(r, dtype=np.float32)
        self.repetition_penalty = np.ones(r, dtype=np.float32)
        self.presence_penalty = np.zeros(r, dtype=np.float32)
        self.frequency_penalty = np.zeros(r, dtype=np.float32)
        self.num_logprobs = np.full(r, -1, dtype=np.int64)  # -1: the request wants no logprobs
        self.params: list[SamplingParams | None] = [None] * r
        self.seq_ids: list[int | None] = [None] * r
        self.row_of: dict[int, int] = {}
        self._free_rows = list(range(r))
        self.output_counts: torch.Tensor | None = None  # [R, V] fp32, lazily
        self.prompt_mask: torch.Tensor | None = None  # [R, V] bool, lazily
        self.min_tokens_rows: set[int] = set()  # rows still below their min_tokens
        # Rows whose prompt still has positions to score for prompt logprobs -> their k (worker/prompt_logprobs.py).
        self.prompt_logprobs_rows: dict[int, int] = {}
        # Async scheduling: a row whose newest token is still on the device holds its index in the sampled
        # ids of step ``pending_step`` (-1: none pending).
        self.pending_src = np.full(r, -1, dtype=np.int64)
        self.pending_step = np.full(r, -1, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.row_of)

    # ------------------------------------------------------------------------------ membership

    def add(self, req: NewRequest) -> int:
        """Write a new sequence into a free row; returns the row.

        Raises:
            RuntimeError: no free row (the scheduler admits at most max_num_seqs sequences).
        """
        if req.seq_id in self.row_of:
            self.remove(req.seq_id)
        if not self._free_rows:
            raise RuntimeError(f"the input batch is full ({self.max_num_reqs} rows)")
        row = heapq.heappop(self._free_rows)
        self.row_of[req.seq_id] = row
        self.seq_ids[row] = req.seq_id
        n = len(req.token_ids)
        self.token_ids[row, :n] = req.token_ids
        self.num_tokens[row] = n
        self.num_prompt_tokens[row] = req.num_prompt_tokens
        self.num_computed_tokens[row] = req.num_computed_tokens
        self.num_blocks[row] = 0
        self.pending_src[row] = -1
        self.pending_step[row] = -1
        self.append_blocks(row, req.block_ids)
        p = req.sampling_params
        self.params[row] = p
        self.temperature[row] = 0.0 if p.is_greedy else p.temperature
        self.top_k[row] = p.top_k if p.top_k > 0 else self.vocab_size
        self.top_p[row] = p.top_p
        self.min_p[row] = p.min_p
        self.repetition_penalty[row] = p.repetition_penalty
        self.presence_penalty[row] = p.presence_penalty
        self.frequency_penalty[row] = p.frequency_penalty
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        if p.min_tokens > 0:
            self.min_tokens_rows.add(row)
        if p.prompt_logprobs is not None and req.num_computed_tokens < req.num_prompt_tokens - 1:
            self.prompt_logprobs_rows[row] = p.prompt_logprobs
        if p.repetition_penalty != 1.0 or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0:
            self._init_penalty_state(row, req)
        return row

    def remove(self, seq_id: int) -> None:
        row = self.row_of.pop(seq_id, None)
        if row is None:
            return
        self.seq_ids[row] = None
        self.params[row] = None
        self.min_tokens_rows.discard(row)
        self.prompt_logprobs_rows.pop(row, None)
        heapq.heappush(self._free_rows, row)

    def append_blocks(self, row: int, block_ids: list[int]) -> None:
        if block_ids:
            start = int(self.num_blocks[row])
            self.block_table[row, start:start + len(block_ids)] = block_ids
            self.num_blocks[row] = start + len(block_ids)

    # ------------------------------------------------------------------------------ sampling state

    def _init_penalty_state(self, row: int, req: NewRequest) -> None:
        if self.output_counts is None:
            self.output_counts = torch.zeros(self.max_num_reqs, self.vocab_size, dtype=torch.float32,
                                             device=self.device)
            self.prompt_mask = torch.zeros(self.max_num_reqs, self.vocab_size, dtype=torch.bool, device=self.device)
        assert self.prompt_mask is not None
        self.output_counts[row].zero_()
        self.prompt_mask[row].zero_()
        prompt = torch.tensor(req.token_ids[:req.num_prompt_tokens], dtype=torch.int64, device=self.device)
        self.prompt_mask[row, prompt] = True
        output = req.token_ids[req.num_prompt_tokens:]
        if output:
            ids = torch.tensor(output, dtype=torch.int64, device=self.device)
            self.output_counts[row].index_add_(0, ids, torch.ones(len(ids), device=self.device))

    def uses_penalties(self, rows: np.ndarray) -> tuple[bool, bool, bool]:
        """(repetition, presence, frequency): whether any of ``rows`` uses each penalty."""
        return (bool((self.repetition_penalty[rows] != 1.0).any()), bool((self.presence_penalty[rows] != 0.0).any()),
                bool((self.frequency_penalty[rows] != 0.0).any()))

    def mark_sampled(self, rows: np.ndarray, token_ids: torch.Tensor | None, rows_device: torch.Tensor | None,
                     step_id: int) -> None:
        """At launch: each row of ``rows`` gains one token, known only on the device for now (``token_ids``
        [N] int64, row ``rows[i]``'s at index i); penalty counts are updated on the device. ``token_ids`` is
        None on a pipeline stage that does not sample (it only keeps the counts)."""
        for row in self.min_tokens_rows.intersection(rows.tolist()):
            p = self.params[row]
            if p is not None and self.num_tokens[row] + 1 - self.num_prompt_tokens[row] >= p.min_tokens:
                self.min_tokens_rows.discard(row)
        self.num_tokens[rows] += 1
        self.pending_src[rows] = np.arange(len(rows))
        self.pending_step[rows] = step_id
        if self.output_counts is not None and token_ids is not None:
            assert rows_device is not None
            self.output_counts.index_put_((rows_device, token_ids),
                                          torch.ones(len(rows), device=self.device), accumulate=True)

    def write_sampled(self, rows: list[int], seq_ids: list[int], positions: list[int], token_ids: list[int],
                      step_id: int) -> None:
        """When step ``step_id``'s ids arrive: write them into rows still held by the same sequences."""
        for row, sid, pos, tok in zip(rows, seq_ids, positions, token_ids, strict=True):
            if self.seq_ids[row] != sid:
                continue  # finished or preempted meanwhile
            self.token_ids[row, pos] = tok
            if self.pending_step[row] == step_id:
                self.pending_src[row] = -1
                self.pending_step[row] = -1
