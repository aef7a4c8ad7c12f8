"""``--quantization int8`` on CPU: INT8 weights x INT8 activations quantized per token (W8A8 dynamic).

The format's weights are the same on every device (``qweight`` int8 [N, K], symmetric per output channel,
``weight_scale`` float32 [N]: ``roofline.quant.int8``). On CPU the matmul quantizes the activations too, as
vLLM's CPU backend runs its INT8 W8A8 layers, because torch's CPU weight-only kernel
(``torch._weight_int8pack_mm``) was far slower than fp32 here while the integer GEMM was faster (issue 32;
``python -m roofline.bench.cpu --gemm`` on the AMD EPYC Zen 5 of 2026-12-04, 2 threads: the default model's 121
linears of a decode step with distinct weights, lm_head included, each format throughout: W8A16
``_weight_int8pack_mm`` 0.37x fp32 at M = 1 and 0.02x at M = 32; W8A8 ``torch._int_mm`` on the same codes 3.26x
at M = 1 and 3.49x at M = 32).

Arithmetic, per row m of ``x`` [M, K]:
1. ``s_x[m] = max(max_k |x[m, k]| / 127, 1e-10)`` and ``q_x[m, k] = round(x[m, k] / s_x[m])`` (|q_x| <= 127
   by construction, so no clamp is needed), the same per-token rounding as SmoothQuant's W8A8;
2. ``acc = q_x @ qweight^T`` in int32 (``torch._int_mm``: AVX-512 VNNI / AMX through oneDNN), exact;
3. ``out[m, n] = acc[m, n] * (s_x[m] * weight_scale[n])`` in float32.
Steps 1 and 2 are exact integer work per row, so a row's output does not depend on its batch-mates
(batch-invariant greedy decoding). One row (batch-1 decode) runs all three steps in one C++ call
(:func:`gemv_w8a8`, AVX-512 VNNI), bit-identical to the torch ops, which take every other shape. Quality is W8A8's: activation outliers set the row's scale (no smoothing
at load), measured with ``roofline eval`` in the README's quality table.
"""

from __future__ import annotations

import functools

import torch

from roofline.kernels.cpu_bf16 import TILE_MAX_ROWS

INT8_MAX = 127.0
MIN_SCALE = 1e-10  # the scale floor of roofline.kernels.quant_types.quantize_per_token_int8


