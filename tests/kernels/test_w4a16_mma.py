"""The INT4 tensor-core decode GEMM (roofline.kernels.w4a16_mma, Gluon kernel in gluon_w4a16).

CPU: the mma layout is what its docstring says (every code of a random weight found at its word and bit), the
repack inverts, malformed input is refused naming the tensor's shape, and the dispatch declines where the
kernel does not apply. H200 (``-m gpu``): the kernel against a float64 oracle at every tile and split, inside a
CUDA graph with PDL, and through an INT4 linear layer against the Triton path.
"""

from __future__ import annotations

import pytest
import torch

from roofline.kernels.quant_layouts import pack_int4
from roofline.kernels.w4a16_mma import (
    _NIBBLE_SHIFT,
    DEFAULT_TILES,
    HOPPER_TILES,
    MmaConfig,
    mma_supported,
    pick_tile,
    repack_int4_mma,
    unpack_int4_mma,
)


def _codes(n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)


def test_mma_layout_holds_every_code_where_the_docstring_says():
    n, k = 24, 256
    q = _codes(n, k)
    words = repack_int4_mma(pack_int4(q))
    assert words.shape == (k // 128, n * 16) and words.dtype == torch.int32
    w = words.to(torch.int64) & 0xFFFFFFFF
    for kt in range(k // 128):
        for col in range(n):
            for t in range(4):
                for rb in range(4):
                    word = int(w[kt, 16 * col + 4 * t + rb])
                    got = [(word >> _NIBBLE_SHIFT[j]) & 0xF for j in range(8)]
                    want = q[col, 128 * kt + 32 * rb + 8 * t: 128 * kt + 32 * rb + 8 * t + 8].tolist()
                    assert got == want, (kt, col, t, rb)


def test_repack_inverts_and_keeps_sign_bits():
    q = _codes(256, 384, seed=1)
    q[:, 7::8] = 15  # nibble 7 = 15 sets bit 31 of every GPTQ word
    qw = pack_int4(q)
    assert torch.equal(unpack_int4_mma(repack_int4_mma(qw), 256), qw)


@pytest.mark.parametrize("shape,dtype", [((3, 128), torch.int32), ((16, 128), torch.int64), ((32,), torch.int32)])
def test_repack_refuses_malformed_qweight_naming_its_shape(shape, dtype):
    with pytest.raises(ValueError, match=r"qweight.*" + str(tuple(shape)).replace("(", r"\(").replace(")", r"\)")):
        repack_int4_mma(torch.zeros(shape, dtype=dtype))


def test_mma_is_declined_with_a_reason_off_gpu_and_for_unsupported_shapes():
    assert "cpu" in mma_supported(4096, 4096, 128, torch.bfloat16, torch.device("cpu"))
    if torch.cuda.is_available():
        dev = torch.device("cuda", 0)
        assert "group size 64" in mma_supported(4096, 4096, 64, torch.bfloat16, dev)
        assert "float16" in mma_supported(4096, 4096, 128, torch.float16, dev)
        assert "K=576" in mma_supported(4096, 576, 128, torch.bfloat16, dev)


def test_measured_table_picks_the_mma_kernel_only_where_it_won(monkeypatch):
    from roofline.kernels import linear_dispatch

    rows = [dict(n=4096, k=4096, m=m, config=dict(block_m=max(8, m), block_n=128, num_warps=4, stages=2,
                                                     prefetch_x=m <= 16, split_k=4),
                 us=10.0 * m, triton_us=10.0 * m + (5 if m <= 16 else -5)) for m in (1, 8, 16, 32, 64)]
    monkeypatch.setattr(linear_dispatch, "_table", lambda device: {"int4_mma": rows})
    dev = torch.device("cpu")
    assert linear_dispatch.int4_mma_config(1, 4096, 4096, dev) == MmaConfig(8, 128, 4, 2, True, 4)
    assert linear_dispatch.int4_mma_config(5, 4000, 4096, dev).block_m == 8  # nearest shape, next measured M
    assert linear_dispatch.int4_mma_config(12, 4096, 4096, dev).block_m == 16
    assert linear_dispatch.int4_mma_config(17, 4096, 4096, dev) is None  # the Triton path won at M = 32
    assert linear_dispatch.int4_mma_config(65, 4096, 4096, dev) is None
    monkeypatch.setattr(linear_dispatch, "_table", lambda device: {})
    assert linear_dispatch.int4_mma_config(3, 4096, 4096, dev) == pick_tile(3)
    # a table measured up to M = 16 only: larger M get the default tile for their rows, not the M = 16 tile
    monkeypatch.setattr(linear_dispatch, "_table", lambda device: {"int4_mma": rows[:3]})
    assert linear_dispatch.int4_mma_config(40, 4096, 4096, dev) == pick_tile(40)
    assert linear_dispatch.int4_mma_config(16, 4096, 4096, dev).block_m == 16


def test_persistent_grid_refuses_a_register_ring_or_x_loaded_in_the_iteration():
    from roofline.kernels.w4a16_mma import w4a16_mma_gemm

    qm = repack_int4_mma(pack_int4(_codes(128, 256)))
    s = torch.ones(2, 128, dtype=torch.bfloat16)
    x = torch.zeros(1, 256, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="persistent=2 takes stages=1.*stages=3"):
        w4a16_mma_gemm(x, qm, s, s, config=MmaConfig(8, 128, 4, stages=3, persistent=2))
    with pytest.raises(ValueError, match="prefetch_x=False"):
        w4a16_mma_gemm(x, qm, s, s, config=MmaConfig(8, 128, 4, prefetch_x=False, persistent=1))
    with pytest.raises(ValueError, match=r"wgmma in \(1, 2\) takes .*wgmma=1, num_warps=2, block_n=64, persistent=1"):
        w4a16_mma_gemm(x, qm, s, s, config=MmaConfig(8, 64, 2, persistent=1, wgmma=1))
    with pytest.raises(ValueError, match="wgmma=3"):
        w4a16_mma_gemm(x, qm, s, s, config=MmaConfig(8, 64, 4, wgmma=3))


def test_tile_table_covers_every_decode_m():
    assert [pick_tile(m).block_m for m in (1, 8, 9, 16, 17, 32, 33, 64)] == [8, 8, 16, 16, 32, 32, 64, 64]
    hopper = [pick_tile(m, hopper=True) for m in (1, 16, 17, 32, 33, 64)]
    assert [c.block_m for c in hopper] == [8, 16, 32, 32, 64, 64]
    assert [c.wgmma for c in hopper] == [0, 0, 2, 2, 2, 2]  # mma.sync up to 16 rows, wgmma above
    for _, cfg in HOPPER_TILES:
        assert cfg.block_n % 64 == 0 and cfg.num_warps in (4, 8) and not cfg.persistent
    with pytest.raises(ValueError, match="M <= 64.*65"):
        pick_tile(65, hopper=True)
    for max_m, cfg in DEFAULT_TILES:
        assert cfg.block_m >= max_m and cfg.block_m % 8 == 0 and cfg.block_n % (16 * cfg.num_warps) == 0
    with pytest.raises(ValueError, match="M <= 64.*65"):
        pick_tile(65)


# ------------------------------------------------------------------------------------------------ H200

def _gpu_case(n, k, seed=0):
    from roofline.kernels.quant_gemm import prepare_int4
    from roofline.quant.quantize import quantize_int4_rtn

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.05
    p = prepare_int4(quantize_int4_rtn(w, 128), torch.bfloat16)
    return p, repack_int4_mma(p.qweight)


def _oracle(x, p):
    from roofline.kernels.quant_layouts import unpack_int4

    q = unpack_int4(p.qweight).double()  # [N, K]
    n, k = q.shape
    s = p.scales.double().t().repeat_interleave(128, dim=1)
    z = p.zeros.double().t().repeat_interleave(128, dim=1)
    return x.double() @ ((q - z) * s).t()


needs_gluon = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0)
    or mma_supported(256, 256, 128, torch.bfloat16, torch.device("cuda", 0)) is not None,
    reason="needs an sm_80+ GPU and Triton with Gluon")


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("m", [1, 3, 8, 13, 16, 31, 64])
@pytest.mark.parametrize("n,k", [(256, 256), (384, 1152), (4096, 4096)])
def test_gpu_mma_gemm_matches_float64(m, n, k):
    from roofline.kernels.w4a16_mma import w4a16_mma_gemm

    p, qm = _gpu_case(n, k)
    x = (torch.randn(m, k, device="cuda") * 0.5).bfloat16()
    ref = _oracle(x, p)
    tiles = {pick_tile(m)} | {c for _, c in DEFAULT_TILES if c.block_m >= m and n % c.block_n == 0}
    for tile in tiles:
        for stages in (1, 2, 4):
            for prefetch_x in ((True, False) if tile.block_m <= 16 else (False,)):
                for split in (1, 2, 3, None):
                    # persistent: 1 program per SM (each takes several items at these shapes) and 64 (one each)
                    for persistent in ((0, 1, 64) if stages == 1 and prefetch_x else (0,)):
                        cfg = tile._replace(stages=stages, prefetch_x=prefetch_x, split_k=split, persistent=persistent)
                        out = w4a16_mma_gemm(x, qm, p.scales, p.zeros, config=cfg)
                        err = ((out.double() - ref).norm() / ref.norm()).item()
                        assert err < 4e-3, (cfg, err)  # bf16 output rounding (2^-9 relative) plus fp32 sums


