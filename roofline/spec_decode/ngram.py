"""The n-gram proposer (prompt lookup decoding, Saxena 2023; vLLM's ``ngram`` method).

For a sequence ``t_0 .. t_{n-1}``, try suffix lengths from ``prompt_lookup_max`` down to
``prompt_lookup_min``: the first length whose last ``size`` tokens also occur earlier wins, and the tokens
that followed its latest earlier occurrence, up to ``k`` of them, are the drafts. Deterministic: its ``q`` is
one-hot on each proposed token. Runs on the host over the engine's token lists (numpy windows, no loop per
candidate position).
"""

from __future__ import annotations

import numpy as np


def ngram_propose(token_ids: list[int] | np.ndarray, k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Up to ``k`` draft tokens for the continuation of ``token_ids`` (possibly none).

    Args:
        token_ids: the sequence so far (prompt + output), ids.
        k: the most drafts to return, >= 0.
        lookup_min, lookup_max: suffix lengths tried, longest first; 1 <= lookup_min <= lookup_max.

    Raises:
        ValueError: ``k`` < 0 or a bad lookup range.
    """
    if k < 0:
        raise ValueError(f"k must be >= 0, got {k}")
    if not 1 <= lookup_min <= lookup_max:
        raise ValueError(f"need 1 <= lookup_min <= lookup_max, got {lookup_min}, {lookup_max}")
    if k == 0:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    n = len(tokens)
    for size in range(min(lookup_max, n - 1), lookup_min - 1, -1):
        suffix = tokens[n - size:]
        # Candidate starts 0 .. n - size - 1: each occurrence ends before the suffix itself, so at least one
        # token follows it.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:n - 1], size)  # [n - size, size]
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + size
            return tokens[start:start + k].tolist()
    return []
