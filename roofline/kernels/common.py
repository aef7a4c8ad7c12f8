"""Input checks shared by the paged attention kernels, and the KV-cache quantization formats.

Quantized KV caches (``--kv-cache-dtype int8 | fp8_e4m3``) store codes in the cache tensors and float32
scales beside them; the store kernel quantizes (rope_cache.py) and the attention kernels dequantize in
registers (decode_attention.py, prefill_attention.py). Two schemes, one per format:

- int8, per token and KV head (``KV_QUANT_PER_TOKEN``): ``scale = amax / 127`` over the head's D values,
  ``code = clamp(floor(x / scale + 0.5), -127, 127)`` (symmetric, round half up, never -128), and
  ``x ~ code * scale`` with ``|x - code * scale| <= scale / 2``. Scales: [num_blocks, block_size, H_kv]
  float32, one per cache slot and KV head, so a token's bytes depend on that token alone.
  float32 and not float16: 4 bytes instead of 2 per head is 1.5% of an int8 token at D 128, and it
  keeps ``amax / 127`` exact for any amax (float16 would go subnormal below amax ~ 7.8e-3 and lose the
  scale's precision, and overflow above 8.3e6).
- fp8_e4m3, per (layer, KV head), static (``KV_QUANT_PER_HEAD``): ``code = e4m3(clamp(x / scale, +-448))``
  (round to nearest even, saturating), ``x ~ code * scale``. Scales: [H_kv] float32 per layer, set once at
  start-up by calibration (``roofline.attention.kv_calibration``). E4M3 has a constant relative precision
  (3 mantissa bits, a relative rounding error <= 2^-4) over its normal range [2^-6, 448], a ratio of
  2^15, so a scale only has to keep a head's values inside that range: one per head because head
  magnitudes differ by orders of magnitude, static so a token's stored bytes depend on the token alone
  (batch invariance; a prefix-cache block stays reusable).

The attention kernels use the per-key scales without materializing a dequantized tile:
``(q . code_k) * k_scale`` after the QK dot, and ``(p * v_scale) . code_v`` before the PV dot; the codes
only need a cast to the dot dtype in registers (int8 and e4m3 values are exact in fp16/bf16/fp32).
"""

from __future__ import annotations

from typing import Protocol

import torch

# Quantization scheme of a KV cache, a constexpr of the Triton kernels.
KV_QUANT_NONE = 0
KV_QUANT_PER_TOKEN = 1  # int8: scales [num_blocks, block_size, H_kv]
KV_QUANT_PER_HEAD = 2  # fp8 e4m3: scales [H_kv]
INT8_MAX = 127.0
FP8_E4M3_MAX = 448.0  # largest finite float8_e4m3fn (OCP FP8 spec, 2023: S.1111.110 = 448)
FLOAT_KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class PagedBatch(Protocol):
    """What the paged attention kernels read of a step's attention metadata (device tensors + one host int)."""

    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    max_query_len: int


def check_paged_attention_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """q [T, H, D]; caches [num_blocks, block_size, H_kv, D], equal shapes, contiguous last dims, H % H_kv == 0.

    Raises:
        ValueError: naming the shapes that disagree.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    num_kv_heads, d_cache = k_cache.shape[2], k_cache.shape[3]
    if d_cache != head_dim or v_cache.shape != k_cache.shape:
        raise ValueError(f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} disagree")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} must be a multiple of num_kv_heads {num_kv_heads}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous last dim")


def kv_quant_mode(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> int:
    """The quantization scheme of a cache from its dtype, after checking its scale tensors.

    Args:
        k_cache: [num_blocks, block_size, H_kv, D] float32/float16/bfloat16 (no scales), int8 or
            float8_e4m3fn.
        k_scale, v_scale: None for float caches; float32, contiguous, [num_blocks, block_size, H_kv]
            for int8 and [H_kv] for float8_e4m3fn.

    Returns:
        KV_QUANT_NONE, KV_QUANT_PER_TOKEN (int8) or KV_QUANT_PER_HEAD (fp8).

    Raises:
        ValueError: an unsupported cache dtype, or scales missing, of the wrong shape/dtype, or not contiguous.
    """
    if k_cache.dtype in FLOAT_KV_DTYPES:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"a {k_cache.dtype} KV cache takes no scales (got k_scale/v_scale)")
        return KV_QUANT_NONE
    if k_cache.dtype == torch.int8:
        mode, want = KV_QUANT_PER_TOKEN, tuple(k_cache.shape[:3])
    elif k_cache.dtype == torch.float8_e4m3fn:
        mode, want = KV_QUANT_PER_HEAD, (k_cache.shape[2],)
    else:
        raise ValueError(f"unsupported KV cache dtype {k_cache.dtype}; supported: float32, float16, bfloat16, "
                         f"int8, float8_e4m3fn")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if s is None or tuple(s.shape) != want or s.dtype != torch.float32 or not s.is_contiguous():
            got = "None" if s is None else f"{tuple(s.shape)} {s.dtype}"
            raise ValueError(f"a {k_cache.dtype} KV cache needs {name} float32 contiguous {want}, got {got}")
    return mode


# ---------------------------------------------------------------------------------------- pure-torch twins

def ref_quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 over the last dim: x [..., D] -> (codes [..., D] int8, scales [...] float32).

    ``scale = amax / 127`` (0 for an all-zero row, whose codes are 0); ``code = clamp(floor(x / scale + 0.5),
    -127, 127)``. fp32 arithmetic; the store kernel computes the same ops (IEEE division) in the same order.
    """
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # A tensor divisor, not the Python scalar: CUDA torch computes ``t / scalar`` as ``t * (1 / scalar)``,
    # one ulp off the kernel's IEEE division in some rows (seen on the H200 as flipped codes at ties).
    scale = amax / torch.full_like(amax, INT8_MAX)
    s = scale.unsqueeze(-1)
    y = torch.where(s > 0, xf / torch.where(s > 0, s, 1.0), 0.0)
    return torch.floor(y + 0.5).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8), scale


def ref_quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [..., H_kv, D] with per-head ``scale`` [H_kv] -> float8_e4m3fn codes ``e4m3(clamp(x / scale, +-448))``."""
    y = x.float() / scale.float()[:, None]
    return y.clamp_(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def ref_dequantize(codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Codes [..., H_kv, D] (gathered cache rows) times their scales -> ``dtype``.

    ``scale``: None (a float cache: a plain cast), per-token [..., H_kv] matching the codes' leading dims
    (int8), or per-head [H_kv] (fp8). Multiplies in fp32, then casts once.
    """
    if scale is None:
        return codes.to(dtype)
    s = scale.float()
    s = s[:, None] if s.dim() == 1 else s.unsqueeze(-1)
    return (codes.float() * s).to(dtype)
