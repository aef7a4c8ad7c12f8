"""Weight layouts of the quantized GEMM kernels (``roofline.kernels.quant_gemm``, whose docstring describes
them), the per-M tile table and the shared argument checks. Made once at load time by ``prepare_*`` from the
canonical forms of ``roofline.kernels.quant_types``."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from roofline.kernels.quant_types import ChannelWeight, Int4Weight

# Weight formats, a constexpr of the GEMM kernel.
FMT_DENSE = 0  # W [N, K] in the activation dtype
FMT_INT4 = 1  # qweight int32 [K // 8, N], scales/zeros [K // G, N]
FMT_INT8 = 2  # q int8 [N, K], scales float32 [N]; activations float
FMT_INT8_INT8 = 3  # activations int8 too, x_scale float32 [M]
FMT_FP8 = 4  # q float8_e4m3fn [N, K], scales float32 [N]; activations rounded to E4M3 per token (GEMV only)
FMT_FP8_W8A16 = 5  # q float8_e4m3fn [N, K], scales float32 [N]; activations float (FP8 weight-only)
_MIN_SCALE = 1e-10  # = roofline.quant.quantize._MIN_SCALE: an all-zero row quantizes to zeros
_MAGIC = 8388608.0  # 2^23: the float32 with bits 0x4B000000


@dataclass(frozen=True)
class GemmConfig:
    """One tile configuration. ``split_k`` None: chosen per shape by :func:`choose_split_k`."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int | None = None
    unpack: int = 0  # INT4 only: 0 = word per row (GPTQ-triton style loads), 1 = one load per word + reshape
    gemv: bool = False  # the FMA stream without tl.dot (quant_gemv._gemv_kernel); block_m = rows per program (<= 4).
    # Programmatic dependent launch (sm_90+): 0 off, 1 release the next kernel right after the wait, 2 release it
    # after the K loop; None: ``roofline.kernels.pdl.MODE``. The kernel starts its first weight loads before it waits.
    pdl: int | None = None
    # Tiled weight-only 8-bit (int8, fp8 W8A16): out^T = W @ x^T, the converted codes as the MMA's A operand in
    # registers (``quant_gemm._qgemm_kernel``'s SWAP_AB). Other formats refuse it.
    swap_ab: bool = False
    # INT8 W8A16 and INT4 W4A16 only: the warp-specialized Gluon GEMM on sm_90 (``roofline.kernels.ws_gemm``:
    # 1 (True) a TMA loader, a converter and an MMA partition; 2 the converter issues the copies itself (no loader
    # warp: more registers for the MMA, which 128 x 256 tiles need); block_m 64 / 128 / 256, num_warps unused, split_k
    # None: ws_gemm.choose_ws_split); elsewhere the tiled default.
    ws: int = 0
    # GEMV configs take num_stages=1: the kernel prefetches the next tile itself, and Triton's pipeliner on top of
    # that gave wrong 16-bit results on the H200 (triton 3.6, 2026-12-01).


