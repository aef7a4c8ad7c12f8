"""RadixAttention prefix cache: a radix tree over token ids whose nodes own KV blocks. Pure Python.

After SGLang's ``mem_cache/radix_cache.py`` (Zheng et al., "SGLang: Efficient Execution of Structured
Language Model Programs", 2024, section 3), at the paged KV cache's block granularity:

- Each edge is a run of whole blocks: ``key`` holds ``len(value) * block_size`` token ids and ``value`` the
  KV block ids that hold them. Children are keyed by the token ids of their first block, and an edge is split
  where two inserted sequences diverge (at the first block that differs).
- Reuse is per whole block. A match is floored to whole blocks, and the tail of a partially filled block is
  never shared: a sequence computes it again in a block of its own. So a cached block is never written again.
- The tree holds one reference (``BlockPool.ref_counts``) on each of its blocks; sequences using them hold
  their own references through their block tables.
- ``lock(node)`` marks the path root -> ``node`` as in use (``lock_ref``, counted on every node of the path).
  Locked nodes are never evicted. A node with ``lock_ref == 0`` holds blocks that only the tree references:
  they are *evictable* and count as free for the scheduler (``BlockPool.num_free_blocks``).
- ``evict(n)`` frees blocks from unlocked leaves, least recently used first, a leaf's deepest blocks first;
  a leaf emptied this way is removed, and its parent may become an evictable leaf in turn.

Recency is a logical clock (one tick per ``lock`` or ``insert``), so eviction order is deterministic.
Mutates only itself and the pool's ref counts / free list. Not thread-safe: only the engine loop calls it.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

from roofline.engine.block_pool import BlockPool

_node_ids = itertools.count()


@dataclass(eq=False)
class RadixNode:
    key: tuple[int, ...] = ()  # token ids of this edge, len(value) * block_size of them
    value: list[int] = field(default_factory=list)  # block ids, one per block_size tokens of key
    parent: RadixNode | None = field(default=None, repr=False)  # None: the root, or removed from the tree
    children: dict[tuple[int, ...], RadixNode] = field(default_factory=dict, repr=False)
    lock_ref: int = 0  # locks on this node or a descendant
    last_access: int = 0  # logical clock
    node_id: int = field(default_factory=lambda: next(_node_ids))

    @property
    def is_leaf(self) -> bool:
        return not self.children


class PrefixMatch(NamedTuple):
    """The cached prefix of a token sequence: its blocks, its length, and the node to lock to keep it."""

    block_ids: list[int]
    num_tokens: int  # len(block_ids) * block_size
    node: RadixNode  # the node where the match ends (the root when nothing matched)


class RadixCache:
    """Prefix cache over ``pool``'s blocks (attaches itself as ``pool.prefix_cache``).

    Counters (cumulative, for metrics): ``num_query_tokens`` / ``num_hit_tokens`` (recorded by the caller with
    ``record_query``: prompt tokens looked up, and those found) and ``num_evicted_blocks``.
    """

    def __init__(self, pool: BlockPool):
        self.pool = pool
        self.block_size = pool.block_size
        self.root = RadixNode()
        self.root.lock_ref = 1  # never evicted, never unlocked
        pool.prefix_cache = self
        self._num_cached_blocks = 0
        self._num_evictable_blocks = 0
        self._num_nodes = 0
        self._clock = 0
        # Lazy min-heap of (last_access, node_id, node): candidates for eviction. Entries go stale when a node
        # is touched, locked, gains a child or leaves the tree; they are checked when popped.
        self._heap: list[tuple[int, int, RadixNode]] = []
        self.num_query_tokens = 0
        self.num_hit_tokens = 0
        self.num_evicted_blocks = 0

    # ------------------------------------------------------------------------------ counts

    @property
    def num_cached_blocks(self) -> int:
        """Blocks in the tree, locked or not."""
        return self._num_cached_blocks

    @property
    def num_evictable_blocks(self) -> int:
        """Blocks in unlocked nodes: only the tree holds them, and ``evict`` can free them."""
        return self._num_evictable_blocks

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        """Count one lookup of ``num_query_tokens`` prompt tokens, ``num_hit_tokens`` of them found."""
        self.num_query_tokens += num_query_tokens
        self.num_hit_tokens += num_hit_tokens

    # ------------------------------------------------------------------------------ lookups

    def _num_common_blocks(self, key: tuple[int, ...], token_ids: list[int], start: int, max_blocks: int) -> int:
        """Whole blocks at the start of ``key`` equal to ``token_ids[start:]``, at most ``max_blocks``."""
        bs = self.block_size
        n = min(len(key) // bs, max_blocks)
        if key[:n * bs] == tuple(token_ids[start:start + n * bs]):
            return n
        m = 0
        while m < n and key[m * bs:(m + 1) * bs] == tuple(token_ids[start + m * bs:start + (m + 1) * bs]):
            m += 1
        return m

    def match(self, token_ids: list[int], max_tokens: int | None = None) -> PrefixMatch:
        """The longest cached prefix of ``token_ids[:max_tokens]``, floored to whole blocks.

        Splits the node where the match ends inside an edge, so that the returned node covers exactly the
        matched blocks. Does not lock anything or refresh recency: ``lock(match.node)`` does both.
        """
        bs = self.block_size
        limit = len(token_ids) if max_tokens is None else max(0, min(len(token_ids), max_tokens))
        max_blocks = limit // bs
        node, blocks, i = self.root, [], 0
        while i < max_blocks:
            child = node.children.get(tuple(token_ids[i * bs:(i + 1) * bs]))
            if child is None:
                break
            m = self._num_common_blocks(child.key, token_ids, i * bs, max_blocks - i)
            if m < len(child.value):
                child = self._split(child, m)
            blocks.extend(child.value)
            node, i = child, i + m
        return PrefixMatch(blocks, i * bs, node)

    def match_length(self, token_ids: list[int], max_tokens: int | None = None) -> int:
        """Tokens ``match`` would find, without changing the tree (for scheduling policies)."""
        bs = self.block_size
        limit = len(token_ids) if max_tokens is None else max(0, min(len(token_ids), max_tokens))
        max_blocks = limit // bs
        node, i = self.root, 0
        while i < max_blocks:
            child = node.children.get(tuple(token_ids[i * bs:(i + 1) * bs]))
            if child is None:
                break
            m = self._num_common_blocks(child.key, token_ids, i * bs, max_blocks - i)
            i += m
            if m < len(child.value):
                break
            node = child
        return i * bs

    # ------------------------------------------------------------------------------ insert

    def insert(self, token_ids: list[int], block_ids: list[int], num_tokens: int) -> RadixNode:
        """Cache the first ``num_tokens`` of ``token_ids``, floored to whole blocks, whose KV is in
        ``block_ids`` (a block table: block ``i`` holds tokens ``[i * block_size, (i + 1) * block_size)``).

        ``num_tokens`` is the count of *verified* tokens whose KV a completed step has written; never pass
        speculative drafts or tokens of a step still in flight. Blocks of a range already cached stay as
        they are (the caller's duplicate blocks are not taken); new ranges take a reference on the caller's
        blocks. Refreshes recency along the path. Returns the node where the inserted prefix ends (the root
        when it is shorter than a block); lock it to protect the caller's blocks.

        Raises:
            ValueError: ``block_ids`` does not cover ``num_tokens`` tokens.
        """
        bs = self.block_size
        n_blocks = min(num_tokens, len(token_ids)) // bs
        if len(block_ids) < n_blocks:
            raise ValueError(f"{len(block_ids)} blocks cannot hold {n_blocks * bs} tokens of {bs} per block")
        node, i = self.root, 0
        while i < n_blocks:
            first = tuple(token_ids[i * bs:(i + 1) * bs])
            child = node.children.get(first)
            if child is None:
                child = RadixNode(key=tuple(token_ids[i * bs:n_blocks * bs]), value=list(block_ids[i:n_blocks]),
                                  parent=node)
                self.pool.incref(child.value)
                node.children[first] = child
                self._num_nodes += 1
                self._num_cached_blocks += len(child.value)
                self._num_evictable_blocks += len(child.value)
                node, i = child, n_blocks
                break
            m = self._num_common_blocks(child.key, token_ids, i * bs, n_blocks - i)
            if m < len(child.value):
                child = self._split(child, m)
            node, i = child, i + m
        self._touch(node)
        return node

    def _split(self, child: RadixNode, m: int) -> RadixNode:
        """Cut ``child``'s edge after ``m`` blocks; returns the new upper node. ``child`` keeps its identity
        (and the locks of whoever holds it) as the lower part."""
        bs = self.block_size
        parent = child.parent
        assert parent is not None and 0 < m < len(child.value)
        upper = RadixNode(key=child.key[:m * bs], value=child.value[:m], parent=parent, lock_ref=child.lock_ref,
                          last_access=child.last_access)
        parent.children[child.key[:bs]] = upper
        child.key, child.value, child.parent = child.key[m * bs:], child.value[m:], upper
        upper.children[child.key[:bs]] = child
        self._num_nodes += 1
        return upper

    # ------------------------------------------------------------------------------ locks

    def _path(self, node: RadixNode) -> list[RadixNode]:
        """``node`` and its ancestors, the root excluded.

        Raises:
            RuntimeError: ``node`` is no longer in the tree.
        """
        path = []
        while node is not self.root:
            if node.parent is None:
                raise RuntimeError(f"node {node.node_id} is not in the tree (evicted)")
            path.append(node)
            node = node.parent
        return path

    def _touch(self, node: RadixNode) -> None:
        self._clock += 1
        for n in self._path(node):
            n.last_access = self._clock
        self._push_if_evictable(node)

    def lock(self, node: RadixNode) -> None:
        """Protect the path root -> ``node`` from eviction (one more user) and refresh its recency.

        Raises:
            RuntimeError: ``node`` has left the tree.
        """
        self._clock += 1
        for n in self._path(node):
            if n.lock_ref == 0:
                self._num_evictable_blocks -= len(n.value)
            n.lock_ref += 1
            n.last_access = self._clock

    def num_evictable_on_path(self, node: RadixNode) -> int:
        """Blocks on the path root -> ``node`` that are evictable now (those ``lock(node)`` would protect)."""
        n, total = node, 0
        while n is not self.root and n.lock_ref == 0:  # locks count on every ancestor: stop at the first
            total += len(n.value)
            assert n.parent is not None, f"node {n.node_id} is not in the tree (evicted)"
            n = n.parent
        return total

    def unlock(self, node: RadixNode) -> None:
        """Release one ``lock(node)``. Nodes no longer locked become evictable.

        Raises:
            RuntimeError: a node of the path is not locked (an unlock without its lock); nothing changes.
        """
        path = self._path(node)
        for n in path:
            if n.lock_ref <= 0:
                raise RuntimeError(f"unlock of node {n.node_id}, which is not locked")
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self._num_evictable_blocks += len(n.value)
        if path:
            self._push_if_evictable(path[0])

    # ------------------------------------------------------------------------------ eviction

    def _is_evictable_leaf(self, node: RadixNode) -> bool:
        return node.parent is not None and not node.children and node.lock_ref == 0 and bool(node.value)

    def _push_if_evictable(self, node: RadixNode) -> None:
        if self._is_evictable_leaf(node):
            heapq.heappush(self._heap, (node.last_access, node.node_id, node))
            if len(self._heap) > 2 * self._num_nodes + 64:
                self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [(n.last_access, n.node_id, n) for n in self._nodes() if self._is_evictable_leaf(n)]
        heapq.heapify(self._heap)

    def _pop_lru_leaf(self) -> RadixNode | None:
        while self._heap:
            access, _, node = heapq.heappop(self._heap)
            if self._is_evictable_leaf(node) and access == node.last_access:
                return node
        return None

    def evict(self, num_blocks: int) -> list[int]:
        """Free at least ``num_blocks`` blocks (or all evictable ones, if fewer) from unlocked leaves, least
        recently used first; within a leaf the deepest blocks go first. Returns the freed block ids in the
        order they went to the pool's free list.

        Raises:
            RuntimeError: an unlocked node holds a block that someone else references (a broken lock).
        """
        freed: list[int] = []
        while len(freed) < num_blocks:
            node = self._pop_lru_leaf()
            if node is None:
                break
            k = min(len(node.value), num_blocks - len(freed))
            keep = len(node.value) - k
            taken = node.value[keep:][::-1]  # deepest first
            for b in taken:
                if self.pool.ref_counts[b] != 1:
                    self._push_if_evictable(node)
                    raise RuntimeError(f"evicting block {b} of unlocked node {node.node_id}, but it has "
                                       f"{self.pool.ref_counts[b]} holders")
            first = node.key[:self.block_size]
            node.key, node.value = node.key[:keep * self.block_size], node.value[:keep]
            self.pool.decref(taken)
            freed.extend(taken)
            self._num_cached_blocks -= k
            self._num_evictable_blocks -= k
            self.num_evicted_blocks += k
            if node.value:
                self._push_if_evictable(node)
                continue
            parent = node.parent
            assert parent is not None
            del parent.children[first]
            node.parent = None
            self._num_nodes -= 1
            self._push_if_evictable(parent)
        return freed

    # ------------------------------------------------------------------------------ inspection

    def _nodes(self) -> list[RadixNode]:
        """Every node but the root, parents before children."""
        out, stack = [], list(self.root.children.values())
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def all_block_ids(self) -> list[int]:
        """Every block the tree holds (one reference each)."""
        return [b for n in self._nodes() for b in n.value]

    def check_invariants(self) -> None:
        """Edges are whole blocks keyed by their first block; locks count their descendants' locks; the
        counters match the tree; an unlocked node's blocks are held by the tree alone."""
        bs = self.block_size
        cached = evictable = 0
        nodes = self._nodes()
        for n in nodes:
            assert n.parent is not None and n.parent.children.get(n.key[:bs]) is n, f"node {n.node_id} unlinked"
            assert n.value and len(n.key) == len(n.value) * bs, f"node {n.node_id}: {len(n.key)} tokens, " \
                                                                 f"{len(n.value)} blocks"
            assert n.lock_ref >= sum(c.lock_ref for c in n.children.values()), f"node {n.node_id} lock count"
            assert n.lock_ref >= 0
            for b in n.value:
                assert self.pool.ref_counts[b] >= 1, f"cached block {b} is free"
                if n.lock_ref == 0:
                    assert self.pool.ref_counts[b] == 1, f"unlocked block {b} has {self.pool.ref_counts[b]} holders"
            cached += len(n.value)
            evictable += len(n.value) if n.lock_ref == 0 else 0
        assert len(nodes) == self._num_nodes, f"{len(nodes)} nodes, counted {self._num_nodes}"
        assert cached == self._num_cached_blocks, f"{cached} cached blocks, counted {self._num_cached_blocks}"
        assert evictable == self._num_evictable_blocks, \
            f"{evictable} evictable blocks, counted {self._num_evictable_blocks}"
        blocks = self.all_block_ids()
        assert len(blocks) == len(set(blocks)), "a block is in the tree twice"
