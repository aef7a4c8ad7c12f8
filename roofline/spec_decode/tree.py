"""Token trees: drafting several continuations at once and verifying them in one target pass.

A request that knows tokens t_0 .. t_{n-1} drafts a tree of N nodes (N <= ``MAX_TREE_NODES``, the prefill
kernel's mask limit). Node i holds a token, its parent (-1: the root, which is t_{n-1}, the last known
token) and its depth (1 for a child of the root). Nodes are in breadth-first order, so a parent comes before
its children and the nodes of one depth are contiguous.

- **Drafting** (``select_nodes``, ``best_first_tree``): EAGLE-2's dynamic tree (Li et al. 2024, "EAGLE-2:
  Faster Inference of Language Models with Dynamic Draft Trees"): a node's score is the cumulative draft
  log-probability of its path; each depth expands the top-k nodes of the depth before, and the tree keeps the
  N best nodes. Since a child's score is at most its parent's, the N best (ties broken by depth) always
  include every kept node's parent. Medusa (Cai et al. 2024) takes the Cartesian product of its heads' top-k
  tokens, pruned to the N best paths by the same score (``best_first_tree``).
- **Verification** (one target pass): the root and the N nodes are the request's 1 + N query rows; node i sits
  at position n - 1 + depth_i (RoPE) and in the KV slot of position n - 1 + 1 + i (``verify_tree`` writes the
  slots in node order); each node attends to the cached prefix, the root and its ancestors (``region_mask``,
  the ancestor bitmasks of ``AttentionMetadata.tree_mask``).
- **Acceptance** (``walk``): greedy keeps the longest root-to-leaf path whose tokens equal the target's
  argmax at their parents, and emits the argmax after it. Sampling runs recursive rejection over a node's
  children (SpecInfer: Miao et al. 2024, "SpecInfer", multi-step speculative sampling; EAGLE-2's sampling):
  the children are deterministic drafts (top-k of the draft, a function of the context), so each is a one-hot
  q: child c is accepted with probability r(c) / sum(r) where r is the target's distribution with the earlier
  rejected siblings removed; after the last rejection the token is drawn from r. Each test is Leviathan et
  al.'s rule for a one-hot q on the residual, so the emitted tokens are distributed exactly as the target's.
- **KV compaction**: the accepted path's K/V (already rotated for their final positions, since a node's
  RoPE position is n - 1 + depth) move from their node slots to positions n .. n - 1 + a in every layer
  (``compact_kv``); the slots past them are rewritten by later steps, and the scheduler frees the blocks the
  sequence no longer needs (``Scheduler.update``'s rewind).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

MAX_TREE_NODES = 64  # one int64 ancestor bitmask per query row (roofline.kernels.prefill_attention.MAX_TREE_ROWS)


@dataclass
class DraftTree:
    """``tokens`` [N] int64 draft ids; ``parents`` [N] int64 (-1: the root, else an earlier node); ``depth`` [N]
    int64 (1-based), breadth-first (module docstring)."""

    tokens: np.ndarray
    parents: np.ndarray
    depth: np.ndarray

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def max_depth(self) -> int:
        return int(self.depth.max()) if len(self.depth) else 0

    def children(self) -> list[list[int]]:
        """children[0] are the root's children, children[1 + i] node i's, in node order (best score first)."""
        out: list[list[int]] = [[] for _ in range(len(self) + 1)]
        for i, p in enumerate(self.parents.tolist()):
            out[p + 1].append(i)
        return out

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to ``node`` (inclusive)."""
        out = []
        while node >= 0:
            out.append(node)
            node = int(self.parents[node])
        return out[::-1]

    def leaves(self) -> list[int]:
        has_child = set(self.parents.tolist())
        return [i for i in range(len(self)) if i not in has_child]

    @staticmethod
    def chain(tokens: list[int]) -> DraftTree:
        n = len(tokens)
        return DraftTree(np.array(tokens, dtype=np.int64), np.arange(n, dtype=np.int64) - 1,
                         np.arange(1, n + 1, dtype=np.int64))


def _to_int64(x: int) -> int:
    """An unsigned 64-bit pattern as the signed value numpy/torch int64 hold (bit 63 set: negative)."""
    return x - (1 << 64) if x >= 1 << 63 else x


