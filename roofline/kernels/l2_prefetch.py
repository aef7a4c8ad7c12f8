"""Stream a weight into the GPU's L2 cache while a decode step is busy with kernels that barely touch HBM
(issue 28, "no bubbles").

At batch 1 a decode step alternates between weight streams (the GEMVs, bound by HBM bandwidth) and kernels
that are bound by latency: RoPE + the KV store, decode attention over a short context, its reduction, the
norms, SiLU-and-mul. While those run the memory system idles. :func:`prefetch` launches a small kernel whose
lanes issue Hopper bulk L2 prefetches (``cp.async.bulk.prefetch.L2.global``: one instruction moves up to
``LANE_BYTES`` contiguous bytes from HBM into L2, no registers, no completion to wait for) over the first
``max_bytes`` of a weight, so the GEMV that reads that weight a few kernels later finds it in L2 (50 MB on
H100 and H200). Launched with programmatic dependent launch, the kernel starts while the previous kernel
still runs; it issues its prefetches first, then lets the next kernel launch, then waits for the previous one
(so completion order, which the next kernel's ``gdc_wait`` relies on, is kept).

Sources: PTX ISA 8.0, ``cp.async.bulk.prefetch`` (sm_90); CUDA C++ Programming Guide, "Programmatic Dependent
Launch"; H100/H200 L2 capacity, NVIDIA H100 Tensor Core GPU Architecture whitepaper (50 MB).

``MAX_BYTES`` (per call; 0 off) and ``SITES`` are process-wide and read at launch, so before CUDA graph capture
(``roofline bench decode --l2-prefetch``). A site is a layer's name, launched right after the kernel before its
producer (``o_proj`` after qkv, ``gate_up_proj`` after o_proj, ``down_proj`` after gate_up), or ``NAME@qkv``:
that layer's weight launched right after qkv, to stream during RoPE and attention as well.
"""

from __future__ import annotations

import torch

from roofline.kernels import pdl

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = None

MAX_BYTES = 0  # bytes of a weight prefetched per call; 0: off
SITES: frozenset[str] = frozenset({"o_proj", "gate_up_proj", "down_proj"})
KIND = "line"  # "bulk": cp.async.bulk.prefetch.L2 of LANE_BYTES a lane; "line": prefetch.global.L2 per 128-byte line
LANES = 32  # bulk: one warp a program
LANE_BYTES = 4096  # bulk: bytes per prefetch (a multiple of 16)
LINES = 1024  # line: 128-byte lines a program (128 KB), over 4 warps
MAX_M = 16  # decode sizes only: above this the GEMMs are not bound by the weight stream


def enabled(num_tokens: int, site: str) -> bool:
    """True where a linear layer named ``site`` asks for :func:`prefetch` at ``num_tokens`` rows: ``MAX_BYTES`` >
    0, ``site`` in ``SITES`` and ``num_tokens`` <= ``MAX_M`` (the device is :func:`prefetch`'s question)."""
    return bool(MAX_BYTES) and num_tokens <= MAX_M and site in SITES


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _l2_prefetch_kernel(P, nbytes, LANES: tl.constexpr, LANE_BYTES: tl.constexpr, PDL: tl.constexpr):
        # Lane i of program p prefetches bytes [(p LANES + i) LANE_BYTES, + LANE_BYTES) of P (clipped to nbytes,
        # rounded down to 16: the instruction's granularity; the caller passes a 16-byte aligned P).
        off = tl.program_id(0).to(tl.int64) * (LANES * LANE_BYTES) + tl.arange(0, LANES).to(tl.int64) * LANE_BYTES
        size = (tl.minimum(nbytes - off, LANE_BYTES) // 16 * 16).to(tl.int32)
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.gt.s32 p, $2, 0; @p cp.async.bulk.prefetch.L2.global [$1], $2; mov.u32 $0, 0; }",
            "=r,l,r", [P + off, size], dtype=tl.int32, is_pure=False, pack=1)
        if PDL:
            gdc_launch_dependents()  # the next kernel may launch; it still waits for this one to finish
            gdc_wait()  # finish after the previous kernel, so the next kernel's gdc_wait covers it too

    @triton.jit
    def _l2_prefetch_lines_kernel(P, nbytes, LINES: tl.constexpr, PDL: tl.constexpr):
        # One prefetch.global.L2::evict_last per 128-byte line of P below nbytes: no destination register, nothing
        # to wait for, so the warp moves on (unlike a bulk prefetch, which the measured CTAs outlived).
        off = tl.program_id(0).to(tl.int64) * (LINES * 128) + tl.arange(0, LINES).to(tl.int64) * 128
        tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.lt.s64 p, $2, $3; @p prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0; }",
            "=r,l,l,l", [P + off, off, nbytes + tl.zeros_like(off)], dtype=tl.int32, is_pure=False, pack=1)
        if PDL:
            gdc_launch_dependents()
            gdc_wait()


def prefetch(t: torch.Tensor, max_bytes: int | None = None) -> int:
    """Start moving the first ``max_bytes`` (default ``MAX_BYTES``) of ``t``'s storage into L2; returns the bytes
    requested (0 where nothing launched: a CPU tensor, no triton, a device without bulk prefetch).

    Args:
        t: a contiguous CUDA tensor (any dtype), 16-byte aligned (every torch allocation is).
        max_bytes: a cap; the prefetch covers ``min(t.nbytes, max_bytes)`` rounded down to 16 bytes.
    Nothing is read back: the prefetch is a hint, correctness never depends on it.
    """
    cap = MAX_BYTES if max_bytes is None else max_bytes
    if triton is None or t.device.type != "cuda" or not pdl.has_pdl(t.device) or cap <= 0:
        return 0
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError(f"l2_prefetch: needs a contiguous, 16-byte aligned tensor, got strides {t.stride()} at "
                         f"address {t.data_ptr():#x}")
    nbytes = min(t.numel() * t.element_size(), cap) // 16 * 16
    if nbytes <= 0:
        return 0
    flat = t.reshape(-1).view(torch.uint8)
    if KIND == "bulk":
        _l2_prefetch_kernel[(triton.cdiv(nbytes, LANES * LANE_BYTES),)](
            flat, nbytes, LANES=LANES, LANE_BYTES=LANE_BYTES, num_warps=1, **pdl.launch_kwargs(t.device))
    else:
        _l2_prefetch_lines_kernel[(triton.cdiv(nbytes, LINES * 128),)](
            flat, nbytes, LINES=LINES, num_warps=4, **pdl.launch_kwargs(t.device))
    return nbytes
