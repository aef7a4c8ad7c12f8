"""The split-K epilogue shared by the GEMV kernels (``roofline.kernels.quant_gemv``): its own module so that the
GEMV does not import ``quant_gemm`` (which launches the GEMV): no import cycle between the two. Also the
arrival counters every last-arrival reduction uses (split-K GEMMs, the MoE router, split-KV decode attention)."""

from __future__ import annotations

import torch

_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown buffers: CUDA graphs captured with them still replay on them


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """A zeroed int32 buffer of >= n arrival counters for ``device``, shared by every kernel that reduces by last
    arrival: each program atomically counts itself in (acq_rel, gpu scope), and the last one reduces and writes
    0 back, so the buffer is zero again when the kernel ends. Kernels of one stream may share it because each
    uses it only after its programmatic-dependent-launch wait (``roofline.kernels.pdl``), i.e. after the kernel
    before it has finished; kernels on different streams must not run concurrently on it. A request for more
    counters than the buffer holds (decode attention asks for rows x kv heads) allocates a larger one and keeps
    the old one alive, zeroed, for the graphs that captured it."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        if buf is not None:
            _RETIRED.append(buf)
        buf = torch.zeros(max(n, 2 * buf.numel() if buf is not None else 16384), dtype=torch.int32, device=device)
        _COUNTERS[device] = buf
    return buf


try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

if triton is not None:

    @triton.jit
    def _splitk_epilogue(acc, offs_m, offs_n, mmask, nmask, Out, Partials, Counters, pid, split, M, N, stride_om,
                         SPLIT_K, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        # acc: fp32 [BLOCK_M, BLOCK_N]. Store, or split-K reduce as in _qgemm_kernel (last arrival sums the
        # partials in split order, deterministic, and re-arms the tile's counter). SPLIT_K is a run-time value
        # (one compiled GEMV serves every split count).
        omask = mmask[:, None] & nmask[None, :]
        out_ptrs = Out + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
        if SPLIT_K == 1:
            tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=omask)
        else:
            mn = offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
            tl.store(Partials + split.to(tl.int64) * M * N + mn, acc, mask=omask)
            tl.debug_barrier()
            arrived = tl.atomic_add(Counters + pid, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT_K - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for sp in range(SPLIT_K):
                    total += tl.load(Partials + sp * M * N + mn, mask=omask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptrs, total.to(Out.dtype.element_ty), mask=omask)
                tl.atomic_xchg(Counters + pid, 0)