@pytest.mark.gpu
@needs_gluon
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9, reason="needs sm_90")
@pytest.mark.parametrize("m", [1, 3, 8, 13, 16, 31, 64])
@pytest.mark.parametrize("n,k", [(256, 256), (384, 1152), (4096, 4096)])
def test_gpu_wgmma_gemm_matches_float64(m, n, k):
    from roofline.kernels.w4a16_mma import w4a16_mma_gemm

    p, qm = _gpu_case(n, k, seed=m)
    x = (torch.randn(m, k, device="cuda") * 0.5).bfloat16()
    ref = _oracle(x, p)
    bm = pick_tile(m).block_m
    for bn, nw in ((64, 4), (128, 4), (128, 8)):
        if n % bn:
            continue
        for split, pipe in [(sp, p) for sp in (1, 2, 3, None) for p in (1, 2)]:  # split 3 of 9 k-tiles: odd bodies
            cfg = MmaConfig(bm, bn, nw, split_k=split, wgmma=pipe)
            out = w4a16_mma_gemm(x, qm, p.scales, p.zeros, config=cfg)
            assert out.shape == (m, n)
            err = ((out.double() - ref).norm() / ref.norm()).item()
            assert err < 4e-3, (cfg, err)  # bf16 output rounding plus fp32 sums, as the mma.sync kernel


