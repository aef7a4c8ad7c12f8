"""Case builders and float64 references shared by the kernel tests (see conftest.py for the interpreter).

bf16 is wrong under the Triton interpreter, so bf16 cases are GPU-only (``gpu_only`` marks).
"""

from __future__ import annotations

import pytest
import torch

from roofline.attention.backend import AttentionMetadata

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Relative-error bounds ||out - ref|| / ||ref|| by operand dtype (issue 5).
TOL = {torch.float32: 1e-5, torch.float16: 1e-3, torch.bfloat16: 1e-2}
gpu_only = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
# CPU interpreter: fp32/fp16 at small shapes; bf16 on the GPU only.
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=gpu_only, id="bfloat16")]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN/inf anywhere in out gives inf (never passes)."""
    out64, ref64 = out.double(), ref.double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))


def make_paged_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, seed=0):
    """Random paged KV cache + queries + AttentionMetadata; blocks are shuffled so tables are non-trivial.

    Returns (q [T, H, D], k_cache, v_cache [num_blocks, block_size, H_kv, D], meta).
    """
    g = torch.Generator().manual_seed(seed)
    nblocks = [(s + block_size - 1) // block_size for s in seq_lens]
    total = sum(nblocks) + 3  # a few blocks nobody owns: reading them would be a bug
    perm = torch.randperm(total, generator=g)
    max_blocks = max(nblocks) + 1  # padded column of zeros
    tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32)
    slots = []
    pos = 0
    for i, (nb, q_len, s) in enumerate(zip(nblocks, q_lens, seq_lens, strict=True)):
        tables[i, :nb] = perm[pos:pos + nb].to(torch.int32)
        pos += nb
        for p in range(s - q_len, s):
            slots.append(int(tables[i, p // block_size]) * block_size + p % block_size)
    k_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(total, block_size, num_kv_heads, head_dim, generator=g).to(dtype)
    q = torch.randn(sum(q_lens), num_heads, head_dim, generator=g).to(dtype)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=DEVICE),
        query_start_loc=qsl.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=tables.to(DEVICE),
        max_query_len=max(q_lens),
        seq_lens_cpu=list(seq_lens),
        query_lens_cpu=list(q_lens),
    )
    return q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), meta


def positions_of(meta) -> torch.Tensor:
    """[T] int64 absolute position of each new token of ``meta``'s flat batch."""
    pos = [p for q_len, s in zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True) for p in range(s - q_len, s)]
    return torch.tensor(pos, dtype=torch.int64, device=meta.slot_mapping.device)


def backend_with_cache(name, num_heads, num_kv_heads, head_dim, k_cache, v_cache, rope_base=10000.0):
    """An attention backend whose one-layer KV pool holds a copy of ``k_cache``/``v_cache``."""
    from roofline.attention.backend import get_attention_backend
    from roofline.layers.rotary import RotaryEmbedding

    rotary = RotaryEmbedding(head_dim, 4096, rope_base, device=k_cache.device)
    backend = get_attention_backend(name)(num_heads, num_kv_heads, head_dim, rotary)
    pool = backend.allocate_kv_cache(1, k_cache.shape[0], k_cache.shape[1], k_cache.dtype, k_cache.device)
    pool[0].k.copy_(k_cache)
    pool[0].v.copy_(v_cache)
    return backend


