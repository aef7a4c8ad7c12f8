"""Gluon (Hopper, sm_90) paged causal prefill attention: the @gluon.jit kernels only, no torch import, so the
ahead-of-time check (bench/gluon_aot_check.py) can compile them for sm_90 in a torch-free Triton 3.6 venv.
The wrapper, fallback rules and docs of the arguments live in ``roofline.kernels.gluon_prefill``.

Same math and masking as ``roofline.kernels.prefill_attention._prefill_kernel`` (query j of a chunk at
position ctx + j sees keys 0..ctx + j; FlashAttention-2's online softmax in log2 units), with Hopper's
asynchronous units spelled out (FlashAttention-3, Shah et al. 2024):

- one program = BLOCK_M (128) query rows of one head, ``num_warps`` 8 = two warpgroups of 64 rows each
  (the wgmma accumulator layout tiles M over 8 warps);
- Q: one TMA copy [BLOCK_M, D] from q viewed as [num_tokens, H * D] (rows past the chunk are other
  sequences' rows or TMA zero fill, never stored);
- K, V: a ring of NUM_STAGES shared-memory stages, one mbarrier per stage and operand, filled by TMA from
  the cache viewed as [num_slots, H_kv * D]; a BLOCK_N tile is BLOCK_N / PAGE_ROWS copies of PAGE_ROWS
  rows, PAGE_ROWS = min(block_size, BLOCK_N), each at [block_id * block_size + offset, kv_head * D];
- S = Q K^T: ``warpgroup_mma`` (async) from shared Q and K^T (a permuted view), fp32 accumulator;
- P (bf16/fp16, registers, the wgmma A operand layout) times V from shared memory accumulates into O in
  registers (fp32);
- keys every row of the tile may see run without a mask; the diagonal band (at most
  ceil(BLOCK_M / BLOCK_N) + 1 tiles) runs with the causal mask;
- the tile holding the sequence's end has stale cache rows past seq_len (possibly NaN): their V rows are
  zeroed in shared memory before the PV product (p = 0 there, but 0 * NaN = NaN).

Kernels (the first three with the same arguments and grid (cdiv(max_query_len, BLOCK_M), num_seqs, H), heaviest M
tiles first; the others add the tree-mask arguments, the persistent one its own grid):

- ``gluon_prefill_kernel`` ("plain"): per tile QK, softmax, PV in turn; the loads of tile i + NUM_STAGES are
  issued as soon as tile i's PV product has completed (NUM_STAGES - 1 tiles of K/V in flight behind the MMAs).
- ``gluon_prefill_kernel_pipelined``: FA3's intra-warpgroup overlap (S_j and P_{j-1} V_{j-1} in flight while
  the softmax of S_j runs), same in-line TMA issue.
- ``gluon_prefill_kernel_ws``: the pipelined consumers plus a 1-warp TMA loader partition (``gl.warp_specialize``)
  with per-stage empty mbarriers and register reallocation (setmaxnreg through ``maxnreg``).
- ``gluon_prefill_kernel_pingpong`` (VARIANT "pingpong"; "ws2" with PINGPONG False): FA3's inter-warpgroup
  ping-pong: the two consumer warpgroups are separate partitions of 64 rows whose GEMM issue alternates through
  hardware named barriers (bar.sync / bar.arrive 14 and 15), each with the intra-warpgroup overlap.
- ``gluon_prefill_kernel_persistent`` (VARIANT "persistent"): the ping-pong kernel on a persistent grid (one CTA
  per SM looping over (m-tile, seq, head) work items, heaviest causal m-tiles first).

The ws, pingpong / ws2 and persistent kernels also take the tree mask of speculative tree verification
(TREE, ``roofline.kernels.prefill_attention``'s semantics: a region key is visible to a region row only if its
bit is set in the row's int64 ancestor mask; tree keys go through the masked loop).

Not yet done: a TMA store of O, FP8 (E4M3) K/V.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared,
    mbarrier,
    tma,
    warpgroup_mma,
    warpgroup_mma_wait,
)


@gluon.jit
def _issue_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, bt_row, tile, seq_len, kv_col,
                   PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                   NUM_STAGES: gl.constexpr):
    """TMA copies of K and V tile ``tile`` (keys tile * BLOCK_N ...) into ring stage tile % NUM_STAGES."""
    stage = tile % NUM_STAGES
    k_dst = k_smem.index(stage)
    v_dst = v_smem.index(stage)
    k_bar = k_bars.index(stage)
    v_bar = v_bars.index(stage)
    mbarrier.expect(k_bar, BLOCK_N * k_desc.block_type.shape[1] * k_desc.dtype.primitive_bitwidth // 8)
    mbarrier.expect(v_bar, BLOCK_N * v_desc.block_type.shape[1] * v_desc.dtype.primitive_bitwidth // 8)
    start_n = tile * BLOCK_N
    last_block = (seq_len - 1) // PAGE  # block-table entries past the sequence may be garbage: clamp
    for c in gl.static_range(BLOCK_N // PAGE_ROWS):
        key = start_n + c * PAGE_ROWS
        page = gl.load(bt_row + gl.minimum(key // PAGE, last_block))
        row = page * PAGE + key % PAGE
        tma.async_copy_global_to_shared(k_desc, [row, kv_col], k_bar, k_dst.slice(c * PAGE_ROWS, PAGE_ROWS))
        tma.async_copy_global_to_shared(v_desc, [row, kv_col], v_bar, v_dst.slice(c * PAGE_ROWS, PAGE_ROWS))


@gluon.jit
def _attend_tile(q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, bt_row, tile, n_tiles, seq_len, kv_col,
                 acc, m_i, l_i, offs_m_pos, scale_log2e,
                 MASKED: gl.constexpr, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr,
                 s_layout: gl.constexpr, o_layout: gl.constexpr, num_warps: gl.constexpr):
    stage = tile % NUM_STAGES
    phase = (tile // NUM_STAGES) & 1
    k_buf = k_smem.index(stage)
    v_buf = v_smem.index(stage)

    # S = Q K^T (fp32, [BLOCK_M, BLOCK_N]); K^T is a transposed view of the [BLOCK_N, D] stage.
    mbarrier.wait(k_bars.index(stage), phase)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_smem, k_buf.permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))

    p, m_new, l_i, alpha = _softmax_step(s, m_i, l_i, tile, offs_m_pos, seq_len, scale_log2e, 0, 0, MASKED, False,
                                         BLOCK_N, s_layout)
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    p_op = gl.convert_layout(p.to(v_desc.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    mbarrier.wait(v_bars.index(stage), phase)
    if MASKED:
        _zero_v_tail(v_buf, tile, seq_len, BLOCK_N, num_warps)
    acc = warpgroup_mma(p_op, v_buf, acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))  # p's registers live until it lands

    # Both products of this stage are done: refill it with tile + NUM_STAGES.
    gl.thread_barrier()
    nxt = tile + NUM_STAGES
    if nxt < n_tiles:
        _issue_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, bt_row, nxt, seq_len, kv_col,
                       PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)
    return acc, m_new, l_i


@gluon.jit
def gluon_prefill_kernel(
    q_desc, k_desc, v_desc, Out, BlockTables, QueryStartLoc, SeqLens,
    scale_log2e, stride_ot, stride_oh, stride_bt,
    GROUP: gl.constexpr, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """Grid (cdiv(max_query_len, BLOCK_M), num_seqs, H); heaviest M tiles first (as the Triton kernel)."""
    seq = gl.program_id(1)
    head = gl.program_id(2)
    q_start = gl.load(QueryStartLoc + seq)
    q_len = gl.load(QueryStartLoc + seq + 1) - q_start
    m_block = gl.num_programs(0) - 1 - gl.program_id(0)
    m0 = m_block * BLOCK_M
    if m0 < q_len:
        seq_len = gl.load(SeqLens + seq)
        ctx = seq_len - q_len
        kv_head = head // GROUP
        kv_col = kv_head * HEAD_DIM
        bt_row = BlockTables + seq.to(gl.int64) * stride_bt

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
        fence_async_shared()

        # Keys < ctx + m0 + 1 are visible to every row of the tile; the band up to ctx + m0 + BLOCK_M is masked.
        n_full = (ctx + m0 + 1) // BLOCK_N
        n_tiles = gl.cdiv(gl.minimum(seq_len, ctx + m0 + BLOCK_M), BLOCK_N)

        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_start + m0, head * HEAD_DIM], q_bar, q_smem)
        for i in gl.static_range(NUM_STAGES):
            if i < n_tiles:
                _issue_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, bt_row, i, seq_len, kv_col,
                               PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)

        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        offs_m_pos = ctx + offs_m
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        mbarrier.wait(q_bar, 0)

        for tile in range(0, n_full):
            acc, m_i, l_i = _attend_tile(
                q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, bt_row, tile, n_tiles, seq_len, kv_col,
                acc, m_i, l_i, offs_m_pos, scale_log2e,
                False, PAGE, PAGE_ROWS, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, s_layout, o_layout, num_warps)
        for tile in range(n_full, n_tiles):
            acc, m_i, l_i = _attend_tile(
                q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, bt_row, tile, n_tiles, seq_len, kv_col,
                acc, m_i, l_i, offs_m_pos, scale_log2e,
                True, PAGE, PAGE_ROWS, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, s_layout, o_layout, num_warps)

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))

        # Every valid row saw key 0 at least (l_i > 0); rows past the chunk are not stored.
        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = acc / l_o[:, None]
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        ptrs = Out + (q_start + rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
        gl.store(ptrs, out.to(Out.dtype.element_ty), mask=(rows < q_len)[:, None])


# ------------------------------------------------------------------------------------------------------------
# Pipelined variant (FA3's intra-warpgroup overlap, Shah et al. 2024, Algorithm 2): while the tensor cores run
# S_j = Q K_j^T and O += P_{j-1} V_{j-1} (both issued async), the warpgroup waits only for S_j and computes its
# softmax; O is rescaled after the PV product lands. P of the previous tile stays in registers across the
# iteration, so BLOCK_N 64 keeps the register budget (S 32 + P 16 + O 64 fp32/bf16 registers per thread).


@gluon.jit
def _zero_v_tail(v_buf, tile, seq_len, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """Zero the V rows of ``tile`` at or past seq_len (stale cache slots, maybe NaN) in shared memory."""
    if tile * BLOCK_N + BLOCK_N > seq_len:
        v_reg_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        v_rows = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, v_reg_layout))
        v_val = v_buf.load(v_reg_layout)
        v_val = gl.where((v_rows < seq_len)[:, None], v_val, gl.zeros_like(v_val))
        v_buf.store(v_val)
        fence_async_shared()
        gl.thread_barrier()


@gluon.jit
def _softmax_step(s, m_i, l_i, tile, offs_m_pos, seq_len, scale_log2e, tree_bits, tree_start, MASKED: gl.constexpr,
                  TREE: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Online softmax of one S tile (log2 units): returns p, the new max, the new sum and the rescale alpha.
    TREE (masked tiles only): a key at tree-region index a = key - tree_start >= 0 is visible to a row only if
    bit a of the row's ``tree_bits`` (int64 [rows], -1 for rows before the region) is set, as the Triton
    kernel's tree mask (``roofline.kernels.prefill_attention``); a row may then see no key of a tile, so its max
    stays -inf and 0 is subtracted instead."""
    if MASKED:
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = (offs_n[None, :] <= offs_m_pos[:, None]) & (offs_n[None, :] < seq_len)
        if TREE:
            rel = offs_n - tree_start  # [BLOCK_N] key index inside the tree region (< 0: the prefix)
            shift = gl.minimum(gl.maximum(rel, 0), 63).to(gl.int64)
            bit = (tree_bits[:, None] >> shift[None, :]) & 1
            visible = visible & ((rel[None, :] < 0) | (bit != 0))
        s = gl.where(visible, s * scale_log2e, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        if TREE:
            m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)
        else:
            m_sub = m_new
        s = s - m_sub[:, None]
    else:
        m_new = gl.maximum(m_i, gl.max(s, axis=1) * scale_log2e)
        m_sub = m_new
        s = s * scale_log2e - m_new[:, None]
    p = gl.exp2(s)
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _pipelined_step(q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, bt_row, tile, n_tiles, seq_len,
                    kv_col, acc, m_i, l_i, p_prev, offs_m_pos, scale_log2e, empty_bars, tree_bits, tree_start,
                    MASKED: gl.constexpr, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, s_layout: gl.constexpr,
                    o_layout: gl.constexpr, num_warps: gl.constexpr, WS: gl.constexpr, TREE: gl.constexpr):
    """Tile ``tile`` >= 1: S_tile and O += P_{tile-1} V_{tile-1} in flight together, softmax of S_tile.
    WS: a loader partition refills the ring; the freed stage is signalled on ``empty_bars`` instead."""
    stage = tile % NUM_STAGES
    prev = (tile - 1) % NUM_STAGES
    mbarrier.wait(k_bars.index(stage), (tile // NUM_STAGES) & 1)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
    mbarrier.wait(v_bars.index(prev), ((tile - 1) // NUM_STAGES) & 1)
    _zero_v_tail(v_smem.index(prev), tile - 1, seq_len, BLOCK_N, num_warps)
    acc = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # S lands first (issued first)
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, tile, offs_m_pos, seq_len, scale_log2e, tree_bits, tree_start,
                                       MASKED, TREE, BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(v_desc.dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    acc, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_prev))  # p_prev read by the async PV
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    # Tile - 1's stage is consumed by both warpgroups: refill it with tile - 1 + NUM_STAGES.
    gl.thread_barrier()
    if WS:
        mbarrier.arrive(empty_bars.index(prev), count=1)
    else:
        nxt = tile - 1 + NUM_STAGES
        if nxt < n_tiles:
            _issue_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, bt_row, nxt, seq_len, kv_col,
                           PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)
    return acc, m_i, l_i, p_op


@gluon.jit
def _first_tile(q_smem, k_smem, k_bars, offs_m_pos, seq_len, scale_log2e, tree_bits, tree_start, MASKED: gl.constexpr,
                TREE: gl.constexpr,
                BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, s_layout: gl.constexpr, o_layout: gl.constexpr,
                dtype: gl.constexpr):
    mbarrier.wait(k_bars.index(0), 0)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_smem, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, 0, offs_m_pos, seq_len, scale_log2e, tree_bits, tree_start,
                                       MASKED, TREE, BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    return p_op, m_i, l_i


@gluon.jit
def gluon_prefill_kernel_pipelined(
    q_desc, k_desc, v_desc, Out, BlockTables, QueryStartLoc, SeqLens,
    scale_log2e, stride_ot, stride_oh, stride_bt,
    GROUP: gl.constexpr, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
):
    """As ``gluon_prefill_kernel`` (same arguments and grid), with the QK / PV products of consecutive tiles
    overlapped with the softmax (module section above). NUM_STAGES >= 3 lets the refill of tile j + 2 land while
    tile j + 1 is being consumed."""
    seq = gl.program_id(1)
    head = gl.program_id(2)
    q_start = gl.load(QueryStartLoc + seq)
    q_len = gl.load(QueryStartLoc + seq + 1) - q_start
    m_block = gl.num_programs(0) - 1 - gl.program_id(0)
    m0 = m_block * BLOCK_M
    if m0 < q_len:
        seq_len = gl.load(SeqLens + seq)
        ctx = seq_len - q_len
        kv_head = head // GROUP
        kv_col = kv_head * HEAD_DIM
        bt_row = BlockTables + seq.to(gl.int64) * stride_bt

        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 16])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 16])

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
        fence_async_shared()

        n_full = (ctx + m0 + 1) // BLOCK_N
        n_tiles = gl.cdiv(gl.minimum(seq_len, ctx + m0 + BLOCK_M), BLOCK_N)

        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_start + m0, head * HEAD_DIM], q_bar, q_smem)
        for i in gl.static_range(NUM_STAGES):
            if i < n_tiles:
                _issue_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, bt_row, i, seq_len, kv_col,
                               PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)

        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        offs_m_pos = ctx + offs_m
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        mbarrier.wait(q_bar, 0)

        if n_full > 0:
            p_op, m_i, l_i = _first_tile(q_smem, k_smem, k_bars, offs_m_pos, seq_len, scale_log2e, 0, 0, False, False,
                                         BLOCK_M, BLOCK_N, s_layout, o_layout, v_desc.dtype)
        else:
            p_op, m_i, l_i = _first_tile(q_smem, k_smem, k_bars, offs_m_pos, seq_len, scale_log2e, 0, 0, True, False,
                                         BLOCK_M, BLOCK_N, s_layout, o_layout, v_desc.dtype)
        for tile in range(1, n_full):
            acc, m_i, l_i, p_op = _pipelined_step(
                q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, bt_row, tile, n_tiles, seq_len, kv_col,
                acc, m_i, l_i, p_op, offs_m_pos, scale_log2e, k_bars, 0, 0,
                False, PAGE, PAGE_ROWS, BLOCK_M, BLOCK_N, NUM_STAGES, s_layout, o_layout, num_warps, False, False)
        for tile in range(gl.maximum(n_full, 1), n_tiles):
            acc, m_i, l_i, p_op = _pipelined_step(
                q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, bt_row, tile, n_tiles, seq_len, kv_col,
                acc, m_i, l_i, p_op, offs_m_pos, scale_log2e, k_bars, 0, 0,
                True, PAGE, PAGE_ROWS, BLOCK_M, BLOCK_N, NUM_STAGES, s_layout, o_layout, num_warps, False, False)
        # The last tile's PV product.
        last = n_tiles - 1
        mbarrier.wait(v_bars.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
        _zero_v_tail(v_smem.index(last % NUM_STAGES), last, seq_len, BLOCK_N, num_warps)
        acc = warpgroup_mma(p_op, v_smem.index(last % NUM_STAGES), acc, is_async=True)
        acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))

        l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
        out = acc / l_o[:, None]
        rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
        ptrs = Out + (q_start + rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
        gl.store(ptrs, out.to(Out.dtype.element_ty), mask=(rows < q_len)[:, None])


# ------------------------------------------------------------------------------------------------------------
# Warp-specialized variant (FA3's producer/consumer split): a 1-warp loader partition issues every K/V TMA copy
# into the ring, waiting on per-stage "empty" mbarriers; the default partition (the two consumer warpgroups)
# runs the pipelined loop above and arrives on a stage's empty barrier once both warpgroups' PV product of it
# has landed. Register budgets: the loader 32 per thread, the consumers what ``maxnreg`` leaves (the wrapper
# passes maxnreg=168: (168 * 12 warps * 32 - 32 * 4 warps * 32) / 256 = 240 per consumer thread).


@gluon.jit
def _load_tree_bits(tree_row, offs_m, offs_m_pos, q_len, tree_start, TREE: gl.constexpr):
    """Each row's tree ancestor bitmask (int64 [rows]): tree_mask[seq, row - region start] for rows in the tree
    region, -1 (every key, plain causal) for the rows before it and past the chunk. 0 (unused) without TREE."""
    if TREE:
        rel_m = offs_m_pos - tree_start
        bits = gl.load(tree_row + gl.maximum(rel_m, 0), mask=(offs_m < q_len) & (rel_m >= 0), other=-1)
    else:
        bits = 0
    return bits


@gluon.jit
def _ws_loader(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, bt_row, n_tiles, seq_len, kv_col,
               PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    for tile in range(0, n_tiles):
        stage = tile % NUM_STAGES
        # Barriers start in phase 0 not completed: waiting on parity 1 passes at once (the ring starts empty).
        mbarrier.wait(empty_bars.index(stage), ((tile // NUM_STAGES) & 1) ^ 1)
        _issue_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, bt_row, tile, seq_len, kv_col,
                       PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)


@gluon.jit
def _ws_consumer(q_smem, k_smem, v_smem, k_bars, v_bars, empty_bars, q_bar, k_desc, v_desc, bt_row, Out,
                 n_full, n_tiles, seq_len, kv_col, ctx, m0, q_start, q_len, head, stride_ot, stride_oh,
                 scale_log2e, tree_row, tree_start,
                 TREE: gl.constexpr, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr,
                 BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr):
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
    offs_m_pos = ctx + offs_m
    tree_bits = _load_tree_bits(tree_row, offs_m, offs_m_pos, q_len, tree_start, TREE)
    acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    mbarrier.wait(q_bar, 0)
    if n_full > 0:
        p_op, m_i, l_i = _first_tile(q_smem, k_smem, k_bars, offs_m_pos, seq_len, scale_log2e, tree_bits, tree_start,
                                     False, TREE,
                                     BLOCK_M, BLOCK_N, s_layout, o_layout, v_desc.dtype)
    else:
        p_op, m_i, l_i = _first_tile(q_smem, k_smem, k_bars, offs_m_pos, seq_len, scale_log2e, tree_bits, tree_start,
                                     True, TREE,
                                     BLOCK_M, BLOCK_N, s_layout, o_layout, v_desc.dtype)
    for tile in range(1, n_full):
        acc, m_i, l_i, p_op = _pipelined_step(
            q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, bt_row, tile, n_tiles, seq_len, kv_col,
            acc, m_i, l_i, p_op, offs_m_pos, scale_log2e, empty_bars, tree_bits, tree_start,
            False, PAGE, PAGE_ROWS, BLOCK_M, BLOCK_N, NUM_STAGES, s_layout, o_layout, num_warps, True, TREE)
    for tile in range(gl.maximum(n_full, 1), n_tiles):
        acc, m_i, l_i, p_op = _pipelined_step(
            q_smem, k_smem, v_smem, k_bars, v_bars, k_desc, v_desc, bt_row, tile, n_tiles, seq_len, kv_col,
            acc, m_i, l_i, p_op, offs_m_pos, scale_log2e, empty_bars, tree_bits, tree_start,
            True, PAGE, PAGE_ROWS, BLOCK_M, BLOCK_N, NUM_STAGES, s_layout, o_layout, num_warps, True, TREE)
    last = n_tiles - 1
    mbarrier.wait(v_bars.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
    _zero_v_tail(v_smem.index(last % NUM_STAGES), last, seq_len, BLOCK_N, num_warps)
    acc = warpgroup_mma(p_op, v_smem.index(last % NUM_STAGES), acc, is_async=True)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc / l_o[:, None]
    rows = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = Out + (q_start + rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
    gl.store(ptrs, out.to(Out.dtype.element_ty), mask=(rows < q_len)[:, None])


@gluon.jit
def gluon_prefill_kernel_ws(
    q_desc, k_desc, v_desc, Out, BlockTables, QueryStartLoc, SeqLens,
    scale_log2e, stride_ot, stride_oh, stride_bt, TreeMask, stride_tm,
    GROUP: gl.constexpr, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
    TREE: gl.constexpr, TREE_ROWS: gl.constexpr,
):
    """As ``gluon_prefill_kernel`` (same grid), warp-specialized (section above). TreeMask [num_seqs, TREE_ROWS]
    int64 (row stride stride_tm) when TREE: the tree mask of ``roofline.kernels.prefill_attention`` (any pointer
    otherwise)."""
    seq = gl.program_id(1)
    head = gl.program_id(2)
    q_start = gl.load(QueryStartLoc + seq)
    q_len = gl.load(QueryStartLoc + seq + 1) - q_start
    m_block = gl.num_programs(0) - 1 - gl.program_id(0)
    m0 = m_block * BLOCK_M
    if m0 < q_len:
        seq_len = gl.load(SeqLens + seq)
        ctx = seq_len - q_len
        kv_col = (head // GROUP) * HEAD_DIM
        bt_row = BlockTables + seq.to(gl.int64) * stride_bt

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        empty_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
            mbarrier.init(empty_bars.index(i), count=1)
        fence_async_shared()

        n_full = (ctx + m0 + 1) // BLOCK_N
        n_tiles = gl.cdiv(gl.minimum(seq_len, ctx + m0 + BLOCK_M), BLOCK_N)
        tree_start = seq_len - gl.minimum(q_len, TREE_ROWS)  # first key of the tree region (TREE only)
        if TREE:  # tree keys go through the masked loop
            n_full = gl.minimum(n_full, tree_start // BLOCK_N)
        tree_row = TreeMask + seq.to(gl.int64) * stride_tm
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_start + m0, head * HEAD_DIM], q_bar, q_smem)

        gl.warp_specialize([
            (_ws_consumer, (q_smem, k_smem, v_smem, k_bars, v_bars, empty_bars, q_bar, k_desc, v_desc, bt_row, Out,
                            n_full, n_tiles, seq_len, kv_col, ctx, m0, q_start, q_len, head, stride_ot, stride_oh,
                            scale_log2e, tree_row, tree_start, TREE, PAGE, PAGE_ROWS, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES, num_warps)),
            (_ws_loader, (k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, bt_row, n_tiles, seq_len,
                          kv_col, PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)),
        ], [1], [32])


# ------------------------------------------------------------------------------------------------------------
# Ping-pong variant (FA3, Shah et al. 2024, section 3.1 "pingpong scheduling" and Algorithm 2): the two consumer
# warpgroups are separate partitions of 64 rows each (the default partition = warpgroup 0, a 4-warp worker =
# warpgroup 1) plus the TMA loader; named barriers order their GEMM issue so that warpgroup 0 issues its QK / PV
# products, then warpgroup 1, then warpgroup 0 ...: while one warpgroup runs its softmax (exp2 on the SFU) the
# tensor cores run the other's products. Inside each warpgroup the QK of tile j and PV of tile j - 1 are in
# flight together during the softmax of tile j (the pipelined step above).
#
# Barrier protocol (hardware named barriers 14 + w, 256 threads = both warpgroups): warpgroup w runs
# K = n_tiles + 1 "GEMM sections" (each: wait for its turn with bar.sync 14 + w, issue the async wgmmas, then
# bar.arrive 15 - w to hand the turn over). Warpgroup 1 arrives once on barrier 14 before its first section and
# skips the hand-over after its last one, so each barrier gets exactly K syncs and K arrivals (nothing pending at
# exit). Ids 14 / 15: Triton's own partition barriers (gl.thread_barrier in a partition) use low ids.
# Registers: the launch passes maxnreg=168 (3 warpgroups x 128 threads x 168 = 64512 of the 65536-entry file);
# the partitions' setmaxnreg budgets are 240 (each consumer warpgroup) and 24 (the loader).
# The ring's empty barriers count 2 arrivals per stage (one per warpgroup), separately for K (released once the
# QK product landed) and V (once the PV product landed), as FA3's two pipelines. _zero_v_tail runs in both
# warpgroups on the last tile: both write the same zeros (benign), each before its own PV product.


@gluon.jit
def _issue_one(desc, smem, bars, bt_row, tile, slot, seq_len, kv_col, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr,
               BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """TMA copies of one operand (K or V) of tile ``tile`` into ring stage slot % NUM_STAGES."""
    stage = slot % NUM_STAGES
    dst = smem.index(stage)
    bar = bars.index(stage)
    mbarrier.expect(bar, BLOCK_N * desc.block_type.shape[1] * desc.dtype.primitive_bitwidth // 8)
    start_n = tile * BLOCK_N
    last_block = (seq_len - 1) // PAGE  # block-table entries past the sequence may be garbage: clamp
    for c in gl.static_range(BLOCK_N // PAGE_ROWS):
        key = start_n + c * PAGE_ROWS
        page = gl.load(bt_row + gl.minimum(key // PAGE, last_block))
        tma.async_copy_global_to_shared(desc, [page * PAGE + key % PAGE, kv_col], bar,
                                        dst.slice(c * PAGE_ROWS, PAGE_ROWS))


@gluon.jit
def _pp_issue_tile(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, bt_row, tile, slot, seq_len, kv_col,
                   PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Loader side of the split K / V ring: K of ``tile`` once both warpgroups released the stage's K (their QK
    product landed: empty_bars[stage]), V once they released its V (PV landed: empty_bars[NUM_STAGES + stage])."""
    stage = slot % NUM_STAGES
    parity = ((slot // NUM_STAGES) & 1) ^ 1  # barriers start in phase 0: parity 1 passes at once (empty ring)
    mbarrier.wait(empty_bars.index(stage), parity)
    _issue_one(k_desc, k_smem, k_bars, bt_row, tile, slot, seq_len, kv_col, PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)
    mbarrier.wait(empty_bars.index(NUM_STAGES + stage), parity)
    _issue_one(v_desc, v_smem, v_bars, bt_row, tile, slot, seq_len, kv_col, PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)


@gluon.jit
def _pp_loader(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, bt_row, n_tiles, seq_len, kv_col,
               PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    for tile in range(0, n_tiles):
        _pp_issue_tile(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, bt_row, tile, tile, seq_len,
                       kv_col, PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)


@gluon.jit
def _pp_wait_turn(WG: gl.constexpr):
    """bar.sync on warpgroup WG's named barrier (14 + WG): returns once the other warpgroup handed over."""
    if WG == 0:
        gl.inline_asm_elementwise("bar.sync 14, 256; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
    else:
        gl.inline_asm_elementwise("bar.sync 15, 256; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _pp_hand_over(WG: gl.constexpr):
    """bar.arrive on the other warpgroup's named barrier (non-blocking)."""
    if WG == 0:
        gl.inline_asm_elementwise("bar.arrive 15, 256; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)
    else:
        gl.inline_asm_elementwise("bar.arrive 14, 256; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False,
                                  pack=1)


@gluon.jit
def _pp_step(q_smem, k_smem, v_smem, k_bars, v_bars, empty_bars, tile, seq_len, acc, m_i, l_i, p_prev,
             offs_m_pos, scale_log2e, tree_bits, tree_start, ring, MASKED: gl.constexpr, TREE: gl.constexpr,
             WG: gl.constexpr, PINGPONG: gl.constexpr,
             BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, s_layout: gl.constexpr,
             o_layout: gl.constexpr, dtype: gl.constexpr):
    """One warpgroup's tile ``tile`` >= 1 (64 rows): S_tile and O += P_{tile-1} V_{tile-1} issued in its turn,
    softmax of S_tile while the other warpgroup's products run. ``ring``: the ring slot of this item's tile 0
    (0 unless persistent: the ring's stages and phases run on across work items)."""
    slot = ring + tile
    stage = slot % NUM_STAGES
    prev = (slot - 1) % NUM_STAGES
    mbarrier.wait(k_bars.index(stage), (slot // NUM_STAGES) & 1)
    mbarrier.wait(v_bars.index(prev), ((slot - 1) // NUM_STAGES) & 1)
    if MASKED:
        _zero_v_tail(v_smem.index(prev), tile - 1, seq_len, BLOCK_N, 4)
    if PINGPONG:
        _pp_wait_turn(WG)
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_smem, k_smem.index(stage).permute((1, 0)), s, use_acc=False, is_async=True)
    acc = warpgroup_mma(p_prev, v_smem.index(prev), acc, is_async=True)
    if PINGPONG:
        _pp_hand_over(WG)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
    gl.thread_barrier()  # this warpgroup's 4 warps are done with K of stage `stage`: the loader may refill it
    mbarrier.arrive(empty_bars.index(stage), count=1)
    p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, tile, offs_m_pos, seq_len, scale_log2e, tree_bits, tree_start,
                                       MASKED, TREE, BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
    acc, p_prev = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_prev))
    acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    gl.thread_barrier()  # ... and with V of stage prev
    mbarrier.arrive(empty_bars.index(NUM_STAGES + prev), count=1)
    return acc, m_i, l_i, p_op


@gluon.jit
def _pp_consumer(q_smem, k_smem, v_smem, k_bars, v_bars, empty_bars, q_bar, Out, n_full, n_tiles, seq_len, ctx,
                 m0, q_start, q_len, head, stride_ot, stride_oh, scale_log2e, tree_row, tree_start,
                 WG: gl.constexpr, PINGPONG: gl.constexpr, TREE: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr,
                 NUM_STAGES: gl.constexpr):
    """Warpgroup WG (4 warps) of the ping-pong kernel: rows m0 + 64 WG ... m0 + 64 WG + 63 of the tile."""
    HALF: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    dtype: gl.constexpr = q_smem.dtype
    q_half = q_smem.slice(WG * HALF, HALF)  # [64, D]
    r0 = m0 + WG * HALF
    offs_m = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    offs_m_pos = ctx + offs_m
    tree_bits = _load_tree_bits(tree_row, offs_m, offs_m_pos, q_len, tree_start, TREE)
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_layout))
    if PINGPONG:
        if WG == 1:
            _pp_hand_over(WG)  # warpgroup 0 goes first
    mbarrier.wait(q_bar, 0)

    # Tile 0: S only (no previous P).
    mbarrier.wait(k_bars.index(0), 0)
    if PINGPONG:
        _pp_wait_turn(WG)
    s = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_half, k_smem.index(0).permute((1, 0)), s, use_acc=False, is_async=True)
    if PINGPONG:
        _pp_hand_over(WG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    gl.thread_barrier()
    mbarrier.arrive(empty_bars.index(0), count=1)  # K of stage 0 consumed
    if n_full > 0:
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, 0, offs_m_pos, seq_len, scale_log2e, tree_bits, tree_start,
                                           False, TREE, BLOCK_N, s_layout)
    else:
        p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, 0, offs_m_pos, seq_len, scale_log2e, tree_bits, tree_start,
                                           True, TREE, BLOCK_N, s_layout)
    p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))

    for tile in range(1, n_full):
        acc, m_i, l_i, p_op = _pp_step(q_half, k_smem, v_smem, k_bars, v_bars, empty_bars, tile, seq_len, acc, m_i,
                                       l_i, p_op, offs_m_pos, scale_log2e, tree_bits, tree_start, 0, False, TREE, WG,
                                       PINGPONG, HALF, BLOCK_N,
                                       NUM_STAGES, s_layout, o_layout, dtype)
    for tile in range(gl.maximum(n_full, 1), n_tiles):
        acc, m_i, l_i, p_op = _pp_step(q_half, k_smem, v_smem, k_bars, v_bars, empty_bars, tile, seq_len, acc, m_i,
                                       l_i, p_op, offs_m_pos, scale_log2e, tree_bits, tree_start, 0, True, TREE, WG,
                                       PINGPONG, HALF, BLOCK_N,
                                       NUM_STAGES, s_layout, o_layout, dtype)

    # The last tile's PV product: the (n_tiles + 1)-th section; warpgroup 1 does not hand over after it.
    last = n_tiles - 1
    mbarrier.wait(v_bars.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
    _zero_v_tail(v_smem.index(last % NUM_STAGES), last, seq_len, BLOCK_N, 4)
    if PINGPONG:
        _pp_wait_turn(WG)
    acc = warpgroup_mma(p_op, v_smem.index(last % NUM_STAGES), acc, is_async=True)
    if PINGPONG:
        if WG == 0:
            _pp_hand_over(WG)
    acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))

    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc / l_o[:, None]
    rows = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = Out + (q_start + rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
    gl.store(ptrs, out.to(Out.dtype.element_ty), mask=(rows < q_len)[:, None])


@gluon.jit
def _pp_consumer1(q_smem, k_smem, v_smem, k_bars, v_bars, empty_bars, q_bar, Out, n_full, n_tiles, seq_len, ctx,
                  m0, q_start, q_len, head, stride_ot, stride_oh, scale_log2e, tree_row, tree_start,
                  PINGPONG: gl.constexpr, TREE: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    _pp_consumer(q_smem, k_smem, v_smem, k_bars, v_bars, empty_bars, q_bar, Out, n_full, n_tiles, seq_len, ctx,
                 m0, q_start, q_len, head, stride_ot, stride_oh, scale_log2e, tree_row, tree_start,
                 1, PINGPONG, TREE, HEAD_DIM, BLOCK_N, NUM_STAGES)


@gluon.jit
def _pp_consumer0(q_smem, k_smem, v_smem, k_bars, v_bars, empty_bars, q_bar, Out, n_full, n_tiles, seq_len, ctx,
                  m0, q_start, q_len, head, stride_ot, stride_oh, scale_log2e, tree_row, tree_start,
                  PINGPONG: gl.constexpr, TREE: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    _pp_consumer(q_smem, k_smem, v_smem, k_bars, v_bars, empty_bars, q_bar, Out, n_full, n_tiles, seq_len, ctx,
                 m0, q_start, q_len, head, stride_ot, stride_oh, scale_log2e, tree_row, tree_start,
                 0, PINGPONG, TREE, HEAD_DIM, BLOCK_N, NUM_STAGES)


@gluon.jit
def gluon_prefill_kernel_pingpong(
    q_desc, k_desc, v_desc, Out, BlockTables, QueryStartLoc, SeqLens,
    scale_log2e, stride_ot, stride_oh, stride_bt, TreeMask, stride_tm,
    GROUP: gl.constexpr, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
    TREE: gl.constexpr, TREE_ROWS: gl.constexpr, PINGPONG: gl.constexpr,
):
    """As ``gluon_prefill_kernel`` (same arguments and grid; BLOCK_M 128, launched with num_warps 4: the default
    partition is warpgroup 0, the workers warpgroup 1 (4 warps) and the loader (1 warp)). PINGPONG False drops
    the named barriers (two free-running consumer warpgroups: the "ws2" variant, for comparison)."""
    seq = gl.program_id(1)
    head = gl.program_id(2)
    q_start = gl.load(QueryStartLoc + seq)
    q_len = gl.load(QueryStartLoc + seq + 1) - q_start
    m_block = gl.num_programs(0) - 1 - gl.program_id(0)
    m0 = m_block * BLOCK_M
    if m0 < q_len:
        seq_len = gl.load(SeqLens + seq)
        ctx = seq_len - q_len
        kv_col = (head // GROUP) * HEAD_DIM
        bt_row = BlockTables + seq.to(gl.int64) * stride_bt

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        # empty_bars[stage]: K of the stage free, empty_bars[NUM_STAGES + stage]: its V free (FA3's separate K / V
        # pipelines: K of tile j + NUM_STAGES loads once QK_j landed, before PV_j is done)
        empty_bars = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
            mbarrier.init(empty_bars.index(i), count=2)  # one arrival per consumer warpgroup
            mbarrier.init(empty_bars.index(NUM_STAGES + i), count=2)
        fence_async_shared()

        n_full = (ctx + m0 + 1) // BLOCK_N
        n_tiles = gl.cdiv(gl.minimum(seq_len, ctx + m0 + BLOCK_M), BLOCK_N)
        tree_start = seq_len - gl.minimum(q_len, TREE_ROWS)  # first key of the tree region (TREE only)
        if TREE:  # tree keys go through the masked loop
            n_full = gl.minimum(n_full, tree_start // BLOCK_N)
        tree_row = TreeMask + seq.to(gl.int64) * stride_tm
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_start + m0, head * HEAD_DIM], q_bar, q_smem)

        # (the argument tuples are spelled out: a tuple variable would turn the constexprs into tensors)
        gl.warp_specialize([
            (_pp_consumer0, (q_smem, k_smem, v_smem, k_bars, v_bars, empty_bars, q_bar, Out, n_full, n_tiles, seq_len, ctx,
                             m0, q_start, q_len, head, stride_ot, stride_oh, scale_log2e, tree_row, tree_start,
                             PINGPONG, TREE, HEAD_DIM, BLOCK_N, NUM_STAGES)),
            (_pp_consumer1, (q_smem, k_smem, v_smem, k_bars, v_bars, empty_bars, q_bar, Out, n_full, n_tiles, seq_len, ctx,
                             m0, q_start, q_len, head, stride_ot, stride_oh, scale_log2e, tree_row, tree_start,
                             PINGPONG, TREE, HEAD_DIM, BLOCK_N, NUM_STAGES)),
            (_pp_loader, (k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, bt_row, n_tiles, seq_len,
                          kv_col, PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)),
        ], [4, 1], [240, 24])


# ------------------------------------------------------------------------------------------------------------
# Persistent ping-pong variant: grid = one CTA per SM; each CTA loops over work items (m-tile, seq, head) in
# the order heaviest causal m-tiles first (item i -> m-tile num_m_blocks - 1 - i // (num_seqs * H), then seq, then
# head: the heads of one KV group are neighbours, for L2 reuse of K/V), items i = pid, pid + grid, ...
# All three partitions walk the same item sequence. The loader also loads Q (q_full / q_empty barriers, the
# consumers free Q once their last QK product of the item has landed), so the next item's Q and first K/V tiles
# load while the consumers finish the current item. The K/V ring's slots and phases continue across items
# (``ring`` counts the tiles this CTA has consumed). Named-barrier protocol as above, continued across items:
# warpgroup 1 arrives once on barrier 14 at the start and both warpgroups hand over after every section;
# warpgroup 0 ends with one extra bar.sync 14 that takes warpgroup 1's last hand-over (nothing pending at exit).


@gluon.jit
def _persist_item(i, QueryStartLoc, SeqLens, num_seqs, num_heads, num_m_blocks, BLOCK_M: gl.constexpr,
                  BLOCK_N: gl.constexpr):
    """Work item i -> (seq, head, m0, q_start, q_len, seq_len, n_full, n_tiles)."""
    per_mb = num_seqs * num_heads
    m_block = num_m_blocks - 1 - i // per_mb
    rem = i % per_mb
    seq = rem // num_heads
    head = rem % num_heads
    q_start = gl.load(QueryStartLoc + seq)
    q_len = gl.load(QueryStartLoc + seq + 1) - q_start
    seq_len = gl.load(SeqLens + seq)
    m0 = m_block * BLOCK_M
    ctx = seq_len - q_len
    n_full = (ctx + m0 + 1) // BLOCK_N
    n_tiles = gl.cdiv(gl.minimum(seq_len, ctx + m0 + BLOCK_M), BLOCK_N)
    return seq, head, m0, q_start, q_len, seq_len, n_full, n_tiles


@gluon.jit
def _persist_loader(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_bars, v_bars, empty_bars,
                    BlockTables, QueryStartLoc, SeqLens, stride_bt, num_seqs, num_heads, num_m_blocks, num_items,
                    GROUP: gl.constexpr, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    ring = 0
    n_done = 0
    for i in range(gl.program_id(0), num_items, gl.num_programs(0)):
        seq, head, m0, q_start, q_len, seq_len, n_full, n_tiles = _persist_item(
            i, QueryStartLoc, SeqLens, num_seqs, num_heads, num_m_blocks, BLOCK_M, BLOCK_N)
        if m0 < q_len:
            mbarrier.wait(q_empty, (n_done & 1) ^ 1)  # both consumers are done with the previous item's Q
            mbarrier.expect(q_full, q_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(q_desc, [q_start + m0, head * HEAD_DIM], q_full, q_smem)
            bt_row = BlockTables + seq.to(gl.int64) * stride_bt
            kv_col = (head // GROUP) * HEAD_DIM
            for tile in range(0, n_tiles):
                _pp_issue_tile(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, empty_bars, bt_row, tile, ring + tile,
                               seq_len, kv_col, PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)
            ring += n_tiles
            n_done += 1


@gluon.jit
def _persist_consumer(q_smem, k_smem, v_smem, q_full, q_empty, k_bars, v_bars, empty_bars, Out, QueryStartLoc,
                      SeqLens, TreeMask, stride_tm, stride_ot, stride_oh, scale_log2e, num_seqs, num_heads, num_m_blocks,
                      num_items,
                      WG: gl.constexpr, TREE: gl.constexpr, TREE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                      BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    HALF: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 16])
    dtype: gl.constexpr = q_smem.dtype
    q_half = q_smem.slice(WG * HALF, HALF)  # [64, D]
    if WG == 1:
        _pp_hand_over(WG)  # warpgroup 0 goes first
    ring = 0
    n_done = 0
    for i in range(gl.program_id(0), num_items, gl.num_programs(0)):
        seq, head, m0, q_start, q_len, seq_len, n_full, n_tiles = _persist_item(
            i, QueryStartLoc, SeqLens, num_seqs, num_heads, num_m_blocks, BLOCK_M, BLOCK_N)
        if m0 < q_len:
            ctx = seq_len - q_len
            tree_start = seq_len - gl.minimum(q_len, TREE_ROWS)
            if TREE:
                n_full = gl.minimum(n_full, tree_start // BLOCK_N)
            r0 = m0 + WG * HALF
            offs_m = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
            offs_m_pos = ctx + offs_m
            tree_bits = _load_tree_bits(TreeMask + seq.to(gl.int64) * stride_tm, offs_m, offs_m_pos, q_len,
                                        tree_start, TREE)
            acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
            m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
            l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_layout))
            mbarrier.wait(q_full, n_done & 1)

            # Tile 0: S only.
            stage0 = ring % NUM_STAGES
            mbarrier.wait(k_bars.index(stage0), (ring // NUM_STAGES) & 1)
            _pp_wait_turn(WG)
            s = gl.zeros([HALF, BLOCK_N], gl.float32, s_layout)
            s = warpgroup_mma(q_half, k_smem.index(stage0).permute((1, 0)), s, use_acc=False, is_async=True)
            _pp_hand_over(WG)
            s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
            gl.thread_barrier()
            mbarrier.arrive(empty_bars.index(stage0), count=1)  # K of this stage consumed
            if n_full > 0:
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, 0, offs_m_pos, seq_len, scale_log2e, tree_bits,
                                                   tree_start, False, TREE, BLOCK_N, s_layout)
            else:
                p, m_i, l_i, alpha = _softmax_step(s, m_i, l_i, 0, offs_m_pos, seq_len, scale_log2e, tree_bits,
                                                   tree_start, True, TREE, BLOCK_N, s_layout)
            p_op = gl.convert_layout(p.to(dtype), gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2))
            for tile in range(1, n_full):
                acc, m_i, l_i, p_op = _pp_step(q_half, k_smem, v_smem, k_bars, v_bars, empty_bars, tile, seq_len,
                                               acc, m_i, l_i, p_op, offs_m_pos, scale_log2e, tree_bits, tree_start,
                                               ring, False, TREE, WG, True, HALF, BLOCK_N, NUM_STAGES, s_layout,
                                               o_layout, dtype)
            for tile in range(gl.maximum(n_full, 1), n_tiles):
                acc, m_i, l_i, p_op = _pp_step(q_half, k_smem, v_smem, k_bars, v_bars, empty_bars, tile, seq_len,
                                               acc, m_i, l_i, p_op, offs_m_pos, scale_log2e, tree_bits, tree_start,
                                               ring, True, TREE, WG, True, HALF, BLOCK_N, NUM_STAGES, s_layout,
                                               o_layout, dtype)
            # Every QK product of this item has landed: Q may be overwritten with the next item's.
            gl.thread_barrier()
            mbarrier.arrive(q_empty, count=1)

            last = ring + n_tiles - 1
            v_last = v_smem.index(last % NUM_STAGES)
            mbarrier.wait(v_bars.index(last % NUM_STAGES), (last // NUM_STAGES) & 1)
            _zero_v_tail(v_last, n_tiles - 1, seq_len, BLOCK_N, 4)
            _pp_wait_turn(WG)
            acc = warpgroup_mma(p_op, v_last, acc, is_async=True)
            _pp_hand_over(WG)
            acc, p_op = warpgroup_mma_wait(num_outstanding=0, deps=(acc, p_op))
            gl.thread_barrier()
            mbarrier.arrive(empty_bars.index(NUM_STAGES + last % NUM_STAGES), count=1)  # V consumed

            l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
            out = acc / l_o[:, None]
            rows = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, o_layout))
            cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
            ptrs = Out + (q_start + rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
            gl.store(ptrs, out.to(Out.dtype.element_ty), mask=(rows < q_len)[:, None])
            ring += n_tiles
            n_done += 1
    if WG == 0:
        _pp_wait_turn(WG)  # takes warpgroup 1's last hand-over


@gluon.jit
def _persist_consumer0(q_smem, k_smem, v_smem, q_full, q_empty, k_bars, v_bars, empty_bars, Out, QueryStartLoc,
                       SeqLens, TreeMask, stride_tm, stride_ot, stride_oh, scale_log2e, num_seqs, num_heads, num_m_blocks,
                       num_items, TREE: gl.constexpr, TREE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    _persist_consumer(q_smem, k_smem, v_smem, q_full, q_empty, k_bars, v_bars, empty_bars, Out, QueryStartLoc,
                      SeqLens, TreeMask, stride_tm, stride_ot, stride_oh, scale_log2e, num_seqs, num_heads, num_m_blocks,
                      num_items, 0, TREE, TREE_ROWS, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES)


@gluon.jit
def _persist_consumer1(q_smem, k_smem, v_smem, q_full, q_empty, k_bars, v_bars, empty_bars, Out, QueryStartLoc,
                       SeqLens, TreeMask, stride_tm, stride_ot, stride_oh, scale_log2e, num_seqs, num_heads, num_m_blocks,
                       num_items, TREE: gl.constexpr, TREE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
                       BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    _persist_consumer(q_smem, k_smem, v_smem, q_full, q_empty, k_bars, v_bars, empty_bars, Out, QueryStartLoc,
                      SeqLens, TreeMask, stride_tm, stride_ot, stride_oh, scale_log2e, num_seqs, num_heads, num_m_blocks,
                      num_items, 1, TREE, TREE_ROWS, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES)


@gluon.jit
def gluon_prefill_kernel_persistent(
    q_desc, k_desc, v_desc, Out, BlockTables, QueryStartLoc, SeqLens,
    scale_log2e, stride_ot, stride_oh, stride_bt, TreeMask, stride_tm, num_seqs, num_heads, num_m_blocks,
    GROUP: gl.constexpr, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
    TREE: gl.constexpr, TREE_ROWS: gl.constexpr,
):
    """Persistent ping-pong (section above): grid (min(num SMs, items),), items num_m_blocks * num_seqs * num_heads with
    num_m_blocks = cdiv(max_query_len, BLOCK_M); launched as the pingpong kernel (num_warps 4, maxnreg 168)."""
    num_items = num_m_blocks * num_seqs * num_heads
    q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
    k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
    v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
    q_full = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty_bars = gl.allocate_shared_memory(gl.int64, [2 * NUM_STAGES, 1], mbarrier.MBarrierLayout())  # K, V
    mbarrier.init(q_full, count=1)
    mbarrier.init(q_empty, count=2)  # one arrival per consumer warpgroup
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_bars.index(i), count=1)
        mbarrier.init(v_bars.index(i), count=1)
        mbarrier.init(empty_bars.index(i), count=2)
        mbarrier.init(empty_bars.index(NUM_STAGES + i), count=2)
    fence_async_shared()
    gl.warp_specialize([
        (_persist_consumer0, (q_smem, k_smem, v_smem, q_full, q_empty, k_bars, v_bars, empty_bars, Out,
                              QueryStartLoc, SeqLens, TreeMask, stride_tm, stride_ot, stride_oh, scale_log2e,
                              num_seqs, num_heads, num_m_blocks, num_items, TREE, TREE_ROWS, HEAD_DIM, BLOCK_M, BLOCK_N,
                              NUM_STAGES)),
        (_persist_consumer1, (q_smem, k_smem, v_smem, q_full, q_empty, k_bars, v_bars, empty_bars, Out,
                              QueryStartLoc, SeqLens, TreeMask, stride_tm, stride_ot, stride_oh, scale_log2e,
                              num_seqs, num_heads, num_m_blocks, num_items, TREE, TREE_ROWS, HEAD_DIM, BLOCK_M, BLOCK_N,
                              NUM_STAGES)),
        (_persist_loader, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_bars, v_bars,
                           empty_bars, BlockTables, QueryStartLoc, SeqLens, stride_bt, num_seqs, num_heads, num_m_blocks,
                           num_items, GROUP, PAGE, PAGE_ROWS, HEAD_DIM, BLOCK_M, BLOCK_N, NUM_STAGES)),
    ], [4, 1], [240, 24])


# ------------------------------------------------------------------------------------------------------------
# FP8 variant (FlashAttention-3's FP8 forward, Shah et al. 2024, section 3.3): Q, K and V are E4M3 codes and both
# products run on the FP8 tensor cores (twice the bf16 rate on Hopper). The pipelined structure above (QK of tile
# j and PV of tile j - 1 in flight during the softmax of tile j), with three differences:
#
# - V^T: an FP8 wgmma reads its B operand from shared memory K-major only (the reduction dimension contiguous,
#   PTX ISA "wgmma.mma_async": transpose is supported for 16-bit types only). For P V the reduction runs over the
#   keys, but the cache holds V rows with D contiguous, so each V tile is transposed once, register-side, into a
#   [D, BLOCK_N] buffer (FA3 does the same with LDSM/STSM in its producer warpgroup). The transpose also zeroes the
#   rows at or past seq_len (stale slots may hold NaN codes).
# - P goes through shared memory (a double buffer, the A operand from shared memory): Triton 3.6 cannot keep an
#   8-bit register operand alive across ``warpgroup_mma_wait`` ("Unexpected bitwidth in WGMMAWaitGroupOp: 8"),
#   and the softmax of tile j must overlap the P_{j-1} V_{j-1} product that reads P_{j-1}.
# - Scales: q has one E4M3 scale per (token, head) row (``per_token_quant_fp8``), the cache one per KV head
#   (``roofline.kernels.common``, static). S = (q8 . k8) * q_scale[row] * k_scale, folded into the per-row softmax
#   scale. Q_SPLIT: q is two E4M3 terms with that scale, hi + lo (``per_token_quant_fp8_split``), and S is the sum of
#   two FP8 products in one accumulator: q at ~7 significant bits instead of 4 (with q in E4M3 alone the default
#   model's KL against an unquantized cache rose by 60%: bench/fp8_prefill_quality.py), for one more QK wgmma. P in [0, 1] is stored as e4m3(P * 448) (P_SCALE: the largest finite E4M3, OCP FP8 2023) so that small
#   probabilities keep normal E4M3 precision down to 2^-6 / 448 instead of flushing below 2^-9; the 448 and
#   v_scale divide out in the epilogue.
# - Two-level accumulation: each tile's P V product starts from zero (``use_acc=False``: one MMA chain of BLOCK_N
#   keys in the tensor core's reduced-precision FP8 accumulator) and is added to the fp32 O in registers, as FA3's
#   FP8 path does (the wgmma FP8 accumulator keeps about 14 mantissa bits, DeepSeek-V3 report section 3.3.2).

P_SCALE = gl.constexpr(448.0)


@gluon.jit
def _fp8_transpose_v(v_buf, vt_smem, tile, seq_len, BLOCK_N: gl.constexpr, num_warps: gl.constexpr):
    """V tile ``tile`` [BLOCK_N, D] (E4M3, as TMA wrote it) -> V^T [D, BLOCK_N] in ``vt_smem``; keys at or past
    seq_len are zeroed. Each thread moves 4 x 4 blocks (4-byte loads along D, 4-byte stores along the keys)."""
    ld_layout: gl.constexpr = gl.BlockedLayout([4, 4], [4, 8], [BLOCK_N // 16, num_warps * 16 // BLOCK_N], [1, 0])
    v = v_buf.load(ld_layout)
    if tile * BLOCK_N + BLOCK_N > seq_len:
        rows = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ld_layout))
        v = gl.where((rows < seq_len)[:, None], v, gl.zeros_like(v))
    vt_smem.store(gl.permute(v, (1, 0)))
    fence_async_shared()
    gl.thread_barrier()


@gluon.jit
def _fp8_softmax_step(s, m_i, l_i, tile, offs_m_pos, seq_len, row_scale, MASKED: gl.constexpr,
                      BLOCK_N: gl.constexpr, s_layout: gl.constexpr):
    """Online softmax of one S tile of code products; ``row_scale`` [BLOCK_M] = q_scale * k_scale * softmax
    scale * log2(e). Returns P (fp32), the new max, the new sum and the rescale alpha (log2 units)."""
    s = s * row_scale[:, None]
    if MASKED:
        offs_n = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
        visible = (offs_n[None, :] <= offs_m_pos[:, None]) & (offs_n[None, :] < seq_len)
        s = gl.where(visible, s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    p = gl.exp2(s - m_new[:, None])
    alpha = gl.exp2(m_i - m_new)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, m_new, l_i, alpha


@gluon.jit
def _fp8_qk(q_smem, qlo_smem, k_smem, k_bars, tile, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            NUM_STAGES: gl.constexpr, s_layout: gl.constexpr, Q_SPLIT: gl.constexpr):
    """Issue S_tile = Q K_tile^T (async, FP8 codes, fp32 accumulator; Q_SPLIT: hi K^T + lo K^T) once the tile's
    K has landed."""
    stage = tile % NUM_STAGES
    mbarrier.wait(k_bars.index(stage), (tile // NUM_STAGES) & 1)
    kt = k_smem.index(stage).permute((1, 0))
    s = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_smem, kt, s, use_acc=False, is_async=True)
    if Q_SPLIT:
        s = warpgroup_mma(qlo_smem, kt, s, is_async=True)
    return s


@gluon.jit
def _fp8_pv(p_smem, v_smem, vt_smem, v_bars, tile, seq_len, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
            HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, o_layout: gl.constexpr, num_warps: gl.constexpr):
    """Issue P_tile V_tile (async, from zero: the first level of the two-level accumulation) once the tile's V
    has landed and been transposed. The transpose's fence and barrier also publish P_tile (stored earlier) to
    the tensor cores."""
    stage = tile % NUM_STAGES
    mbarrier.wait(v_bars.index(stage), (tile // NUM_STAGES) & 1)
    _fp8_transpose_v(v_smem.index(stage), vt_smem, tile, seq_len, BLOCK_N, num_warps)
    pv = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
    return warpgroup_mma(p_smem.index(tile % 2), vt_smem.permute((1, 0)), pv, use_acc=False, is_async=True)


@gluon.jit
def _fp8_step(q_smem, qlo_smem, k_smem, v_smem, vt_smem, p_smem, k_bars, v_bars, k_desc, v_desc, bt_row, tile,
              n_tiles, seq_len, kv_col, acc, m_i, l_i, offs_m_pos, row_scale,
              MASKED: gl.constexpr, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, s_layout: gl.constexpr,
              o_layout: gl.constexpr, num_warps: gl.constexpr, Q_SPLIT: gl.constexpr):
    """Tile ``tile`` >= 1: S_tile and P_{tile-1} V_{tile-1} in flight together, softmax of S_tile, then
    O = (O + P_{tile-1} V_{tile-1}) * alpha_tile and the refill of tile - 1's stage."""
    s = _fp8_qk(q_smem, qlo_smem, k_smem, k_bars, tile, BLOCK_M, BLOCK_N, NUM_STAGES, s_layout, Q_SPLIT)
    pv = _fp8_pv(p_smem, v_smem, vt_smem, v_bars, tile - 1, seq_len, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES,
                 o_layout, num_warps)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))  # the QK product(s), issued before the PV one
    p, m_i, l_i, alpha = _fp8_softmax_step(s, m_i, l_i, tile, offs_m_pos, seq_len, row_scale, MASKED, BLOCK_N,
                                           s_layout)
    p_smem.index(tile % 2).store((p * P_SCALE).to(gl.float8e4nv))  # the other buffer is P_{tile-1}'s, in use
    pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv, ))
    acc = (acc + pv) * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    gl.thread_barrier()  # both warpgroups are done with tile - 1's stage and with V^T
    nxt = tile - 1 + NUM_STAGES
    if nxt < n_tiles:
        _issue_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, bt_row, nxt, seq_len, kv_col,
                       PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)
    return acc, m_i, l_i


@gluon.jit
def _fp8_issue_q(q_desc, qlo_desc, q_smem, qlo_smem, q_bar, row, col, Q_SPLIT: gl.constexpr):
    """TMA copies of q's E4M3 tile (and of its second term when Q_SPLIT) at [row, col], both on ``q_bar``."""
    if Q_SPLIT:
        mbarrier.expect(q_bar, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(qlo_desc, [row, col], q_bar, qlo_smem)
    else:
        mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [row, col], q_bar, q_smem)


@gluon.jit
def _fp8_store_out(acc, l_i, Out, VScale, kv_head, r0, q_start, q_len, head, stride_ot, stride_oh,
                   ROWS: gl.constexpr, HEAD_DIM: gl.constexpr, o_layout: gl.constexpr):
    """O = acc * v_scale / (P_SCALE * l) for query rows r0 ... r0 + ROWS - 1 of the chunk (those < q_len); every
    valid row saw key 0 at least (l > 0)."""
    l_o = gl.convert_layout(l_i, gl.SliceLayout(1, o_layout))
    out = acc * (gl.load(VScale + kv_head) / P_SCALE) / l_o[:, None]
    rows = r0 + gl.arange(0, ROWS, layout=gl.SliceLayout(1, o_layout))
    cols = gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, o_layout))
    ptrs = Out + (q_start + rows).to(gl.int64)[:, None] * stride_ot + head * stride_oh + cols[None, :]
    gl.store(ptrs, out.to(Out.dtype.element_ty), mask=(rows < q_len)[:, None])


@gluon.jit
def gluon_prefill_kernel_fp8(
    q_desc, qlo_desc, k_desc, v_desc, Out, BlockTables, QueryStartLoc, SeqLens, QScale, KScale, VScale,
    scale_log2e, stride_ot, stride_oh, stride_bt, stride_qs,
    GROUP: gl.constexpr, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
    Q_SPLIT: gl.constexpr,
):
    """As ``gluon_prefill_kernel_pipelined`` (same grid) on E4M3 q / cache codes (section above). qlo_desc: q's
    second E4M3 term when Q_SPLIT (q_desc again otherwise, unused). QScale: float32 per (token, head) q scales,
    row stride ``stride_qs``; KScale, VScale: float32 [H_kv] cache scales; Out in the 16-bit dtype of the model."""
    seq = gl.program_id(1)
    head = gl.program_id(2)
    q_start = gl.load(QueryStartLoc + seq)
    q_len = gl.load(QueryStartLoc + seq + 1) - q_start
    m_block = gl.num_programs(0) - 1 - gl.program_id(0)
    m0 = m_block * BLOCK_M
    if m0 < q_len:
        seq_len = gl.load(SeqLens + seq)
        ctx = seq_len - q_len
        kv_head = head // GROUP
        kv_col = kv_head * HEAD_DIM
        bt_row = BlockTables + seq.to(gl.int64) * stride_bt

        # FP8 wgmma: K of one instruction is 32 (8-bit operands).
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, BLOCK_N, 32])
        o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                           instr_shape=[16, HEAD_DIM, 32])
        p_smem_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl.float8e4nv)
        vt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N], gl.float8e4nv)

        q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
        qlo_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        vt_smem = gl.allocate_shared_memory(gl.float8e4nv, [HEAD_DIM, BLOCK_N], vt_layout)
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [2, BLOCK_M, BLOCK_N], p_smem_layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
        fence_async_shared()

        n_full = (ctx + m0 + 1) // BLOCK_N
        n_tiles = gl.cdiv(gl.minimum(seq_len, ctx + m0 + BLOCK_M), BLOCK_N)

        _fp8_issue_q(q_desc, qlo_desc, q_smem, qlo_smem, q_bar, q_start + m0, head * HEAD_DIM, Q_SPLIT)
        for i in gl.static_range(NUM_STAGES):
            if i < n_tiles:
                _issue_kv_tile(k_desc, v_desc, k_smem, v_smem, k_bars, v_bars, bt_row, i, seq_len, kv_col,
                               PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)

        offs_m = m0 + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        offs_m_pos = ctx + offs_m
        q_scale = gl.load(QScale + (q_start + offs_m).to(gl.int64) * stride_qs + head, mask=offs_m < q_len,
                          other=1.0)
        row_scale = q_scale * (gl.load(KScale + kv_head) * scale_log2e)
        m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
        l_i = gl.zeros([BLOCK_M], gl.float32, gl.SliceLayout(1, s_layout))
        acc = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, o_layout)
        mbarrier.wait(q_bar, 0)

        # Tile 0: S and its softmax only (its PV product runs in the step of tile 1).
        s = _fp8_qk(q_smem, qlo_smem, k_smem, k_bars, 0, BLOCK_M, BLOCK_N, NUM_STAGES, s_layout, Q_SPLIT)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
        if n_full > 0:
            p, m_i, l_i, alpha = _fp8_softmax_step(s, m_i, l_i, 0, offs_m_pos, seq_len, row_scale, False, BLOCK_N,
                                                   s_layout)
        else:
            p, m_i, l_i, alpha = _fp8_softmax_step(s, m_i, l_i, 0, offs_m_pos, seq_len, row_scale, True, BLOCK_N,
                                                   s_layout)
        p_smem.index(0).store((p * P_SCALE).to(gl.float8e4nv))
        for tile in range(1, n_full):
            acc, m_i, l_i = _fp8_step(
                q_smem, qlo_smem, k_smem, v_smem, vt_smem, p_smem, k_bars, v_bars, k_desc, v_desc, bt_row, tile,
                n_tiles, seq_len, kv_col, acc, m_i, l_i, offs_m_pos, row_scale,
                False, PAGE, PAGE_ROWS, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, s_layout, o_layout, num_warps,
                Q_SPLIT)
        for tile in range(gl.maximum(n_full, 1), n_tiles):
            acc, m_i, l_i = _fp8_step(
                q_smem, qlo_smem, k_smem, v_smem, vt_smem, p_smem, k_bars, v_bars, k_desc, v_desc, bt_row, tile,
                n_tiles, seq_len, kv_col, acc, m_i, l_i, offs_m_pos, row_scale,
                True, PAGE, PAGE_ROWS, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES, s_layout, o_layout, num_warps,
                Q_SPLIT)
        # The last tile's PV product.
        pv = _fp8_pv(p_smem, v_smem, vt_smem, v_bars, n_tiles - 1, seq_len, BLOCK_M, BLOCK_N, HEAD_DIM, NUM_STAGES,
                     o_layout, num_warps)
        pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv, ))
        acc = acc + pv

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))

        _fp8_store_out(acc, l_i, Out, VScale, kv_head, m0, q_start, q_len, head, stride_ot, stride_oh, BLOCK_M,
                       HEAD_DIM, o_layout)


