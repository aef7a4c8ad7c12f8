"""Paged causal prefill attention with a Gluon kernel for Hopper (sm_90): TMA, async wgmma (issue 29).

``gluon_prefill_attention`` has the signature of ``roofline.kernels.prefill_attention.paged_prefill_attention``
and computes the same thing (query j of a chunk at position ctx + j; chunked prefill, prefix hits and chain
verification). Kernel design: ``roofline.kernels.gluon_prefill_kernels``.

What the Gluon kernel covers (``gluon_unsupported_reason`` says why not, else None): a CUDA device of compute
capability 9.x, Triton with ``triton.experimental.gluon``, q in bf16 or fp16 and the cache in q's dtype or in
``float8_e4m3fn`` (``--kv-cache-dtype fp8_e4m3``: the FP8 kernel, FA3's FP8 forward; not int8 codes),
head_dim 64 or 128, any block_size that is a power of two >= 16 (a tile of BLOCK_N keys is BLOCK_N /
block_size TMA copies when block_size < BLOCK_N); a ``tree_mask`` only with the warp-specialized variants
(``TREE_VARIANTS``). Anything else runs the Triton kernel, with one log line per reason.

The Triton backend picks it at init (``choose_prefill_kernel``): ``ROOFLINE_PREFILL_KERNEL``
(``PREFILL_KERNEL_ENV``) "auto" (the default: Gluon on sm_90), "gluon" or "triton".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable

import torch

from roofline.kernels.act_quant import per_token_quant_fp8, per_token_quant_fp8_split
from roofline.kernels.common import KV_QUANT_PER_HEAD, PagedBatch, check_paged_attention_inputs, kv_quant_mode
from roofline.kernels.prefill_attention import LOG2E, check_tree_mask, paged_prefill_attention

logger = logging.getLogger(__name__)

PREFILL_KERNEL_ENV = "ROOFLINE_PREFILL_KERNEL"  # "auto" (default: gluon on sm_90), "triton" or "gluon"
PREFILL_KERNELS = ("auto", "triton", "gluon")
# The FP8 kernel for an fp8_e4m3 cache on sm_90: on by default since 2026-12-07 (on an H100 its two-term path matched
# float64 within 1.7-1.9e-2, and end to end it was 1.11x the Triton kernel on 7,680-token prompts and 1.01x on
# ShareGPT: bench/results/fp8-prefill-h100-20261207b/); "0" keeps the Triton kernel, which casts the codes to bf16 in
# registers (about 9x closer to float64, 0.7x the speed). A config with VARIANT "fp8" runs the FP8 kernel whatever
# the variable says.
FP8_PREFILL_ENV = "ROOFLINE_GLUON_FP8_PREFILL"
GLUON_HEAD_DIMS = (64, 128)
GLUON_DTYPES = (torch.bfloat16, torch.float16)
GLUON_VARIANTS = ("plain", "pipelined", "ws", "pingpong", "ws2", "persistent")
# Variants whose consumer warpgroups are separate partitions (launched with num_warps 4: warpgroup 0 is the
# default partition; warpgroup 1 and the loader are workers; FA3's ping-pong: their GEMM issue alternates through
# named barriers, each with the intra-warpgroup overlap; BLOCK_M 128 only). "ws2" is "pingpong" without the
# named barriers. The value is the kernel's PINGPONG flag.
TWO_CONSUMER_VARIANTS = {"pingpong": True, "ws2": False, "persistent": True}
# "persistent": the ping-pong kernel with a persistent grid (one CTA per SM looping over (m-tile, seq, head)
# work items, heaviest causal m-tiles first; the loader partition also loads Q).
# Variants with the tree mask (speculative tree verification). A tree call runs with BLOCK_N at most
# TREE_BLOCK_N: the BLOCK_N 128 tree specialization spills (96 B under the 168-register cap; 0 at 64).
TREE_VARIANTS = ("ws", "pingpong", "ws2", "persistent")
# The FP8 kernels (E4M3 q, K, V and P on the FP8 tensor cores), the only variants for a float8_e4m3fn cache and for
# nothing else: "fp8" (``gluon_prefill_kernel_fp8``: the pipelined skeleton, 8 warps, the V transpose on the
# consumers' path) and "fp8pp" (``gluon_prefill_kernel_fp8pp``: the ping-pong skeleton, two consumer warpgroups
# and a producer warpgroup that loads K / V and transposes V into NUM_VT buffers, CHUNK keys at a time).
FP8_VARIANT = "fp8"
FP8_PINGPONG = "fp8pp"
FP8_VARIANTS = (FP8_VARIANT, FP8_PINGPONG)
TREE_BLOCK_N = 64
WS_MAXNREG = 168  # warp-specialized: 12 warps x 168 = the register file; the loader drops to 32, consumers get 240

try:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    from roofline.kernels.gluon_prefill_kernels import (
        gluon_prefill_kernel,
        gluon_prefill_kernel_fp8,
        gluon_prefill_kernel_fp8pp,
        gluon_prefill_kernel_persistent,
        gluon_prefill_kernel_pingpong,
        gluon_prefill_kernel_pipelined,
        gluon_prefill_kernel_ws,
    )

    GLUON_KERNELS = {"plain": gluon_prefill_kernel, "pipelined": gluon_prefill_kernel_pipelined,
                     "ws": gluon_prefill_kernel_ws, "pingpong": gluon_prefill_kernel_pingpong,
                     "ws2": gluon_prefill_kernel_pingpong, "persistent": gluon_prefill_kernel_persistent,
                     FP8_VARIANT: gluon_prefill_kernel_fp8, FP8_PINGPONG: gluon_prefill_kernel_fp8pp}
except Exception:  # pragma: no cover - no triton, or a triton without gluon
    gl = None

_logged: set[str] = set()


def default_gluon_config(head_dim: int, block_size: int) -> dict:
    """Tile sizes and kernel: BLOCK_M 128 (two warpgroups of 64 rows, 8 warps + the loader warp), BLOCK_N 128, a
    2-stage K/V ring (Q 32 KB + K/V 128 KB of shared memory at D 128), the FA3 "pingpong" kernel (two consumer
    warpgroups taking turns at the tensor cores through named barriers, each overlapping its QK of tile j with
    its PV of tile j - 1, a 1-warp TMA loader): the fastest on the H200 (``bench/results/fa3-20261204b/``,
    causal GQA 32/8 D 128, 4k/8k/16k: 0.99/1.03/1.03x cuDNN SDPA contiguous, 0.89/0.94/1.05x at block 16, where
    "ws" reached 0.82/0.86/0.88x and 0.77/0.81/0.84x and the Triton kernel 0.80/0.86/0.86x and 0.60/0.64/0.65x
    in the same run).
    VARIANT (``roofline.kernels.gluon_prefill_kernels``): "plain" (TMA ring, one tile's QK, softmax, PV in
    turn), "pipelined" (QK and PV of consecutive tiles in flight during the softmax; meant for BLOCK_N 64 and
    3 stages), "ws" (pipelined consumers + a 1-warp TMA loader partition, ``WS_MAXNREG``)."""
    return dict(BLOCK_M=128, BLOCK_N=128, NUM_STAGES=2, num_warps=8, VARIANT="pingpong")


def default_gluon_fp8_config(head_dim: int, block_size: int) -> dict:
    """The FP8 kernel's tiles (an fp8_e4m3 cache): BLOCK_M 128 (two warpgroups), BLOCK_N 128, a 3-stage K/V ring
    (Q 2 x 16 KB + K/V 96 KB + V^T 16 KB + P 32 KB of shared memory at D 128), no spills
    (``bench/gluon_aot_check.py --fp8``), q as two E4M3 terms (Q_SPLIT; False: one, ~7% faster and less exact).
    The fastest of the configs timed on an H100 (``bench/results/fp8-prefill-h100-20261207/``: 440 TFLOP/s at 8k
    contiguous, against 367-421 for BLOCK_N 64 or 2 stages). NUM_VT and CHUNK are read by VARIANT "fp8pp" only
    (its V^T buffers and the keys per step of its producer's transpose)."""
    return dict(BLOCK_M=128, BLOCK_N=128, NUM_STAGES=3, num_warps=8, VARIANT=FP8_VARIANT, Q_SPLIT=True, NUM_VT=2,
                CHUNK=32)


SMEM_LIMIT = 227 * 1024  # bytes of shared memory one CTA may use on sm_90 (H100/H200)


def gluon_config_reason(cfg: dict, head_dim: int, tree: bool = False, fp8: bool = False) -> str | None:
    """Why the full config ``cfg`` (BLOCK_M, BLOCK_N, NUM_STAGES, num_warps, VARIANT; NUM_VT and CHUNK with "fp8pp")
    cannot run, or None.
    Host-only (no device query): the rules of the kernels in ``roofline.kernels.gluon_prefill_kernels``.
    ``fp8``: the cache holds float8_e4m3fn codes (a VARIANT in ``FP8_VARIANTS`` only)."""
    variant = cfg.get("VARIANT")
    if fp8 != (variant in FP8_VARIANTS):
        return (f"VARIANT {variant!r} with a {'float8_e4m3fn' if fp8 else '16-bit'} cache: an fp8 cache runs "
                f"VARIANT {' or '.join(map(repr, FP8_VARIANTS))}, which need one")
    if tree and variant not in TREE_VARIANTS:
        return f"tree_mask with VARIANT {variant!r}: the Gluon tree mask is in {TREE_VARIANTS} only"
    if cfg["BLOCK_N"] not in (64, 128) or cfg["BLOCK_M"] != 16 * cfg["num_warps"] or cfg["NUM_STAGES"] < 2 \
            or variant not in (*GLUON_VARIANTS, *FP8_VARIANTS) \
            or (variant in (*TWO_CONSUMER_VARIANTS, *FP8_VARIANTS) and cfg["BLOCK_M"] != 128):
        return (f"config {cfg}: BLOCK_N must be 64 or 128, BLOCK_M 16 * num_warps (128 for "
                f"{(*TWO_CONSUMER_VARIANTS, *FP8_VARIANTS)}), NUM_STAGES >= 2 and VARIANT one of "
                f"{(*GLUON_VARIANTS, *FP8_VARIANTS)}")
    if variant == FP8_PINGPONG and (cfg["NUM_VT"] not in (1, 2, 3) or cfg["CHUNK"] not in (16, 32, 64)
                                    or cfg["CHUNK"] > cfg["BLOCK_N"]):
        return (f"config {cfg}: {FP8_PINGPONG!r} needs NUM_VT in (1, 2, 3) and CHUNK in (16, 32, 64), at most "
                f"BLOCK_N")
    block_n = min(cfg["BLOCK_N"], TREE_BLOCK_N) if tree else cfg["BLOCK_N"]
    if fp8:  # 1-byte Q (both terms, allocated either way) + K/V ring, V^T [NUM_VT, D, BLOCK_N], P [2, BLOCK_M, BLOCK_N]
        num_vt = cfg["NUM_VT"] if variant == FP8_PINGPONG else 1
        smem = (head_dim * (2 * cfg["BLOCK_M"] + 2 * cfg["NUM_STAGES"] * block_n + num_vt * block_n)
                + 2 * cfg["BLOCK_M"] * block_n)
    else:
        smem = 2 * head_dim * (cfg["BLOCK_M"] + 2 * cfg["NUM_STAGES"] * block_n)  # Q + the K/V ring, 16-bit
    if smem > SMEM_LIMIT:
        return (f"config {cfg}: Q + {cfg['NUM_STAGES']} K/V stages need {smem} B of shared memory at head_dim "
                f"{head_dim}, above the {SMEM_LIMIT} B a CTA may use")
    return None


def gluon_unsupported_reason(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor | None = None,
                             tree_mask: torch.Tensor | None = None,
                             config: dict | None = None) -> str | None:
    """Why the Gluon kernel cannot run this call (a short phrase naming the value), or None if it can."""
    if gl is None:
        return "triton.experimental.gluon is not importable"
    if not q.is_cuda:
        return f"device {q.device} is not CUDA"
    cap = torch.cuda.get_device_capability(q.device)
    if cap[0] != 9:
        return f"compute capability {cap[0]}.{cap[1]} is not 9.x (Hopper)"
    fp8 = k_cache.dtype == torch.float8_e4m3fn
    if q.dtype not in GLUON_DTYPES or not (fp8 or k_cache.dtype == q.dtype):
        return (f"dtype q {q.dtype} / cache {k_cache.dtype}: needs q bf16 or fp16 and the cache in q's dtype or "
                f"float8_e4m3fn")
    head_dim = q.shape[2]
    if head_dim not in GLUON_HEAD_DIMS:
        return f"head_dim {head_dim} not in {GLUON_HEAD_DIMS}"
    block_size = k_cache.shape[1]
    if block_size < 16 or block_size & (block_size - 1):
        return f"block_size {block_size} is not a power of two >= 16"
    default = default_gluon_fp8_config if fp8 else default_gluon_config
    cfg = {**default(head_dim, block_size), **(config or {})}
    reason = gluon_config_reason(cfg, head_dim, tree_mask is not None, fp8)
    if reason is not None:
        return reason
    if q.stride(2) != 1 or q.stride(1) != head_dim or q.stride(0) % 8 or q.data_ptr() % 16:
        return f"q strides {q.stride()}: rows must be [H, D] contiguous and 16-byte aligned for TMA"
    num_kv_heads = k_cache.shape[2]
    row = num_kv_heads * head_dim
    if k_cache.stride() != (block_size * row, row, head_dim, 1) or k_cache.data_ptr() % 16:
        return f"cache strides {k_cache.stride()}: TMA views the cache as [num_blocks * block_size, H_kv * D]"
    if v_cache is not None and (v_cache.stride() != k_cache.stride() or v_cache.data_ptr() % 16):
        return f"v_cache strides {v_cache.stride()} differ from k_cache's {k_cache.stride()}"
    return None


def _log_once(reason: str) -> None:
    if reason not in _logged:
        _logged.add(reason)
        logger.info("gluon prefill: %s; using the Triton prefill kernel", reason)


def gluon_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: PagedBatch,
    scale: float,
    out: torch.Tensor | None = None,
    config: dict | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    tree_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of new tokens over their paged context, by the Gluon sm_90 kernel when it applies
    (module docstring), else by ``paged_prefill_attention`` (same arguments; one log line per reason).

    Args:
        q: [num_tokens, H, D] bf16/fp16, rows of sequence i at query_start_loc[i]:query_start_loc[i+1].
        k_cache, v_cache: [num_blocks, block_size, H_kv, D], already holding this step's keys/values.
        meta: query_start_loc [num_seqs+1] int32, seq_lens [num_seqs] int32, block_tables [num_seqs, W] int32,
            max_query_len (host int).
        scale: softmax scale. out: optional [num_tokens, H, D] output.
        config: optional dict(BLOCK_M, BLOCK_N, NUM_STAGES, num_warps, VARIANT) over ``default_gluon_config``;
            a fallback runs the Triton kernel with its own default config.
        k_scale, v_scale: as ``paged_prefill_attention``. An fp8 cache (float32 [H_kv] scales) runs the FP8 kernel:
            q is quantized per (token, head) to E4M3 (``per_token_quant_fp8``, one launch) and P to E4M3; the
            result is within ``FP8_REL_TOL`` of the float64 oracle on the same cache codes. An int8 cache runs
            the Triton kernel.
        tree_mask: as ``paged_prefill_attention`` ([num_seqs, W <= 64] int64 ancestor bitmasks); Gluon runs it
            with the ``TREE_VARIANTS`` (BLOCK_N capped at ``TREE_BLOCK_N``), the others fall back.

    Returns:
        [num_tokens, H, D] in q's dtype (fp32 softmax statistics and accumulation).

    Raises:
        ValueError: as ``paged_prefill_attention`` (shapes, H not a multiple of H_kv, a tree_mask wider than 64).
    """
    check_paged_attention_inputs(q, k_cache, v_cache)
    quant = kv_quant_mode(k_cache, k_scale, v_scale)
    num_seqs = meta.query_start_loc.shape[0] - 1
    check_tree_mask(tree_mask, num_seqs)
    fp8 = quant == KV_QUANT_PER_HEAD
    if quant and not fp8:
        reason = "int8 KV cache (the Gluon kernels read bf16/fp16 or fp8_e4m3 caches)"
    elif fp8 and (config or {}).get("VARIANT") not in FP8_VARIANTS and os.environ.get(FP8_PREFILL_ENV, "1") == "0":
        reason = f"fp8_e4m3 cache: the Gluon FP8 kernel is off ({FP8_PREFILL_ENV}=0)"
    else:
        reason = gluon_unsupported_reason(q, k_cache, v_cache, tree_mask, config)
    if reason is not None:
        _log_once(reason)
        return paged_prefill_attention(q, k_cache, v_cache, meta, scale, out=out,
                                       k_scale=k_scale, v_scale=v_scale, tree_mask=tree_mask)
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    if fp8:
        return launch_gluon_fp8(q, k_cache, v_cache, meta, scale, out,
                           {**default_gluon_fp8_config(head_dim, block_size), **(config or {})}, k_scale, v_scale)
    cfg = {**default_gluon_config(head_dim, block_size), **(config or {})}
    if tree_mask is not None:
        cfg["BLOCK_N"] = min(cfg["BLOCK_N"], TREE_BLOCK_N)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    page_rows = min(block_size, block_n)
    gdt = gl.bfloat16 if q.dtype == torch.bfloat16 else gl.float16
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, head_dim], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gdt)
    q2 = q.as_strided((num_tokens, num_heads * head_dim), (q.stride(0), 1))  # q may be a view of a fused qkv
    q_desc = TensorDescriptor(q2, list(q2.shape), [q2.stride(0), 1], [block_m, head_dim], q_layout)
    num_slots = k_cache.shape[0] * block_size
    k_desc, v_desc = (TensorDescriptor(c, [num_slots, num_kv_heads * head_dim], [c.stride(1), 1],
                                       [page_rows, head_dim], kv_layout) for c in (k_cache, v_cache))
    grid = ((meta.max_query_len + block_m - 1) // block_m, num_seqs, num_heads)
    variant = cfg["VARIANT"]
    num_warps = cfg["num_warps"]
    extra = dict(maxnreg=WS_MAXNREG) if variant in ("ws", *TWO_CONSUMER_VARIANTS) else {}
    if variant in TREE_VARIANTS:  # TreeMask is any pointer without a tree (unused)
        tm = tree_mask if tree_mask is not None else meta.seq_lens
        extra.update(TreeMask=tm, stride_tm=tree_mask.stride(0) if tree_mask is not None else 0,
                     TREE=tree_mask is not None, TREE_ROWS=check_tree_mask(tree_mask, num_seqs))
    if variant in TWO_CONSUMER_VARIANTS:  # 3 partitions of 4 + 4 + 1 warps (padded to 12), 168 x 384 registers
        num_warps = 4
        if variant == "persistent":
            num_mb = grid[0]
            items = num_mb * num_seqs * num_heads
            grid = (min(items, _num_sms(q.device)),)
            extra.update(num_seqs=num_seqs, num_heads=num_heads, num_m_blocks=num_mb)
        else:
            extra["PINGPONG"] = TWO_CONSUMER_VARIANTS[variant]
    GLUON_KERNELS[variant][grid](
        q_desc, k_desc, v_desc, out, meta.block_tables, meta.query_start_loc, meta.seq_lens,
        scale * LOG2E, out.stride(0), out.stride(1), meta.block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, PAGE=block_size, PAGE_ROWS=page_rows, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=cfg["NUM_STAGES"], num_warps=num_warps, **extra,
    )
    return out


# Relative Frobenius error of the FP8 kernel against the float64 oracle on the same cache codes (q and P rounded
# to E4M3). On an H100 (every GPU case of tests/kernels/test_gluon_prefill.py, 2026-12-07): 1.72-1.88e-2 with q in
# two terms (the default), 2.65-2.85e-2 with one; its torch twin gives 1.7-1.9e-2 and 2.7-2.8e-2 on the CPU.
FP8_REL_TOL = 3e-2


def ref_fp8_attention_tiles(qc: torch.Tensor, k: torch.Tensor, v: torch.Tensor, visible: torch.Tensor,
                            row_scale: torch.Tensor | float, block_n: int, round_p: bool = True) -> torch.Tensor:
    """The FP8 kernel's online softmax and PV over one sequence, in float32: tiles of ``block_n`` keys, log2
    units, each tile's P rounded as e4m3(P * 448) (``round_p``) before its product with v, the row sum of the
    unrounded P.

    Args:
        qc: [H, Q, D] float32 (q's code values, or values with ``row_scale`` the plain softmax scale).
        k, v: [H, S, D] float32 (cache codes or values). visible: bool [Q, S] (False: masked key).
        row_scale: [H, Q, 1] or a float: the factor that turns qc . k into log2-unit logits.
        block_n: keys per tile (the kernel's BLOCK_N).

    Returns:
        acc / (448 * l): [H, Q, D] float32 (times v's scale for output values).
    """
    from roofline.kernels.common import FP8_E4M3_MAX

    num_heads, q_len, head_dim = qc.shape
    m = torch.full((num_heads, q_len, 1), float("-inf"), device=qc.device)
    l_sum = torch.zeros((num_heads, q_len, 1), device=qc.device)
    acc = torch.zeros((num_heads, q_len, head_dim), device=qc.device)
    for n0 in range(0, k.shape[1], block_n):
        s = torch.bmm(qc, k[:, n0:n0 + block_n].transpose(1, 2)) * row_scale
        s = s.masked_fill(~visible[None, :, n0:n0 + block_n], float("-inf"))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        p = torch.exp2(s - m_new)
        alpha = torch.exp2(m - m_new)
        l_sum = l_sum * alpha + p.sum(-1, keepdim=True)
        p8 = p * FP8_E4M3_MAX
        if round_p:
            p8 = p8.to(torch.float8_e4m3fn).float()
        acc = acc * alpha + torch.bmm(p8, v[:, n0:n0 + block_n])
        m = m_new
    return acc / (FP8_E4M3_MAX * l_sum)


def ref_prefill_attention_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedBatch,
                              scale: float, k_scale: torch.Tensor, v_scale: torch.Tensor,
                              block_n: int = 128, q_split: bool = True) -> torch.Tensor:
    """Pure-torch twin of the FP8 kernel's arithmetic (``gluon_prefill_kernel_fp8``), in float32 on any device:
    q rounded per (token, head) row to E4M3 (``ref_per_token_quant_fp8_split``: two terms with ``q_split``, as
    the kernel's Q_SPLIT, else hi alone), S from the codes times q_scale * k_scale * scale, then
    ``ref_fp8_attention_tiles`` and O = acc * v_scale. The same rounding points as the kernel, not its bits
    (exp2 and the order of fp32 sums differ).

    Args: as ``gluon_prefill_attention`` with an fp8_e4m3 cache (k_scale, v_scale float32 [H_kv]); ``block_n``
        the kernel's BLOCK_N (default: ``default_gluon_fp8_config``'s).
    Returns: [num_tokens, H, D] in q's dtype.
    """
    from roofline.kernels.act_quant import ref_per_token_quant_fp8_split

    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    hi, lo, q_scale = ref_per_token_quant_fp8_split(q)
    q8 = (hi.float() + lo.float() if q_split else hi.float()).view(num_tokens, num_heads, head_dim)
    q_scale = q_scale.view(num_tokens, num_heads)
    ks = k_scale.float().repeat_interleave(group)  # [H]
    vs = v_scale.float().repeat_interleave(group)
    out = torch.empty_like(q)
    flat_k = k_cache.reshape(-1, num_kv_heads, head_dim)
    flat_v = v_cache.reshape(-1, num_kv_heads, head_dim)
    qsl = meta.query_start_loc.tolist()
    for i, seq_len in enumerate(meta.seq_lens.tolist()):
        start, q_len = qsl[i], qsl[i + 1] - qsl[i]
        if q_len == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        slots = meta.block_tables[i].long()[pos // block_size] * block_size + pos % block_size
        k = flat_k[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)  # [H, S, D] codes
        v = flat_v[slots].float().repeat_interleave(group, dim=1).transpose(0, 1)
        row_scale = (q_scale[start:start + q_len] * ks * (scale * LOG2E)).t()[:, :, None]  # [H, Q, 1]
        visible = pos[None, :] <= (pos[seq_len - q_len:])[:, None]  # [Q, S] causal
        o = ref_fp8_attention_tiles(q8[start:start + q_len].transpose(0, 1), k, v, visible, row_scale, block_n)
        out[start:start + q_len] = (o * vs[:, None, None]).transpose(0, 1).to(q.dtype)
    return out


def launch_gluon_fp8(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: PagedBatch, scale: float,
                     out: torch.Tensor, cfg: dict, k_scale: torch.Tensor, v_scale: torch.Tensor,
                     q_fp8: tuple[torch.Tensor, torch.Tensor | None, torch.Tensor] | None = None) -> torch.Tensor:
    """The FP8 kernel (``gluon_prefill_kernel_fp8``) on an fp8_e4m3 cache, no checks (``gluon_prefill_attention``
    checks, then calls this). q [T, H, D] 16-bit is quantized here per (token, head) row to E4M3 with float32
    scales (two terms with cfg["Q_SPLIT"], ``per_token_quant_fp8_split``), unless ``q_fp8`` = (hi, lo or None
    float8_e4m3fn [T * H, D], scales float32 [T * H, 1]) gives them (row t * H + h). cfg: a full config
    (``default_gluon_fp8_config``). Returns out."""
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    page_rows = min(block_size, block_n)
    split = cfg.get("Q_SPLIT", True)
    if q_fp8 is None:  # [T * H, D] codes, [T * H, 1] scales: row t * H + h
        if split:
            q_fp8 = per_token_quant_fp8_split(q)
        else:
            hi, scale_q = per_token_quant_fp8(q)
            q_fp8 = (hi, None, scale_q)
    q8, q_lo, q_scale = q_fp8
    q2 = q8.view(num_tokens, num_heads * head_dim)
    fdt = gl.float8e4nv
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, head_dim], fdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], fdt)
    q_desc = TensorDescriptor(q2, list(q2.shape), [q2.stride(0), 1], [block_m, head_dim], q_layout)
    qlo_desc = q_desc
    if split:
        lo2 = q_lo.view(num_tokens, num_heads * head_dim)
        qlo_desc = TensorDescriptor(lo2, list(lo2.shape), [lo2.stride(0), 1], [block_m, head_dim], q_layout)
    num_slots = k_cache.shape[0] * block_size
    k_desc, v_desc = (TensorDescriptor(c, [num_slots, num_kv_heads * head_dim], [c.stride(1), 1],
                                       [page_rows, head_dim], kv_layout) for c in (k_cache, v_cache))
    grid = ((meta.max_query_len + block_m - 1) // block_m, meta.query_start_loc.shape[0] - 1, num_heads)
    variant = cfg.get("VARIANT", FP8_VARIANT)
    num_warps = cfg["num_warps"]
    extra = {}
    if variant == FP8_PINGPONG:  # 3 warpgroups: the default partition (consumer 0) + consumer 1 + the producer
        num_warps = 4
        extra = dict(maxnreg=WS_MAXNREG, NUM_VT=cfg["NUM_VT"], CHUNK=cfg["CHUNK"])
    GLUON_KERNELS[variant][grid](
        q_desc, qlo_desc, k_desc, v_desc, out, meta.block_tables, meta.query_start_loc, meta.seq_lens, q_scale, k_scale,
        v_scale, scale * LOG2E, out.stride(0), out.stride(1), meta.block_tables.stride(0), num_heads,
        GROUP=num_heads // num_kv_heads, PAGE=block_size, PAGE_ROWS=page_rows, HEAD_DIM=head_dim,
        BLOCK_M=block_m, BLOCK_N=block_n, NUM_STAGES=cfg["NUM_STAGES"], num_warps=num_warps, Q_SPLIT=split,
        **extra,
    )
    return out


_SMS: dict[int, int] = {}


def _num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device`` (the persistent grid: one CTA per SM), cached."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SMS:
        _SMS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SMS[index]


def choose_prefill_kernel(requested: str | None = None) -> Callable[..., torch.Tensor]:
    """The prefill entry point a backend uses, decided once at backend init: ``requested`` or the
    ``ROOFLINE_PREFILL_KERNEL`` environment variable: "auto" (default: "gluon" where the current CUDA device is
    sm_90 and Gluon imports, else "triton"), "triton" or "gluon" (which still falls back per call, logged, where
    the Gluon kernel does not apply).

    Raises:
        ValueError: a name outside ``PREFILL_KERNELS`` (names the allowed ones).
    """
    name = (requested if requested is not None else os.environ.get(PREFILL_KERNEL_ENV, "auto")).strip().lower()
    if name not in PREFILL_KERNELS:
        raise ValueError(f"{PREFILL_KERNEL_ENV}={name!r}: the prefill kernel must be one of {PREFILL_KERNELS}")
    if name == "auto":
        hopper = gl is not None and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
        name = "gluon" if hopper else "triton"
    if name == "gluon":
        logger.info("prefill attention: Gluon sm_90 kernel where it applies (%s=gluon)", PREFILL_KERNEL_ENV)
        return gluon_prefill_attention
    return paged_prefill_attention