@pytest.mark.gpu
@needs_gluon
def test_gpu_mma_gemm_in_a_cuda_graph_with_pdl_equals_eager():
    from roofline.kernels.w4a16_mma import w4a16_mma_gemm

    p, qm = _gpu_case(1024, 2048, seed=3)
    x = (torch.randn(1, 2048, device="cuda") * 0.5).bfloat16()
    eager = w4a16_mma_gemm(x, qm, p.scales, p.zeros, pdl_mode=0)  # the default config: one-tile prefetch
    from roofline.worker.cuda_graph import capture_graph

    def chain():
        out = w4a16_mma_gemm(x, qm, p.scales, p.zeros, pdl_mode=1)
        return out, w4a16_mma_gemm(out.repeat(1, 2), qm, p.scales, p.zeros, pdl_mode=1)

    graph, (out, out2) = capture_graph(chain)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    assert torch.equal(out2, w4a16_mma_gemm(eager.repeat(1, 2), qm, p.scales, p.zeros, pdl_mode=0))


@pytest.mark.gpu
@needs_gluon
def test_gpu_int4_layer_uses_the_mma_layout_and_agrees_with_the_triton_path():
    from types import SimpleNamespace

    from roofline.kernels import linear_dispatch
    from roofline.kernels.switch import set_kernels_enabled

    set_kernels_enabled(True)
    p, qm = _gpu_case(2048, 1024, seed=5)
    layer = SimpleNamespace(qweight=p.qweight, scales=p.scales, zeros=p.zeros, int4_group_size=128)
    prepared = linear_dispatch.prepare_w4a16_mma(p.qweight, 128, torch.bfloat16)
    assert torch.equal(prepared["qweight_mma"], qm)
    for m in (1, 8, 64, 65):
        x = (torch.randn(m, 1024, device="cuda") * 0.5).bfloat16()
        triton_out = linear_dispatch.w4a16(x, layer)
        mma_out = linear_dispatch.w4a16(x, SimpleNamespace(**vars(layer), qweight_mma=qm))
        ref = _oracle(x, p)
        for out in (triton_out, mma_out):
            assert ((out.double() - ref).norm() / ref.norm()).item() < 4e-3
