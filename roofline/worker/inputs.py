"""Input preparation: the step's flat batch and sampling inputs from the persistent batch, and the pinned
staging that moves them to the device without a host sync.

Vectorized gathers over the persistent batch (``InputBatch``) give input_ids, positions, slot_mapping, block
tables and query_start_loc; they go to the device from pinned host buffers with non-blocking copies, and
``paged_metadata`` builds the attention metadata once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from roofline.attention.backend import TREE_LO_NONE, AttentionMetadata, paged_metadata, slot_mapping
from roofline.layers.sampler import SamplingMetadata
from roofline.step import StepInput
from roofline.worker.input_batch import InputBatch


class InputPreparer:
    """Builds each step's device inputs from ``batch`` (see the module docstring).

    ``step_id`` (set by the worker each step) picks the staging set; ``num_spec`` [max_num_seqs] holds each
    row's drafts this step (0: the row does not speculate); ``prev_sampled`` the last launched step's sampled ids
    on the device; ``generators`` the seeded requests' generators (seq_id -> ``torch.Generator``).
    """

    def __init__(self, batch: InputBatch, device: torch.device, block_size: int, vocab_size: int,
                 build_metadata: Callable[[AttentionMetadata], AttentionMetadata], tree_as_decode_rows: bool = False):
        self.batch, self.device, self.block_size, self.vocab_size = batch, device, block_size, vocab_size
        self.build_metadata = build_metadata  # the attention backend's per-step precomputation
        # The backend takes a tree verify step as decode rows (``AttentionBackend.tree_as_decode_rows``).
        self.tree_as_decode_rows = tree_as_decode_rows
        self.pin = device.type == "cuda"
        self._staging: dict[tuple[str, int], torch.Tensor] = {}
        self.step_id = 0
        self.num_spec = np.zeros(len(batch.num_tokens), dtype=np.int64)
        self.prev_sampled: torch.Tensor | None = None
        self.generators: dict[int, torch.Generator] = {}
        self.seeds: dict[int, int] = {}  # seq_id -> seed + seed_offset, for ``keyed_seed``
        # row -> this step's token tree (``roofline.spec_decode.tree.DraftTree``) from a tree proposer; its
        # nodes sit in token_ids after the row's known tokens, and the verifier clears the dict.
        self.trees: dict[int, Any] = {}

    def to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        """Copy a host array to the device: through a pinned staging buffer and a non-blocking copy on CUDA.

        Staging buffers alternate between two sets by step parity: with at most one step in flight behind
        the one being prepared, the set written now was last read by a step that has finished.
        """
        t = torch.from_numpy(array)
        if not self.pin:
            return t
        key = (name, self.step_id % 2)
        buf = self._staging.get(key)
        if buf is None or buf.numel() < t.numel():
            buf = torch.empty(max(t.numel(), 1024), dtype=t.dtype, pin_memory=True)
            self._staging[key] = buf
        staged = buf[:t.numel()].view(t.shape)
        staged.copy_(t)
        return staged.to(self.device, non_blocking=True)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A non-blocking device -> host copy into pinned memory (a plain reference on CPU)."""
        if not self.pin:
            return t
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def prepare_inputs(
        self, step: StepInput, tag: str = ""
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray, np.ndarray]:
        """The step's flat batch. Returns input_ids [T], positions [T], the backend's metadata, the batch rows of the sequences that sample this step (in batch order),
        and the flat index of each one's last token (``logits_indices``). ``tag`` prefixes the staging
        buffers' names (a pipeline's micro-batches are prepared in one step)."""
        batch = self.batch
        rows = np.fromiter((batch.row_of[sid] for sid, _ in step.scheduled), dtype=np.int64,
                           count=len(step.scheduled))
        counts = np.fromiter((n for _, n in step.scheduled), dtype=np.int64, count=len(step.scheduled))
        query_start = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        total = int(query_start[-1])
        start = batch.num_computed_tokens[rows]  # [S] first position of each chunk
        token_rows = np.repeat(rows, counts)  # [T]
        positions = np.repeat(start - query_start[:-1], counts) + np.arange(total)  # [T]
        input_ids = batch.token_ids[token_rows, positions]
        slots = slot_mapping(batch.block_table, token_rows, positions, self.block_size)
        seq_lens = start + counts
        max_blocks = int(batch.num_blocks[rows].max())
        num_spec = self.num_spec[rows]
        samples = seq_lens - num_spec == batch.num_tokens[rows]  # drafts sit past num_tokens
        verify_rows = bool(num_spec.any() and samples.all() and (counts == 1 + num_spec).all())
        tree_mask = tree_rows = None
        if self.trees:
            # A tree-verification step: node i of a row is read from slot n + i (in node order) but sits at
            # position n - 1 + depth_i, and sees the cached prefix, the root and its ancestors only.
            from roofline.spec_decode.tree import region_mask

            if self.tree_as_decode_rows and verify_rows:
                # decode rows (below): row lo + i, node i, sees keys from start + 1 on by its ancestor bits
                tree_rows = (np.full(total, TREE_LO_NONE, dtype=np.int64), np.full(total, -1, dtype=np.int64))
            else:
                width = max(len(t) for t in self.trees.values())
                tree_mask = np.full((len(rows), width), -1, dtype=np.int64)
            for i, r in enumerate(rows.tolist()):
                t = self.trees.get(r)
                if t is not None and counts[i] == 1 + len(t):
                    lo = query_start[i] + 1
                    positions[lo:lo + len(t)] = start[i] + t.depth
                    if tree_rows is not None:
                        tree_rows[0][lo:lo + len(t)] = start[i] + 1
                        tree_rows[1][lo:lo + len(t)] = region_mask(t, len(t), q_len=len(t))
                    else:
                        tree_mask[i] = region_mask(t, width)
        if verify_rows and tree_mask is None:
            # A verify step (every request decodes its last token + its drafts): one decode row per token,
            # row j of a request seeing start + j + 1 keys through the request's block table (a tree's rows
            # only those of ``tree_rows``). The cache store precedes attention, so this is the causal extend,
            # with the decode kernel's fixed shapes (CUDA graphs replay it). Query rows, sample rows and logits
            # indices are unchanged.
            attn_rows, attn_starts = token_rows, np.arange(total + 1)
            attn_lens = np.repeat(start - query_start[:-1], counts) + np.arange(total) + 1
        else:
            attn_rows, attn_starts, attn_lens = rows, query_start, seq_lens
        meta = paged_metadata(slots, attn_starts, attn_lens, batch.block_table[attn_rows, :max_blocks],
                              lambda name, a: self.to_device(tag + name, a), tree_mask, tree_rows)
        ids = self.to_device(tag + "input_ids", input_ids)
        pos = self.to_device(tag + "positions", positions)
        # A sequence's newest token may still be on its way from the previous step (async scheduling): read
        # it on the device from that step's sampled ids.
        pending = samples & (batch.pending_src[rows] >= 0) & (batch.pending_step[rows] == self.step_id - 1)
        if pending.any():
            assert self.prev_sampled is not None
            dst = self.to_device(tag + "pending_dst", query_start[1:][pending] - 1)
            src = self.to_device(tag + "pending_src", batch.pending_src[rows][pending])
            ids[dst] = self.prev_sampled[src]
        return ids, pos, self.build_metadata(meta), rows[samples], query_start[1:][samples] - 1

    def prepare_sampling(self, rows: np.ndarray, tag: str = "", positions: np.ndarray | None = None) -> SamplingMetadata:
        """Sampling inputs for logits rows ``i`` = sequence rows ``rows[i]`` (the row -> request index).

        ``positions[i]``: the sequence index of the token row ``i`` samples; a seeded request's generator is
        re-seeded with ``keyed_seed(seed, positions[i])`` for that one draw (rows must then be distinct).

        ``tag`` prefixes the staging buffers' names: a second call in the same step (speculative decoding's
        verify and draft passes) must not overwrite pinned buffers whose non-blocking copies may be pending."""
        batch = self.batch
        if positions is not None and self.generators:
            from roofline.layers.sampler import keyed_seed

            for r, pos in zip(rows.tolist(), positions.tolist(), strict=True):
                sid = batch.seq_ids[r]
                if sid in self.generators:
                    self.generators[sid].manual_seed(keyed_seed(self.seeds[sid], pos))
        temps = batch.temperature[rows]
        need_rep, need_pres, need_freq = batch.uses_penalties(rows)
        penalties = need_rep or need_pres or need_freq
        idx = self.to_device(tag + "sampling_rows", rows) if penalties else None

        def col(name: str, values: np.ndarray) -> torch.Tensor:
            return self.to_device(tag + name, np.ascontiguousarray(values))

        banned = None
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        below = batch.min_tokens_rows.intersection(rows.tolist()) if batch.min_tokens_rows else ()
        for i, r in enumerate(rows.tolist() if below else ()):
            if r in below:  # below min_tokens: EOS and stop ids may not be sampled yet
                p = batch.params[r]
                assert p is not None
                stop_ids = set(p.stop_token_ids or []) | (set() if p.ignore_eos else p._all_stop_token_ids)
                ban_rows += [i] * len(stop_ids)
                ban_ids += sorted(stop_ids)
        if ban_rows:
            banned = torch.zeros(len(rows), self.vocab_size, dtype=torch.bool, device=self.device)
            banned[self.to_device(tag + "ban_rows", np.array(ban_rows, dtype=np.int64)),
                   self.to_device(tag + "ban_ids", np.array(ban_ids, dtype=np.int64))] = True
        return SamplingMetadata(
            temperatures=col("temperature", temps),
            top_ks=col("top_k", batch.top_k[rows]) if (batch.top_k[rows] < self.vocab_size).any() else None,
            top_ps=col("top_p", batch.top_p[rows]) if (batch.top_p[rows] < 1.0).any() else None,
            min_ps=col("min_p", batch.min_p[rows]) if (batch.min_p[rows] > 0).any() else None,
            repetition_penalties=col("rep", batch.repetition_penalty[rows]) if need_rep else None,
            presence_penalties=col("pres", batch.presence_penalty[rows]) if need_pres else None,
            frequency_penalties=col("freq", batch.frequency_penalty[rows]) if need_freq else None,
            prompt_mask=batch.prompt_mask[idx] if need_rep and batch.prompt_mask is not None else None,
            output_counts=batch.output_counts[idx] if penalties and batch.output_counts is not None else None,
            banned_mask=banned,
            generators=([self.generators.get(batch.seq_ids[r]) for r in rows.tolist()]  # type: ignore[arg-type]
                        if self.generators else [None] * len(rows)),
            all_greedy=bool((temps == 0.0).all()),
            max_num_logprobs=int(batch.num_logprobs[rows].max()),
        )