# (largest M, config) per format, first match wins. Initial values: the small-M row follows the split-K
# W4A16 blog (BM 16, BN 32, BK 128, 4 warps, 4 stages) and our earlier dense GEMV sweep on the H200
# (BN 32, BK 256: docs/kernels.md); the tiled rows are common Hopper GEMM tiles. bench/gpu_quant_gemm.py
# sweeps alternatives; replace these with its measurements.
CONFIGS: dict[str, list[tuple[int, GemmConfig]]] = {
    "int4": [
        (1, GemmConfig(1, 64, 128, 4, 1, gemv=True)),
        (2, GemmConfig(2, 64, 128, 4, 1, gemv=True)),
        (4, GemmConfig(4, 32, 128, 4, 1, gemv=True)),
        (16, GemmConfig(16, 32, 128, 4, 4, unpack=1)),
        (64, GemmConfig(64, 64, 64, 4, 3, unpack=1)),
        # 2 stages: the tiled INT4 path stages [BK, BN] words, scales and zeros per k row (72-80 KB a stage
        # at these tiles), so 3-4 stages exceed the H200's 227 KB of shared memory (measured: 240 KB asked).
        (256, GemmConfig(64, 128, 64, 4, 2, unpack=1)),
        (1 << 62, GemmConfig(128, 128, 64, 8, 2, unpack=1)),
    ],
    "int8": [
        (1, GemmConfig(1, 32, 256, 8, 1, gemv=True)),
        (4, GemmConfig(4, 16, 128, 8, 1, gemv=True)),
        (16, GemmConfig(16, 32, 128, 4, 4)),
        (64, GemmConfig(64, 64, 64, 4, 4)),
        (256, GemmConfig(64, 128, 64, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 64, 8, 3)),
    ],
    "int8_int8": [
        (1, GemmConfig(1, 32, 256, 8, 1, gemv=True)),
        (4, GemmConfig(4, 16, 128, 8, 1, gemv=True)),
        (16, GemmConfig(16, 64, 128, 4, 4)),
        (64, GemmConfig(64, 64, 128, 4, 4)),
        (256, GemmConfig(64, 128, 128, 4, 3)),
        (1 << 62, GemmConfig(128, 128, 128, 8, 3)),
    ],
    "dense": [
        (1, GemmConfig(1, 16, 256, 4, 1, gemv=True)),
        (4, GemmConfig(4, 8, 128, 4, 1, gemv=True)),
        (16, GemmConfig(16, 32, 256, 4, 4)),
        (64, GemmConfig(64, 64, 64, 4, 4)),
        (256, GemmConfig(64, 128, 64, 4, 4)),
        (1 << 62, GemmConfig(128, 128, 64, 8, 3)),
    ],
}
CONFIGS["fp8_w8a16"] = CONFIGS["int8"]  # FP8 weight-only reads the same bytes per weight as INT8 W8A16
# INT4 with a group size that is not a multiple of 8 cannot use the GEMV (a word would span two groups).
_GEMV_FALLBACK = GemmConfig(16, 32, 64, 4, 2)

SMALL_M = 16  # M <= SMALL_M: the weight-streaming variant (split-K allowed, INT4 scales after the dot)


def pick_config(fmt: str, m: int) -> GemmConfig:
    """The :data:`CONFIGS` row for ``fmt`` ('int4', 'int8', 'int8_int8', 'dense', 'fp8_w8a16') at ``m`` rows."""
    for max_m, cfg in CONFIGS[fmt]:
        if m <= max_m:
            return cfg
    raise AssertionError("unreachable: the last row covers every M")


# ---------------------------------------------------------------------------------------- weight layouts

@dataclass
class Int4Packed:
    """An INT4 weight in the kernel layout (module docstring). ``shape`` is the logical ``(N, K)``."""

    qweight: torch.Tensor  # int32 [K // 8, N]
    scales: torch.Tensor  # [K // G, N], activation dtype
    zeros: torch.Tensor  # [K // G, N], activation dtype, integer values 0..15
    group_size: int

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[1], self.qweight.shape[0] * 8

    def weight_bytes(self) -> int:
        """Bytes a GEMM reads for this weight (packed codes, scales, zeros)."""
        return sum(t.numel() * t.element_size() for t in (self.qweight, self.scales, self.zeros))


@dataclass
class Int8Packed:
    """An INT8 per-output-channel weight in the kernel layout: q int8 ``[N, K]``, scales float32 ``[N]``."""

    q: torch.Tensor
    scales: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)  # type: ignore[return-value]

    def weight_bytes(self) -> int:
        """Bytes a GEMM reads for this weight (codes and scales)."""
        return self.q.numel() * self.q.element_size() + self.scales.numel() * self.scales.element_size()


