"""Decode steps replayed from CUDA graphs over a batch-size ladder (as vLLM and gpt-fast do).

A decode step launches a few hundred small kernels; at small batch their launch gaps cost as much as the
work. One graph per ladder size is captured at start-up with static input buffers. A step with ``n``
sequences replays the smallest captured size ``>= n``: the real rows are copied in, the padding rows get
slot -1 (the cache store skips them) and context length 0 (the decode kernel writes zeros for them).
Block tables are padded to a fixed width (``max_model_len / block_size``), so the decode kernel's split
count, which depends only on static sizes, is the same at capture and replay.
"""

from __future__ import annotations

import logging

import torch

from roofline.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

DEFAULT_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


class CUDAGraphDecoder:
    """Captures ``model(input_ids, positions, meta) -> hidden`` for decode batches of the ladder's sizes."""

    def __init__(self, model: torch.nn.Module, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device, hidden_size: int, dtype: torch.dtype,
                 ladder: tuple[int, ...] = DEFAULT_LADDER):
        sizes = [b for b in ladder if b < max_num_seqs] + [max_num_seqs]
        self.batch_sizes = sorted(set(sizes))
        self.model = model
        self.device = device
        n = self.batch_sizes[-1]
        self.max_blocks_per_seq = max_blocks_per_seq
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            query_start_loc=self.query_start_loc[:bs + 1],
            seq_lens=self.seq_lens[:bs],
            block_tables=self.block_tables[:bs],
            max_query_len=1,
            max_seq_len=self.max_blocks_per_seq,  # unused by the decode path
            seq_lens_cpu=[1] * bs,
            query_lens_cpu=[1] * bs,
        )

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every ladder size, largest first, sharing one memory pool."""
        for bs in reversed(self.batch_sizes):
            meta = self._meta(bs)
            # Warm-up outside capture: Triton compiles and autotunes here, not inside the graph.
            self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], meta)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], meta)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batch sizes %s", self.batch_sizes)

    def can_run(self, num_seqs: int, max_blocks: int) -> bool:
        return num_seqs <= self.batch_sizes[-1] and max_blocks <= self.max_blocks_per_seq

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph for ``n = len(input_ids)`` decode rows; returns hidden [n, hidden_size]."""
        n = input_ids.shape[0]
        bs = next(b for b in self.batch_sizes if b >= n)
        self.input_ids[:n].copy_(input_ids)
        self.positions[:n].copy_(positions)
        self.slot_mapping[:n].copy_(meta.slot_mapping)
        self.seq_lens[:n].copy_(meta.seq_lens)
        width = meta.block_tables.shape[1]
        self.block_tables[:n, :width].copy_(meta.block_tables)
        if n < bs:
            self.slot_mapping[n:bs].fill_(-1)
            self.seq_lens[n:bs].fill_(0)
        self.graphs[bs].replay()
        return self.hidden[:n]