def quantize_rows_int8(x: torch.Tensor, row_parallel: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric INT8 per row: ``x`` float32 [M, K] -> (codes int8 [M, K], scales float32 [M, 1]).

    Four ops (the decode step runs this 120 times per token, so each op's dispatch counts): inf-norm,
    scale, divide-and-round, cast. Equal to ``quantize_per_token_int8`` (same scale, same division).
    ``row_parallel``: ``x`` is this rank's K / tp columns of each row (a row-parallel layer under tensor
    parallelism); the ranks take the row's maximum together (one all-reduce of [M] floats), so each token gets
    the scale of its whole row and TP gives one process's codes.
    """
    amax = torch.linalg.vector_norm(x, float("inf"), dim=-1, keepdim=True)
    if row_parallel:
        from roofline.distributed.communication import tensor_parallel_all_reduce

        amax = tensor_parallel_all_reduce(amax, op="max")
    scale = (amax / INT8_MAX).clamp_(min=MIN_SCALE)
    return torch.round(x / scale).to(torch.int8), scale


def w8a8_dynamic_linear(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
                        bias: torch.Tensor | None = None, row_parallel: bool = False,
                        packed: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] (any float dtype) @ (``qweight`` int8 [N, K] * ``weight_scale`` float32 [N])^T (+ ``bias``
    [N]) with ``x`` quantized per token to INT8 -> [..., N] in ``x``'s dtype. CPU tensors. ``row_parallel``: K is
    this rank's shard of a row-parallel layer (``quantize_rows_int8``); the caller all-reduces the output.
    ``packed``: ``qweight``'s tiles (:func:`tile_pack_int8`), which 2 to ``cpu_bf16.TILE_MAX_ROWS`` rows go
    through (:func:`tile_linear_w8a8`, bit-identical to the torch path and to :func:`gemv_w8a8`'s rows), and one
    row too on a CPU without AMX-INT8 (:func:`vnni_linear_w8a8`; one row takes :func:`gemv_w8a8` otherwise).

    Raises:
        ValueError: ``x``'s last dim is not ``qweight``'s K, ``qweight`` is not int8, or ``weight_scale`` / ``bias``
            do not have N elements.
    """
    if x.shape[-1] != qweight.shape[1] or qweight.dtype != torch.int8:
        raise ValueError(f"w8a8_dynamic_linear: x [..., {x.shape[-1]}] needs int8 qweight [N, {x.shape[-1]}], "
                         f"got {qweight.dtype} {tuple(qweight.shape)}")
    n = qweight.shape[0]
    if weight_scale.numel() != n or (bias is not None and bias.numel() != n):
        raise ValueError(f"w8a8_dynamic_linear: qweight has N = {n} output channels; weight_scale has "
                         f"{weight_scale.numel()}" + ("" if bias is None else f" and bias {bias.numel()}")
                         + f" (each needs {n})")
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    if not row_parallel:
        # The tiles at 2 to TILE_MAX_ROWS rows, and at one row too where there is no AMX (the VNNI GEMM; AMD EPYC
        # Zen 4, 2026-12-07: the default model's 121 linears at M = 1 in 9.8 / 7.3 ms for fp32 / bf16 x against the
        # GEMV's 11.6 / 9.1, medians of 7 alternated passes; AMX's 16-row tile at one row is unmeasured); else, or
        # where the tiles decline, the GEMV at one row. Same bits either way.
        if (packed is not None and 1 <= rows <= TILE_MAX_ROWS and (rows > 1 or not amx_int8_available())
                and (y := tile_linear_w8a8(x2, packed, weight_scale, bias)) is not None):
            return y.reshape(*x.shape[:-1], n)
        if rows == 1 and (y := gemv_w8a8(x2, qweight, weight_scale, bias)) is not None:
            return y.reshape(*x.shape[:-1], n)
    xq, xs = quantize_rows_int8(x2 if x2.dtype == torch.float32 else x2.float(), row_parallel)
    out = torch._int_mm(xq, qweight.t()) * (xs * weight_scale)  # [M, N] int32 * [M, N] float32 -> float32
    if bias is not None:
        out = out + bias
    return out.to(x.dtype).reshape(*x.shape[:-1], qweight.shape[0])


def gemv_w8a8(x: torch.Tensor, qweight: torch.Tensor, weight_scale: torch.Tensor,
              bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """One row of :func:`w8a8_dynamic_linear` in one C++ call (``roofline_gemv_w8a8``: the quantization of ``x``
    and AVX-512 VNNI ``vpdpbusd`` integer dot products, Intel SDM), bit-identical to the torch path (same scale,
    same round-half-even codes, exact int32 sums, the same fp32 products and casts). ``x`` [1, K] float32 or
    bfloat16, ``qweight`` int8 [N, K] and ``weight_scale`` float32 [N] contiguous, ``bias`` [N] float32/bfloat16 or
    None -> [1, N] in ``x``'s dtype. None where it does not apply (no AVX-512 VNNI, K not a multiple of 64 or
    over 16384, other dtypes or layouts, no library, ``ROOFLINE_CPU_GEMV=0``): the caller runs the torch path.

    Why: at M = 1 the torch path is five small ops (inf-norm, scale, divide-round, cast, ``_int_mm``, then the
    scale products and the cast) around a oneDNN integer GEMM that streamed the weight slower than this loop."""
    from roofline.kernels.cpu_bf16 import _cpp_library

    if (x.device.type != "cpu" or x.dim() != 2 or x.shape[0] != 1 or x.dtype not in (torch.float32, torch.bfloat16)
            or qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.shape[1] != x.shape[1]
            or x.shape[1] % 64 or x.shape[1] > 16384 or not qweight.is_contiguous()
            or weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous()
            or weight_scale.numel() != qweight.shape[0]
            or (bias is not None and (bias.dtype not in (torch.float32, torch.bfloat16) or not bias.is_contiguous()
                                      or bias.numel() != qweight.shape[0]))
            or (lib := _cpp_library()) is None):
        return None
    x = x.contiguous()
    y = torch.empty(1, qweight.shape[0], dtype=x.dtype)
    ok = lib.roofline_gemv_w8a8(x.data_ptr(), int(x.dtype == torch.bfloat16), qweight.data_ptr(),
                                weight_scale.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                int(bias is not None and bias.dtype == torch.bfloat16), y.data_ptr(),
                                int(x.dtype == torch.bfloat16), qweight.shape[0], qweight.shape[1],
                                torch.get_num_threads())
    return y if ok else None


def tile_pack_int8(qweight: torch.Tensor) -> torch.Tensor | None:
    """``qweight`` int8 [N, K] -> its tiles [N/16, K/64, 16, 64] int8 (tile (n, k), row r, byte 4c + i =
    ``qweight[16n + c, 64k + 4r + i]``: Intel SDM's layout for TDPBSSD, whose rows are also VPDPBUSD's B operand), for
    :func:`tile_linear_w8a8`; None where no tile kernel can run (neither AMX-INT8 nor AVX-512 VNNI, no library,
    N % 16, K % 64, K > 16384)."""
    if (qweight.dtype != torch.int8 or qweight.dim() != 2 or qweight.shape[0] % 16 or qweight.shape[1] % 64
            or qweight.shape[1] > 16384 or qweight.shape[0] == 0
            or not (amx_int8_available() or vnni_int8_available())):
        return None
    from roofline.kernels.cpu_bf16 import _cpp_library

    N, K = qweight.shape
    w = qweight.detach().contiguous()
    out = torch.empty(N // 16, K // 64, 16, 64, dtype=torch.int8)
    _cpp_library().roofline_amx_pack_s8(w.data_ptr(), out.data_ptr(), N, K, torch.get_num_threads())
    return out


def _tiled_w8a8(fn_name: str, x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor,
                bias: torch.Tensor | None, max_rows: int) -> torch.Tensor | None:
    """``x`` [M, K] through the library's tile kernel ``fn_name`` (see :func:`tile_linear_w8a8`)."""
    from roofline.kernels.cpu_bf16 import _cpp_library

    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype not in (torch.float32, torch.bfloat16)
            or x.shape[0] > max_rows
            or packed.dtype != torch.int8 or packed.dim() != 4 or tuple(packed.shape[2:]) != (16, 64)
            or not packed.is_contiguous() or x.shape[1] != packed.shape[1] * 64
            or weight_scale.dtype != torch.float32 or not weight_scale.is_contiguous()
            or weight_scale.numel() != packed.shape[0] * 16
            or (bias is not None and (bias.dtype not in (torch.float32, torch.bfloat16) or not bias.is_contiguous()
                                      or bias.numel() != weight_scale.numel()))
            or (lib := _cpp_library()) is None):
        return None
    x = x.contiguous()
    M, K, N = x.shape[0], x.shape[1], weight_scale.numel()
    y = torch.empty(M, N, dtype=x.dtype)
    if M == 0:
        return y
    ok = getattr(lib, fn_name)(x.data_ptr(), int(x.dtype == torch.bfloat16), packed.data_ptr(),
                               weight_scale.data_ptr(), 0 if bias is None else bias.data_ptr(),
                               int(bias is not None and bias.dtype == torch.bfloat16), y.data_ptr(),
                               int(x.dtype == torch.bfloat16), M, N, K, torch.get_num_threads())
    return y if ok else None


def amx_linear_w8a8(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor,
                    bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`w8a8_dynamic_linear` on M rows in one C++ call (``roofline_amx_linear_w8a8``): each row quantized as
    :func:`gemv_w8a8` does, the int32 sums on AMX tiles (TDPBSSD, exact), the same fp32 epilogue, so every row is
    bit-identical to the GEMV's and the torch path's at any M. ``x`` [M, K] float32 or bfloat16, ``packed`` from
    :func:`tile_pack_int8`, ``weight_scale`` float32 [N], ``bias`` [N] float32/bfloat16 or None -> [M, N] in
    ``x``'s dtype; None where it does not apply (the caller runs the torch path).

    Why: the torch path at 32 rows (the main job's batch) is quantize + ``torch._int_mm`` + two elementwise ops
    per linear; on the Intel Xeon (AMX) of 2026-12-05 the int8 batch-32 decode step was 57.4 ms against bf16's
    20.9 (``bench/results/cpu-amx-20261205/``)."""
    return _tiled_w8a8("roofline_amx_linear_w8a8", x, packed, weight_scale, bias, 1 << 62)


def vnni_linear_w8a8(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """:func:`amx_linear_w8a8` for a CPU without AMX-INT8, on the same tiles and 1 to ``cpu_bf16.TILE_MAX_ROWS`` rows
    (``roofline_vnni_linear_w8a8``): the int32 sums by AVX-512 VNNI ``vpdpbusd`` (Intel SDM; x's k quad, plus 128,
    broadcast against a tile row of 16 columns, and 128 times each column's sum taken off), exact, so every row is
    bit-identical to :func:`gemv_w8a8`'s and the torch path's at any M. None where it does not apply."""
    return _tiled_w8a8("roofline_vnni_linear_w8a8", x, packed, weight_scale, bias, TILE_MAX_ROWS)


def tile_linear_w8a8(x: torch.Tensor, packed: torch.Tensor, weight_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """The tile kernel this CPU has: :func:`amx_linear_w8a8` with AMX-INT8, else :func:`vnni_linear_w8a8`."""
    fn = amx_linear_w8a8 if amx_int8_available() else vnni_linear_w8a8
    return fn(x, packed, weight_scale, bias)


@functools.cache
def _probe(fn_name: str, feature: str) -> bool:
    """The CPU has ``feature`` (a ``detect_cpu_features`` flag) and the library's W8A8 tile kernel ``fn_name`` gives
    a 2x16x64 product of ones right (it returns 0 where it was not built for this CPU, or AMX tiles are refused)."""
    from roofline.cpu import detect_cpu_features
    from roofline.kernels.cpu_bf16 import _cpp_library

    lib = _cpp_library()
    if lib is None or not getattr(detect_cpu_features(), feature, False):
        return False
    w = torch.ones(16, 64, dtype=torch.int8)
    wp = torch.empty(16 * 64, dtype=torch.int8)
    x = torch.ones(2, 64)
    s = torch.ones(16)
    y = torch.empty(2, 16)
    return bool(lib.roofline_amx_pack_s8(w.data_ptr(), wp.data_ptr(), 16, 64, 1)
                and getattr(lib, fn_name)(x.data_ptr(), 0, wp.data_ptr(), s.data_ptr(), 0, 0, y.data_ptr(), 0, 2, 16,
                                          64, 1)
                and torch.allclose(y, torch.full_like(y, 64.0)))


def vnni_int8_available() -> bool:
    """The AVX-512 VNNI W8A8 GEMM runs here: the library built with it and a 2x16x64 product came out right."""
    from roofline.kernels import cpu_bf16

    return cpu_bf16.GEMV and _probe("roofline_vnni_linear_w8a8", "avx512_vnni")


def amx_int8_available() -> bool:
    """The AMX-INT8 GEMM runs here: ``cpu_bf16.AMX`` on (``ROOFLINE_CPU_AMX``), the library built with AMX-INT8, the
    tile state granted, and a 2x16x64 product came out right."""
    from roofline.kernels import cpu_bf16

    return cpu_bf16.AMX and _probe("roofline_amx_linear_w8a8", "amx_int8")
