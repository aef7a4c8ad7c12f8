"""The target's features per persistent-batch row, for the learned drafters that read them (EAGLE's layer,
Medusa's heads): ``FeatureStore``, filled from every step's forward (``observe``, called by the worker before it
advances ``num_computed_tokens``) and read by the proposer's passes."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch


class FeatureStore:
    """Per persistent-batch row, the target's features [n, H] at positions [start, start + n), in a buffer that
    grows by doubling: a step appends its rows in place (a copy of the new rows only; a ``torch.cat`` of the whole
    history each step made an adaptive engine that keeps speculation off pay ~0.1 ms a step at a few hundred
    tokens)."""

    def __init__(self, max_rows: int):
        self.start = np.zeros(max_rows, dtype=np.int64)
        self.size = np.zeros(max_rows, dtype=np.int64)
        self.buf: list[torch.Tensor | None] = [None] * max_rows

    def reset(self, row: int) -> None:
        self.buf[row] = None
        self.size[row] = 0

    def feats(self, row: int) -> torch.Tensor | None:
        """The held features [n, H] of ``row`` (a view), or None."""
        b = self.buf[row]
        return None if b is None else b[:int(self.size[row])]

    def _write(self, row: int, at: int, rows: torch.Tensor) -> None:
        """Features ``rows`` [m, H] at buffer offset ``at`` (<= the held count); the held count becomes at + m."""
        need, buf = at + rows.shape[0], self.buf[row]
        if buf is None or need > buf.shape[0]:
            grown = torch.empty(max(need, 64, 2 * (0 if buf is None else buf.shape[0])), rows.shape[1],
                                dtype=rows.dtype, device=rows.device)
            if buf is not None and at:
                grown[:at] = buf[:at]
            self.buf[row] = buf = grown
        buf[at:need] = rows  # a copy: a CUDA graph's output buffer is reused next step
        self.size[row] = need

    def observe(self, worker: Any, step: Any, hidden: torch.Tensor) -> None:
        """Keep each scheduled row's features from this step's hidden states [T, H] (flat, in
        ``step.scheduled`` order); positions from the row's ``num_computed_tokens`` (not yet advanced) on.
        Features at or past that position from an earlier step (rejected drafts) are replaced."""
        batch, offset = worker.input_batch, 0
        for sid, n in step.scheduled:
            row = batch.row_of[sid]
            c = int(batch.num_computed_tokens[row])
            new = hidden[offset:offset + n]
            offset += n
            s = int(self.start[row])
            if self.buf[row] is None or not s <= c <= s + int(self.size[row]):
                self.start[row] = c
                self._write(row, 0, new)
            else:
                self._write(row, c - s, new)

    def get(self, row: int, lo: int, hi: int) -> torch.Tensor:
        """Features at positions [lo, hi) of ``row``.

        Raises:
            RuntimeError: some of them were never observed (names the row and the ranges)."""
        f, s = self.feats(row), int(self.start[row])
        if f is None or lo < s or hi > s + len(f):
            have = "none" if f is None else f"[{s}, {s + len(f)})"
            raise RuntimeError(f"row {row}: target features for positions [{lo}, {hi}) were not observed "
                               f"(held: {have})")
        return f[lo - s:hi - s]

    def accept_tree(self, row: int, root_pos: int, path: list[int]) -> None:
        """After a tree's verify pass (whose features were observed in node order: the root at ``root_pos``,
        node c at ``root_pos + 1 + c``): keep the root's and the accepted ``path``'s features at positions
        ``root_pos .. root_pos + len(path)``, the positions they now hold."""
        f, s = self.feats(row), int(self.start[row])
        if f is None or not s <= root_pos < s + len(f):
            return
        keep = torch.tensor([root_pos - s] + [root_pos - s + 1 + c for c in path], device=f.device)
        self._write(row, root_pos - s, f[keep])  # the gather copies before the write

    def drop_before(self, row: int, pos: int) -> None:
        f, s = self.feats(row), int(self.start[row])
        if f is not None and pos > s:
            k = min(pos - s, len(f))
            self.buf[row] = self.buf[row][k:]  # a view: the buffer's head is given up until it next grows
            self.size[row] -= k
            self.start[row] = s + k
