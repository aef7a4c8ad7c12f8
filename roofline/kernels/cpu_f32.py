"""fp32 linears on CPU at decode and verify sizes (1 to ``MAX_ROWS`` rows): each weight row streamed once for all rows.

``F.linear`` on fp32 CPU tensors runs MKL: an sgemv at one row, and past two rows an sgemm that is far from the
memory bound at small M. On the Intel Xeon (AMX) of 2026-12-06, 2 threads, the default model's 121 linears
(30 layers' qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, and the 49152x576 LM head, 538 MB of fp32
weights, distinct tensors so nothing stays in cache) took 21.4 ms at M = 1 and 24.5 / 42.0 / 51.7 / 51.5 / 62.6 ms
at M = 2 / 4 / 8 / 16 / 32: a speculative verify pass of 4 rows cost 2x a decode step in its linears. The C++ loop
(``roofline_linear_f32`` in the library of ``roofline.kernels.cpu_paged_attention``: AVX-512F FMAs, four weight
rows a step shared by up to four rows of x (on a CPU with AVX2 + FMA and no AVX-512F, such as most laptops', the
same loop on 8-lane registers and two rows of x), weight rows prefetched, blocks of rows over the threads) took 21.4 /
21.8 / 23.4 / 27.4 / 39.4 / 56.2 ms in the same process (``python bench/cpu_linear.py``,
``bench/results/cpu-f32-linear-20261206/``); at M = 48 both took 73 ms.

Numerics: every output is one 16-lane (AVX2: 8-lane) fp32 accumulator over K in order, its lanes summed in a
fixed order, then the bias added, so a row's result does not depend on M (a verify pass's rows are bit-identical to
decode steps' single rows), and differs from MKL's by summation order only (~1e-7 relative; the tests compare with a float64 reference).
``ROOFLINE_CPU_GEMV=0`` turns it off with the other C++ linears (``roofline.kernels.cpu_bf16``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from roofline.kernels import cpu_bf16

# Past this many rows MKL's sgemm is as fast (M = 48 above); the C++ loop takes at most 64.
MAX_ROWS = 32


def linear_f32(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """``x`` [..., K] fp32 @ ``weight`` [N, K] fp32^T (+ ``bias`` [N] fp32) -> [..., N] fp32 through the C++
    small-M loop, for 1 to ``MAX_ROWS`` rows of ``x`` on the CPU. None where it does not apply (other dtypes,
    devices or row counts, K not a multiple of 16, a non-contiguous weight or bias, no library or neither AVX-512F nor AVX2 + FMA,
    ``ROOFLINE_CPU_GEMV=0``): the caller runs ``F.linear`` then."""
    K = x.shape[-1] if x.dim() else 0
    if (x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu"
            or weight.device.type != "cpu" or weight.dim() != 2 or weight.shape[1] != K or K % 16 or K == 0
            or not weight.is_contiguous()
            or (bias is not None and (bias.dtype != torch.float32 or bias.dim() != 1
                                      or bias.shape[0] != weight.shape[0] or not bias.is_contiguous()))):
        return None
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    if not 1 <= M <= MAX_ROWS or (lib := cpu_bf16._cpp_library()) is None:
        return None
    x2 = x2.contiguous()
    y = torch.empty(M, weight.shape[0], dtype=torch.float32)
    ok = lib.roofline_linear_f32(x2.data_ptr(), weight.data_ptr(), 0 if bias is None else bias.data_ptr(),
                                 y.data_ptr(), M, weight.shape[0], K, torch.get_num_threads())
    return y.reshape(*x.shape[:-1], weight.shape[0]) if ok else None


def available() -> bool:
    """The loop runs here: the library built with AVX-512F or AVX2 + FMA and ``ROOFLINE_CPU_GEMV`` on (a 1 x 16 product)."""
    return linear_f32(torch.ones(1, 16), torch.ones(1, 16)) is not None


def layer_linear(layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """A dense linear layer's product on the CPU's own kernels: :func:`linear_f32` for fp32 rows, else
    ``cpu_bf16.layer_linear`` (bf16 through the packed copy); None where neither applies (the caller's path)."""
    if x.dtype == torch.float32 and x.device.type == "cpu" and isinstance(getattr(layer, "weight", None), torch.Tensor):
        return linear_f32(x, layer.weight, bias)
    return cpu_bf16.layer_linear(layer, x, bias)


def cpu_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through :func:`linear_f32` where it applies."""
    out = linear_f32(x, weight, bias)
    return out if out is not None else F.linear(x, weight, bias)
