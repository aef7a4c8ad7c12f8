"""bf16 linears on CPU with the weight packed once after loading, instead of on every call.

Where the C++ library has a tile kernel (:func:`tiles_available`), each weight is packed once into Intel's VNNI
tile layout (:func:`tile_pack`) and 1 to ``TILE_MAX_ROWS`` rows run :func:`amx_linear` (AMX-BF16) or
:func:`vnni_linear` (AVX-512 BF16): each output summed in the same order at any M, so a row's bits do not depend on
the rows beside it (speculative verify passes equal decode steps, and the CPU decode plan runs the same kernels);
more rows (prefill) run ``F.linear`` on the dense weight. Otherwise the weight is packed for oneDNN:

``F.linear`` on bf16 CPU tensors runs oneDNN's matmul (AVX-512 BF16 dot products, or AMX tiles), but the weight
arrives in torch's plain [N, K] layout, so every call first reorders it into oneDNN's blocked layout: at decode
sizes that reorder reads and writes the whole weight again, about as costly as the product. Inductor's CPU
"freezing" pass avoids it by packing each weight once (``torch.ops.mkldnn._reorder_linear_weight``) and calling
``torch.ops.mkldnn._linear_pointwise`` with the packed tensor; this module does the same at load.

Same kernel, same numerics: on the Intel Xeon (AMX) of 2026-12-04 the packed product was bit-identical to
``F.linear`` for the default model's five linear shapes at M = 1, 2, 7, 32 and 100 (tests/cpu/test_cpu_bf16.py
checks it within bf16 rounding wherever it runs). Measured there (2 threads, 8 layers' worth of distinct
weights, alternated in one process, another job on the cores): 1.63x ``F.linear`` at M = 1, 1.51x at M = 32;
no gain in fp32 (0.88x at M = 1, 1.07x at M = 32), so only bf16 weights are packed.

``PREPACK`` (module-wide, read when a model's weights are processed after loading; 0/1 from the environment
``ROOFLINE_CPU_PREPACK``, default on) turns it off for A/B measurements.
"""

from __future__ import annotations

import functools
import os

import torch

from roofline.cpu import detect_cpu_features

PREPACK = os.environ.get("ROOFLINE_CPU_PREPACK", "1") != "0"


@functools.cache
def _cpu_has_bf16_units() -> bool:
    """oneDNN has bf16 arithmetic on this CPU (AVX-512 BF16 or AMX-BF16): where bf16 is fast at all."""
    if not torch.backends.mkldnn.is_available():
        return False
    features = detect_cpu_features()
    return features.avx512_bf16 or features.amx_bf16


def prepacks(dtype: torch.dtype) -> bool:
    """Linear weights of ``dtype`` on this CPU get a packed copy after loading: bf16, bf16 units, packing on."""
    return PREPACK and dtype == torch.bfloat16 and _cpu_has_bf16_units()


