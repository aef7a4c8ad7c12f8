"""Decode-attention inputs shared by ``bench attention`` and its ``--decode-only`` mode
(``roofline.bench.attention_decode``): the paged cache of one (batch, context, KV format) point, and the bytes a
decode kernel reads from it. Its own module so the two benchmarks do not import each other."""

from __future__ import annotations

import math
from typing import Any

KV_FORMATS = ("bfloat16", "float16", "int8", "fp8_e4m3", "fp8")


def decode_kv_bytes(batch: int, ctx: int, kv_heads: int, head_dim: int, kv_cache_dtype: str) -> int:
    """KV bytes one decode call reads (values + per-token scales): ``batch * ctx * kv_cache_bytes_per_token``
    of one layer (module docstring).

    Raises:
        ValueError: an unknown ``kv_cache_dtype`` (lists the known ones).
    """
    from roofline.costmodel import kv_cache_bytes_per_token

    if kv_cache_dtype not in KV_FORMATS:
        raise ValueError(f"unknown kv_cache_dtype {kv_cache_dtype!r}; known: {', '.join(KV_FORMATS)}")
    return int(batch * ctx * kv_cache_bytes_per_token(1, kv_heads, head_dim, kv_cache_dtype))


def _decode_inputs(batch, ctx, heads, kv_heads, head_dim, block_size, dtype, kv_cache_dtype="bfloat16",
                   device="cuda"):
    """q [B, H, D] in ``dtype``; a shuffled paged cache holding ``ctx`` keys per sequence in ``kv_cache_dtype``
    (quantized from a random ``dtype`` cache with the ref twins); block tables; seq_lens; k/v scales (None
    for 16-bit caches). Returns (q, k_cache, v_cache, tables, seq_lens, k_scale, v_scale)."""
    import torch

    from roofline.attention.backend import FP8_CALIBRATION_HEADROOM
    from roofline.costmodel import canonical_dtype
    from roofline.kernels.common import FP8_E4M3_MAX, ref_quantize_fp8, ref_quantize_int8

    fmt = canonical_dtype(kv_cache_dtype)  # "fp8" -> "fp8_e4m3", "float16" -> "fp16"
    nb = math.ceil(ctx / block_size)
    kc = torch.randn(batch * nb, block_size, kv_heads, head_dim, device=device, dtype=dtype)
    vc = torch.randn_like(kc)
    tables = torch.randperm(batch * nb, device=device).to(torch.int32).view(batch, nb)
    seq_lens = torch.full((batch,), ctx, device=device, dtype=torch.int32)
    q = torch.randn(batch, heads, head_dim, device=device, dtype=dtype)
    def quantize(cache):  # in slices of blocks: the fp32 temporaries of a whole 20 GiB cache would not fit
        step = 1024
        if fmt == "int8":
            codes = torch.empty(cache.shape, dtype=torch.int8, device=device)
            scales = torch.empty(cache.shape[:3], dtype=torch.float32, device=device)
            for i in range(0, cache.shape[0], step):
                codes[i:i + step], scales[i:i + step] = ref_quantize_int8(cache[i:i + step])
            return codes, scales
        amax = torch.stack([cache[i:i + step].float().abs().amax(dim=(0, 1, 3))
                            for i in range(0, cache.shape[0], step)]).amax(0)
        scales = amax * (FP8_CALIBRATION_HEADROOM / FP8_E4M3_MAX)  # the engine's calibration rule, per head
        codes = torch.empty(cache.shape, dtype=torch.float8_e4m3fn, device=device)
        for i in range(0, cache.shape[0], step):
            codes[i:i + step] = ref_quantize_fp8(cache[i:i + step], scales)
        return codes, scales

    ks = vs = None
    if fmt in ("int8", "fp8_e4m3"):
        (kc, ks), (vc, vs) = quantize(kc), quantize(vc)
    elif fmt == "fp16":
        kc, vc = kc.half(), vc.half()
    return q, kc, vc, tables, seq_lens, ks, vs


def measure_read_bandwidth_cuda(nbytes: int = 4 << 30) -> dict[str, float]:
    """Bytes/s of a large x.sum() (read) and x.copy_() (read + write), do_bench medians."""
    import torch
    from triton.testing import do_bench

    x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
    y = torch.empty_like(x)
    t_read = do_bench(lambda: x.sum(), return_mode="median") * 1e-3
    t_copy = do_bench(lambda: y.copy_(x), return_mode="median") * 1e-3
    return dict(read_bytes_per_s=nbytes / t_read, copy_bytes_per_s=2 * nbytes / t_copy)


def _parse_ints(s: str) -> list[int]:
    return [int(float(x.lower().replace("k", "")) * (1024 if "k" in x.lower() else 1)) for x in s.split(",") if x]


def logged_bandwidth() -> tuple[Any, list[str], dict[str, float]]:
    """The attention benchmarks' start: a ``log`` that prints and keeps each line, those lines, and the read /
    copy bandwidth measured here (already logged)."""
    import torch

    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    torch.manual_seed(0)
    bw = measure_read_bandwidth_cuda()
    log(f"read bandwidth {bw['read_bytes_per_s'] / 1e12:.2f} TB/s, copy {bw['copy_bytes_per_s'] / 1e12:.2f} TB/s")
    return log, lines, bw