# ------------------------------------------------------------------------------------------------------------
# FP8 ping-pong variant (VARIANT "fp8pp"): the FP8 arithmetic above on the ping-pong skeleton, with FA3's FP8
# producer (Shah et al. 2024, section 3.3: "in-kernel transpose" in the producer warpgroup). Three partitions of 4
# warps: consumer warpgroups 0 and 1 (64 query rows each, GEMM issue alternating through the named barriers 14 / 15
# as in ``gluon_prefill_kernel_pingpong``) and a producer warpgroup that issues the TMA copies of K and V and
# transposes each V tile into a ring of NUM_VT V^T buffers, CHUNK keys at a time (a chunk is CHUNK x D bytes: 8
# registers a thread at CHUNK 32), zeroing the keys at or past seq_len. So the transposes leave the consumers'
# critical path. Registers through setmaxnreg: 232 (warpgroup 1), 48 (the producer; at 32 it spilled) and what is
# left, 224, for warpgroup 0 (the default partition); no spills (bench/gluon_aot_check.py --fp8). Each warpgroup
# keeps its own double-buffered P. Barriers: k_bars / v_bars (TMA landed), k_empty (count 2: both warpgroups' QK
# products of the stage landed), vt_full (count 1: the producer published V^T), vt_empty (count 2: both PV products
# read it). The producer reads the V stage itself, so it refills that stage right after the transpose; it refills K
# of tile t + NUM_STAGES once k_empty says both QK products of tile t landed (so it transposes tile t + 1 only after
# them; with NUM_VT 1 it also waits for both PV products of tile t - 1 before transposing tile t).


