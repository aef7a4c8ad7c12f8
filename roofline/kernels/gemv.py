"""Small-M linear layers (decode GEMV) in Triton, and a dispatcher that picks it or cuBLAS by M.

At decode batch sizes (M = 1..16 rows) ``y = x W^T`` is a stream over the weight [N, K]: N*K*itemsize
bytes against 2*M*N*K FLOPs, far below the H200's ridge point (~200 FLOP/byte), so the floor is
bytes / HBM bandwidth. cuBLAS picks GEMM tilings that leave bandwidth on the table for M = 1 (issue 5:
2.66 TB/s for a 14336x4096 bf16 weight against 4.10 TB/s for a plain read).

Kernel: grid (cdiv(N, BLOCK_N), cdiv(M, 16)). A program owns BLOCK_N output columns ("wide-N": small
BLOCK_N gives N/BLOCK_N programs, several resident per SM, enough bytes in flight to cover DRAM latency)
and walks the full K in BLOCK_K steps: W tile [BLOCK_N, BLOCK_K] (rows contiguous in memory) and x tile
[16, BLOCK_K] (M padded to 16 for tl.dot), fp32 accumulator [16, BLOCK_N]. Every weight byte is read once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

# Largest M for which fast_linear uses the Triton GEMV. Measured on the H200 (docs/kernels.md,
# bench/results/gemv-*.json): the best-tuned Triton GEMV is within -3%..+10% of cuBLAS per shape and
# slower on some M (2-8) specialisations, so it does not pay robustly: 0 = always F.linear.
FAST_LINEAR_MAX_M = 0
DEFAULT_GEMV_CONFIG = dict(BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=4)


def ref_linear_small_m(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """Pure-torch twin: x [..., K] @ weight[N, K]^T (+ bias [N]) -> [..., N] in x's dtype."""
    return F.linear(x, weight, bias)


if triton is not None:

    @triton.jit
    def _gemv_kernel(
        X, W, B, Out, M, N, K,
        stride_xm, stride_wn, stride_om,
        HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr, DOT_PRECISION: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_k = tl.arange(0, BLOCK_K)
        mmask = offs_m < M
        nmask = offs_n < N
        x_ptrs = X + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
        w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                x = tl.load(x_ptrs, mask=mmask[:, None], other=0.0)
                w = tl.load(w_ptrs, mask=nmask[:, None], other=0.0)
            else:
                kmask = (k0 + offs_k) < K
                x = tl.load(x_ptrs, mask=mmask[:, None] & kmask[None, :], other=0.0)
                w = tl.load(w_ptrs, mask=nmask[:, None] & kmask[None, :], other=0.0)
            acc = tl.dot(x, tl.trans(w), acc, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
            x_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(B + offs_n, mask=nmask, other=0.0).to(tl.float32)[None, :]
        tl.store(Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :],
                 acc.to(Out.dtype.element_ty), mask=mmask[:, None] & nmask[None, :])


def linear_small_m(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, config: dict | None = None
) -> torch.Tensor:
    """y = x @ weight^T + bias with a weight-streaming Triton GEMV (meant for M <= 16 rows).

    Args:
        x: [..., K] fp32/fp16/bf16 (M = prod of leading dims).
        weight: [N, K], same dtype, K contiguous.
        bias: optional [N].
        config: optional dict(BLOCK_N, BLOCK_K, num_warps, num_stages) over DEFAULT_GEMV_CONFIG.

    Returns:
        [..., N] in x's dtype; fp32 accumulation.

    Raises:
        ValueError: shape/dtype mismatch. RuntimeError: triton missing.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use torch.nn.functional.linear on this machine")
    n, k = weight.shape
    if x.shape[-1] != k or x.dtype != weight.dtype:
        raise ValueError(f"x {tuple(x.shape)}/{x.dtype} does not match weight {tuple(weight.shape)}/{weight.dtype}")
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    cfg = dict(DEFAULT_GEMV_CONFIG)
    if config:
        cfg.update(config)
    if m > 0:
        grid = (triton.cdiv(n, cfg["BLOCK_N"]), triton.cdiv(m, 16))
        _gemv_kernel[grid](
            x2, weight, bias if bias is not None else weight, out, m, n, k,
            x2.stride(0), weight.stride(0), out.stride(0),
            HAS_BIAS=bias is not None, EVEN_K=k % cfg["BLOCK_K"] == 0,
            DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            BLOCK_M=16, BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return out.view(*x.shape[:-1], n)


def fast_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, except on CUDA fp16/bf16 with at most FAST_LINEAR_MAX_M rows: the Triton GEMV."""
    m = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if (triton is not None and x.is_cuda and 0 < m <= FAST_LINEAR_MAX_M
            and x.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x.dtype):
        return linear_small_m(x, weight, bias)
    return F.linear(x, weight, bias)