def int4_weight_bytes(n: int, k: int, group_size: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """Bytes of an :class:`Int4Packed` ``[N, K]`` weight: ``N*K/2`` codes + scales and zeros ``[K/G, N]``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    return n * k // 2 + 2 * (k // group_size) * n * itemsize


def int8_weight_bytes(n: int, k: int) -> int:
    """Bytes of an :class:`Int8Packed` ``[N, K]`` weight: ``N*K`` codes + float32 scales ``[N]``."""
    return n * k + 4 * n


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """uint8 ``[N, K]`` codes in [0, 15] -> int32 ``[K // 8, N]``, ``word[r, n] = sum_i q[n, 8r+i] << 4i``.

    Raises:
        ValueError: K not a multiple of 8, or codes outside [0, 15].
    """
    n, k = q.shape
    if k % 8:
        raise ValueError(f"INT4 packing needs K % 8 == 0, got K={k}")
    qi = q.to(torch.int64)
    if qi.numel() and (int(qi.min()) < 0 or int(qi.max()) > 15):
        raise ValueError(f"INT4 codes must lie in [0, 15], got [{int(qi.min())}, {int(qi.max())}]")
    shifts = torch.arange(8, device=q.device, dtype=torch.int64) * 4
    words = (qi.t().reshape(k // 8, 8, n) << shifts[None, :, None]).sum(dim=1)  # [K // 8, N], < 2^32
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement: nibble 7 >= 8 sets the sign
    return words.to(torch.int32).contiguous()


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """The inverse of :func:`pack_int4`: int32 ``[K // 8, N]`` -> uint8 ``[N, K]`` codes."""
    k8, n = qweight.shape
    shifts = torch.arange(8, device=qweight.device, dtype=torch.int32) * 4
    q = (qweight[:, None, :] >> shifts[None, :, None]) & 0xF  # [K // 8, 8, N]
    return q.reshape(k8 * 8, n).t().to(torch.uint8).contiguous()


def prepare_int4(w: Int4Weight, dtype: torch.dtype = torch.bfloat16) -> Int4Packed:
    """Canonical INT4 -> the kernel layout (module docstring), scales and zeros in ``dtype``.

    Raises:
        ValueError: an act-order ``g_idx`` other than ``k // group_size`` (permute the input channels
            first), K not a multiple of 8 or of the group size.
    """
    n, k = w.q.shape
    g = w.group_size
    if g <= 0 or k % g:
        raise ValueError(f"group size {g} does not divide K={k}")
    if w.g_idx is not None:
        plain = torch.arange(k, device=w.g_idx.device) // g
        if not torch.equal(w.g_idx.long(), plain):
            raise ValueError("act-order g_idx is not supported by the kernels: permute the weight's input "
                             "channels (and the activations) so that groups are contiguous first")
    return Int4Packed(
        qweight=pack_int4(w.q),
        scales=w.scales.t().to(dtype).contiguous(),
        zeros=w.zeros.t().to(dtype).contiguous(),
        group_size=g,
    )


def prepare_int8(w: ChannelWeight) -> Int8Packed:
    """Canonical per-channel INT8 -> the kernel layout (the same ``[N, K]`` codes, float32 scales).

    Raises:
        ValueError: codes that are not int8 (FP8 weights use ``torch._scaled_mm``).
    """
    if w.q.dtype != torch.int8:
        raise ValueError(f"prepare_int8 takes int8 codes, got {w.q.dtype}")
    return Int8Packed(w.q.contiguous(), w.scales.float().reshape(-1).contiguous())




def _as_rows(x: torch.Tensor, k: int, name: str) -> torch.Tensor:
    if x.shape[-1] != k:
        raise ValueError(f"{name}: x has {x.shape[-1]} input channels, the weight K={k}")
    x2 = x.reshape(-1, k)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def _check_float_act(x: torch.Tensor, name: str) -> None:
    if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ValueError(f"{name}: activations must be float16, bfloat16 or float32, got {x.dtype}")
