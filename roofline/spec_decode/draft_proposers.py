"""The device proposers: a draft model (a separate checkpoint, or a quantized copy of the target, with its own
KV) and the layer-skip self-draft (the target's first k decoder layers, its final norm and LM head, writing
the target's own KV for those layers). Registered under ``draft_model`` (``proposer.PROPOSERS``): the entry
picks the layer-skip proposer when ``speculative_config.num_layers`` is set.

Both draft autoregressively: ``k_r`` sequential one-token passes per row ``r``, pass j reading the token at
position ``num_tokens - 1 + j`` and sampling draft j + 1 from q (the row's own sampling processing, its seeded
generator included), which it writes into the persistent batch's ``token_ids``. Each row's q [k_r, V] goes to
the verifier (``roofline.spec_decode.verifier``).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import numpy as np
import torch

from roofline.attention.backend import paged_metadata, slot_mapping
from roofline.spec_decode.proposer import DeviceProposer


class AutoregressiveProposer(DeviceProposer):
    """The draft loop shared by the device proposers; a subclass gives one pass's logits (``draft_logits``)."""

    def load(self, worker: Any) -> None:  # noqa: B027 - nothing beyond the target by default
        """Build what the proposer needs next to the worker's target (before the KV pools are sized)."""

    kv_bytes_per_token = 0  # KV-cache bytes per token of the proposer's own pool (sized with the target's)
    weight_bytes: int | None = None  # a separate draft's weight bytes (the policy's prior for c)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:  # noqa: B027
        """Its own KV pool in the target's blocks, if any."""

    def capture_graphs(self, worker: Any, max_rows: int) -> None:  # noqa: B027
        """CUDA graphs of its decode passes (GPU only), after the target's."""

    def reset(self, row: int) -> None:  # noqa: B027
        """A new sequence in ``row`` of the persistent batch."""

    def observe(self, worker: Any, step: Any, hidden: torch.Tensor) -> None:  # noqa: B027
        """Every step's final hidden states [T, H] (flat, ``step.scheduled`` order), before the worker advances
        ``num_computed_tokens``: the features a learned drafter reads (``roofline.spec_decode.eagle``)."""

    def rewind(self, row: int, num_valid: int) -> None:  # noqa: B027
        """After verification: the row's draft state is valid below ``num_valid`` positions at most."""

    @abstractmethod
    def draft_logits(self, worker: Any, rows: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Logits [len(rows), V] fp32 of the draft reading the token at ``positions[i]`` of row ``rows[i]``."""

    def propose_draft_token_ids(self, worker: Any, rows: np.ndarray, num_drafts: np.ndarray) -> dict[int, Any]:
        """See the module docstring: writes the drafts into ``worker.input_batch.token_ids`` and returns
        {row: q [k_r, V] fp32}."""
        from roofline.layers.sampler import processed_probs

        batch = worker.input_batch
        q: dict[int, list[torch.Tensor]] = {int(r): [] for r in rows}
        for j in range(int(num_drafts.max())):
            act = rows[num_drafts > j]
            pos = batch.num_tokens[act] - 1 + j  # [A]
            logits = self.draft_logits(worker, act, pos)
            # A seeded row draws the noise its verify pass will draw at that position (keyed_seed): the draft's
            # sample then couples with the target's, and the two agree wherever the distributions are close.
            md = worker.prepare_sampling(act, tag="draft_", positions=pos + 1)
            probs = processed_probs(logits, md)  # [A, V]
            noise = torch.empty_like(probs).exponential_()
            for i, g in enumerate(md.generators):
                if g is not None:
                    noise[i].exponential_(generator=g)
            tok = torch.where(md.temperatures < 1e-5, probs.argmax(dim=-1), (probs / noise).argmax(dim=-1))
            batch.token_ids[act, pos + 1] = tok.cpu().numpy()
            for i, r in enumerate(act.tolist()):
                q[r].append(probs[i])
        return {r: torch.stack(v) for r, v in q.items()}


class LayerSkipProposer(AutoregressiveProposer):
    """The target's first ``num_layers`` layers (``model.forward(..., num_layers=k)``): its attention layers
    write K/V into the target's own cache for those layers, at the drafted positions; the verify pass
    overwrites them."""

    def __init__(self, spec_config: Any):
        super().__init__(spec_config)
        self.num_layers: int = spec_config.num_layers
        self.graphs: Any = None

    def capture_graphs(self, worker: Any, max_rows: int) -> None:
        from roofline.worker.cuda_graph import CUDAGraphRunner

        k, model, mc = self.num_layers, worker.model, worker.model_config
        self.graphs = CUDAGraphRunner(lambda ids, pos, meta: model(ids, pos, meta, num_layers=k), worker.backend,
                                      worker.config.scheduler_config.max_num_seqs, worker.max_blocks_per_seq,
                                      worker.device, mc.hidden_size, worker.dtype, share_with=worker.graphs,
                                      name=f"draft, {k} layers")
        self.graphs.capture()

    def draft_logits(self, worker: Any, rows: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        batch, bs, dev = worker.input_batch, worker.block_size, worker.device
        seq_lens = positions + 1
        max_blocks = int(((seq_lens + bs - 1) // bs).max())
        meta = paged_metadata(slot_mapping(batch.block_table, rows, positions, bs), np.arange(len(rows) + 1),
                              seq_lens, batch.block_table[rows, :max_blocks], dev)
        ids = torch.from_numpy(batch.token_ids[rows, positions]).to(dev)
        pos = torch.from_numpy(positions).to(dev)
        meta = worker.backend.build_metadata(meta)
        if self.graphs is not None and self.graphs.can_run(len(rows), max_blocks):
            hidden = self.graphs.run(ids, pos, meta)
        else:
            hidden = worker.model(ids, pos, meta, num_layers=self.num_layers)
        return worker.model.compute_logits(hidden)


class DraftModelProposer(AutoregressiveProposer):
    """A separate draft model (``roofline.spec_decode.draft_model.DraftModel``): another checkpoint, or the
    target quantized at load, with its own KV pool in the target's blocks."""

    def __init__(self, spec_config: Any):
        super().__init__(spec_config)
        self.draft: Any = None

    def load(self, worker: Any) -> None:
        from roofline.spec_decode.draft_model import DraftModel

        self.draft = DraftModel(worker.config, worker.source, worker.model_config,
                                worker.config.scheduler_config.max_num_seqs, worker.dtype, worker.kv_dtype,
                                worker.device)
        self.kv_bytes_per_token = self.draft.kv_bytes_per_token
        self.weight_bytes = self.draft.weight_bytes

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        self.draft.allocate_kv_cache(num_blocks, block_size)

    def capture_graphs(self, worker: Any, max_rows: int) -> None:
        self.draft.capture_graphs(max_rows, worker.max_blocks_per_seq)  # a decode row per position to fill

    def reset(self, row: int) -> None:
        self.draft.reset(row)

    def rewind(self, row: int, num_valid: int) -> None:
        self.draft.rewind(row, num_valid)

    def draft_logits(self, worker: Any, rows: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        # Catches the draft's KV up through ``positions`` first (DraftModel.decode).
        if (positions == worker.input_batch.num_tokens[rows] - 1).all():  # a step's first pass
            self.catch_up_rows = int((positions - np.minimum(self.draft.computed[rows], positions)).max()) + 1
        return self.draft.decode(worker.input_batch.token_ids, worker.input_batch.block_table, rows, positions,
                                 worker.block_size, worker.config.scheduler_config.max_num_batched_tokens)


def draft_model_proposer(spec_config: Any) -> type[AutoregressiveProposer]:
    """The ``draft_model`` method's class: the layer-skip self with ``num_layers``, else a separate draft."""
    return LayerSkipProposer if spec_config.num_layers is not None else DraftModelProposer