def attention_f64(q, k_cache, v_cache, meta, scale) -> torch.Tensor:
    """float64 paged causal attention (independent of ref_paged_attention): [T, H, D] float64."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty(q.shape, dtype=torch.float64)
    tables = meta.block_tables.cpu().long()
    flat_k = k_cache.reshape(-1, num_kv_heads, head_dim).double().cpu()
    flat_v = v_cache.reshape(-1, num_kv_heads, head_dim).double().cpu()
    start = 0
    for i, (q_len, s) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu, strict=True)):
        pos = torch.arange(s)
        slots = tables[i, pos // block_size] * block_size + pos % block_size
        k = flat_k[slots].repeat_interleave(group, dim=1)  # [s, H, D]
        v = flat_v[slots].repeat_interleave(group, dim=1)
        qi = q[start:start + q_len].double().cpu()
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale
        q_pos = torch.arange(s - q_len, s)[:, None]
        scores.masked_fill_(torch.arange(s)[None, :] > q_pos, float("-inf"))
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)
        start += q_len
    return out


def poison_stale_slots(kc, vc, meta):
    """NaN in every cache slot no sequence owns (tails of last blocks, unowned blocks): must never leak."""
    block_size = kc.shape[1]
    live = torch.zeros(kc.shape[0] * block_size, dtype=torch.bool)
    tables = meta.block_tables.cpu().long()
    for i, s in enumerate(meta.seq_lens_cpu):
        pos = torch.arange(s)
        live[tables[i, pos // block_size] * block_size + pos % block_size] = True
    dead = (~live).to(kc.device)
    kc.view(-1, *kc.shape[2:])[dead] = float("nan")
    vc.view(-1, *vc.shape[2:])[dead] = float("nan")


# ---------------------------------------------------------------------------------------- quantized caches

KV_FORMATS = ["int8", "fp8_e4m3"]
# Loose bounds on ||ref on the quantized cache - attention_f64 on the unquantized one|| / ||.||: the format's
# quantization error, not the kernels'. int8: |error| <= scale / 2 = amax / 254 per element (amax ~ 3 sigma
# of a Gaussian row of 64: <= 0.6% of sigma), measured 0.6-0.8% on outputs; fp8 e4m3: relative rounding
# error <= 2^-4 per element, measured 3.0-3.4%. The kernels themselves are held to TOL against the ref on
# the SAME quantized cache.
QUANT_TOL = {"int8": 0.02, "fp8_e4m3": 2.0 ** -4}


def quantize_cache(kc, vc, fmt):
    """(k codes, v codes, k_scale, v_scale) of float caches [num_blocks, block_size, H_kv, D] via the ref twins:
    int8 per slot and head; fp8 per head with the engine's calibration rule (2 x amax / 448)."""
    from roofline.attention.backend import FP8_CALIBRATION_HEADROOM
    from roofline.kernels.common import FP8_E4M3_MAX, ref_quantize_fp8, ref_quantize_int8

    kf, vf = kc.float(), vc.float()
    if fmt == "int8":
        (kq, ks), (vq, vs) = ref_quantize_int8(kf), ref_quantize_int8(vf)
        return kq, vq, ks.contiguous(), vs.contiguous()
    ks = kf.abs().amax(dim=(0, 1, 3)) * FP8_CALIBRATION_HEADROOM / FP8_E4M3_MAX
    vs = vf.abs().amax(dim=(0, 1, 3)) * FP8_CALIBRATION_HEADROOM / FP8_E4M3_MAX
    return ref_quantize_fp8(kf, ks), ref_quantize_fp8(vf, vs), ks, vs


def poison_stale_quantized(kq, vq, meta, k_scale, v_scale):
    """Poison every slot no sequence owns in a quantized cache: fp8 codes NaN; int8 codes 127 (the largest)
    with NaN scales. Reading one would show (NaN, or a huge wrong value)."""
    block_size = kq.shape[1]
    live = torch.zeros(kq.shape[0] * block_size, dtype=torch.bool)
    tables = meta.block_tables.cpu().long()
    for i, s in enumerate(meta.seq_lens_cpu):
        pos = torch.arange(s)
        live[tables[i, pos // block_size] * block_size + pos % block_size] = True
    dead = (~live).to(kq.device)
    for codes, scale in ((kq, k_scale), (vq, v_scale)):
        flat = codes.view(-1, *codes.shape[2:])
        if codes.dtype == torch.int8:
            flat[dead] = 127
            scale.view(-1, scale.shape[-1])[dead] = float("nan")
        else:
            flat.view(torch.uint8)[dead] = 0x7F  # the e4m3fn NaN code (torch has no masked_fill for fp8)
