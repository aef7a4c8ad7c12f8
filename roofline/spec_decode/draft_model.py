"""A separate draft model for speculative decoding: another checkpoint with the target's vocabulary
(``"model": PATH``), or the target's own weights quantized at load (``"quantization": "int4"``).

It keeps its own KV cache, in the same blocks as the target's: the same block ids, block tables and slot
mapping index a second pool of ``num_blocks`` blocks with the draft's layer count and head shape, so the block
pool, prefix caching and preemption need nothing new. ``Worker._num_kv_blocks`` sizes the two pools together
(the bytes per token are the sum of both).

The draft's KV is filled lazily: ``computed[row]`` counts the positions of a row whose draft KV is valid.
Each draft pass (``decode``) runs the draft over the positions it has not seen up to the token it reads. In
a step's first pass these are usually one or two (the target's bonus or correction token, and an accepted
draft the draft never read), in its later passes one; they run as decode rows, one per position, so every
pass has the decode pass's fixed shapes. A row with more (the prompt, or tokens the target decoded while
speculation was off) is first caught up by a packed prefill (``catch_up``). After verification only the positions whose tokens were accepted stay valid (``rewind``):
the draft's rejected positions are recomputed on the next catch-up, exactly as the target's are.

With CUDA graphs on (the engine's GPU default), the decode-row passes replay graphs captured over the draft's
own backend's static buffers (``capture_graphs``); only prefill catch-ups run eager. On the H200 with the
default model's int4 self-draft at batch 1, every step ran an eager catch-up before this, ~25 ms of host
launches against ~1.1 ms for a plain step (`bench/results/spec-20261203b/`).
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from roofline.attention.backend import AttentionMetadata, get_attention_backend, paged_metadata, slot_mapping
from roofline.attention.kv_cache import kv_bytes_per_token
from roofline.config import EngineConfig, ModelConfig, check_draft_vocab
from roofline.layers.rotary import RotaryEmbedding
from roofline.models import loader
from roofline.quant import get_quant_config
from roofline.worker.cuda_graph import CUDAGraphRunner

logger = logging.getLogger(__name__)

CATCH_UP_SPAN = 8  # a row with at most this many positions to fill runs them as decode rows (``decode``)


class DraftModel:
    """The draft's model, attention backend and KV pool (see the module docstring).

    Args:
        config: the engine's configuration (its ``speculative_config`` names the draft).
        target_source, target_config: the target's checkpoint and shape (the draft's, without ``"model"``).
        max_rows: rows of the persistent batch (``computed`` has one entry per row).

    Raises:
        ValueError: the draft's vocabulary differs from the target's (names both sizes).
    """

    def __init__(self, config: EngineConfig, target_source: loader.ModelSource, target_config: ModelConfig,
                 max_rows: int, dtype: torch.dtype, kv_dtype: torch.dtype, device: torch.device):
        spec = config.speculative_config
        assert spec is not None
        if spec.model is not None:
            self.source = loader.resolve_draft_model(spec.model, target_source.format)
            mc = loader.load_config(self.source)
        else:
            self.source, mc = target_source, target_config
        check_draft_vocab(mc, target_config)
        self.model_config = mc
        self.device, self.dtype, self.kv_dtype = device, dtype, kv_dtype
        rotary = RotaryEmbedding.from_config(mc, device)
        self.backend = get_attention_backend(config.attention_backend)(mc.num_attention_heads,
                                                                        mc.num_key_value_heads, mc.head_dim, rotary)
        quant = get_quant_config(spec.quantization, loader.checkpoint_quantization_config(self.source),
                                 draft_group_size(mc, config.quantization_group_size))
        self.model = loader.load_model(mc, self.source, self.backend, quant, dtype, device, config.seed + 1)
        self.kv_bytes_per_token = kv_bytes_per_token(mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
                                                     kv_dtype)
        self.computed = np.zeros(max_rows, dtype=np.int64)
        self.graphs: CUDAGraphRunner | None = None  # decode passes, once captured (capture_graphs)
        logger.info("draft model %s (%s%s): %d layers, %.1f MB of weights", self.source.name, self.source.format,
                    f", {spec.quantization} at load" if spec.quantization else "", mc.num_hidden_layers,
                    self.weight_bytes / 1e6)

    @property
    def weight_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.model.parameters())  # yields a tied tensor once

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.backend.allocate_kv_cache(self.model_config.num_hidden_layers, num_blocks, block_size, self.kv_dtype,
                                       self.device)

    def capture_graphs(self, max_rows: int, max_blocks_per_seq: int) -> None:
        """Capture the draft's decode-row passes in CUDA graphs for up to ``max_rows`` rows (one per position:
        a step's first ``decode`` may run several per request), over its own backend's static buffers and memory pool
        (after ``allocate_kv_cache``). Prefill catch-ups stay eager."""
        self.graphs = CUDAGraphRunner(self.model, self.backend, max_rows, max_blocks_per_seq, self.device,
                                      self.model_config.hidden_size, self.dtype, name="draft model")
        self.graphs.capture()

    def _metadata(self, block_table: np.ndarray, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                  block_size: int) -> tuple[AttentionMetadata, np.ndarray, np.ndarray]:
        """Packed chunks: row ``rows[i]`` computes positions [starts[i], ends[i]). Returns the metadata, the
        flat token rows and positions."""
        counts = ends - starts
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        token_rows = np.repeat(rows, counts)
        positions = np.repeat(starts - qsl[:-1], counts) + np.arange(int(qsl[-1]))
        max_blocks = int(((ends + block_size - 1) // block_size).max())
        meta = paged_metadata(slot_mapping(block_table, token_rows, positions, block_size), qsl, ends,
                              block_table[rows, :max_blocks], self.device)
        return self.backend.build_metadata(meta), token_rows, positions

    def catch_up(self, token_ids: np.ndarray, block_table: np.ndarray, rows: np.ndarray, ends: np.ndarray,
                 block_size: int, max_tokens: int) -> None:
        """Fill the draft KV of each row ``rows[i]`` up to position ``ends[i]`` (exclusive), from
        ``computed``: packed prefill passes of at most ``max_tokens`` tokens (a longer row runs alone)."""
        starts = np.minimum(self.computed[rows], ends)
        need = ends > starts
        rows, starts, ends = rows[need], starts[need], ends[need]
        i = 0
        while i < len(rows):
            j, total = i, 0
            while j < len(rows) and (j == i or total + ends[j] - starts[j] <= max_tokens):
                total += int(ends[j] - starts[j])
                j += 1
            meta, token_rows, positions = self._metadata(block_table, rows[i:j], starts[i:j], ends[i:j], block_size)
            ids = torch.from_numpy(token_ids[token_rows, positions]).to(self.device)
            self.model(ids, torch.from_numpy(positions).to(self.device), meta)
            i = j
        self.computed[rows] = ends

    def _decode_rows(self, token_ids: np.ndarray, block_table: np.ndarray, rows: np.ndarray,
                     positions: np.ndarray, block_size: int) -> torch.Tensor:
        """One decode row per entry: ``rows[i]`` (repeats allowed) reads the token at ``positions[i]`` and sees
        ``positions[i] + 1`` keys. The cache store precedes attention, so a row sees the K/V that rows of the
        same sequence at earlier positions write in this pass (the target's verify step relies on the same).
        Returns hidden [len(rows), H], from a CUDA graph where one fits."""
        meta, _, _ = self._metadata(block_table, rows, positions, positions + 1, block_size)
        ids = torch.from_numpy(token_ids[rows, positions]).to(self.device)
        pos = torch.from_numpy(positions).to(self.device)
        if self.graphs is not None and self.graphs.can_run(len(rows), meta.block_tables.shape[1]):
            return self.graphs.run(ids, pos, meta)
        return self.model(ids, pos, meta)

    def decode(self, token_ids: np.ndarray, block_table: np.ndarray, rows: np.ndarray, last: np.ndarray,
               block_size: int, max_tokens: int) -> torch.Tensor:
        """One draft pass: fills each row ``rows[i]``'s draft KV from ``computed`` through position ``last[i]``
        (the token the pass reads) and returns the draft's logits there, [len(rows), V] fp32; ``computed``
        moves past ``last``. A row with at most ``CATCH_UP_SPAN`` positions to fill runs them as decode rows in
        this one pass (one row in a step's later passes, one or two in its first); a longer one (a prompt) is
        first caught up by packed prefill passes of at most ``max_tokens`` tokens (``catch_up``)."""
        starts = np.minimum(self.computed[rows], last)
        long = last - starts >= CATCH_UP_SPAN
        if long.any():
            self.catch_up(token_ids, block_table, rows[long], last[long], block_size, max_tokens)
            starts = np.minimum(self.computed[rows], last)
        counts = last - starts + 1
        ends = np.cumsum(counts)
        token_rows = np.repeat(rows, counts)
        positions = np.repeat(starts - (ends - counts), counts) + np.arange(int(ends[-1]))
        hidden = self._decode_rows(token_ids, block_table, token_rows, positions, block_size)
        self.computed[rows] = last + 1
        if len(token_rows) > len(rows):  # several rows for some request: its logits are at its last one
            hidden = hidden[torch.from_numpy(ends - 1).to(self.device)]
        return self.model.compute_logits(hidden)

    def rewind(self, row: int, num_valid: int) -> None:
        """After verification: the row's draft KV is valid below ``num_valid`` at most."""
        self.computed[row] = min(int(self.computed[row]), num_valid)

    def reset(self, row: int) -> None:
        """A new sequence in ``row``: none of its draft KV is known (a cached prefix is recomputed)."""
        self.computed[row] = 0


def draft_group_size(mc: ModelConfig, preferred: int) -> int:
    """The INT4 group size for a draft quantized at load: ``preferred`` (the engine's) if it divides every
    linear layer's input size (hidden and MLP width; head dims follow), else the largest of 128, 64, 32 that
    does (the default model's hidden size 576 takes 64). A draft's quality matters less than the target's:
    it only moves the acceptance rate, never the output distribution."""
    sizes = (mc.hidden_size, mc.intermediate_size, mc.num_attention_heads * mc.head_dim)
    for g in (preferred, 128, 64, 32):
        if all(k % g == 0 for k in sizes):
            return g
    return preferred  # the quantizer's error names the layer and the sizes that divide it