@gluon.jit
def _fp8pp_transpose(v_buf, vt_buf, tile, seq_len, BLOCK_N: gl.constexpr, CHUNK: gl.constexpr):
    """V tile [BLOCK_N, D] -> V^T [D, BLOCK_N] (4 warps), CHUNK keys at a time; keys >= seq_len become 0."""
    gl.static_assert(CHUNK == 16 or CHUNK == 32 or CHUNK == 64, "CHUNK must be 16, 32 or 64 (4 warps of 4 x 4 blocks)")
    ld_layout: gl.constexpr = gl.BlockedLayout([4, 4], [4, 8], [CHUNK // 16, 64 // CHUNK], [1, 0])
    for c in gl.static_range(BLOCK_N // CHUNK):
        v = v_buf.slice(c * CHUNK, CHUNK).load(ld_layout)
        if tile * BLOCK_N + (c + 1) * CHUNK > seq_len:
            rows = tile * BLOCK_N + c * CHUNK + gl.arange(0, CHUNK, layout=gl.SliceLayout(1, ld_layout))
            v = gl.where((rows < seq_len)[:, None], v, gl.zeros_like(v))
        vt_buf.slice(c * CHUNK, CHUNK, dim=1).store(gl.permute(v, (1, 0)))


@gluon.jit
def _fp8pp_producer(k_desc, v_desc, k_smem, v_smem, vt_smem, k_bars, v_bars, k_empty, vt_full, vt_empty, bt_row,
                    n_tiles, seq_len, kv_col, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, BLOCK_N: gl.constexpr,
                    NUM_STAGES: gl.constexpr, NUM_VT: gl.constexpr, CHUNK: gl.constexpr):
    for i in gl.static_range(NUM_STAGES):
        if i < n_tiles:
            _issue_one(k_desc, k_smem, k_bars, bt_row, i, i, seq_len, kv_col, PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)
            _issue_one(v_desc, v_smem, v_bars, bt_row, i, i, seq_len, kv_col, PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES)
    for tile in range(0, n_tiles):
        stage = tile % NUM_STAGES
        vb = tile % NUM_VT
        mbarrier.wait(v_bars.index(stage), (tile // NUM_STAGES) & 1)
        mbarrier.wait(vt_empty.index(vb), ((tile // NUM_VT) & 1) ^ 1)  # parity 1 passes at once: empty ring
        _fp8pp_transpose(v_smem.index(stage), vt_smem.index(vb), tile, seq_len, BLOCK_N, CHUNK)
        fence_async_shared()  # V^T (generic stores) before the consumers' wgmma reads; V's reads before the refill
        gl.thread_barrier()  # all 4 warps stored their chunks and read the V stage
        mbarrier.arrive(vt_full.index(vb), count=1)
        nxt = tile + NUM_STAGES
        if nxt < n_tiles:
            _issue_one(v_desc, v_smem, v_bars, bt_row, nxt, nxt, seq_len, kv_col, PAGE, PAGE_ROWS, BLOCK_N,
                       NUM_STAGES)
            mbarrier.wait(k_empty.index(stage), (tile // NUM_STAGES) & 1)  # both QK products of `tile` landed
            _issue_one(k_desc, k_smem, k_bars, bt_row, nxt, nxt, seq_len, kv_col, PAGE, PAGE_ROWS, BLOCK_N,
                       NUM_STAGES)


@gluon.jit
def _fp8pp_qk(q_half, qlo_half, k_buf, BLOCK_N: gl.constexpr, s_layout: gl.constexpr, Q_SPLIT: gl.constexpr):
    kt = k_buf.permute((1, 0))
    s = gl.zeros([64, BLOCK_N], gl.float32, s_layout)
    s = warpgroup_mma(q_half, kt, s, use_acc=False, is_async=True)
    if Q_SPLIT:
        s = warpgroup_mma(qlo_half, kt, s, is_async=True)
    return s


@gluon.jit
def _fp8pp_step(q_half, qlo_half, k_smem, vt_smem, p_smem, k_bars, k_empty, vt_full, vt_empty, tile, seq_len, acc,
                m_i, l_i, offs_m_pos, row_scale, MASKED: gl.constexpr, WG: gl.constexpr, BLOCK_N: gl.constexpr,
                HEAD_DIM: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_VT: gl.constexpr, s_layout: gl.constexpr,
                o_layout: gl.constexpr, Q_SPLIT: gl.constexpr):
    """One warpgroup's tile ``tile`` >= 1: S_tile and P_{tile-1} V_{tile-1} issued in its turn, the softmax of
    S_tile and the store of P_tile while the other warpgroup's products run, then O = (O + PV) * alpha."""
    stage = tile % NUM_STAGES
    prev = tile - 1
    vb = prev % NUM_VT
    mbarrier.wait(k_bars.index(stage), (tile // NUM_STAGES) & 1)
    mbarrier.wait(vt_full.index(vb), (prev // NUM_VT) & 1)
    _pp_wait_turn(WG)
    s = _fp8pp_qk(q_half, qlo_half, k_smem.index(stage), BLOCK_N, s_layout, Q_SPLIT)
    pv = gl.zeros([64, HEAD_DIM], gl.float32, o_layout)
    pv = warpgroup_mma(p_smem.index(2 * WG + prev % 2), vt_smem.index(vb).permute((1, 0)), pv, use_acc=False, is_async=True)
    _pp_hand_over(WG)
    s = warpgroup_mma_wait(num_outstanding=1, deps=(s, ))
    gl.thread_barrier()
    mbarrier.arrive(k_empty.index(stage), count=1)
    p, m_i, l_i, alpha = _fp8_softmax_step(s, m_i, l_i, tile, offs_m_pos, seq_len, row_scale, MASKED, BLOCK_N,
                                           s_layout)
    p_smem.index(2 * WG + tile % 2).store((p * P_SCALE).to(gl.float8e4nv))  # the other buffer is P_{tile-1}'s, in use
    fence_async_shared()
    pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv, ))
    acc = (acc + pv) * gl.convert_layout(alpha, gl.SliceLayout(1, o_layout))[:, None]
    gl.thread_barrier()  # P_tile stored by all 4 warps; V^T of prev read
    mbarrier.arrive(vt_empty.index(vb), count=1)
    return acc, m_i, l_i


@gluon.jit
def _fp8pp_consumer(q_smem, qlo_smem, k_smem, vt_smem, p_smem, k_bars, k_empty, vt_full, vt_empty, q_bar, Out,
                    QScale, KScale, VScale, n_full, n_tiles, seq_len, ctx, m0, q_start, q_len, head, kv_head,
                    stride_ot, stride_oh, stride_qs, scale_log2e, WG: gl.constexpr, HEAD_DIM: gl.constexpr,
                    BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, NUM_VT: gl.constexpr, Q_SPLIT: gl.constexpr):
    """Warpgroup WG of the FP8 ping-pong kernel: rows m0 + 64 WG ... m0 + 64 WG + 63 of the tile."""
    HALF: gl.constexpr = 64
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, BLOCK_N, 32])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, HEAD_DIM, 32])
    q_half = q_smem.slice(WG * HALF, HALF)
    qlo_half = qlo_smem.slice(WG * HALF, HALF)
    r0 = m0 + WG * HALF
    offs_m = r0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, s_layout))
    offs_m_pos = ctx + offs_m
    q_scale = gl.load(QScale + (q_start + offs_m).to(gl.int64) * stride_qs + head, mask=offs_m < q_len, other=1.0)
    row_scale = q_scale * (gl.load(KScale + kv_head) * scale_log2e)
    acc = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
    m_i = gl.full([HALF], float("-inf"), gl.float32, gl.SliceLayout(1, s_layout))
    l_i = gl.zeros([HALF], gl.float32, gl.SliceLayout(1, s_layout))
    if WG == 1:
        _pp_hand_over(WG)  # warpgroup 0 goes first
    mbarrier.wait(q_bar, 0)

    # Tile 0: S only (no previous P).
    mbarrier.wait(k_bars.index(0), 0)
    _pp_wait_turn(WG)
    s = _fp8pp_qk(q_half, qlo_half, k_smem.index(0), BLOCK_N, s_layout, Q_SPLIT)
    _pp_hand_over(WG)
    s = warpgroup_mma_wait(num_outstanding=0, deps=(s, ))
    gl.thread_barrier()
    mbarrier.arrive(k_empty.index(0), count=1)
    if n_full > 0:
        p, m_i, l_i, alpha = _fp8_softmax_step(s, m_i, l_i, 0, offs_m_pos, seq_len, row_scale, False, BLOCK_N,
                                               s_layout)
    else:
        p, m_i, l_i, alpha = _fp8_softmax_step(s, m_i, l_i, 0, offs_m_pos, seq_len, row_scale, True, BLOCK_N,
                                               s_layout)
    p_smem.index(2 * WG).store((p * P_SCALE).to(gl.float8e4nv))
    fence_async_shared()
    gl.thread_barrier()

    for tile in range(1, n_full):
        acc, m_i, l_i = _fp8pp_step(q_half, qlo_half, k_smem, vt_smem, p_smem, k_bars, k_empty, vt_full, vt_empty,
                                    tile, seq_len, acc, m_i, l_i, offs_m_pos, row_scale, False, WG, BLOCK_N,
                                    HEAD_DIM, NUM_STAGES, NUM_VT, s_layout, o_layout, Q_SPLIT)
    for tile in range(gl.maximum(n_full, 1), n_tiles):
        acc, m_i, l_i = _fp8pp_step(q_half, qlo_half, k_smem, vt_smem, p_smem, k_bars, k_empty, vt_full, vt_empty,
                                    tile, seq_len, acc, m_i, l_i, offs_m_pos, row_scale, True, WG, BLOCK_N,
                                    HEAD_DIM, NUM_STAGES, NUM_VT, s_layout, o_layout, Q_SPLIT)

    # The last tile's PV product: the (n_tiles + 1)-th section; warpgroup 1 does not hand over after it.
    last = n_tiles - 1
    vb = last % NUM_VT
    mbarrier.wait(vt_full.index(vb), (last // NUM_VT) & 1)
    _pp_wait_turn(WG)
    pv = gl.zeros([HALF, HEAD_DIM], gl.float32, o_layout)
    pv = warpgroup_mma(p_smem.index(2 * WG + last % 2), vt_smem.index(vb).permute((1, 0)), pv, use_acc=False, is_async=True)
    if WG == 0:
        _pp_hand_over(WG)
    pv = warpgroup_mma_wait(num_outstanding=0, deps=(pv, ))
    acc = acc + pv

    _fp8_store_out(acc, l_i, Out, VScale, kv_head, r0, q_start, q_len, head, stride_ot, stride_oh, HALF, HEAD_DIM,
                   o_layout)


@gluon.jit
def gluon_prefill_kernel_fp8pp(
    q_desc, qlo_desc, k_desc, v_desc, Out, BlockTables, QueryStartLoc, SeqLens, QScale, KScale, VScale,
    scale_log2e, stride_ot, stride_oh, stride_bt, stride_qs,
    GROUP: gl.constexpr, PAGE: gl.constexpr, PAGE_ROWS: gl.constexpr, HEAD_DIM: gl.constexpr,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr, num_warps: gl.constexpr,
    Q_SPLIT: gl.constexpr, NUM_VT: gl.constexpr, CHUNK: gl.constexpr,
):
    """As ``gluon_prefill_kernel_fp8`` (same arguments, grid and arithmetic; BLOCK_M 128), launched with num_warps
    4 (the default partition is consumer warpgroup 0; warpgroup 1 and the producer warpgroup are workers). NUM_VT:
    V^T buffers; CHUNK: keys per step of the producer's transpose."""
    seq = gl.program_id(1)
    head = gl.program_id(2)
    q_start = gl.load(QueryStartLoc + seq)
    q_len = gl.load(QueryStartLoc + seq + 1) - q_start
    m_block = gl.num_programs(0) - 1 - gl.program_id(0)
    m0 = m_block * BLOCK_M
    if m0 < q_len:
        seq_len = gl.load(SeqLens + seq)
        ctx = seq_len - q_len
        kv_head = head // GROUP
        kv_col = kv_head * HEAD_DIM
        bt_row = BlockTables + seq.to(gl.int64) * stride_bt

        p_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([64, BLOCK_N], gl.float8e4nv)
        vt_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([HEAD_DIM, BLOCK_N], gl.float8e4nv)
        q_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
        qlo_smem = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_M, HEAD_DIM], q_desc.layout)
        k_smem = gl.allocate_shared_memory(k_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(v_desc.dtype, [NUM_STAGES, BLOCK_N, HEAD_DIM], v_desc.layout)
        vt_smem = gl.allocate_shared_memory(gl.float8e4nv, [NUM_VT, HEAD_DIM, BLOCK_N], vt_layout)
        p_smem = gl.allocate_shared_memory(gl.float8e4nv, [4, 64, BLOCK_N], p_layout)  # warpgroup WG: 2 WG, 2 WG + 1
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
        vt_full = gl.allocate_shared_memory(gl.int64, [NUM_VT, 1], mbarrier.MBarrierLayout())
        vt_empty = gl.allocate_shared_memory(gl.int64, [NUM_VT, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(NUM_STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
            mbarrier.init(k_empty.index(i), count=2)  # one arrival per consumer warpgroup
        for i in gl.static_range(NUM_VT):
            mbarrier.init(vt_full.index(i), count=1)
            mbarrier.init(vt_empty.index(i), count=2)
        fence_async_shared()

        n_full = (ctx + m0 + 1) // BLOCK_N
        n_tiles = gl.cdiv(gl.minimum(seq_len, ctx + m0 + BLOCK_M), BLOCK_N)
        _fp8_issue_q(q_desc, qlo_desc, q_smem, qlo_smem, q_bar, q_start + m0, head * HEAD_DIM, Q_SPLIT)

        gl.warp_specialize([
            (_fp8pp_consumer, (q_smem, qlo_smem, k_smem, vt_smem, p_smem, k_bars, k_empty, vt_full, vt_empty, q_bar, Out,
                               QScale, KScale, VScale, n_full, n_tiles, seq_len, ctx, m0, q_start, q_len, head, kv_head,
                               stride_ot, stride_oh, stride_qs, scale_log2e, 0, HEAD_DIM, BLOCK_N, NUM_STAGES, NUM_VT,
                               Q_SPLIT)),
            (_fp8pp_consumer, (q_smem, qlo_smem, k_smem, vt_smem, p_smem, k_bars, k_empty, vt_full, vt_empty, q_bar, Out,
                               QScale, KScale, VScale, n_full, n_tiles, seq_len, ctx, m0, q_start, q_len, head, kv_head,
                               stride_ot, stride_oh, stride_qs, scale_log2e, 1, HEAD_DIM, BLOCK_N, NUM_STAGES, NUM_VT,
                               Q_SPLIT)),
            (_fp8pp_producer, (k_desc, v_desc, k_smem, v_smem, vt_smem, k_bars, v_bars, k_empty, vt_full, vt_empty,
                               bt_row, n_tiles, seq_len, kv_col, PAGE, PAGE_ROWS, BLOCK_N, NUM_STAGES, NUM_VT, CHUNK)),
        ], [4, 4], [232, 48])  # setmaxnreg: warpgroup 1 232, the producer 48, warpgroup 0 (default) what is left: 224
