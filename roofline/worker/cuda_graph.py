"""Decode steps replayed from CUDA graphs over a batch-size ladder (as vLLM and gpt-fast do).

A decode step launches a few hundred small kernels; at small batch their launch gaps cost as much as the
work. One graph per ladder size is captured at start-up over static input buffers. A step with ``n``
sequences replays the smallest captured size ``>= n``: the real rows are copied in, and the attention
backend pads the rest (``prepare_replay``: slot -1, which the cache store skips, and context 0, for which
the decode kernel writes zeros). The backend's static block table has a fixed width
(``max_model_len / block_size``), so its decode split count, which depends only on static sizes, is the
same at capture and replay.

Speculative decoding's verify step replays the same graphs: ``Worker.prepare_inputs`` lays out a step in
which every request decodes 1 + k tokens (its last token and k drafts) as 1 + k decode rows that share
the request's block table, row j seeing ``start + j + 1`` keys. The cache store runs before attention,
so row j reads the drafts' K/V written by rows < j in the same pass: causal, exact, and of fixed shape.
A token tree's verify step is decode rows too (one per node, each seeing the prefix and its ancestors through
``tree_lo`` / ``tree_bits``): with ``tree_rows`` the graphs are captured with those inputs. With a draft model, a
second runner captures the draft's one-token passes over the same static
attention buffers and memory pool (``share_with``); replays never overlap, so sharing is safe.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from roofline.attention.backend import AttentionBackend, AttentionMetadata

logger = logging.getLogger(__name__)

DEFAULT_LADDER = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256, 320, 384, 448, 512)


def capture_graph(fn: Callable[[], Any], warmup: int = 1, pool: Any = None) -> tuple[torch.cuda.CUDAGraph, Any]:
    """(a CUDA graph of ``fn()``, the output ``fn`` returned while captured: static tensors each replay
    rewrites), after ``warmup`` calls on a side stream (torch's capture recipe: Triton compiles and autotunes
    there, outside the capture), in memory pool ``pool`` (None: a new one, ``graph.pool()``)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    return graph, out


class CUDAGraphRunner:
    """Captures ``model(input_ids, positions, meta) -> hidden`` for decode batches of the ladder's sizes.

    Raises:
        ValueError: the backend cannot be captured (``supports_cuda_graphs`` is False).
    """

    def __init__(self, model: torch.nn.Module, backend: AttentionBackend, max_num_seqs: int,
                 max_blocks_per_seq: int, device: torch.device, hidden_size: int, dtype: torch.dtype,
                 ladder: tuple[int, ...] = DEFAULT_LADDER, share_with: CUDAGraphRunner | None = None,
                 name: str = "decode", tree_rows: bool = False):
        if not backend.supports_cuda_graphs:
            raise ValueError(f"the {backend.name} attention backend cannot be captured in CUDA graphs")
        sizes = [b for b in ladder if b < max_num_seqs] + [max_num_seqs]
        self.batch_sizes = sorted(set(sizes))
        self.model = model
        self.backend = backend
        self.device = device
        self.max_blocks_per_seq = max_blocks_per_seq
        self.name = name
        n = self.batch_sizes[-1]
        # tree_rows: the graphs also take a token tree's decode rows (AttentionMetadata.tree_lo / tree_bits).
        self.tree_rows = tree_rows if share_with is None else share_with.tree_rows
        if share_with is None:
            backend.init_capture(n, max_blocks_per_seq, device, tree_rows=tree_rows)
        elif n > share_with.batch_sizes[-1] or max_blocks_per_seq > share_with.max_blocks_per_seq:
            raise ValueError(f"a shared runner's {n} rows x {max_blocks_per_seq} blocks exceed the first runner's "
                             f"{share_with.batch_sizes[-1]} x {share_with.max_blocks_per_seq}")
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(n, hidden_size, dtype=dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = share_with.pool if share_with is not None else None

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every ladder size, largest first, sharing one memory pool."""
        for bs in reversed(self.batch_sizes):
            meta = self.backend.capture_metadata(bs)

            def step(bs=bs, meta=meta) -> None:
                self.hidden[:bs] = self.model(self.input_ids[:bs], self.positions[:bs], meta)

            graph, _ = capture_graph(step, pool=self.pool)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs (%s) for batch sizes %s", self.name, self.batch_sizes)

    def can_run(self, num_seqs: int, max_blocks: int, tree: bool = False) -> bool:
        """Whether a decode step of ``num_seqs`` rows reading ``max_blocks`` blocks (``tree``: with a token
        tree's masks) replays a graph."""
        return num_seqs <= self.batch_sizes[-1] and max_blocks <= self.max_blocks_per_seq and (self.tree_rows or not tree)

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Replay the graph for ``n = len(input_ids)`` decode rows; returns hidden [n, hidden_size] (a view of
        the static output: read it before the next replay)."""
        n = input_ids.shape[0]
        bs = next(b for b in self.batch_sizes if b >= n)
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.backend.prepare_replay(bs, meta)
        self.graphs[bs].replay()
        return self.hidden[:n]
