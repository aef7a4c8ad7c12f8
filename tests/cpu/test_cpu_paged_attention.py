"""The CPU paged decode attention kernel (``roofline.kernels.cpu_paged_attention``) against a float64 oracle:
shuffled block tables, partial last blocks whose stale tail holds NaN (never read), GQA groups, fp32 and bf16
caches, rows scattered in the step's batch; batch invariance; refusals."""

from __future__ import annotations

import math
import shutil

import pytest
import torch

from roofline.cpu import detect_cpu_features
from roofline.kernels import cpu_paged_attention as cpa
from roofline.kernels.common import ref_dequantize

pytestmark = pytest.mark.skipif(cpa.unavailable_reason() is not None,
                                reason=f"kernel not built: {cpa.unavailable_reason()}")


def _case(lens, heads, kv_heads, head_dim, block_size, cache_dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = sum(-(-n // block_size) for n in lens) + 3
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=gen)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = torch.zeros(len(lens), max_blocks, dtype=torch.int64)
    for i, n in enumerate(lens):
        nb = -(-n // block_size)
        tables[i, :nb] = torch.tensor([perm.pop() for _ in range(nb)])
        last, used = tables[i, nb - 1], n - (nb - 1) * block_size
        k[last, used:] = float("nan")  # a freed request's leftovers: must never be read
        v[last, used:] = float("nan")
    num_rows = len(lens) + 2
    q = torch.randn(num_rows, heads, head_dim, generator=gen)
    rows = torch.randperm(num_rows, generator=gen)[:len(lens)].sort().values
    return q, k.to(cache_dtype).contiguous(), v.to(cache_dtype).contiguous(), tables, torch.tensor(lens), rows


def _oracle(q, k, v, tables, lens, rows, scale):
    heads, group = q.shape[1], q.shape[1] // k.shape[2]
    out = {}
    for i, n in enumerate(lens.tolist()):
        blocks = tables[i, :-(-n // k.shape[1])]
        kk = k[blocks].reshape(-1, k.shape[2], k.shape[3])[:n].double().repeat_interleave(group, dim=1)  # [n, H, D]
        vv = v[blocks].reshape(-1, v.shape[2], v.shape[3])[:n].double().repeat_interleave(group, dim=1)
        qi = q[rows[i]].double()  # [H, D]
        p = torch.softmax(torch.einsum("hd,nhd->hn", qi, kk) * scale, dim=-1)
        out[int(rows[i])] = torch.einsum("hn,nhd->hd", p, vv)
        assert out[int(rows[i])].shape == (heads, q.shape[2])
    return out


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lens,heads,kv_heads,head_dim,block_size", [
    ([1, 17, 300, 64], 9, 3, 64, 16),   # the default model's heads; a 1-token row, partial blocks
    ([5, 129], 8, 8, 128, 32),          # no GQA, D 128
    ([70, 33, 2], 16, 1, 32, 64),       # one KV head for 16 query heads, the largest block
    ([40, 3], 24, 4, 64, 16),           # 6 query heads per KV head: the largest group kept in registers at D 64
    ([9, 50], 8, 2, 128, 16),           # 4 per KV head at D 128: past the registers, the loop through memory
])
def test_matches_float64_oracle(cache_dtype, lens, heads, kv_heads, head_dim, block_size):
    q, k, v, tables, lens_t, rows = _case(lens, heads, kv_heads, head_dim, block_size, cache_dtype, seed=len(lens))
    scale = 1 / math.sqrt(head_dim)
    out = torch.full_like(q, -7.0)
    cpa.paged_decode_attention(q, k, v, tables, lens_t, rows, scale, out)
    want = _oracle(q, k, v, tables, lens_t, rows, scale)
    for r in range(q.shape[0]):
        if r in want:
            err = (out[r].double() - want[r]).abs().max().item()
            assert err < 2e-6, (r, err)  # fp32 accumulation over <= 300 keys; K/V widened exactly from bf16
        else:
            assert torch.all(out[r] == -7.0)  # rows not named are left as they were


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(9, 3, 64, 16), (8, 2, 128, 16), (6, 6, 32, 64)])
def test_tree_mask_matches_float64_oracle(cache_dtype, heads, kv_heads, head_dim, block_size):
    """Decode rows with a token tree's ancestor mask (``tree_lo`` / ``tree_bits``): each row attends to the keys
    before ``tree_lo`` and to the tree keys whose bit is set, exactly the float64 softmax over that subset. Rows of
    one sequence share its table (a verify pass's rows); trees straddle block boundaries and reach 64 keys; a row
    with bits -1 is plain causal; hidden keys hold NaN-free values that would change the result if read."""
    gen = torch.Generator().manual_seed(head_dim + block_size)
    lens, cases = [], []  # (sequence length, region start) per sequence; rows: every region key's row
    for ctx, width in ((30, 5), (block_size - 3, 64 - block_size + 3), (1, 9)):
        lens.append(ctx + width)
        cases.append((ctx, width))
    _, k, v, tables_s, _, _ = _case(lens, heads, kv_heads, head_dim, block_size, cache_dtype, seed=3)
    row_seq, row_len, row_lo, row_bits = [], [], [], []
    for s, (ctx, width) in enumerate(cases):
        own = []
        for j in range(width):  # node j's parent: a random earlier node, or none (a child of the root)
            parent = int(torch.randint(-1, j, (), generator=gen)) if j else -1
            own.append((own[parent] if parent >= 0 else 0) | (1 << j))
        for j in range(width):
            bits = own[j] if j != width - 1 or s != 0 else -1  # one plain causal row in the tree's place
            row_seq.append(s)
            row_len.append(ctx + j + 1)
            row_lo.append(ctx)
            row_bits.append(bits - (1 << 64) if bits >= 1 << 63 else bits)
    n = len(row_seq)
    q = torch.randn(n, heads, head_dim, generator=gen)
    tables = tables_s[torch.tensor(row_seq)].contiguous()
    lens_t, rows = torch.tensor(row_len), torch.arange(n)
    lo, bits = torch.tensor(row_lo), torch.tensor(row_bits, dtype=torch.int64)
    scale = 1 / math.sqrt(head_dim)
    out = torch.zeros_like(q)
    cpa.paged_decode_attention(q, k, v, tables, lens_t, rows, scale, out, tree_lo=lo, tree_bits=bits)
    group = heads // kv_heads
    for i in range(n):
        nk = row_len[i]
        blocks = tables[i, :-(-nk // block_size)]
        kk = k[blocks].reshape(-1, kv_heads, head_dim)[:nk].double().repeat_interleave(group, dim=1)
        vv = v[blocks].reshape(-1, kv_heads, head_dim)[:nk].double().repeat_interleave(group, dim=1)
        seen = torch.tensor([t < row_lo[i] or bool((row_bits[i] >> (t - row_lo[i])) & 1) for t in range(nk)])
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[i].double(), kk[seen]) * scale, dim=-1)
        want = torch.einsum("hn,nhd->hd", p, vv[seen])
        err = (out[i].double() - want).abs().max().item()
        assert err < 2e-6, (i, err)
    # A masked row differs from the causal row over the same keys (the mask is applied, not ignored).
    causal = torch.zeros_like(q)
    cpa.paged_decode_attention(q, k, v, tables, lens_t, rows, scale, causal)
    full = [(1 << (row_len[i] - row_lo[i])) - 1 for i in range(n)]
    differs = [i for i in range(n) if row_bits[i] & full[i] != full[i]]  # rows that hide some key
    assert differs and all(not torch.allclose(out[i], causal[i]) for i in differs)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ctx,block_size", [(30, 16), (13, 16), (64, 64), (5, 8)])
def test_tree_row_is_bit_identical_to_its_path_as_a_chain(cache_dtype, ctx, block_size):
    """A tree node's row gives exactly the bits of the decode row at the same position once the sequence holds its
    root-to-node path and nothing else (the decode step after acceptance, or a chain verify pass): the kernel
    attends to the seen keys as that chain's blocks. Trees straddle block boundaries; every node is checked."""
    heads, kv_heads, head_dim = 9, 3, 64
    gen = torch.Generator().manual_seed(ctx * 7 + block_size)
    parents = [-1, -1, 0, 1, 2, 2, 4, 3, 6, -1, 9, 10]  # breadth-first enough: each parent precedes its child
    width = len(parents)
    own = []
    for j, p in enumerate(parents):
        own.append((own[p] if p >= 0 else 0) | (1 << j))
    nb = -(-(ctx + width) // block_size) + 1
    k = torch.randn(2 * nb + 2, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    v = torch.randn(2 * nb + 2, block_size, kv_heads, head_dim, generator=gen).to(cache_dtype)
    tree_table = torch.arange(nb, dtype=torch.int64) * 2 + 1  # scattered blocks
    q = torch.randn(width, heads, head_dim, generator=gen)
    scale = 0.125
    out = torch.zeros(width, heads, head_dim)
    cpa.paged_decode_attention(q, k, v, tree_table.repeat(width, 1).contiguous(),
                               torch.tensor([ctx + j + 1 for j in range(width)]), torch.arange(width), scale, out,
                               tree_lo=torch.full((width,), ctx), tree_bits=torch.tensor(own))
    for j in range(width):
        path = [a for a in range(width) if (own[j] >> a) & 1]  # ancestors and the node, in order
        # the chain: a copy of the cache whose blocks 2b (unused by the tree) hold the context, then the path
        kc, vc = k.clone(), v.clone()
        chain_table = torch.arange(nb, dtype=torch.int64) * 2 + 2
        src = list(range(ctx)) + [ctx + a for a in path]
        for t, u in enumerate(src):
            sb, so = tree_table[u // block_size], u % block_size
            kc[chain_table[t // block_size], t % block_size] = k[sb, so]
            vc[chain_table[t // block_size], t % block_size] = v[sb, so]
        ref = torch.zeros(1, heads, head_dim)
        cpa.paged_decode_attention(q[j:j + 1].contiguous(), kc, vc, chain_table[None].contiguous(),
                                   torch.tensor([len(src)]), torch.arange(1), scale, ref)
        assert torch.equal(out[j], ref[0]), j


def test_tree_mask_refuses_rows_out_of_range():
    q, k, v, tables, lens, rows = _case([80, 10], 9, 3, 64, 16, torch.float32)
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match=r"seq_lens - tree_lo = 70 \(allowed 1..64\)"):
        cpa.paged_decode_attention(q, k, v, tables, lens, rows, 0.1, out, tree_lo=torch.tensor([10, 5]),
                                   tree_bits=torch.tensor([3, -1]))
    with pytest.raises(ValueError, match="tree_lo = 0 with bit 0 clear"):
        cpa.paged_decode_attention(q, k, v, tables, lens, rows, 0.1, out, tree_lo=torch.tensor([79, 0]),
                                   tree_bits=torch.tensor([3, 2]))
    cpa.paged_decode_attention(q, k, v, tables, torch.tensor([80, 2]), rows, 0.1, out,  # bit 0 set: allowed
                               tree_lo=torch.tensor([79, 0]), tree_bits=torch.tensor([3, 1]))
    with pytest.raises(ValueError, match="both or neither"):
        cpa.paged_decode_attention(q, k, v, tables, lens, rows, 0.1, out, tree_lo=torch.tensor([79, 5]))


def test_bf16_output_is_the_fp32_result_rounded_once():
    """``out`` in bf16: the kernel writes each named row rounded once from the fp32 result it would have written
    (what the backend did with an fp32 buffer, ``index_select`` and ``.to``), other rows untouched."""
    q, k, v, tables, lens, rows = _case([1, 17, 300, 64], 9, 3, 64, 16, torch.bfloat16, seed=11)
    o32 = torch.zeros_like(q)
    cpa.paged_decode_attention(q, k, v, tables, lens, rows, 0.125, o32)
    o16 = torch.full(q.shape, -7.0, dtype=torch.bfloat16)
    cpa.paged_decode_attention(q, k, v, tables, lens, rows, 0.125, o16)
    named = torch.zeros(q.shape[0], dtype=torch.bool)
    named[rows] = True
    assert torch.equal(o16[named], o32[named].bfloat16())
    assert torch.all(o16[~named] == -7.0)
    with pytest.raises(ValueError, match="out must be contiguous torch.float32 or torch.bfloat16, got torch.float16"):
        cpa.paged_decode_attention(q, k, v, tables, lens, rows, 0.125, o32.half())
    with pytest.raises(ValueError, match=r"out \(5, 9, 64\) must have q's shape \(6, 9, 64\)"):
        cpa.paged_decode_attention(q, k, v, tables, lens, rows, 0.125, o32[:5].contiguous())


def _rope_case(dtype, cache_dtype, seed=0):
    from roofline.layers.rotary import RotaryEmbedding

    gen = torch.Generator().manual_seed(seed)
    T, H, Hkv, D = 7, 9, 3, 64
    rot = RotaryEmbedding(D, 2048, 100000.0)
    qkv = (3 * torch.randn(T, (H + 2 * Hkv) * D, generator=gen)).to(dtype)  # the fused projection's output
    q, k, v = qkv.split([H * D, Hkv * D, Hkv * D], dim=-1)
    q, k, v = q.reshape(T, H, D), k.reshape(T, Hkv, D), v.reshape(T, Hkv, D)  # strided views, as the model's
    positions = torch.tensor([0, 5, 17, 100, 1000, 2047, 3])
    slots = torch.tensor([3, 17, -1, 40, 159, 0, 77])  # -1: a padding row, not stored
    caches = [torch.full((10, 16, Hkv, D), 0.5, dtype=cache_dtype) for _ in range(2)]
    return q, k, v, positions, rot.cos_sin_cache, caches, slots


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
                                               (torch.float32, torch.float32)])
def test_rope_and_store_equals_the_reference_bit_for_bit(dtype, cache_dtype):
    """RoPE + the KV store in one C++ pass: q, and the cache after the store, bit-identical to ``ref_rotary``
    followed by the indexed write (same fp32 products, each rounded before the add, same roundings to the model
    and cache dtypes); a negative slot stores nothing; the inputs are not modified."""
    from roofline.kernels.rope_cache import ref_rotary

    q, k, v, pos, cs, (kc, vc), slots = _rope_case(dtype, cache_dtype)
    before = [t.clone() for t in (q, k, v)]
    kc_ref, vc_ref = kc.clone(), vc.clone()
    got = cpa.rope_and_store(q, k, v, pos, cs, kc, vc, slots, torch.float32)
    want_q, want_k = ref_rotary(pos, q, k, cs)
    valid = slots >= 0
    kc_ref.view(-1, *kc.shape[2:])[slots[valid]] = want_k[valid].to(cache_dtype)
    vc_ref.view(-1, *vc.shape[2:])[slots[valid]] = v[valid].to(cache_dtype)
    assert got.dtype == torch.float32 and torch.equal(got, want_q.float())
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)
    assert all(torch.equal(a, b) for a, b in zip((q, k, v), before, strict=True))
    if dtype == torch.bfloat16:
        assert torch.equal(cpa.rope_and_store(q, k, v, pos, cs, kc, vc, slots, torch.bfloat16), want_q)


def test_rope_and_store_declines_and_writes_nothing_out_of_range():
    """None (the caller runs the reference, which raises for a bad index) for what it does not cover, and for a
    position past the angle table or a slot past the cache, with the cache left as it was."""
    q, k, v, pos, cs, (kc, vc), slots = _rope_case(torch.bfloat16, torch.bfloat16)
    untouched = kc.clone()
    assert cpa.rope_and_store(q, k, v, pos.clone().fill_(2048), cs, kc, vc, slots, torch.float32) is None
    assert cpa.rope_and_store(q, k, v, pos, cs, kc, vc, slots.clone().fill_(160), torch.float32) is None
    assert torch.equal(kc, untouched)
    assert cpa.rope_and_store(q.float(), k.float(), v.float(), pos, cs, kc, vc, slots, torch.float32) is None  # fp32 model, bf16 cache
    assert cpa.rope_and_store(q, k, v, pos, cs, kc.half(), vc.half(), slots, torch.float32) is None  # fp16 cache
    assert cpa.rope_and_store(q, k, v, pos, cs.double(), kc, vc, slots, torch.float32) is None  # fp64 table
    assert cpa.rope_and_store(q.transpose(1, 2), k, v, pos, cs, kc, vc, slots, torch.float32) is None  # layout


def _quantize(x: torch.Tensor, cache_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Cache rows [num_blocks, bs, H_kv, D] as the engine stores them: int8 with one scale per (slot, KV head),
    fp8 E4M3 with one per KV head (``roofline.kernels.common``)."""
    finite = torch.nan_to_num(x, nan=0.0)
    if cache_dtype == torch.int8:
        scale = (finite.abs().amax(-1) / 127).clamp_min(1e-8)  # [num_blocks, bs, H_kv]
        codes = torch.round(x / scale[..., None]).clamp(-127, 127)
        codes = torch.where(x.isnan(), torch.zeros_like(codes), codes).to(torch.int8)  # stale slots: any code
        return codes.contiguous(), scale.float().contiguous()
    scale = (finite.abs().amax(dim=(0, 1, 3)) / 448).float()  # [H_kv]
    return (x / scale[:, None]).to(torch.float8_e4m3fn).contiguous(), scale.contiguous()


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("lens,heads,kv_heads,head_dim,block_size", [
    ([1, 17, 300, 64], 9, 3, 64, 16),
    ([9, 50], 8, 2, 128, 16),
    ([70, 33, 2], 16, 1, 32, 64),
])
def test_quantized_cache_matches_float64_oracle_on_its_codes(cache_dtype, lens, heads, kv_heads, head_dim,
                                                             block_size):
    """int8 (per-slot scales) and fp8 E4M3 (per-head scales) codes read where they lie: within 2e-6 of the float64
    attention over the dequantized codes (codes x scale, what ``ref_dequantize`` gives), the same bound as fp32, and
    bit-identical to the kernel over that dequantized fp32 cache; an fp8 cache's stale slots hold NaN codes, never
    read. Per-head scales on an int8 cache work too."""
    q, k, v, tables, lens_t, rows = _case(lens, heads, kv_heads, head_dim, block_size, torch.float32, seed=len(lens))
    (kc, ks), (vc, vs) = _quantize(k, cache_dtype), _quantize(v, cache_dtype)
    scale = 1 / math.sqrt(head_dim)
    out = torch.full_like(q, -7.0)
    cpa.paged_decode_attention(q, kc, vc, tables, lens_t, rows, scale, out, k_scale=ks, v_scale=vs)
    per = (lambda s: s[..., None]) if ks.dim() == 3 else (lambda s: s[:, None])
    want = _oracle(q, kc.double() * per(ks.double()), vc.double() * per(vs.double()), tables, lens_t, rows, scale)
    for r in range(q.shape[0]):
        if r in want:
            err = (out[r].double() - want[r]).abs().max().item()
            assert err < 2e-6, (r, err)
        else:
            assert torch.all(out[r] == -7.0)
    # Each block is dequantized once (ref_dequantize's code x scale in fp32) and attended as an fp32 block: the
    # same bits as the kernel over the dequantized fp32 cache.
    kf, vf = ref_dequantize(kc, ks).contiguous(), ref_dequantize(vc, vs).contiguous()
    out32 = torch.full_like(q, -7.0)
    cpa.paged_decode_attention(q, kf, vf, tables, lens_t, rows, scale, out32)
    assert torch.equal(out, out32)
    if cache_dtype == torch.int8:  # the per-KV-head form on int8 codes
        ks_h, vs_h = ks.amax(dim=(0, 1)).contiguous(), vs.amax(dim=(0, 1)).contiguous()
        cpa.paged_decode_attention(q, kc, vc, tables, lens_t, rows, scale, out, k_scale=ks_h, v_scale=vs_h)
        want = _oracle(q, kc.double() * ks_h.double()[:, None], vc.double() * vs_h.double()[:, None], tables, lens_t,
                       rows, scale)
        assert max((out[r].double() - w).abs().max().item() for r, w in want.items()) < 2e-6


@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_quantized_cache_rows_ignore_batch_and_tree_rows_equal_their_chain(cache_dtype):
    """A quantized-cache row alone equals itself in a batch, bit for bit; a prefill chunk's rows run as items
    (row t over ctx + t + 1 keys) equal the decode rows of the same positions; a tree row whose mask keeps a prefix
    of the region equals the causal row over those keys (the scratch path carries the per-slot scales)."""
    q, k, v, tables, lens, rows = _case([40, 200, 9, 123], 9, 3, 64, 16, torch.float32, seed=5)
    (kc, ks), (vc, vs) = _quantize(k, cache_dtype), _quantize(v, cache_dtype)
    kw = dict(k_scale=ks, v_scale=vs)
    full = torch.zeros_like(q)
    cpa.paged_decode_attention(q, kc, vc, tables, lens, rows, 0.125, full, **kw)
    for i in range(4):
        alone = torch.zeros_like(q)
        cpa.paged_decode_attention(q, kc, vc, tables[i:i + 1].contiguous(), lens[i:i + 1], rows[i:i + 1], 0.125,
                                   alone, **kw)
        assert torch.equal(alone[rows[i]], full[rows[i]])
    # Sequence 1 (200 keys): its last 20 positions as one chunk's rows, and as a tree region whose rows keep
    # every earlier region key (bits 2^(j+1) - 1): the same keys, so the same bits.
    n = 20
    qq = torch.randn(n, 9, 64, generator=torch.Generator().manual_seed(1))
    tab = tables[1:2].expand(n, -1).contiguous()
    row_lens = torch.arange(200 - n + 1, 201)
    chunk = torch.zeros_like(qq)
    cpa.paged_decode_attention(qq, kc, vc, tab, row_lens, torch.arange(n), 0.125, chunk, **kw)
    for t in (0, 7, n - 1):
        one = torch.zeros_like(qq)
        cpa.paged_decode_attention(qq, kc, vc, tab[t:t + 1].contiguous(), row_lens[t:t + 1], torch.tensor([t]), 0.125,
                                   one, **kw)
        assert torch.equal(one[t], chunk[t])
    tree = torch.zeros_like(qq)
    lo = torch.full((n,), 200 - n, dtype=torch.int64)
    bits = torch.tensor([(1 << (j + 1)) - 1 for j in range(n)], dtype=torch.int64)
    cpa.paged_decode_attention(qq, kc, vc, tab, row_lens, torch.arange(n), 0.125, tree, tree_lo=lo, tree_bits=bits,
                               **kw)
    assert torch.allclose(tree, chunk, rtol=0, atol=1e-6)
    hidden = bits.clone()
    hidden[5:] &= ~(1 << 3)  # rows past node 3 no longer see it: their results must move
    moved = torch.zeros_like(qq)
    cpa.paged_decode_attention(qq, kc, vc, tab, row_lens, torch.arange(n), 0.125, moved, tree_lo=lo, tree_bits=hidden,
                               **kw)
    assert torch.equal(moved[:5], tree[:5]) and not torch.allclose(moved[5:], tree[5:])


@pytest.mark.skipif(not detect_cpu_features().avx2_fma or shutil.which("g++") is None,
                    reason="needs an x86 CPU with AVX2 + FMA and g++")
@pytest.mark.parametrize("cache_dtype", [torch.int8, torch.float8_e4m3fn])
def test_avx2_build_quantized_cache_matches_its_dequantized_fp32_cache(avx2_library, monkeypatch, cache_dtype):
    """The library built without AVX-512 (a laptop's path, where the int8 batch-invariance defect was seen):
    quantized-cache rows equal the fp32 rows over the dequantized cache bit for bit and the float64 oracle within
    2e-6, and a row alone equals itself in a batch."""
    monkeypatch.setattr(cpa, "_library", lambda: avx2_library)
    q, k, v, tables, lens, rows = _case([1, 17, 300, 64], 9, 3, 64, 16, torch.float32, seed=7)
    (kc, ks), (vc, vs) = _quantize(k, cache_dtype), _quantize(v, cache_dtype)
    out, out32 = torch.zeros_like(q), torch.zeros_like(q)
    cpa.paged_decode_attention(q, kc, vc, tables, lens, rows, 0.125, out, k_scale=ks, v_scale=vs)
    kf, vf = ref_dequantize(kc, ks).contiguous(), ref_dequantize(vc, vs).contiguous()
    cpa.paged_decode_attention(q, kf, vf, tables, lens, rows, 0.125, out32)
    assert torch.equal(out, out32)
    want = _oracle(q, kf, vf, tables, lens, rows, 0.125)
    assert max((out[r].double() - w).abs().max().item() for r, w in want.items()) < 2e-6
    for i in range(4):
        alone = torch.zeros_like(q)
        cpa.paged_decode_attention(q, kc, vc, tables[i:i + 1].contiguous(), lens[i:i + 1], rows[i:i + 1], 0.125,
                                   alone, k_scale=ks, v_scale=vs)
        assert torch.equal(alone[rows[i]], out[rows[i]])


def test_every_e4m3_code_is_read_as_torch_reads_it():
    """The kernel's E4M3 decoding (integer arithmetic, no table) against torch's float8_e4m3fn cast, all 256 codes:
    a one-key row with a zero query outputs V's row, the 256 codes times a unit scale (NaN codes stay NaN)."""
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    v = codes.view(1, 1, 1, 256).contiguous()
    k = torch.zeros(1, 1, 1, 256, dtype=torch.uint8).view(torch.float8_e4m3fn)
    out, one = torch.zeros(1, 1, 256), torch.ones(1)
    cpa.paged_decode_attention(torch.zeros(1, 1, 256), k, v, torch.zeros(1, 1, dtype=torch.int64),
                               torch.ones(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64), 0.1, out,
                               k_scale=one, v_scale=one)
    want = codes.float()
    assert torch.equal(out[0, 0].isnan(), want.isnan()) and int(want.isnan().sum()) == 2
    assert torch.equal(out[0, 0][~want.isnan()], want[~want.isnan()])


def test_quantized_cache_scales_are_checked():
    q, k, v, tables, lens, rows = _case([10], 9, 3, 64, 16, torch.float32)
    (kc, ks), (vc, vs) = _quantize(k, torch.int8), _quantize(v, torch.int8)
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match=r"needs k_scale as contiguous float32 \[4, 16, 3\] \(per slot\) or \[3\]"):
        cpa.paged_decode_attention(q, kc, vc, tables, lens, rows, 0.1, out)
    with pytest.raises(ValueError, match="needs v_scale"):
        cpa.paged_decode_attention(q, kc, vc, tables, lens, rows, 0.1, out, k_scale=ks, v_scale=vs.double())
    with pytest.raises(ValueError, match="must have one form"):
        cpa.paged_decode_attention(q, kc, vc, tables, lens, rows, 0.1, out, k_scale=ks,
                                   v_scale=vs.amax(dim=(0, 1)).contiguous())
    with pytest.raises(ValueError, match="go with an int8 or fp8 cache, not torch.float32"):
        cpa.paged_decode_attention(q, k, v, tables, lens, rows, 0.1, out, k_scale=ks, v_scale=vs)
    assert cpa.supports(9, 64, kc) and cpa.supports(9, 64, kc.view(torch.float8_e4m3fn))


def test_a_row_alone_equals_itself_in_a_batch():
    q, k, v, tables, lens, rows = _case([40, 200, 9, 123], 9, 3, 64, 16, torch.float32, seed=5)
    full = torch.zeros_like(q)
    cpa.paged_decode_attention(q, k, v, tables, lens, rows, 0.125, full)
    for i in range(4):
        alone = torch.zeros_like(q)
        cpa.paged_decode_attention(q, k, v, tables[i:i + 1].contiguous(), lens[i:i + 1], rows[i:i + 1], 0.125,
                                   alone)
        assert torch.equal(alone[rows[i]], full[rows[i]])


def test_refuses_what_it_cannot_run():
    q, k, v, tables, lens, rows = _case([10], 9, 3, 64, 16, torch.float32)
    out = torch.zeros_like(q)
    with pytest.raises(ValueError, match="block_tables must be contiguous torch.int64, got torch.int32"):
        cpa.paged_decode_attention(q, k, v, tables.int(), lens, rows, 0.1, out)
    with pytest.raises(ValueError, match="unsupported: q torch.bfloat16"):
        cpa.paged_decode_attention(q.bfloat16(), k, v, tables, lens, rows, 0.1, out)
    assert cpa.supports(9, 64, k) and not cpa.supports(9, 64, k.half())  # fp16 caches take the torch path
    assert not cpa.supports(9, 64, torch.zeros(4, 128, 3, 64))  # blocks above 64 tokens
    assert not cpa.supports(54, 64, k)  # 18 query heads per KV head


LP_TOL = 0.4  # nats: 1.7x the largest bf16-noise difference measured (0.23)


def test_bf16_engine_with_the_kernel_keeps_the_sdpa_path_tokens(monkeypatch):
    """The default model in bf16 on CPU (fp32 KV cache, as scripts/run.sh runs it): the C++ kernel's decode rows
    against the gathers + SDPA path. The two sum in different fp32 orders and the bf16 model rounds every layer's
    output to 8 bits of mantissa, so logprobs differ by bf16 noise (measured on the Xeon of 2026-12-04: tokens
    identical at all 96 positions, logprobs within 0.23 nats); tokens may part only at a near tie (LP_TOL)."""
    from roofline import LLM, SamplingParams
    from roofline.attention import torch_backend

    llm = LLM(device="cpu", dtype="bfloat16", kv_cache_dtype="float32", max_model_len=512,
              attention_backend="torch")
    llm.engine.worker.cpu_plan = None  # the modules (the plan calls the same kernel from C++: test_cpu_plan.py)
    prompts = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "List three colors:"]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=2)
    calls = []
    real = cpa.paged_decode_attention
    monkeypatch.setattr(cpa, "paged_decode_attention", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    got = llm.generate(prompts, sp, use_tqdm=False)
    assert len(calls) == 30 * 23  # every layer of every decode step (23 after the prefill's token)
    monkeypatch.setattr(cpa, "ENABLED", False)
    ref = llm.generate(prompts, sp, use_tqdm=False)
    assert len(calls) == 30 * 23 and torch_backend.TorchAttentionBackend._use_cpu_kernel is not None
    compared = 0
    for g, r in zip(got, ref, strict=True):
        for pos, (a, b) in enumerate(zip(g.outputs[0].token_ids, r.outputs[0].token_ids, strict=True)):
            lp = r.outputs[0].logprobs[pos]
            if a != b:  # a near tie of the bf16 model: the other token is the runner-up, within LP_TOL
                assert a in lp and lp[b].logprob - lp[a].logprob < LP_TOL, (pos, a, b, lp)
                break
            assert abs(g.outputs[0].logprobs[pos][a].logprob - lp[a].logprob) < LP_TOL
            compared += 1
    assert compared >= 0.75 * 4 * 24


@pytest.fixture
def fresh_build(monkeypatch):
    """``_build`` re-run under the test's environment, and forgotten afterwards."""
    cpa._build.cache_clear()
    yield monkeypatch
    cpa._build.cache_clear()


def test_an_unusable_cache_dir_or_a_corrupt_cached_file_still_builds(fresh_build, tmp_path):
    a_file = tmp_path / "not-a-dir"
    a_file.write_text("x")
    fresh_build.setenv("ROOFLINE_CACHE_DIR", str(a_file))  # mkdir fails: a private temporary directory instead
    assert cpa.unavailable_reason() is None
    cpa._build.cache_clear()
    cache = tmp_path / "cache"
    cache.mkdir()
    tag = __import__("hashlib").sha256(cpa._SOURCE.encode()).hexdigest()[:12]
    so = cache / f"cpu_paged_attention-{tag}-{cpa._cpu_key()}.so"
    so.write_bytes(b"truncated")  # a half-written or foreign file under the kernel's name (never loaded before)
    fresh_build.setenv("ROOFLINE_CACHE_DIR", str(cache))
    assert cpa.unavailable_reason() is None and so.stat().st_size > 1000  # rebuilt in place
    q, k, v, tables, lens, rows = _case([20], 9, 3, 64, 16, torch.float32)
    out = torch.zeros_like(q)
    cpa.paged_decode_attention(q, k, v, tables, lens, rows, 0.125, out)
    assert (out[rows[0]].double() - _oracle(q, k, v, tables, lens, rows, 0.125)[int(rows[0])]).abs().max() < 2e-6


def test_no_compiler_falls_back_to_sdpa_with_one_warning(fresh_build, caplog, tmp_path):
    from roofline import LLM, SamplingParams

    fresh_build.setenv("ROOFLINE_CACHE_DIR", str(tmp_path))  # nothing cached there (a cached build needs no compiler)
    fresh_build.setenv("CXX", "/nonexistent/g++")
    why = cpa.unavailable_reason()
    assert why is not None and why.startswith("the build failed (") and "/nonexistent/g++" in why
    llm = LLM(device="cpu", dtype="float32", max_model_len=256, attention_backend="torch")
    with caplog.at_level("WARNING"):
        out = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert any("the C++ kernel is not used" in r.getMessage() and "/nonexistent/g++" in r.getMessage()
               for r in caplog.records) or torch_backend_logged_before()


def torch_backend_logged_before() -> bool:
    """The warning is logged once per process: an earlier test may have taken it."""
    from roofline.attention.torch_backend import TorchAttentionBackend

    return getattr(TorchAttentionBackend, "_kernel_note_logged", False)
