"""The EAGLE-1 proposer (``"method": "eagle"``): one decoder layer of the target's architecture that reads the
target's features (its final normed hidden states) and the next token's embedding, and predicts the next
feature, which the target's own LM head turns into a draft distribution (``roofline.spec_decode.heads``).

Positions (0-based; a row knows tokens t_0 .. t_{N-1}, the target has computed f_0 .. f_{N-2}, f_p being the
feature whose LM head gives t_{p+1}):
- the draft's row at position p reads (f_p, t_{p+1}) and predicts f̂_{p+1}, whose LM head gives t_{p+2};
- a step's first pass catches the draft's KV up over the positions the target computed since the last
  drafting step (``done[row]`` .. N - 2, real features) and drafts d_1 = t_N from position N - 2's output;
- pass j > 0 reads (f̂_{N-2+j}, d_j) at position N - 2 + j (the previous pass's predicted feature) and drafts
  d_{j+1}. These positions are recomputed from real features on the next step (``done`` stays at N - 1).

The target's features come out of every step's forward (``observe``, called by the worker before it
advances ``num_computed_tokens``) into a per-row ``FeatureStore``; only positions not yet read by the draft are
kept. The draft's KV lives in its own one-layer pool indexed by the target's block ids and tables (as a
separate draft model's does, ``roofline.spec_decode.draft_model``), so it costs 1 / num_layers of the
target's KV per token. A prefix-cache hit reuses the draft KV of the cached blocks, which the sequence that
wrote them filled from the same tokens.

A head with ``aux_layers`` (``heads.fuse_features``) reads EAGLE-3's fused features instead of f_p: the target keeps
the residual streams entering those layers at every forward (``LlamaModel.set_aux_layers``: the modules, the CUDA
graphs and the CPU decode plan write them into one static buffer) and ``observe`` stores f_p + W [rms(a_1) | ...].
Later passes read the head's own predicted features, as without.

With ``tree_topk`` the proposer drafts EAGLE-2's dynamic tree (``propose_draft_token_ids``,
``roofline.spec_decode.tree``) instead of a chain.

On a GPU the draft layer's passes replay CUDA graphs of their own (``capture_graphs``): a catch-up or chain pass as
one decode row per position, a tree depth as one decode row per node with the ancestor mask (``tree_lo`` /
``tree_bits``, where the backend takes trees as decode rows). Each pass still ends in one device -> host copy of
its drafts (the chain's sampled tokens, the tree's top-k), which EAGLE-2's host-side expansion reads.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from torch import nn

from roofline.attention.backend import get_attention_backend, paged_metadata, slot_mapping
from roofline.attention.kv_cache import kv_bytes_per_token
from roofline.kernels.cpu_bf16 import pack_layer, packed_linear, prepack, should_prepack
from roofline.kernels.cpu_f32 import cpu_linear, layer_linear
from roofline.models.loader import process_weights_after_loading
from roofline.spec_decode.draft_proposers import AutoregressiveProposer
from roofline.spec_decode.feature_store import FeatureStore
from roofline.spec_decode.heads import check_head, fuse_features, load_head

logger = logging.getLogger(__name__)


def resolve_head(spec: Any, mc: Any) -> tuple[Any, dict[str, torch.Tensor], str]:
    """The ``spec.method`` head named by ``spec.model`` (or the one bundled for the target), checked against the
    target: its config, tensors and directory.

    Raises:
        ValueError: as ``heads.check_head`` and ``heads.load_head``.
    """
    _, path = check_head(spec, mc)
    cfg, tensors = load_head(path, spec.method)
    return cfg, tensors, path


def check_tree_backend(spec: Any, worker: Any) -> int:
    """``spec.tree_topk`` (0 for a chain) once the worker's attention backend is known to honour tree masks.

    Raises:
        ValueError: a tree on a backend without ``supports_tree_mask`` (names the backend)."""
    from roofline.distributed.parallel_state import get_tp_size

    topk = getattr(spec, "tree_topk", None) or 0
    if topk and not worker.backend.supports_tree_mask:
        raise ValueError(f"speculative_config tree_topk needs an attention backend that applies tree masks; the "
                         f"{worker.backend.name} backend does not (drop tree_topk for a chain)")
    if topk and (get_tp_size() > 1 or worker.pp.pp_size > 1):
        # A tree's acceptance walk draws on the host; ranks and stages would each draw their own.
        raise ValueError(f"speculative_config tree_topk runs on one device (tensor and pipeline parallel size 1), "
                         f"got tensor {get_tp_size()} and pipeline {worker.pp.pp_size}; drop tree_topk for a chain")
    return topk


class EagleProposer(AutoregressiveProposer):
    """See the module docstring."""

    def __init__(self, spec_config: Any):
        super().__init__(spec_config)
        self.layer: Any = None
        self.graphs: Any = None  # CUDAGraphRunner of the draft layer's passes (capture_graphs; GPU only)
        self.cpu_plan: Any = None  # CpuDecodePlan of the draft layer (allocate_kv_cache; a bf16 model on a CPU)
        self._passes = 0  # draft-layer passes so far (their staging names)

    def load(self, worker: Any) -> None:
        from roofline.distributed.parallel_state import get_tp_size
        from roofline.layers.rotary import RotaryEmbedding
        from roofline.models.llama import LlamaDecoderLayer

        mc, dev, dtype = worker.model_config, worker.device, worker.dtype
        if get_tp_size() > 1 or worker.pp.pp_size > 1:
            raise ValueError("speculative_config method 'eagle' runs on one device (tensor and pipeline "
                             "parallel size 1)")
        cfg, t, self.path = resolve_head(self.spec_config, mc)
        backend_cls = get_attention_backend(worker.config.attention_backend)
        self.backend = backend_cls(mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim,
                                   RotaryEmbedding.from_config(mc, dev))
        layer = LlamaDecoderLayer(mc, self.backend, 0, None, "layer")
        sd = {"self_attn.qkv_proj.weight": torch.cat([t["layer.self_attn.q_proj.weight"],
                                                       t["layer.self_attn.k_proj.weight"],
                                                       t["layer.self_attn.v_proj.weight"]]),
              "self_attn.o_proj.weight": t["layer.self_attn.o_proj.weight"],
              "mlp.gate_up_proj.weight": torch.cat([t["layer.mlp.gate_proj.weight"], t["layer.mlp.up_proj.weight"]]),
              "mlp.down_proj.weight": t["layer.mlp.down_proj.weight"],
              "input_layernorm.weight": t["layer.input_layernorm.weight"],
              "post_attention_layernorm.weight": t["layer.post_attention_layernorm.weight"]}
        layer.load_state_dict(sd, strict=True)
        self.layer = layer.to(device=dev, dtype=dtype).eval()
        process_weights_after_loading(self.layer)  # as the target's: bf16 on a CPU packs for the AMX GEMM / GEMV
        self.fc = nn.Linear(2 * mc.hidden_size, mc.hidden_size, bias=True)
        self.fc.load_state_dict({"weight": t["fc.weight"], "bias": t["fc.bias"]})
        self.fc = self.fc.to(device=dev, dtype=dtype).eval()
        pack_layer(self.fc)
        # EAGLE-3's fused features: the target keeps the residual streams entering cfg.aux_layers at every
        # forward (LlamaModel.set_aux_layers), and observe() fuses them into the features the store keeps.
        self.fuse_w: torch.Tensor | None = None
        if cfg.aux_layers:  # load_head checked fuse.weight's shape
            self.fuse_w = t["fuse.weight"].to(device=dev, dtype=dtype)
            sc, spec = worker.config.scheduler_config, self.spec_config
            per_request = 1 + max(spec.num_speculative_tokens or 0, getattr(spec, "tree_budget", None) or 0)
            worker.model.model.set_aux_layers(cfg.aux_layers, max(sc.max_num_batched_tokens, 512,
                                                                  sc.max_num_seqs * per_request))
        self.eps = cfg.rms_norm_eps
        self.embed = worker.model.model.embed_tokens
        # A truncated draft vocabulary: the LM head's rows of ``token_map`` (logits elsewhere -inf, so the draft
        # proposes only mapped tokens and its q is 0 outside them: rejection sampling stays exact).
        self.token_map: torch.Tensor | None = None
        self.lm_sub: torch.Tensor | None = None
        if cfg.draft_vocab_size:
            self.token_map = t["token_map"].to(device=dev, dtype=torch.long)
            w = getattr(worker.model.lm_head, "weight", None)
            if isinstance(w, torch.Tensor) and w.is_floating_point() and w.dim() == 2 and w.shape[1] == mc.hidden_size:
                self.lm_sub = w.detach()[self.token_map].contiguous()
        # bf16 on a CPU: the draft LM head packed like the target's (F.linear at a few rows was ~0.3 ms a call)
        self.lm_sub_packed = prepack(self.lm_sub) if self.lm_sub is not None and should_prepack(self.lm_sub) else None
        self.kv_dtype = worker.kv_dtype
        self.kv_bytes_per_token = kv_bytes_per_token(1, mc.num_key_value_heads, mc.head_dim, worker.kv_dtype)
        self.weight_bytes = sum(p.numel() * p.element_size() for m in (self.layer, self.fc) for p in m.parameters()) + (
            0 if self.fuse_w is None else self.fuse_w.numel() * self.fuse_w.element_size())
        rows = worker.config.scheduler_config.max_num_seqs
        self.tree_topk = check_tree_backend(self.spec_config, worker)
        if cfg.draft_vocab_size and self.tree_topk > cfg.draft_vocab_size:
            raise ValueError(f"speculative_config tree_topk {self.tree_topk} exceeds the head's draft vocabulary "
                             f"({cfg.draft_vocab_size} tokens, {self.path}); use tree_topk <= {cfg.draft_vocab_size}")
        self.store = FeatureStore(rows)
        self.done = np.full(rows, -1, dtype=np.int64)  # draft KV valid below this position (-1: from the store)
        self.pred: dict[int, torch.Tensor] = {}  # row -> the last pass's predicted feature [H]
        logger.info("EAGLE head %s: one decoder layer + fc, %.1f MB of weights; its KV costs %d B/token (%.1f%% "
                    "of the target's %d)", self.path, self.weight_bytes / 1e6, self.kv_bytes_per_token,
                    100 * self.kv_bytes_per_token / worker.kv_bytes_per_token, worker.kv_bytes_per_token)

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> None:
        from roofline.worker.cpu_plan import CpuDecodePlan

        w = self.layer.mlp.down_proj.weight
        self.backend.allocate_kv_cache(1, num_blocks, block_size, self.kv_dtype, w.device)
        # On a CPU in bf16, decode-row passes run the layer in one C++ call (the target's decode plan, without
        # its embedding and final norm), built over the pool just allocated (it holds its pointers).
        if w.device.type == "cpu":
            self.cpu_plan, why = CpuDecodePlan.for_layers([self.layer], self.backend, w.dtype, w.device)
            logger.info("EAGLE draft layer on the CPU decode plan: %s", "on" if self.cpu_plan else f"off ({why})")

    def reset(self, row: int) -> None:
        self.store.reset(row)
        self.done[row] = -1
        self.pred.pop(row, None)

    def observe(self, worker: Any, step: Any, hidden: torch.Tensor) -> None:
        """Keep the step's features (``FeatureStore.observe``): the final normed hidden states [T, H], or with
        fused features f + W [rms(a_1) | ...] from the target's ``aux_out`` (``heads.fuse_features``).

        Raises:
            RuntimeError: the step's forward kept no residual streams (more tokens than ``aux_out`` holds)."""
        if self.fuse_w is not None:
            inner = worker.model.model
            n = hidden.shape[0]
            if n > len(inner.aux_out):  # every forward path writes them where they fit (set_aux_layers)
                raise RuntimeError(f"EAGLE fused features: a step of {n} tokens, but the target keeps residual "
                                   f"streams for at most {len(inner.aux_out)}")
            hidden = fuse_features(hidden, inner.aux_out[:n], self.fuse_w, self.eps)
        self.store.observe(worker, step, hidden)

    def accept_tree(self, row: int, root_pos: int, path: list[int]) -> None:
        self.store.accept_tree(row, root_pos, path)

    def capture_graphs(self, worker: Any, max_rows: int) -> None:
        """The draft layer's passes (embedding, fc, the layer) in CUDA graphs of up to ``max_rows`` decode rows
        over its own backend's static buffers: a catch-up or chain pass as one decode row per position, a tree
        pass as one per node with the ancestor mask (``tree_rows``, where the backend takes trees as decode
        rows). The LM head, the top-k and the host's tree expansion stay outside."""
        from roofline.worker.cuda_graph import CUDAGraphRunner

        mc = worker.model_config
        self._feats = torch.zeros(max_rows, mc.hidden_size, dtype=worker.dtype, device=worker.device)
        tree_rows = bool(self.tree_topk) and self.backend.tree_as_decode_rows
        self.graphs = CUDAGraphRunner(lambda ids, pos, meta: self._step(ids, self._feats[:ids.shape[0]], pos, meta),
                                      self.backend, max_rows, worker.max_blocks_per_seq, worker.device,
                                      mc.hidden_size, worker.dtype, name="EAGLE draft", tree_rows=tree_rows)
        self.graphs.capture()

    def _step(self, ids: torch.Tensor, feats: torch.Tensor, pos: torch.Tensor, meta: Any) -> torch.Tensor:
        """The draft layer on (features [T, H], next-token ids [T]) at RoPE positions ``pos`` [T]: [T, H]."""
        emb = self.embed(ids)
        x = self._fc(torch.cat([feats.to(emb.dtype), emb], dim=-1))
        out, residual = self.layer(pos, x, None, meta)
        return out + residual

    def _pass(self, worker: Any, token_rows: np.ndarray, slot_pos: np.ndarray, rope_pos: np.ndarray,
              next_ids: np.ndarray, feats: torch.Tensor, prefill: tuple[np.ndarray, ...],
              tree: tuple[np.ndarray, np.ndarray] | None = None) -> torch.Tensor:
        """One draft-layer pass over T tokens: token t of batch row ``token_rows[t]`` is stored at position
        ``slot_pos[t]`` of the row's draft KV, rotated at ``rope_pos[t]``, and sees the row's keys through
        ``slot_pos[t]`` (with ``tree`` = (tree_lo, tree_bits) [T], in the tree region only its ancestors). As
        decode rows replayed from the graphs where they fit one, else eager in the packed form ``prefill`` =
        (rows [S], query_start_loc [S + 1], ends [S]), whose tree mask [S, max count] is ``tree``'s bits per row
        (a row's tree region being its T_i tokens). Returns [T, H] (a fresh tensor)."""
        batch, bs = worker.input_batch, worker.block_size
        n = len(token_rows)
        # Through the worker's pinned staging (non-blocking copies on a GPU), under names of their own per pass:
        # every pass ends in a host copy of its drafts, so a name's buffer is free again 8 passes later.
        self._passes += 1
        tag = f"eagle{self._passes % 8}_"

        def to_device(name: str, a: np.ndarray) -> torch.Tensor:
            return worker.inputs.to_device(tag + name, a)

        slots = slot_mapping(batch.block_table, token_rows, slot_pos, bs)
        ids = to_device("ids", np.ascontiguousarray(next_ids, dtype=np.int64))
        pos = to_device("pos", np.ascontiguousarray(rope_pos, dtype=np.int64))
        max_blocks = int((slot_pos // bs).max()) + 1
        if self.graphs is not None and self.graphs.can_run(n, max_blocks, tree=tree is not None):
            meta = paged_metadata(slots, np.arange(n + 1), slot_pos + 1, batch.block_table[token_rows, :max_blocks],
                                  to_device, tree_rows=tree)
            self._feats[:n].copy_(feats)
            return self.graphs.run(ids, pos, self.backend.build_metadata(meta)).clone()
        if self.cpu_plan is not None and n <= self.cpu_plan.max_rows:
            out = self._plan_pass(batch.block_table[token_rows, :max_blocks], slot_pos, rope_pos, slots, ids, feats,
                                  tree)
            if out is not None:
                return out
        rows, qsl, ends = prefill
        mask = None
        if tree is not None:
            counts = np.diff(qsl)
            mask = np.full((len(rows), int(counts.max())), -1, dtype=np.int64)
            mask[np.repeat(np.arange(len(rows)), counts), np.arange(n) - np.repeat(qsl[:-1], counts)] = tree[1]
        max_blocks = int(((ends + bs - 1) // bs).max())
        meta = paged_metadata(slots, qsl, ends, batch.block_table[rows, :max_blocks], to_device, mask)
        return self._step(ids, feats, pos, self.backend.build_metadata(meta))

    def _plan_pass(self, table: np.ndarray, slot_pos: np.ndarray, rope_pos: np.ndarray, slots: np.ndarray,
                   ids: torch.Tensor, feats: torch.Tensor,
                   tree: tuple[np.ndarray, np.ndarray] | None) -> torch.Tensor | None:
        """``_pass`` as decode rows through the CPU decode plan (one C++ call): [T, H], or None where it
        declines (the caller then runs the modules). Token t is a decode row over the first ``slot_pos[t] + 1``
        positions of its row's draft KV (every row's k/v is stored before any row attends), with the tree's
        ancestor bits from ``tree[0][t]`` on; ``table`` [T, max_blocks] is each token's block-table row."""
        emb = self.embed(ids)
        x = self._fc(torch.cat([feats.to(emb.dtype), emb], dim=-1)).contiguous()
        table = torch.from_numpy(np.ascontiguousarray(table, dtype=np.int32))
        args = [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in (rope_pos, slots, slot_pos + 1)]
        lo = bits = None
        if tree is not None:
            lo, bits = (torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in tree)
        return x if self.cpu_plan.run_rows(x, args[0], args[1], table, args[2], lo, bits) else None

    def _forward(self, worker: Any, rows: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                 feats: torch.Tensor, next_ids: np.ndarray) -> torch.Tensor:
        """Draft positions [starts[i], ends[i]) of rows[i], packed: features [T, H] and the ids of the tokens
        one position later [T]. Returns the layer's output [T, H] (predicted next features)."""
        counts = ends - starts
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=qsl[1:])
        token_rows = np.repeat(rows, counts)
        positions = np.repeat(starts - qsl[:-1], counts) + np.arange(int(qsl[-1]))
        return self._pass(worker, token_rows, positions, positions, next_ids, feats, (rows, qsl, ends))

    def _fc(self, x: torch.Tensor) -> torch.Tensor:
        """fc [T, 2H] -> [T, H]: through its packed copy where it has one (bf16 on a CPU)."""
        out = layer_linear(self.fc, x, self.fc.bias)
        return self.fc(x) if out is None else out

    def draft_logits(self, worker: Any, rows: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        return self.logits(worker, self._predict(worker, rows, positions))

    def _predict(self, worker: Any, rows: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """The predicted features [len(rows), H] of the draft reading the token at ``positions[i]`` of row
        ``rows[i]`` (a step's first pass catches the draft KV up first; see the module docstring)."""
        batch = worker.input_batch
        first = positions == batch.num_tokens[rows] - 1  # the step's first pass (all rows or none)
        if first.all():
            ends = positions  # real features through position N - 2: draft rows [start, N - 1)
            starts = np.array([max(int(self.done[r]), int(self.store.start[r])) if self.done[r] >= 0
                               else int(self.store.start[r]) for r in rows], dtype=np.int64)
            starts = np.minimum(starts, ends - 1)
            self.catch_up_rows = int((ends - starts).max())
            feats = torch.cat([self.store.get(int(r), int(s), int(e)) for r, s, e in zip(rows, starts, ends,
                                                                                         strict=True)])
            ids = np.concatenate([batch.token_ids[r, s + 1:e + 1] for r, s, e in zip(rows, starts, ends,
                                                                                      strict=True)])
            out = self._forward(worker, rows, starts, ends, feats, ids)
            last = torch.from_numpy(np.cumsum(ends - starts) - 1).to(out.device)
            pred = out[last]
            for r, e in zip(rows.tolist(), ends.tolist(), strict=True):
                self.done[r] = e
                self.store.drop_before(r, e)
        else:
            assert not first.any(), "a draft pass mixes first and later passes"
            feats = torch.stack([self.pred[int(r)] for r in rows])
            starts = positions - 1
            pred = self._forward(worker, rows, starts, positions, feats, batch.token_ids[rows, positions])
        for i, r in enumerate(rows.tolist()):
            self.pred[r] = pred[i]
        return pred

    def _topk(self, worker: Any, hidden: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The draft's k most likely tokens [N, k] int64 and their log-probabilities [N, k] float32 (host arrays)
        at predicted features ``hidden`` [N, H]. With a truncated draft vocabulary on a plain LM head: over its
        ``token_map`` rows only (the same distribution as ``logits``, whose other entries are -inf, without the
        full-vocabulary logits: on the CPU in bf16, 0.41 against 0.61 ms a call at one row, Intel Xeon, 2 threads;
        equal values may come out in another order)."""
        if self.lm_sub is not None:
            top = torch.log_softmax(self._sub_logits(hidden), dim=-1).topk(k, dim=-1)
            return self.token_map[top.indices].cpu().numpy(), top.values.cpu().numpy()
        top = torch.log_softmax(self.logits(worker, hidden).float(), dim=-1).topk(k, dim=-1)
        return top.indices.cpu().numpy(), top.values.cpu().numpy()

    def _sub_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The truncated draft head's logits [N, draft_vocab_size] fp32: its packed copy (bf16 on a CPU with bf16
        units), else the small-M fp32 loop or F.linear (``cpu_linear``)."""
        x = hidden.to(self.lm_sub.dtype)
        if self.lm_sub_packed is not None:
            return packed_linear(x, self.lm_sub_packed, dense=self.lm_sub).float()
        return cpu_linear(x, self.lm_sub).float()

    def logits(self, worker: Any, hidden: torch.Tensor) -> torch.Tensor:
        """The draft's logits [N, V] fp32 for predicted features ``hidden`` [N, H]: the target's LM head, or with
        a truncated draft vocabulary its ``token_map`` rows only (-inf elsewhere)."""
        if self.token_map is None:
            return worker.model.compute_logits(hidden)
        full = torch.full((hidden.shape[0], worker.model_config.vocab_size), float("-inf"), device=hidden.device)
        if self.lm_sub is not None:
            full[:, self.token_map] = self._sub_logits(hidden)
        else:  # an LM head without a plain weight (quantized): the whole head, masked
            full[:, self.token_map] = worker.model.compute_logits(hidden)[:, self.token_map]
        return full

    # ------------------------------------------------------------------------------ tree drafting

    def propose_draft_token_ids(self, worker: Any, rows: np.ndarray, num_drafts: np.ndarray) -> dict[int, Any]:
        """A chain (``AutoregressiveProposer``), or with ``tree_topk`` EAGLE-2's dynamic tree per row
        (``roofline.spec_decode.tree``): depth 1's candidates are the top-k of the first pass; each later depth
        runs the draft layer on the top-k candidates of the depth before (the frontier, by cumulative
        log-probability), each giving its top-k children; the row keeps its ``num_drafts`` best candidates.
        At most ``num_drafts`` nodes are expanded in all, and none past depth ``num_speculative_tokens``.

        The draft layer's rows for the expanded nodes sit in the draft pool at positions n - 1 .. n - 2 + E
        (E expanded so far; inside the slots the scheduler reserved for the tree) and attend through the
        ancestor mask; every depth recomputes the E rows (one layer; E <= 64), since a row attends to its
        ancestors only. Positions from n - 1 on are recomputed from the target's features next step."""
        if not self.tree_topk:
            return super().propose_draft_token_ids(worker, rows, num_drafts)
        from roofline.spec_decode.tree import DraftTree, place_tree, select_nodes

        batch, k, depth_max = worker.input_batch, self.tree_topk, self.spec_config.num_speculative_tokens
        n = batch.num_tokens[rows].copy()
        # The first pass catches up; self.pred[r]: the root's output.
        tok0, val0 = self._topk(worker, self._predict(worker, rows, n - 1), k)
        # Per row: candidates (parent candidate, token, score, depth), expanded candidates in order, and the
        # draft layer's input feature and output of each expanded one.
        cands = [dict(parent=[-1] * k, token=tok0[i].tolist(), score=val0[i].tolist(), depth=[1] * k)
                 for i in range(len(rows))]
        expanded: list[list[int]] = [[] for _ in rows]
        self.out: dict[int, torch.Tensor] = {}  # row index i -> the draft layer's outputs of its expanded nodes
        feats_in: list[list[torch.Tensor]] = [[] for _ in rows]
        for d in range(1, depth_max):
            new_rows = []
            for i, r in enumerate(rows.tolist()):
                c = cands[i]
                room = int(num_drafts[i]) - len(expanded[i])
                frontier = sorted((j for j in range(len(c["token"])) if c["depth"][j] == d),
                                  key=lambda j, c=c: -c["score"][j])[:max(0, min(k, room))]
                for j in frontier:
                    p = c["parent"][j]
                    feats_in[i].append(self.pred[r] if p < 0 else self.out[i][expanded[i].index(p)])
                expanded[i] += frontier
                if frontier:
                    new_rows.append((i, len(frontier)))
            if not new_rows:
                break
            act = np.array([i for i, _ in new_rows], dtype=np.int64)
            trees = []
            for i in act.tolist():
                c, e = cands[i], expanded[i]
                pos = {cj: m for m, cj in enumerate(e)}
                trees.append(DraftTree(np.array([c["token"][j] for j in e], dtype=np.int64),
                                       np.array([pos.get(c["parent"][j], -1) for j in e], dtype=np.int64),
                                       np.array([c["depth"][j] for j in e], dtype=np.int64)))
            out = self._forward_tree(worker, rows[act], n[act], trees,
                                     torch.cat([torch.stack(feats_in[i]) for i in act.tolist()]))
            sizes = [len(t) for t in trees]
            offs = np.cumsum([0] + sizes)
            self.out = {int(i): out[offs[a]:offs[a + 1]] for a, i in enumerate(act.tolist())}
            last = torch.cat([torch.arange(offs[a + 1] - m, offs[a + 1]) for a, (_, m) in enumerate(new_rows)])
            tok, val = self._topk(worker, out[last.to(out.device)], k)
            q = 0
            for i, m in new_rows:
                c = cands[i]
                for j in expanded[i][-m:]:
                    for t, v in zip(tok[q].tolist(), val[q].tolist(), strict=True):
                        c["parent"].append(j)
                        c["token"].append(t)
                        c["score"].append(c["score"][j] + v)
                        c["depth"].append(d + 1)
                    q += 1
        self.out = {}
        for i, r in enumerate(rows.tolist()):
            c = cands[i]
            tree, _ = select_nodes(c["parent"], c["token"], c["score"], c["depth"], int(num_drafts[i]))
            place_tree(worker, r, tree, int(num_drafts[i]))
        return {}

    def _forward_tree(self, worker: Any, rows: np.ndarray, n: np.ndarray, trees: list[Any],
                      feats: torch.Tensor) -> torch.Tensor:
        """The draft layer on each row's expanded nodes (``trees[i]``, E_i nodes, packed): node m of row i
        reads (its parent's predicted feature ``feats``, its token) at position n_i - 2 + depth, is stored at
        position n_i - 1 + m of the draft pool, and attends to the draft KV below n_i - 1 and its ancestors.
        Returns the predicted features [sum E_i, H]."""
        from roofline.spec_decode.tree import region_mask

        sizes = np.array([len(t) for t in trees], dtype=np.int64)
        qsl = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(sizes, out=qsl[1:])
        token_rows = np.repeat(rows, sizes)
        slot_pos = np.concatenate([n[i] - 1 + np.arange(sizes[i]) for i in range(len(rows))])
        rope_pos = np.concatenate([n[i] - 2 + t.depth for i, t in enumerate(trees)])
        # Node m of row i sees the draft KV below n_i - 1, then its ancestors' bits (the region: the E_i nodes).
        tree = (np.repeat(n - 1, sizes), np.concatenate([region_mask(t, len(t), q_len=len(t)) for t in trees]))
        return self._pass(worker, token_rows, slot_pos, rope_pos, np.concatenate([t.tokens for t in trees]), feats,
                          (rows, qsl, n - 1 + sizes), tree)
