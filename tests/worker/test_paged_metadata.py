"""The one ``AttentionMetadata`` builder (``attention.backend.paged_metadata``), its slot formula, and the one
logprob-entry helper (``worker.sampling.logprob_entry``): exact values on small hand-checked cases."""

from __future__ import annotations

import numpy as np
import torch

from roofline.attention.backend import paged_metadata, slot_mapping
from roofline.step import Logprob
from roofline.worker.sampling import logprob_entry


def test_slot_mapping_follows_each_rows_block_table():
    block_table = np.array([[7, 2, 0], [4, 9, 5]], dtype=np.int32)  # [rows, max_blocks]
    token_rows = np.array([0, 0, 0, 1, 1])
    positions = np.array([3, 4, 9, 0, 8])
    # block_size 4: row 0 position 3 -> block 7 slot 3; 4 -> block 2 slot 0; 9 -> block 0 slot 1;
    # row 1 position 0 -> block 4 slot 0; 8 -> block 5 slot 0.
    got = slot_mapping(block_table, token_rows, positions, 4)
    assert got.dtype == np.int64
    assert got.tolist() == [7 * 4 + 3, 2 * 4 + 0, 0 * 4 + 1, 4 * 4 + 0, 5 * 4 + 0]


def test_paged_metadata_fields():
    slots = np.array([5, 6, 7, 20], dtype=np.int64)
    qsl = np.array([0, 3, 4])
    seq_lens = np.array([10, 1])
    tables = np.array([[1, 2, 3], [5, 0, 0]], dtype=np.int32)
    meta = paged_metadata(slots, qsl, seq_lens, tables, torch.device("cpu"))
    assert meta.slot_mapping.tolist() == [5, 6, 7, 20] and meta.slot_mapping.dtype == torch.int64
    assert meta.query_start_loc.tolist() == [0, 3, 4] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [10, 1] and meta.seq_lens.dtype == torch.int32
    assert meta.block_tables.tolist() == [[1, 2, 3], [5, 0, 0]] and meta.block_tables.dtype == torch.int32
    assert (meta.max_query_len, meta.query_lens_cpu, meta.seq_lens_cpu) == (3, [3, 1], [10, 1])
    # Through a staging function: every array goes through it under its name.
    names = []
    meta = paged_metadata(slots, qsl, seq_lens, tables, lambda n, a: (names.append(n), torch.from_numpy(a))[1])
    assert names == ["slot_mapping", "query_start_loc", "seq_lens", "block_tables"]
    assert meta.seq_lens_cpu == [10, 1]


def test_logprob_entry_puts_the_token_first_and_skips_it_among_the_top_k():
    entry = logprob_entry(5, -2.0, 3, [9, 5, 1, 4], [-0.5, -2.0, -2.5, -3.0], 3)
    assert list(entry) == [5, 9, 1]  # the token, then the top 3 without repeating it
    assert entry[5] == Logprob(-2.0, 3) and entry[9] == Logprob(-0.5, 1) and entry[1] == Logprob(-2.5, 3)
    assert logprob_entry(9, -0.5, 1, [9, 5], [-0.5, -2.0], 0) == {9: Logprob(-0.5, 1)}