def should_prepack(weight: torch.Tensor) -> bool:
    """Pack ``weight`` (a 2-D linear weight [N, K]) on the CPU where :func:`prepacks` says so for its dtype."""
    return weight.device.type == "cpu" and weight.dim() == 2 and prepacks(weight.dtype)


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` bf16 [N, K] -> the same bytes in a kernel's layout, for :func:`packed_linear`: tiles ([N/16, K/32,
    16, 32] bf16, :func:`tile_pack`) where :func:`tiles_available` and N % 16 == K % 32 == 0, else an opaque oneDNN
    tensor (its blocked layout, reported as [N, K])."""
    if tiles_available() and weight.dim() == 2 and weight.shape[0] % 16 == 0 and weight.shape[1] % 32 == 0:
        return tile_pack(weight)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def pack_layer(layer) -> None:
    """After loading: ``layer.packed_weight`` = :func:`prepack` of ``layer.weight`` where :func:`should_prepack`,
    else None (the linear methods that keep a dense 16-bit weight call this)."""
    layer.packed_weight = prepack(layer.weight) if should_prepack(layer.weight) else None


def layer_linear(layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x`` @ ``layer.weight``^T (+ ``bias``) through the packed copy where :func:`pack_layer` made one and ``x`` is
    bf16 on the CPU; None otherwise (the caller's own path). fp32 rows: ``roofline.kernels.cpu_f32.layer_linear``,
    which the layers call."""
    packed = getattr(layer, "packed_weight", None)
    if packed is None or x.dtype != torch.bfloat16 or x.device.type != "cpu":
        return None
    return packed_linear(x, packed, bias, dense=layer.weight)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None,
                  dense: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` [..., K] bf16 @ the packed [N, K] weight^T (+ ``bias`` [N]) -> [..., N] bf16, as ``F.linear``.
    A tile-packed weight (:func:`prepack`) goes through :func:`tile_linear` at 1 to ``TILE_MAX_ROWS`` rows, so
    that a row's result is the same bits at any M (a speculative verify pass's rows equal the decode steps' single
    rows), past that (or with the library turned off since packing) through ``F.linear`` on ``dense`` (oneDNN's
    large-M kernel); a oneDNN-packed weight through oneDNN.

    Raises:
        ValueError: a tile-packed weight, no ``dense``, and the tile kernels declined."""
    x2 = x.reshape(-1, x.shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    M = x2.shape[0]
    out = None
    if packed.dim() == 4 and (M <= TILE_MAX_ROWS or dense is None):
        out = tile_linear(x2, packed, bias)  # one row included: a row's result does not depend on M
    if out is None and packed.dim() == 4:  # past the kernel's rows, or the library was turned off after packing
        if dense is None:
            raise ValueError(f"packed_linear: the tile kernel declined x {x.dtype} {tuple(x.shape)} against the "
                             f"tile-packed weight {tuple(packed.shape)} (it takes bf16 x with K = "
                             f"{packed.shape[1] * 32} and 1 to {TILE_MAX_ROWS} rows, with the C++ library on); "
                             f"pass the dense weight for the other cases")
        out = torch.nn.functional.linear(x2, dense, bias)
    if out is None:
        out = torch.ops.mkldnn._linear_pointwise(x2, packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


# The AMX small-M GEMM (C++, roofline_amx_linear_bf16 in the library of roofline.kernels.cpu_paged_attention);
# ROOFLINE_CPU_AMX=0 turns it off (weights are then packed for the AVX-512 BF16 GEMM where the CPU has it, else for
# oneDNN). Read when weights are packed.
AMX = os.environ.get("ROOFLINE_CPU_AMX", "1") != "0"
# Past this many rows packed_linear hands a tile-packed layer to F.linear on the dense weight (oneDNN's reorder
# is then amortized), and the CPU decode plan to the modules; the AVX-512 BF16 and VNNI kernels take at most this
# many (their C++ checks 256). On the Intel Xeon (AMX) of 2026-12-04, 2 threads, the default model's five shapes
# (4 layers' worth), AMX kernel vs oneDNN packed vs F.linear: M = 32 3.39 / 4.58 / 6.48 ms, M = 64 4.95 / 6.86 /
# 9.29, M = 128 9.87 / 10.56 / 13.37, M = 512 52.5 / 75.9 / 40.9, M = 1376 123.2 / 149.3 / 113.4; on the AMD EPYC
# (AVX-512 BF16) of 2026-12-07 the AVX-512 BF16 kernel ran 1.03-1.04x oneDNN packed at M = 64-256.
TILE_MAX_ROWS = 256


@functools.cache
def _probe(fn_name: str, feature: str) -> bool:
    """The CPU has ``feature`` (a ``detect_cpu_features`` flag) and the library's tile kernel ``fn_name`` gives a
    1x16x32 product of ones right (it returns 0 where it was not built for this CPU, or AMX tiles are refused)."""
    lib = _cpp_library()
    if lib is None or not getattr(detect_cpu_features(), feature, False):
        return False
    w = torch.ones(16, 32, dtype=torch.bfloat16)
    wp = torch.empty(16, 32, dtype=torch.bfloat16)
    y = torch.empty(1, 16, dtype=torch.bfloat16)
    x = torch.ones(1, 32, dtype=torch.bfloat16)
    return bool(lib.roofline_amx_pack_bf16(w.data_ptr(), wp.data_ptr(), 16, 32, 1)
                and getattr(lib, fn_name)(x.data_ptr(), wp.data_ptr(), 0, y.data_ptr(), 1, 16, 32, 1)
                and bool((y == 32).all()))


def amx_available() -> bool:
    """The AMX GEMM runs here: ``AMX`` on, the C++ library built with AMX-BF16 (the CPU has it, the compiler
    targets it), Linux granted the tile state, and a 1x16x32 product came out right."""
    return AMX and _probe("roofline_amx_linear_bf16", "amx_bf16")


def tile_pack(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` [N, K] bf16 (N % 16 == 0, K % 32 == 0) -> [N/16, K/32, 16, 32] bf16: tile (n, k) holds rows
    16n..16n+15 and columns 32k..32k+31 with each row's column pairs interleaved (``tile[r, 2c + j] = weight[16n + c,
    32k + 2r + j]``, Intel SDM's VNNI layout): a TDPBF16PS B-operand tile for :func:`amx_linear`, and row by row (16
    columns x one k pair) a VDPBF16PS operand for :func:`vnni_linear`.

    Raises:
        ValueError: another dtype or shape, or the C++ library is missing."""
    N, K = weight.shape if weight.dim() == 2 else (0, 0)
    if weight.dtype != torch.bfloat16 or weight.dim() != 2 or N % 16 or K % 32 or N == 0 or K == 0:
        raise ValueError(f"tile_pack needs a bf16 [N, K] weight with N % 16 == 0 and K % 32 == 0, got "
                         f"{weight.dtype} {tuple(weight.shape)}")
    lib = _cpp_library()
    if lib is None:
        raise ValueError("tile_pack needs the C++ kernel library (ROOFLINE_CPU_GEMV=0, or it did not build)")
    w = weight.detach().contiguous()
    out = torch.empty(N // 16, K // 32, 16, 32, dtype=torch.bfloat16)
    lib.roofline_amx_pack_bf16(w.data_ptr(), out.data_ptr(), N, K, torch.get_num_threads())
    return out


def _tiled(fn_name: str, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
           max_rows: int) -> torch.Tensor | None:
    """``x`` [M, K] bf16 @ a :func:`tile_pack` weight ^T (+ ``bias``) -> [M, N] bf16 through the library's
    ``fn_name``; None where it does not apply (dtypes, shapes, more than ``max_rows`` rows, no library)."""
    if (x.dim() != 2 or x.dtype != torch.bfloat16 or packed.dim() != 4 or packed.dtype != torch.bfloat16
            or tuple(packed.shape[2:]) != (16, 32) or not packed.is_contiguous()
            or x.shape[1] != packed.shape[1] * 32 or x.device.type != "cpu" or x.shape[0] > max_rows
            or (bias is not None and (bias.dtype != torch.bfloat16 or not bias.is_contiguous()
                                      or bias.shape != (packed.shape[0] * 16,)))
            or (lib := _cpp_library()) is None):
        return None
    x = x.contiguous()
    M, K, N = x.shape[0], x.shape[1], packed.shape[0] * 16
    y = torch.empty(M, N, dtype=torch.bfloat16)
    if M == 0:
        return y
    ok = getattr(lib, fn_name)(x.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                               y.data_ptr(), M, N, K, torch.get_num_threads())
    return y if ok else None


def amx_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x`` [M, K] bf16 (contiguous) @ the weight packed by :func:`tile_pack` ^T (+ ``bias`` [N] bf16) -> [M, N]
    bf16: exact bf16 products summed in fp32 on AMX tiles, the bias added in fp32, rounded once (on the Xeon of
    2026-12-04 bit-identical to ``F.linear`` up to M = 33). None where it does not apply (no AMX, shapes): the
    caller runs another path.

    Why: in the main job (the default model, 32 rows, Intel Xeon with AMX, 2 threads, CPU decode plan off,
    alternated twice) the decode step went from 48.0 / 48.2 ms with oneDNN's packed linear to 42.3 / 40.0 ms with
    this kernel, its linears from 18.2 to 12.6 ms. Microbenchmarks of single shapes on that VM swung between 1.0x
    and 1.5x oneDNN from run to run."""
    return _tiled("roofline_amx_linear_bf16", x, packed, bias, 1 << 62)


def vnni_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x`` [M, K] bf16, 1 <= M <= ``TILE_MAX_ROWS``, @ the weight packed by :func:`tile_pack` ^T (+ ``bias`` [N]
    bf16) -> [M, N] bf16 with AVX-512 BF16 dot products (C++ ``roofline_vnni_linear_bf16``: VDPBF16PS, Intel SDM,
    x's k pair broadcast against a tile row of 16 columns), for a CPU without AMX tiles. Each output is one fp32
    lane that takes the k pairs in order, the bias added in fp32, rounded once: the same operations at any M, so a
    row's bits do not depend on the rows beside it (a verify pass's rows equal the decode steps' single rows), and
    within one bf16 rounding of the float64 product. None where it does not apply (no AVX-512 BF16, shapes, rows).

    Why: on the AMD EPYC of 2026-12-07 (2 threads, AVX-512 BF16, no AMX), the default model's 121 linears (269 MB
    of bf16) took 8.0 / 10.3 / 16.4 / 26.4 / 46.3 ms at M = 1 / 4 / 16 / 32 / 64, against 11.9 / 14.3 / 25.6 /
    40.9 / 68.6 for the one-row-style GEMV it replaces (16 lanes a row, summed across) and 12.5 / 10.3 / 17.2 /
    27.4 / 51.9 for oneDNN with the weight packed once (``python bench/cpu_linear.py --dtype bfloat16``)."""
    return _tiled("roofline_vnni_linear_bf16", x, packed, bias, TILE_MAX_ROWS)


def vnni_available() -> bool:
    """The AVX-512 BF16 small-M GEMM runs here: the library built with it (the CPU has AVX-512 BF16) and a 1x16x32
    product came out right."""
    return GEMV and _probe("roofline_vnni_linear_bf16", "avx512_bf16")


def tiles_available() -> bool:
    """A tile kernel runs here (:func:`amx_linear` or :func:`vnni_linear`): weights are then packed with
    :func:`tile_pack`."""
    return amx_available() or vnni_available()


def tile_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """The tile kernel this CPU has: :func:`amx_linear` with AMX, else :func:`vnni_linear` (None where neither
    applies)."""
    return amx_linear(x, packed, bias) if amx_available() else vnni_linear(x, packed, bias)


# The small-M linear and the fused add + RMSNorm (C++, the library of roofline.kernels.cpu_paged_attention);
# ROOFLINE_CPU_GEMV=0 turns both off.
GEMV = os.environ.get("ROOFLINE_CPU_GEMV", "1") != "0"


def _cpp_library():
    """The compiled library where ``GEMV`` is on and it built, else None."""
    if not GEMV:
        return None
    from roofline.kernels import cpu_paged_attention as cpa

    lib = cpa._library()
    return None if isinstance(lib, str) else lib


def add_rmsnorm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
                ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor] | None:
    """HF ``LlamaRMSNorm`` of bf16 or fp32 rows in one C++ call (``roofline_add_rmsnorm_bf16`` / ``_f32``): ``x``
    [T, H], ``weight`` [H] and ``residual`` [T, H] in one dtype; with ``residual`` returns (rmsnorm(x + residual),
    x + residual), the add rounded to the dtype first (``roofline.kernels.rmsnorm.ref_fused_add_rmsnorm``'s
    numerics), else rmsnorm(x). The sum of squares runs in fp32 in another order than torch's ``mean`` (so the
    last bit can differ); every other rounding is the reference's. None where it does not apply (not bf16 / fp32
    2-D contiguous rows on CPU, no library, ``ROOFLINE_CPU_GEMV=0``): the caller runs the reference. It replaces
    ~9 small torch ops per call, each ~5-10 us at decode sizes (and is what the CPU decode plan runs)."""
    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32)
            or weight.dtype != x.dtype or not x.is_contiguous() or not weight.is_contiguous()
            or (residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype
                                          or not residual.is_contiguous()))
            or (lib := _cpp_library()) is None):
        return None
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else None
    fn = lib.roofline_add_rmsnorm_bf16 if x.dtype == torch.bfloat16 else lib.roofline_add_rmsnorm_f32
    fn(x.data_ptr(), 0 if residual is None else residual.data_ptr(), weight.data_ptr(), out.data_ptr(),
       0 if res_out is None else res_out.data_ptr(), x.shape[0], x.shape[1], float(eps), torch.get_num_threads())
    return out if residual is None else (out, res_out)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor | None:
    """``x`` [T, 2I] bf16 or fp32 (contiguous, CPU) -> [T, I] = silu(gate) * up, the rounding of
    ``roofline.kernels.activation.ref_silu_and_mul`` (bf16: torch's bf16 silu, then its bf16 multiply), in one C++
    pass (``roofline_silu_mul_bf16`` / ``_f32``) instead of a silu, a multiply and two slices; the fp32 exp is
    Cephes' (~1 ulp), not torch's SLEEF one, so a rare product can differ in its last bit. None where it does not
    apply (another dtype or layout, no library, ``ROOFLINE_CPU_GEMV=0``): the caller runs the reference."""
    if (x.device.type != "cpu" or x.dim() != 2 or x.dtype not in (torch.bfloat16, torch.float32) or x.shape[1] % 2
            or not x.is_contiguous() or (lib := _cpp_library()) is None):
        return None
    half = x.shape[1] // 2
    out = torch.empty(x.shape[0], half, dtype=x.dtype)
    fn = lib.roofline_silu_mul_bf16 if x.dtype == torch.bfloat16 else lib.roofline_silu_mul_f32
    fn(x.data_ptr(), out.data_ptr(), x.shape[0], half, torch.get_num_threads())
    return out
