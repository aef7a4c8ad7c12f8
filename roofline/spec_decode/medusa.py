"""The Medusa-1 proposer (``"method": "medusa"``): K residual heads on the target's last feature
(``roofline.spec_decode.heads``). With a row's tokens t_0 .. t_{N-1} and the target's features through
f_{N-2}, draft j (1-based, j <= K) is head j - 1's LM-head distribution at f_{N-2}: head k predicts the token
k + 2 positions past the feature it reads, and t_{N-1} (the target's own token) is already known.

Medusa's drafts do not condition on each other; each is sampled from the distribution the verifier receives
as its q, so rejection sampling keeps the target's distribution exactly as for any draft. It keeps no KV:
only each row's latest feature (``feature_store.FeatureStore``).

With ``tree_topk`` (``roofline.spec_decode.tree``) it drafts a tree instead: the Cartesian product of the heads'
top-k tokens, pruned to the tree budget by summed log-probability.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from roofline.kernels.cpu_bf16 import packed_linear, prepack, should_prepack
from roofline.spec_decode.draft_proposers import AutoregressiveProposer
from roofline.spec_decode.eagle import check_tree_backend, resolve_head
from roofline.spec_decode.feature_store import FeatureStore
from roofline.spec_decode.tree import best_first_tree, place_tree


class MedusaProposer(AutoregressiveProposer):
    """See the module docstring."""

    def load(self, worker: Any) -> None:
        """Load the heads (``speculative_config.model`` or the bundled ones).

        Raises:
            ValueError: as ``heads.check_head`` (which ``roofline.args`` also runs before the target loads)."""
        mc, dev, dtype = worker.model_config, worker.device, worker.dtype
        cfg, t, self.path = resolve_head(self.spec_config, mc)
        self.weight = torch.stack([t[f"heads.{i}.weight"] for i in range(cfg.num_heads)]).to(dev, dtype)  # [K, H, H]
        self.bias = torch.stack([t[f"heads.{i}.bias"] for i in range(cfg.num_heads)]).to(dev, dtype)  # [K, H]
        self.weight_bytes = self.weight.numel() * self.weight.element_size()
        # bf16 on a CPU: each head packed like the target's linears (the AMX GEMM / GEMV instead of oneDNN's
        # unpacked small-M matmul)
        self.packed = [prepack(w) for w in self.weight] if should_prepack(self.weight[0]) else None
        self.store = FeatureStore(worker.config.scheduler_config.max_num_seqs)
        self.tree_topk = check_tree_backend(self.spec_config, worker)

    def reset(self, row: int) -> None:
        self.store.reset(row)

    def observe(self, worker: Any, step: Any, hidden: torch.Tensor) -> None:
        self.store.observe(worker, step, hidden)

    def accept_tree(self, row: int, root_pos: int, path: list[int]) -> None:
        self.store.accept_tree(row, root_pos, path)

    def heads(self, f: torch.Tensor, k: int) -> torch.Tensor:
        """Head ``k``'s input to the LM head from features ``f`` [R, H] (Medusa-1's residual block)."""
        x = f.to(self.weight.dtype)
        if self.packed is not None:
            return f + F.silu(packed_linear(x, self.packed[k], self.bias[k], dense=self.weight[k]))
        return f + F.silu(x @ self.weight[k].T + self.bias[k])

    def propose_draft_token_ids(self, worker: Any, rows: np.ndarray, num_drafts: np.ndarray) -> dict[int, Any]:
        """A chain (``AutoregressiveProposer``), or with ``tree_topk`` a tree per row: the Cartesian product of
        heads 0 .. D - 1's top-k tokens (D = ``num_speculative_tokens``), pruned to the row's ``num_drafts``
        best paths by summed log-probability (``tree.best_first_tree``); the nodes go into ``token_ids`` after
        the row's known tokens and the tree into ``worker.inputs.trees``. No q: a tree's drafts are
        deterministic (``roofline.spec_decode.tree``)."""
        if not self.tree_topk:
            return super().propose_draft_token_ids(worker, rows, num_drafts)
        batch, depth = worker.input_batch, self.spec_config.num_speculative_tokens
        n = batch.num_tokens[rows]
        f = torch.stack([self.store.get(int(r), int(m) - 2, int(m) - 1)[0] for r, m in zip(rows, n, strict=True)])
        for r, m in zip(rows.tolist(), n.tolist(), strict=True):
            self.store.drop_before(r, m - 2)
        h = torch.stack([self.heads(f, k) for k in range(depth)], dim=1)  # [R, D, H]
        lp = torch.log_softmax(worker.model.compute_logits(h.flatten(0, 1)).float(), dim=-1)  # [R * D, V]
        top = lp.topk(self.tree_topk, dim=-1)
        tok = top.indices.view(len(rows), depth, -1).cpu().numpy()
        val = top.values.view(len(rows), depth, -1).cpu().numpy()
        for i, r in enumerate(rows.tolist()):
            place_tree(worker, r, best_first_tree(tok[i], val[i], int(num_drafts[i])), int(num_drafts[i]))
        return {}

    def draft_logits(self, worker: Any, rows: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        n = worker.input_batch.num_tokens[rows]
        j = positions - (n - 1)  # this pass's draft index, 0-based (the same for every row)
        f = torch.stack([self.store.get(int(r), int(m) - 2, int(m) - 1)[0] for r, m in zip(rows, n, strict=True)])
        k = int(j[0])
        if k == 0:
            for r, m in zip(rows.tolist(), n.tolist(), strict=True):
                self.store.drop_before(r, m - 2)
        return worker.model.compute_logits(self.heads(f, k))