def region_mask(tree: DraftTree, width: int, q_len: int | None = None) -> np.ndarray:
    """[width] int64 ancestor bitmasks of a request whose last query rows are ``tree``'s N nodes (q_len rows in
    all, default 1 + N: the root, then the nodes), for ``AttentionMetadata.tree_mask`` of width ``width`` >= N:
    the region is the last r = min(q_len, width) rows; region rows before the tree (the root, when
    r = N + 1) are plain causal (-1), and node i's row sees those rows, itself and its ancestors.

    Raises:
        ValueError: ``width`` below N or above ``MAX_TREE_NODES`` (names both).
    """
    n = len(tree)
    if not n <= width <= MAX_TREE_NODES:
        raise ValueError(f"a tree of {n} nodes needs a mask width in [{n}, {MAX_TREE_NODES}], got {width}")
    r = min(1 + n if q_len is None else q_len, width)
    shift = r - n  # region rows before the tree: 0 or 1 (the root)
    pre = (1 << shift) - 1
    out = np.full(width, -1, dtype=np.int64)
    own: list[int] = []
    for i, p in enumerate(tree.parents.tolist()):
        bits = (own[p] if p >= 0 else 0) | (1 << (i + shift))
        own.append(bits)
        out[shift + i] = _to_int64(bits | pre)
    return out


def select_nodes(cand_parent: list[int], cand_token: list[int], cand_score: list[float], cand_depth: list[int],
                 budget: int) -> tuple[DraftTree, list[int]]:
    """The best ``budget`` candidates by score (ties: shallower first), as a breadth-first ``DraftTree``.

    Args:
        cand_parent: per candidate, its parent candidate's index (-1: a child of the root). A child's score
            must not exceed its parent's (cumulative log-probabilities), so the kept set holds every parent.
        cand_token, cand_score, cand_depth: its token, cumulative score and depth (1-based).
    Returns:
        the tree, and for each node the candidate it came from.
    """
    order = sorted(range(len(cand_token)), key=lambda c: (-cand_score[c], cand_depth[c], c))[:budget]
    kept = set(order)
    # breadth-first: by depth, then by score order within a depth
    rank = {c: i for i, c in enumerate(order)}
    bfs = sorted(kept, key=lambda c: (cand_depth[c], rank[c]))
    index = {c: i for i, c in enumerate(bfs)}
    parents = []
    for c in bfs:
        p = cand_parent[c]
        assert p < 0 or p in index, "a kept candidate's parent was pruned (scores must not grow along a path)"
        parents.append(index[p] if p >= 0 else -1)
    tree = DraftTree(np.array([cand_token[c] for c in bfs], dtype=np.int64), np.array(parents, dtype=np.int64),
                     np.array([cand_depth[c] for c in bfs], dtype=np.int64))
    return tree, bfs


def best_first_tree(top_tokens: np.ndarray, top_logprobs: np.ndarray, budget: int) -> DraftTree:
    """Medusa's Cartesian candidates pruned to the ``budget`` best paths: depth d's token is any of
    ``top_tokens[d - 1]``, a path's score the sum of its tokens' log-probabilities. A best-first search from
    the root returns exactly the ``budget`` highest-scoring prefixes (scores only fall along a path).

    Args:
        top_tokens: [D, k] int64, each depth's top-k draft tokens (best first).
        top_logprobs: [D, k] float, their log-probabilities.
    """
    depth_max, k = top_tokens.shape
    cand_parent: list[int] = []
    cand_token: list[int] = []
    cand_score: list[float] = []
    cand_depth: list[int] = []
    heap = [(-float(top_logprobs[0, j]), 1, j, -1) for j in range(k)]  # (-score, depth, choice, parent)
    heapq.heapify(heap)
    while heap and len(cand_token) < budget:
        neg, d, j, parent = heapq.heappop(heap)
        c = len(cand_token)
        cand_parent.append(parent)
        cand_token.append(int(top_tokens[d - 1, j]))
        cand_score.append(-neg)
        cand_depth.append(d)
        if d < depth_max:
            for jj in range(k):
                heapq.heappush(heap, (neg - float(top_logprobs[d, jj]), d + 1, jj, c))
    tree, _ = select_nodes(cand_parent, cand_token, cand_score, cand_depth, budget)
    return tree


