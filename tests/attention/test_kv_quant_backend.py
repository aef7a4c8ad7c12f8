"""The torch attention backend on quantized KV caches (int8, fp8 e4m3): the CPU path CI runs.

Same scattered-block, chunked-prefill + decode schedule as test_torch_backend.py (identity RoPE). Every
output row must equal dense causal attention over the DEQUANTIZED stored K/V (tightly: the backend reads
prefill K/V back from the cache, not the fresh k/v), and differ measurably from attention over the fresh
values (else the cache would not be what is attended). Stale slots hold NaN scales (int8) / NaN codes (fp8).
Also: the pool's scale tensors and byte count, the calibration of fp8 scales.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from test_torch_backend import (
    BLOCK_SIZE,
    HEAD_DIM,
    NUM_BLOCKS,
    NUM_HEADS,
    NUM_KV_HEADS,
    SEQ_LENS,
    STEPS,
    dense_causal,
    make_meta,
)

from roofline.attention.backend import AttentionMetadata
from roofline.attention.kv_cache import KVCachePool, kv_bytes_per_token
from roofline.attention.torch_backend import TorchAttentionBackend
from roofline.kernels.common import ref_dequantize, ref_quantize_fp8, ref_quantize_int8

KV_DTYPES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}


def _identity_rope():
    return SimpleNamespace(cos_sin_cache=torch.cat([torch.ones(64, HEAD_DIM // 2), torch.zeros(64, HEAD_DIM // 2)],
                                                   dim=-1))


@pytest.mark.parametrize("fmt", list(KV_DTYPES))
def test_torch_backend_attends_to_the_quantized_cache(fmt):
    torch.manual_seed(0)
    qs = [torch.randn(n, NUM_HEADS, HEAD_DIM) for n in SEQ_LENS]
    ks = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in SEQ_LENS]
    vs = [torch.randn(n, NUM_KV_HEADS, HEAD_DIM) for n in SEQ_LENS]
    perm = torch.randperm(NUM_BLOCKS, generator=torch.Generator().manual_seed(1)).tolist()
    sizes = [math.ceil(n / BLOCK_SIZE) for n in SEQ_LENS]
    tables = [perm[sum(sizes[:i]):sum(sizes[:i + 1])] for i in range(len(SEQ_LENS))]
    backend = TorchAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, _identity_rope())
    cache = backend.allocate_kv_cache(1, NUM_BLOCKS, BLOCK_SIZE, KV_DTYPES[fmt], torch.device("cpu"))[0]
    assert cache.k_scale is not None and cache.v_scale is not None
    if fmt == "int8":
        cache.k_scale.fill_(float("nan"))
        cache.v_scale.fill_(float("nan"))
        cache.k.fill_(127)
        cache.v.fill_(127)
        deq = [tuple(ref_dequantize(*ref_quantize_int8(x)) for x in kv) for kv in zip(ks, vs, strict=True)]
    else:
        cache.k_scale.copy_(torch.tensor([0.01, 0.02]))
        cache.v_scale.copy_(torch.tensor([0.02, 0.01]))
        cache.k.view(torch.uint8).fill_(0x7F)  # NaN codes
        cache.v.view(torch.uint8).fill_(0x7F)
        deq = [(ref_dequantize(ref_quantize_fp8(k, cache.k_scale), cache.k_scale),
                ref_dequantize(ref_quantize_fp8(v, cache.v_scale), cache.v_scale)) for k, v in zip(ks, vs, strict=True)]
    want = [dense_causal(q, k, v) for q, (k, v) in zip(qs, deq, strict=True)]
    fresh = [dense_causal(q, k, v) for q, k, v in zip(qs, ks, vs, strict=True)]
    computed = [0, 0, 0]
    gap = 0.0
    for news in STEPS:
        if not any(news):
            break
        meta = make_meta(tables, computed, news)
        live = [i for i, n in enumerate(news) if n]
        q = torch.cat([qs[i][computed[i]:computed[i] + news[i]] for i in live])
        k = torch.cat([ks[i][computed[i]:computed[i] + news[i]] for i in live])
        v = torch.cat([vs[i][computed[i]:computed[i] + news[i]] for i in live])
        positions = torch.cat([torch.arange(computed[i], computed[i] + news[i]) for i in live])
        out = backend.forward(q.clone(), k.clone(), v, positions, cache, backend.build_metadata(meta))
        row = 0
        for i in live:
            got = out[row:row + news[i]]
            torch.testing.assert_close(got, want[i][computed[i]:computed[i] + news[i]], rtol=1e-5, atol=1e-5)
            gap = max(gap, float((got - fresh[i][computed[i]:computed[i] + news[i]]).abs().max()))
            row += news[i]
            computed[i] += news[i]
    assert computed == SEQ_LENS
    assert gap > 1e-3, f"outputs match the unquantized k/v ({gap:.1e}): the cache is not what is attended"


def test_pool_allocates_scales_and_counts_their_bytes():
    pool = KVCachePool(2, 5, 4, 3, 64, torch.int8, torch.device("cpu"))
    c = pool[1]
    assert c.is_quantized and pool.is_quantized
    assert (c.k.dtype, c.k_scale.shape, c.k_scale.dtype, c.v_scale.shape) == (
        torch.int8, (5, 4, 3), torch.float32, (5, 4, 3))
    assert pool.bytes_per_token == 2 * 2 * 3 * (64 + 4) == kv_bytes_per_token(2, 3, 64, torch.int8)
    fp8 = KVCachePool(2, 5, 4, 3, 64, torch.float8_e4m3fn, torch.device("cpu"))
    assert fp8[0].k_scale.tolist() == [1.0, 1.0, 1.0] and fp8.bytes_per_token == 2 * 2 * 3 * 64
    assert KVCachePool(2, 5, 4, 3, 64, torch.bfloat16, torch.device("cpu"))[0].k_scale is None
    with pytest.raises(ValueError, match="unsupported KV-cache dtype torch.uint8"):
        kv_bytes_per_token(2, 3, 64, torch.uint8)


def test_fp8_calibration_sets_per_head_scales_from_post_rope_amax():
    torch.manual_seed(2)
    num_layers, n = 2, 24
    backend = TorchAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, _identity_rope())
    pool = backend.allocate_kv_cache(num_layers, 4, 4, torch.float8_e4m3fn, torch.device("cpu"))
    mag = torch.tensor([0.5, 40.0])[None, :, None]  # heads of very different magnitudes
    kvs = [(torch.randn(n, NUM_KV_HEADS, HEAD_DIM) * mag, torch.randn(n, NUM_KV_HEADS, HEAD_DIM) * mag.flip(1))
           for _ in range(num_layers)]
    meta = AttentionMetadata(slot_mapping=torch.full((n,), -1), query_start_loc=torch.tensor([0, 10, n]),
                             seq_lens=torch.tensor([10, n - 10]), block_tables=torch.zeros(2, 1, dtype=torch.int32),
                             max_query_len=n - 10, query_lens_cpu=[10, n - 10], seq_lens_cpu=[10, n - 10])
    q = torch.randn(n, NUM_HEADS, HEAD_DIM)
    outs = []

    def run():
        for layer, (k, v) in enumerate(kvs):
            outs.append(backend.forward(q.clone(), k.clone(), v, torch.arange(n), pool[layer], meta))

    stats = backend.calibrate_kv_scales(run)
    assert not backend.is_calibrating
    for layer, (k, v) in enumerate(kvs):
        torch.testing.assert_close(pool[layer].k_scale, k.abs().amax(dim=(0, 2)) * 2 / 448)
        torch.testing.assert_close(pool[layer].v_scale, v.abs().amax(dim=(0, 2)) * 2 / 448)
    assert stats["k_max"] / stats["k_min"] > 50  # per head: the two heads' scales differ ~80x
    # Calibration attends to the fresh k/v, per sequence, causally, and stores nothing.
    want = torch.cat([dense_causal(q[:10], kvs[0][0][:10], kvs[0][1][:10]),
                      dense_causal(q[10:], kvs[0][0][10:], kvs[0][1][10:])])
    torch.testing.assert_close(outs[0], want, rtol=1e-5, atol=1e-5)
    assert pool[0].k.float().abs().sum() == 0
    with pytest.raises(RuntimeError, match=r"did not reach layers \[1\]"):
        backend.calibrate_kv_scales(lambda: backend.forward(q.clone(), kvs[0][0].clone(), kvs[0][1], torch.arange(n),
                                                            pool[0], meta))
    int8 = TorchAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, _identity_rope())
    int8.allocate_kv_cache(1, 4, 4, torch.int8, torch.device("cpu"))
    with pytest.raises(RuntimeError, match="needs an allocated fp8_e4m3 KV cache, got torch.int8"):
        int8.calibrate_kv_scales(lambda: None)


def test_fp8_calibration_sees_the_qk_norm():
    """A Qwen3 layer's q/k norm (``QKNorm``) reaches the calibration forward: the k scales follow the NORMED k (what
    the cache stores), not the raw projection's."""
    from roofline.attention import QKNorm
    from roofline.kernels.rmsnorm import ref_rmsnorm
    from roofline.layers.norm import RMSNorm

    torch.manual_seed(3)
    n = 12
    backend = TorchAttentionBackend(NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, _identity_rope())
    pool = backend.allocate_kv_cache(1, 4, 4, torch.float8_e4m3fn, torch.device("cpu"))
    norms = QKNorm(RMSNorm(HEAD_DIM, 1e-6), RMSNorm(HEAD_DIM, 1e-6))
    norms.k_norm.weight.data.copy_(torch.linspace(0.5, 2.0, HEAD_DIM))
    k = torch.randn(n, NUM_KV_HEADS, HEAD_DIM) * torch.tensor([0.5, 40.0])[None, :, None]
    v = torch.randn(n, NUM_KV_HEADS, HEAD_DIM)
    meta = AttentionMetadata(slot_mapping=torch.full((n,), -1), query_start_loc=torch.tensor([0, n]),
                             seq_lens=torch.tensor([n]), block_tables=torch.zeros(1, 1, dtype=torch.int32),
                             max_query_len=n, query_lens_cpu=[n], seq_lens_cpu=[n])
    backend.calibrate_kv_scales(lambda: backend.forward(torch.randn(n, NUM_HEADS, HEAD_DIM), k.clone(), v,
                                                        torch.arange(n), pool[0], meta, norms))
    want = ref_rmsnorm(k, norms.k_norm.weight, 1e-6).abs().amax(dim=(0, 2)) * 2 / 448
    torch.testing.assert_close(pool[0].k_scale, want)
    assert pool[0].k_scale.max() / pool[0].k_scale.min() < 2  # normed: the heads' 80x magnitude gap is gone
