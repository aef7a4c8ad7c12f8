"""Tree-masked prefill attention (speculative tree verification; issue 29) against per-path runs.

A token tree's rows attend to the cached prefix and to their ancestors only. Running each root-to-leaf
path alone as a plain causal chunk over the same prefix must give the same output row for every node of
the path: that is checked for the Triton kernel and its ``ref_`` twin, and against the float64 oracle
(``attention_f64`` on each path).
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import DEVICE, TOL, attention_f64, rel_err  # noqa: E402

from roofline.attention.backend import AttentionMetadata  # noqa: E402
from roofline.kernels.prefill_attention import (  # noqa: E402
    MAX_TREE_ROWS,
    paged_prefill_attention,
    ref_prefill_attention,
)

H, H_KV, D = 4, 2, 32


def _paged(seqs, block_size, dtype, seed):
    """seqs: list of (k [L, H_KV, D], v, q [q_len, H, D]) dense per sequence -> (q, k_cache, v_cache, meta)
    with shuffled blocks; the q rows are the last q_len positions of each sequence."""
    g = torch.Generator().manual_seed(seed)
    nblocks = [-(-k.shape[0] // block_size) for k, _, _ in seqs]
    perm = torch.randperm(sum(nblocks) + 2, generator=g)
    kc = torch.randn(sum(nblocks) + 2, block_size, H_KV, D, generator=g).to(dtype)
    vc = torch.randn_like(kc)
    tables = torch.zeros(len(seqs), max(nblocks) + 1, dtype=torch.int32)
    pos = 0
    for i, ((k, v, _), nb) in enumerate(zip(seqs, nblocks, strict=True)):
        tables[i, :nb] = perm[pos:pos + nb].to(torch.int32)
        pos += nb
        for p in range(k.shape[0]):
            b, o = int(tables[i, p // block_size]), p % block_size
            kc[b, o], vc[b, o] = k[p].to(dtype), v[p].to(dtype)
    q_lens = [q.shape[0] for _, _, q in seqs]
    seq_lens = [k.shape[0] for k, _, _ in seqs]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(sum(q_lens), dtype=torch.int64, device=DEVICE),
        query_start_loc=torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                                     device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE), block_tables=tables.to(DEVICE),
        max_query_len=max(q_lens), seq_lens_cpu=seq_lens, query_lens_cpu=q_lens)
    q = torch.cat([q for _, _, q in seqs]).to(dtype)
    return q.to(DEVICE), kc.to(DEVICE), vc.to(DEVICE), meta


def _ancestor_masks(parents):
    """parents[j] < j (topological order; -1 for a root) -> [n] int64 masks: bit a set iff a is j or an ancestor."""
    masks = []
    for j, _ in enumerate(parents):
        m, a = 0, j
        while a >= 0:
            m |= 1 << a
            a = parents[a]
        masks.append(m - (1 << 64) if m >= 1 << 63 else m)  # as a signed int64
    return masks


def _paths(parents):
    leaves = [j for j in range(len(parents)) if j not in parents]
    out = []
    for leaf in leaves:
        path, a = [], leaf
        while a >= 0:
            path.append(a)
            a = parents[a]
        out.append(path[::-1])
    return out


def _rand(g, *shape):
    return torch.randn(*shape, generator=g)


def _tree_case(requests, width, block_size, dtype, seed):
    """requests: list of (prefix_len, num_plain_rows, parents or None). A request's chunk is num_plain_rows plain
    causal rows then the tree's nodes (None: plain rows only). Returns (q, k_cache, v_cache, meta with the tree
    mask, per-request (prefix, plain, parents, k, v, q))."""
    g = torch.Generator().manual_seed(seed)
    seqs, masks, trees = [], [], []
    for prefix, plain, parents in requests:
        n = len(parents or [])
        total = prefix + plain + n
        k, v, q = _rand(g, total, H_KV, D), _rand(g, total, H_KV, D), _rand(g, plain + n, H, D)
        seqs.append((k, v, q))
        row = [-1] * width  # plain causal, also for region rows before the tree
        if parents:
            r = min(plain + n, width)
            assert n <= r, "the tree must fit in the region"
            for j, m in enumerate(_ancestor_masks(parents)):
                # node j is region row r - n + j; its ancestors' region indices shift by r - n too
                shift = r - n
                bits = m << shift if shift else m
                if shift:  # the region rows before the tree (plain rows) are ancestors of every node
                    bits |= (1 << shift) - 1
                bits &= (1 << 64) - 1
                row[r - n + j] = bits - (1 << 64) if bits >= 1 << 63 else bits
        masks.append(row)
        trees.append((prefix, plain, parents, k, v, q))
    q, kc, vc, meta = _paged(seqs, block_size, dtype, seed)
    meta.tree_mask = torch.tensor(masks, dtype=torch.int64, device=DEVICE)
    return q, kc, vc, meta, trees


def _check_tree(requests, width, block_size, dtype, seed, config=None):
    """Checks every tree node of ``requests`` (as ``_tree_case``) against its paths run alone."""
    q, kc, vc, meta, trees = _tree_case(requests, width, block_size, dtype, seed)
    tree_mask, meta.tree_mask = meta.tree_mask, None
    scale = 1.0 / math.sqrt(D)
    out = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, kc, vc, meta, scale, out=out, config=config, tree_mask=tree_mask)
    ref = ref_prefill_attention(q, kc, vc, meta, scale, tree_mask=tree_mask)
    assert rel_err(out, ref) < TOL[dtype], f"kernel vs ref_ with a tree mask: {rel_err(out, ref):.2e}"

    # Each root-to-leaf path alone: prefix + plain rows + the path's nodes, one plain causal chunk.
    start = 0
    for prefix, plain, parents, k, v, qi in trees:
        rows = out[start:start + plain + len(parents or [])]
        for path in _paths(parents) if parents else [[]]:
            keep = list(range(prefix + plain)) + [prefix + plain + a for a in path]
            one_q = torch.cat([qi[:plain], qi[[plain + a for a in path]]])
            pq, pk, pv, pm = _paged([(k[keep], v[keep], one_q)], block_size, dtype, seed + 1)
            alone = paged_prefill_attention(pq, pk, pv, pm, scale, config=config)
            f64 = attention_f64(pq, pk, pv, pm, scale)
            mine = torch.cat([rows[:plain], rows[[plain + a for a in path]]])
            assert rel_err(mine, alone) < TOL[dtype], f"path {path}: tree vs alone {rel_err(mine, alone):.2e}"
            assert rel_err(mine.cpu(), f64) < TOL[dtype], f"path {path}: tree vs float64"
            assert rel_err(ref[start:start + plain + len(parents or [])][[*range(plain), *[plain + a for a in path]]],
                           alone) < TOL[dtype]
        start += plain + len(parents or [])
    return out, ref


# root 0; 1, 2 under 0; 3, 4 under 1; 5 under 2; 6 under 5: paths [0,1,3], [0,1,4], [0,2,5,6]
TREE7 = [-1, 0, 0, 1, 1, 2, 5]


@pytest.mark.parametrize("dtype,block_size,block_n,big", [(torch.float32, 16, 16, True),
                                                         (torch.float16, 1, 16, False),
                                                         (torch.float32, 16, 64, False)])
def test_tree_as_decode_rows_equals_the_masked_prefill(dtype, block_size, block_n, big):
    """A tree verify step as one decode row per query row (``tree_decode_rows`` + the decode kernel's tree mask,
    what ``ROOFLINE_TREE_VERIFY=decode`` runs): equal to the tree-masked prefill's ``ref_`` within the dtype's
    tolerance. Trees with rows before the region and a plain chunk beside them; ``big`` adds a 64-node tree
    (bit 63). Four splits over short contexts give splits whose keys are all masked: their running max must not
    turn into NaN."""
    from roofline.attention.backend import tree_decode_rows
    from roofline.kernels.decode_attention import paged_decode_attention

    requests = [(20, 0, TREE7), (10, 2, None), (0, 0, [-1, 0, 0, 1]), (9, 3, [-1, 0, 1, 0, 3])]
    if big:
        g = torch.Generator().manual_seed(11)
        requests.append((40, 0, [-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, MAX_TREE_ROWS)]))
    q, kc, vc, meta, _ = _tree_case(requests, MAX_TREE_ROWS if big else 12, block_size, dtype, seed=12)
    scale = 1.0 / math.sqrt(D)
    table, lens, lo, bits = tree_decode_rows(meta, q.shape[0])
    assert table.shape[0] == lens.shape[0] == q.shape[0]
    # Row lengths: each query row sees its own position and everything before it.
    ql, sl = torch.tensor(meta.query_lens_cpu), torch.tensor(meta.seq_lens_cpu)
    assert lens.tolist() == [int(L - n + t + 1) for n, L in zip(ql, sl, strict=True) for t in range(int(n))]
    lens_dev, lo, bits = lens.to(DEVICE, torch.int32), lo.to(DEVICE), bits.to(DEVICE)
    out = paged_decode_attention(q, kc, vc, table, lens_dev, scale, block_n=block_n, num_splits=4, tree_lo=lo,
                                 tree_bits=bits)
    ref = ref_prefill_attention(q, kc, vc, meta, scale, tree_mask=meta.tree_mask)
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < TOL[dtype], f"decode rows vs the masked prefill ref_: {rel_err(out, ref):.2e}"
    if big:  # without the mask the same rows see their siblings: the mask is what makes them agree
        loose = paged_decode_attention(q, kc, vc, table, lens_dev, scale, block_n=block_n, num_splits=4)
        assert rel_err(loose, ref) > 10 * TOL[dtype]


def test_tree_decode_rows_refuse_what_they_cannot_run():
    from roofline.kernels.decode_attention import paged_decode_attention

    q, kc, vc, meta, _ = _tree_case([(5, 0, [-1, 0])], 8, 16, torch.float32, seed=13)
    lens = torch.tensor([6, 7], dtype=torch.int32, device=DEVICE)
    table = meta.block_tables[[0, 0]]
    lo = torch.full((2,), 5, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match=r"tree_lo and tree_bits must both be \[num_seqs=2\] int64"):
        paged_decode_attention(q, kc, vc, table, lens, 0.2, tree_lo=lo)
    with pytest.raises(ValueError, match="a tree mask runs in decode variant 'old' with query_len 1; got variant 'mma'"):
        paged_decode_attention(q, kc, vc, table, lens, 0.2, tree_lo=lo, tree_bits=lo, variant="mma")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("block_size", [16, 1])
def test_tree_rows_equal_their_paths_alone(dtype, block_size):
    requests = [
        (20, 0, TREE7),            # a tree after a 20-token prefix
        (10, 5, None),             # a plain extend chunk in the same batch (mask rows -1)
        (0, 0, [-1, 0, 0, 1]),     # no prefix: the root sees only itself
        (9, 3, [-1, 0, 1, 0, 3]),  # plain rows of the chunk before the tree: region rows 0..2 are ancestors
    ]
    _check_tree(requests, 8, block_size, dtype, seed=block_size + (dtype == torch.float16))


def test_tree_of_64_nodes_uses_every_bit():
    # A 64-node random tree (bit 63 is the sign bit of the int64 mask) after a 40-token prefix.
    g = torch.Generator().manual_seed(3)
    parents = [-1] + [int(torch.randint(0, j, (1,), generator=g)) for j in range(1, MAX_TREE_ROWS)]
    parents[63] = 62  # the last node under the one before it: its mask has bits 62 and 63
    out, _ = _check_tree([(40, 0, parents)], MAX_TREE_ROWS, 16, torch.float32, seed=4)
    assert torch.isfinite(out).all()


def test_all_ones_mask_is_plain_causal():
    g = torch.Generator().manual_seed(5)
    seqs = [(_rand(g, 30, H_KV, D), _rand(g, 30, H_KV, D), _rand(g, 12, H, D)),
            (_rand(g, 7, H_KV, D), _rand(g, 7, H_KV, D), _rand(g, 7, H, D))]
    q, kc, vc, meta = _paged(seqs, 16, torch.float32, 5)
    plain = paged_prefill_attention(q, kc, vc, meta, 0.2)
    ones = paged_prefill_attention(q, kc, vc, meta, 0.2, tree_mask=torch.full((2, 64), -1, dtype=torch.int64,
                                                                               device=DEVICE))
    assert rel_err(ones, plain) < 1e-6


def test_tree_mask_errors_name_the_limit():
    g = torch.Generator().manual_seed(6)
    q, kc, vc, meta = _paged([(_rand(g, 5, H_KV, D), _rand(g, 5, H_KV, D), _rand(g, 5, H, D))], 16,
                             torch.float32, 6)
    with pytest.raises(ValueError, match="tree_mask covers 65 query rows per request; the limit is 64"):
        paged_prefill_attention(q, kc, vc, meta, 0.2, tree_mask=torch.zeros(1, 65, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match="tree_mask covers 65 query rows per request; the limit is 64"):
        ref_prefill_attention(q, kc, vc, meta, 0.2, tree_mask=torch.zeros(1, 65, dtype=torch.int64, device=DEVICE))
    with pytest.raises(ValueError, match=r"tree_mask must be int64 \[num_seqs=1, <= 64\], got torch.int32"):
        paged_prefill_attention(q, kc, vc, meta, 0.2, tree_mask=torch.zeros(1, 8, dtype=torch.int32, device=DEVICE))
    with pytest.raises(ValueError, match=r"got torch.int64 \(2, 8\)"):
        paged_prefill_attention(q, kc, vc, meta, 0.2, tree_mask=torch.zeros(2, 8, dtype=torch.int64, device=DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", [None, dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, USE_TMA=True),
                                    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3)])
@pytest.mark.parametrize("block_size", [16, 64])
def test_tree_gpu_bf16(config, block_size):
    # GPU tiles: a 300-token prefix, the 7-node tree, a long plain chunk beside it, and a 64-node tree.
    g = torch.Generator().manual_seed(7)
    parents = [-1] + [int(torch.randint(max(0, j - 3), j, (1,), generator=g)) for j in range(1, 64)]
    _check_tree([(300, 0, TREE7), (1000, 200, None), (70, 0, parents)], 64, block_size, torch.bfloat16, seed=8,
                config=config)