@dataclass
class WalkResult:
    """One request's acceptance: ``path`` the accepted nodes (depth 1 first), ``token`` the one more token
    emitted after them, ``stop_node`` the node the walk ended at (-1: the root)."""

    path: list[int]
    token: int
    stop_node: int


def walk(tree: DraftTree, child_p: np.ndarray, argmax: np.ndarray, greedy: bool,
         uniform: Any, final_sample: Any) -> WalkResult:
    """Accept a path of ``tree`` (module docstring, "Acceptance").

    Args:
        child_p: [N] the target's probability of node i's token at its parent (after the request's sampling
            processing).
        argmax: [1 + N] the target's argmax at the root (0) and at node i (1 + i).
        greedy: the request's temperature is 0.
        uniform: ``uniform()`` -> a float in [0, 1) (the request's generator).
        final_sample: ``final_sample(stop_node, rejected_tokens)`` -> the token drawn from the target at
            ``stop_node`` (-1: root) with ``rejected_tokens`` removed (sampling only).
    """
    kids = tree.children()
    node, path = -1, []
    while True:
        rejected: list[int] = []
        nxt = -1
        if greedy:
            want = int(argmax[node + 1])
            nxt = next((c for c in kids[node + 1] if int(tree.tokens[c]) == want), -1)
        else:
            mass = 1.0  # the residual's total: the target's mass left after the rejected siblings
            for c in kids[node + 1]:
                p = float(child_p[c])
                if mass > 0 and uniform() * mass < p:
                    nxt = c
                    break
                rejected.append(int(tree.tokens[c]))
                mass -= p
        if nxt < 0:
            tok = int(argmax[node + 1]) if greedy else int(final_sample(node, rejected))
            return WalkResult(path, tok, node)
        path.append(nxt)
        node = nxt


def residual_sample(probs: torch.Tensor, rejected: list[int], generator: torch.Generator | None = None) -> int:
    """One token from ``probs`` [V] with the ``rejected`` tokens removed (renormalized: an exponential race,
    ``argmax(r / E)``), the last draw of recursive rejection; ``probs`` itself when nothing is left (the
    rejected children held all its mass, up to rounding)."""
    residual = probs.clone()
    if rejected:
        residual[torch.tensor(rejected, device=probs.device)] = 0.0
    if float(residual.sum()) <= 0:
        residual = probs
    noise = torch.empty_like(residual).exponential_(generator=generator)
    return int((residual / noise).argmax())


def place_tree(worker: Any, row: int, tree: DraftTree, num_drafts: int) -> None:
    """Write ``tree``'s tokens into ``row``'s ``token_ids`` after its known tokens (node order) and hand the tree
    to the step's inputs (``InputPreparer.trees``), which read them as the row's query rows.

    Raises:
        RuntimeError: the tree's node count is not the ``num_drafts`` slots the scheduler reserved."""
    if len(tree) != num_drafts:
        raise RuntimeError(f"row {row}: a tree of {len(tree)} nodes for {num_drafts} reserved draft slots")
    n = int(worker.input_batch.num_tokens[row])
    worker.input_batch.token_ids[row, n:n + len(tree)] = tree.tokens
    worker.inputs.trees[row] = tree


def compact_kv(pool: Any, src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Copy the K/V (and an int8 cache's per-slot scales) at ``src_slots`` [m] to ``dst_slots`` [m] in every
    layer of the ``KVCachePool`` (flat slot ids; the accepted path's nodes to their final positions): one
    gather and one scatter over the pool's single [layers, 2, blocks, block_size, heads, dim] tensor."""
    if src_slots.numel() == 0:
        return
    kv = pool.kv
    flat = kv.view(kv.shape[0] * 2, kv.shape[2] * kv.shape[3], *kv.shape[4:])
    flat[:, dst_slots] = flat[:, src_slots]
    for c in pool.caches:
        for s in (c.k_scale, c.v_scale):
            if s is not None and s.dim() == 3:
                flat = s.view(-1, s.shape[-1])
                flat[dst_slots] = flat[src_slots]
