"""Quantized GEMM kernels (Triton) against float64 references computed from the canonical forms.

Tolerances: ||out - ref64|| / ||ref64|| < TOL[dtype] (fp32 1e-5, fp16 1e-3, bf16 1e-2; kernel_cases.py).
The canonical scales are pre-rounded to the activation dtype (as ``prepare_int4`` stores them), so the
float64 reference and the kernel see the same weight and the error left is accumulation and output
rounding (plus, for the tiled INT4 variant, one rounding of each dequantized weight to the dtype).
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import DEVICE, DTYPES, TOL, gpu_only, rel_err  # noqa: E402

from roofline.kernels import quant_gemm as qg  # noqa: E402
from roofline.kernels.quant_gemm import GemmConfig  # noqa: E402
from roofline.quant.quantize import (  # noqa: E402
    Int4Weight,
    quantize_int4_rtn,
    quantize_int8_per_channel,
    quantize_per_token_fp8,
    quantize_per_token_int8,
)

# Small tiles so the CPU interpreter covers several tiles, N/M tails and split-K with few programs.
SMALL_SPLIT = GemmConfig(16, 32, 64, 4, 1, split_k=3)  # weight-streaming variant, 3 K splits
SMALL_UNPACK = GemmConfig(16, 32, 64, 4, 1, split_k=2, unpack=1)  # INT4: one load per word + reshape
TILED = GemmConfig(32, 32, 64, 4, 1)  # tiled variant (INT4: per-element scales)
TILED_BK128 = GemmConfig(32, 32, 128, 4, 1)  # BLOCK_K > G for G = 32/64: scales gathered per row
GEMV_SPLIT = GemmConfig(4, 16, 32, 4, 1, split_k=2, gemv=True)  # the FMA stream, 4 rows, 2 K splits
GEMV_ONE = GemmConfig(1, 32, 64, 4, 1, gemv=True)  # one row per program (M programs along M)
GEMV_ONE_SPLIT = GemmConfig(1, 64, 32, 4, 1, split_k=3, gemv=True)  # INT4: the 2-D one-row stream, 3 K splits
SWAP = GemmConfig(16, 32, 64, 4, 1, swap_ab=True)  # weight-only 8-bit: out^T = W @ x^T (codes as the A operand)
SWAP_SPLIT = GemmConfig(32, 16, 64, 4, 1, split_k=3, swap_ab=True)  # ... over 3 K splits, 32 rows of x a program
CONFIGS = {"default": None, "split3": SMALL_SPLIT, "unpack": SMALL_UNPACK, "tiled": TILED, "bk128": TILED_BK128,
           "gemv": GEMV_SPLIT, "gemv1": GEMV_ONE, "gemv1split": GEMV_ONE_SPLIT, "swap": SWAP, "swap_split": SWAP_SPLIT}


def _int4_case(n, k, group_size, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g)
    cw = quantize_int4_rtn(w, group_size)
    cw.scales = cw.scales.to(dtype).float()  # the scales the kernel reads (see module docstring)
    return cw


def _int4_f64(cw: Int4Weight) -> torch.Tensor:
    """float64 [N, K] from the canonical form, independent of the packing code."""
    g = torch.arange(cw.q.shape[1]) // cw.group_size
    return (cw.q.double() - cw.zeros.double()[:, g]) * cw.scales.double()[:, g]


def _to(p: qg.Int4Packed | qg.Int8Packed, device: str):
    if isinstance(p, qg.Int4Packed):
        return qg.Int4Packed(p.qweight.to(device), p.scales.to(device), p.zeros.to(device), p.group_size)
    return qg.Int8Packed(p.q.to(device), p.scales.to(device))


# ---------------------------------------------------------------------------------------- packing

def test_pack_int4_known_words():
    q = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 7], [8, 9, 10, 11, 12, 13, 14, 15], [15] * 8], dtype=torch.uint8)
    words = qg.pack_int4(q)  # [1, 3]: one word per output channel
    assert words.dtype == torch.int32 and words.shape == (1, 3)
    # nibble i (bits 4i..4i+3) holds k = i: 0x76543210; 0xFEDCBA98 and 0xFFFFFFFF as two's complement int32
    assert words.tolist() == [[0x76543210, 0xFEDCBA98 - 2**32, -1]]
    assert torch.equal(qg.unpack_int4(words), q)


@pytest.mark.parametrize("n,k,group_size", [(1, 8, 8), (37, 96, 32), (64, 256, 128)])
def test_prepare_int4_round_trip(n, k, group_size):
    cw = _int4_case(n, k, group_size, torch.float16, seed=n)
    p = qg.prepare_int4(cw, torch.float16)
    assert p.qweight.shape == (k // 8, n) and p.scales.shape == (k // group_size, n) == p.zeros.shape
    assert p.shape == (n, k)
    assert torch.equal(qg.unpack_int4(p.qweight), cw.q)  # exact
    assert torch.equal(p.zeros.t().to(torch.uint8), cw.zeros)
    assert torch.equal(p.scales.t().float(), cw.scales)
    assert p.weight_bytes() == qg.int4_weight_bytes(n, k, group_size, torch.float16) == n * k // 2 + 4 * n * k // group_size


def test_prepare_int8_and_bytes():
    cw = quantize_int8_per_channel(torch.randn(10, 24))
    p = qg.prepare_int8(cw)
    assert torch.equal(p.q, cw.q) and p.scales.dtype == torch.float32 and p.shape == (10, 24)
    assert p.weight_bytes() == qg.int8_weight_bytes(10, 24) == 10 * 24 + 40


def test_packing_errors():
    with pytest.raises(ValueError, match="K % 8"):
        qg.pack_int4(torch.zeros(2, 12, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"\[0, 15\]"):
        qg.pack_int4(torch.full((2, 8), 16, dtype=torch.uint8))
    cw = _int4_case(8, 64, 32, torch.float32)
    cw.g_idx = torch.arange(64, dtype=torch.int32) // 32  # trivial act-order: accepted
    qg.prepare_int4(cw)
    cw.g_idx = cw.g_idx.flip(0)
    with pytest.raises(ValueError, match="permute"):
        qg.prepare_int4(cw)


def test_choose_split_k():
    # Llama-3-8B at M=1, BLOCK_N 32, 132 SMs (the docstring's figures).
    assert qg.choose_split_k(6144 // 32, 4096 // 128, 132) == 2
    assert qg.choose_split_k(4096 // 32, 4096 // 128, 132) == 4
    assert qg.choose_split_k(28672 // 32, 4096 // 128, 132) == 1
    assert qg.choose_split_k(4096 // 32, 14336 // 128, 132) == 4
    assert qg.choose_split_k(1, 3, 132) == 1  # never fewer than 2 K tiles per split


# ---------------------------------------------------------------------------------------- w4a16

W4_SHAPES = [(1, 64, 256, 32), (5, 80, 256, 64), (19, 48, 384, 128)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,group_size", W4_SHAPES)
@pytest.mark.parametrize("cfg", ["default", "split3", "unpack", "tiled", "bk128"])
def test_w4a16_matches_f64(m, n, k, group_size, cfg, dtype):
    _check_w4a16(m, n, k, group_size, CONFIGS[cfg], dtype)


def _check_w4a16(m, n, k, group_size, config, dtype):
    # w4a16_gemm with ``config`` within the dtype's tolerance of float64 and of the ref_ twin
    cw = _int4_case(n, k, group_size, dtype, seed=m + n)
    p = _to(qg.prepare_int4(cw, dtype), DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    out = qg.w4a16_gemm(x, p.qweight, p.scales, p.zeros, group_size, config=config)
    assert out.shape == (m, n) and out.dtype == dtype
    ref64 = x.cpu().double() @ _int4_f64(cw).t()
    assert rel_err(out.cpu(), ref64) < TOL[dtype]
    twin = qg.ref_w4a16_gemm(x, p.qweight, p.scales, p.zeros, group_size)
    assert rel_err(out, twin) < TOL[dtype]


def test_w4a16_k_tail_and_batch_dims():
    # K = 96 with BLOCK_K 64: the last tile is half outside K (masked words, scales and zeros).
    cw = _int4_case(40, 96, 32, torch.float32, seed=4)
    p = _to(qg.prepare_int4(cw, torch.float32), DEVICE)
    x = torch.randn(2, 10, 96)
    out = qg.w4a16_gemm(x.to(DEVICE), p.qweight, p.scales, p.zeros, 32, config=TILED)
    assert out.shape == (2, 10, 40)
    assert rel_err(out.cpu(), x.double() @ _int4_f64(cw).t()) < TOL[torch.float32]


def test_w4a16_rejects_mismatched_scales():
    p = _to(qg.prepare_int4(_int4_case(16, 64, 32, torch.float32), torch.float32), DEVICE)
    with pytest.raises(ValueError, match="scales/zeros must be torch.float16"):
        qg.w4a16_gemm(torch.randn(1, 64, device=DEVICE).half(), p.qweight, p.scales, p.zeros, 32)
    with pytest.raises(ValueError, match="group size"):
        qg.w4a16_gemm(torch.randn(1, 64, device=DEVICE), p.qweight, p.scales, p.zeros, 64)


def test_split_k_is_deterministic_and_rearms_counters():
    cw = _int4_case(64, 512, 64, torch.float32, seed=9)
    p = _to(qg.prepare_int4(cw, torch.float32), DEVICE)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(9))
    xd = x.to(DEVICE)
    for cfg in (GemmConfig(16, 32, 64, 4, 1, split_k=8), GemmConfig(2, 32, 64, 4, 1, split_k=8, gemv=True)):
        a = qg.w4a16_gemm(xd, p.qweight, p.scales, p.zeros, 64, config=cfg)
        b = qg.w4a16_gemm(xd, p.qweight, p.scales, p.zeros, 64, config=cfg)
        assert torch.equal(a, b)
        assert int(qg._counters(xd.device, 1).abs().sum()) == 0  # every tile's arrival counter is back at 0
        assert rel_err(a.cpu(), x.double() @ _int4_f64(cw).t()) < TOL[torch.float32]


# ---------------------------------------------------------------------------------------- w8a16, dense

W8_SHAPES = [(1, 64, 256), (7, 70, 200), (33, 40, 128)]  # K = 200: a K tail in every config


@pytest.mark.parametrize("ptx", [False, pytest.param(True, marks=gpu_only, id="ptx")])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", W8_SHAPES)
@pytest.mark.parametrize("cfg", ["default", "split3", "tiled", "swap", "swap_split"])
def test_w8a16_matches_f64(m, n, k, cfg, dtype, ptx, monkeypatch):
    monkeypatch.setattr(qg, "_PTX_CVT_ON", ptx)  # the inline-PTX code conversion (16-bit x on sm_90) or not
    cw = quantize_int8_per_channel(torch.randn(n, k, generator=torch.Generator().manual_seed(n)))
    p = _to(qg.prepare_int8(cw), DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    out = qg.w8a16_gemm(x, p.q, p.scales, config=CONFIGS[cfg])
    assert out.shape == (m, n) and out.dtype == dtype
    ref64 = x.cpu().double() @ (cw.q.double() * cw.scales.double()[:, None]).t()
    assert rel_err(out.cpu(), ref64) < TOL[dtype]
    assert rel_err(out, qg.ref_w8a16_gemm(x, p.q, p.scales)) < TOL[dtype]


WS_CONFIGS = {"ws64": GemmConfig(64, 128, 64, 4, 4, ws=True), "ws128": GemmConfig(128, 128, 64, 8, 4, ws=True),
              "ws64n256": GemmConfig(64, 256, 64, 4, 4, ws=True), "ws128k128": GemmConfig(128, 64, 128, 8, 3, ws=True),
              "ws128split3": GemmConfig(128, 128, 64, 8, 4, split_k=3, ws=True),  # 3 K splits, fp32 partials
              # no loader warp (the converter issues the copies): 128 x 256 and 64 x 256 tiles, split-K
              "ws2n256": GemmConfig(128, 256, 64, 8, 3, ws=2), "ws2m64": GemmConfig(64, 256, 64, 4, 4, ws=2),
              "ws2split3": GemmConfig(128, 128, 64, 8, 4, split_k=3, ws=2),
              # 256-row tiles (two m64 wgmma a warpgroup)
              "ws2m256": GemmConfig(256, 128, 64, 8, 3, ws=2)}


def test_ws_split_fills_the_sms_in_whole_k_runs():
    """choose_ws_split: one resident program per SM, so split K until the grid reaches about the SM count, in
    powers of two of >= 8 K tiles each (the docstring's Llama-3-8B cases at M = 128, 128 x 128 x 64 tiles)."""
    from roofline.kernels.ws_gemm import choose_ws_split

    assert [choose_ws_split(t, kt, 132) for t, kt in [(32, 64), (48, 64), (32, 224), (224, 64)]] == [4, 2, 4, 1]
    assert choose_ws_split(1, 16, 132) == 2 and choose_ws_split(1, 15, 132) == 1  # >= 8 K tiles a split


def _ws_runs() -> bool:
    from roofline.kernels import ws_gemm

    x = torch.zeros(64, 64, dtype=torch.bfloat16, device=DEVICE)
    return ws_gemm.ws_unsupported_reason(x, torch.zeros(64, 64, dtype=torch.int8, device=DEVICE), 64, 64, 64, 2) is None


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 96, 512), (64, 256, 512), (100, 200, 336), (128, 384, 4096), (256, 4096, 4096),
                                   (300, 512, 1024)])
@pytest.mark.parametrize("cfg", list(WS_CONFIGS))
def test_w8a16_ws_matches_f64(m, n, k, cfg, dtype):
    """The warp-specialized Gluon W8A16 GEMM (sm_90; M, N and K tails: TMA zero fill, masked stores) within the
    dtype's tolerance of float64; elsewhere (the CPU, fp32 x) the config falls back to the Triton default, same
    tolerance."""
    if dtype == torch.float32 and m * n * k > 2**24:
        pytest.skip("the fp32 fallback at the 8B's shapes is slow under the interpreter")
    if DEVICE == "cpu" and m * n * k > 2**23:
        pytest.skip("the interpreter: the small shapes cover the fallback")
    cw = quantize_int8_per_channel(torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)))
    p = _to(qg.prepare_int8(cw), DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).to(DEVICE)
    out = qg.w8a16_gemm(x, p.q, p.scales, config=WS_CONFIGS[cfg])
    assert out.shape == (m, n) and out.dtype == dtype
    ref64 = x.cpu().double() @ (cw.q.double() * cw.scales.double()[:, None]).t()
    assert rel_err(out.cpu(), ref64) < TOL[dtype]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_w8a16_ws_extreme_codes_and_runs_on_sm90(dtype):
    """-128 and 127 through the Gluon kernel's PTX conversion, exactly (every q * s is exact in 16 bits); and on an
    sm_90 GPU the kernel really runs (no silent fallback)."""
    if not _ws_runs():
        pytest.skip("the Gluon W8A16 kernel needs sm_90 and Gluon")
    from roofline.kernels import ws_gemm

    q = torch.tensor([[-128, 127, -1, 0] * 16, [1, -127, 5, -5] * 16] * 32, dtype=torch.int8)
    s = torch.tensor([0.5, 2.0] * 32)
    rows = list(range(64)) + list(range(6))  # 70 rows: a second M tile of 6 (TMA zero fill, masked store)
    x = torch.eye(64)[rows].to(dtype)
    want = (q.float() * s[:, None]).t()[rows]
    for loader in (True, False):
        got = ws_gemm.w8a16_ws_gemm(x.cuda(), q.cuda(), s.cuda(), 64, 64, 64, 2, loader=loader)
        assert torch.equal(got.cpu().float(), want)
    out = qg.w8a16_gemm(x.cuda(), q.cuda(), s.cuda(), config=WS_CONFIGS["ws64"])
    assert torch.equal(out.cpu().float(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("loader", [True, False])
@pytest.mark.parametrize("split", [2, 3, 5])
def test_w8a16_ws_split_k_reduces_in_kernel_deterministically(split, loader):
    """Split-K in the Gluon kernel: the last split of each tile sums the fp32 partials in split order in the same
    launch: within bf16's tolerance of float64, bit-identical call after call (the counters were re-armed to 0,
    or the second call would never reduce) and the counters are left zero. 15 K tiles: splits of 8 + 7, 3 x 5 and
    5 x 3 tiles."""
    if not _ws_runs():
        pytest.skip("the Gluon W8A16 kernel needs sm_90 and Gluon")
    from roofline.kernels import ws_gemm

    m, n, k, bk = 70, 320, 64 * 15, 64
    g = torch.Generator().manual_seed(split)
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8).cuda()
    s = (torch.rand(n, generator=g) + 0.5).cuda()
    x = torch.randn(m, k, generator=g).to(torch.bfloat16).cuda()
    counters = torch.zeros(64, dtype=torch.int32, device="cuda")
    runs = [ws_gemm.w8a16_ws_gemm(x, q, s, 64, 64, bk, 3, split_k=split, counters=counters, loader=loader)
            for _ in range(3)]
    assert all(torch.equal(r, runs[0]) for r in runs[1:])
    assert int(counters.abs().sum()) == 0
    ref64 = x.cpu().double() @ (q.cpu().double() * s.cpu().double()[:, None]).t()
    assert rel_err(runs[0].cpu(), ref64) < TOL[torch.bfloat16]


def test_ws_is_refused_outside_int8_and_int4():
    q = torch.zeros(32, 64, dtype=torch.float8_e4m3fn).to(DEVICE)
    with pytest.raises(ValueError, match="ws is an INT8 / INT4 weight-only config only"):
        qg.fp8_w8a16_gemm(torch.randn(2, 64).to(DEVICE), q, torch.ones(32).to(DEVICE), config=WS_CONFIGS["ws64"])


W4_WS_CONFIGS = {"ws128": GemmConfig(128, 128, 64, 8, 4, ws=1), "ws2n256": GemmConfig(128, 256, 64, 8, 3, ws=2),
                 "ws64": GemmConfig(64, 128, 64, 4, 4, ws=1), "ws2split3": GemmConfig(128, 128, 64, 8, 4, split_k=3,
                                                                                        ws=2),
                 "ws2m256": GemmConfig(256, 128, 64, 8, 4, ws=2)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,group_size", [(1, 64, 256, 64), (70, 200, 384, 128), (128, 384, 4096, 128),
                                              (256, 4096, 4096, 128), (300, 520, 1024, 64)])
@pytest.mark.parametrize("cfg", list(W4_WS_CONFIGS))
def test_w4a16_ws_matches_f64(m, n, k, group_size, cfg, dtype):
    """INT4 through the warp-specialized Gluon GEMM (sm_90: the converter partition dequantizes the words with the
    group's scale and zero point; M / N tails, groups of 64 and 128, split-K) within the dtype's tolerance of
    float64 and of the ref_ twin; elsewhere the config falls back to the Triton default for M, same tolerances."""
    if DEVICE == "cpu" and m * n * k > 2**22:
        pytest.skip("the interpreter: the small shapes cover the fallback")
    if dtype == torch.float32 and m * n * k > 2**24:
        pytest.skip("the fp32 fallback at the 8B's shapes is slow")
    _check_w4a16(m, n, k, group_size, W4_WS_CONFIGS[cfg], dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_w4a16_ws_runs_on_sm90_and_refuses_groups_it_cannot_tile():
    """On an sm_90 GPU the INT4 ws path really runs (no silent fallback): every code 0..15 against zero points
    0 and 15, exact in 16 bits; a group of 32 (under BLOCK_K 64) is refused by ws_unsupported_reason (and the
    w4a16_gemm call then takes the Triton default, still right)."""
    if not _ws_runs():
        pytest.skip("the Gluon kernel needs sm_90 and Gluon")
    from roofline.kernels import ws_gemm
    from roofline.kernels.quant_layouts import pack_int4

    n, k = 64, 128
    q = (torch.arange(n * k) % 16).reshape(n, k).to(torch.uint8)
    zeros = torch.tensor([0.0, 15.0]).repeat(n // 2)[None, :].repeat(k // 64, 1)  # [K / 64, N]
    scales = torch.full((k // 64, n), 0.5)
    x = torch.eye(k)[:70 % k].to(torch.bfloat16)  # rows pick input channels
    qw = pack_int4(q).cuda()
    got = ws_gemm.w4a16_ws_gemm(x.cuda(), qw, scales.bfloat16().cuda(), zeros.bfloat16().cuda(), 64, 64, 64, 64, 2)
    g = torch.arange(k) // 64
    w = (q.float() - zeros.t()[:, g]) * scales.t()[:, g]  # [N, K]
    assert torch.equal(got.cpu().float(), w.t()[:70])
    assert "group size 32" in ws_gemm.ws_unsupported_reason(x.cuda(), qw, 64, 64, 64, 2, group_size=32)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("loader", [True, False])
def test_w4a16_ws_packed_math_gives_the_same_bits(dtype, loader):
    """Both forms of the converter's dequantization (fp32; packed 16-bit, two codes an instruction) give exactly
    round((q - z) * s) in x's dtype for every weight: x is the identity, so each output is one weight, bit for bit.
    Random codes, zero points 0..15 and scales per group (8 groups of 64, so the 3-stage ring wraps), fp16 scales
    down to 2^-20 (subnormal products), an N tail (200 of 256)."""
    if not _ws_runs():
        pytest.skip("the Gluon kernel needs sm_90 and Gluon")
    from roofline.kernels import ws_gemm
    from roofline.kernels.quant_layouts import pack_int4

    g = torch.Generator().manual_seed(7)
    n, k, group = 200, 512, 64
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (k // group, n), generator=g).to(dtype)
    low = -20 if dtype == torch.float16 else -12
    scales = torch.exp2(torch.randint(low, 5, (k // group, n), generator=g).float()
                        + torch.rand(k // group, n, generator=g)).to(dtype)
    x = torch.eye(k).to(dtype).cuda()
    gi = torch.arange(k) // group
    want = ((q.float() - zeros.float().t()[:, gi]) * scales.float().t()[:, gi]).to(dtype).t()  # [K, N]
    args = (x, pack_int4(q).cuda(), scales.cuda(), zeros.cuda(), group, 128, 128, 64, 3)
    assert torch.equal(ws_gemm.w4a16_ws_gemm(*args, loader=loader, int4_packed=False).cpu(), want)
    assert torch.equal(ws_gemm.w4a16_ws_gemm(*args, loader=loader, int4_packed=True).cpu(), want)
    # 8 converter warps and 256-row tiles: the same bits
    assert torch.equal(ws_gemm.w4a16_ws_gemm(*args, loader=loader, cvt_warps=8).cpu(), want)
    assert torch.equal(ws_gemm.w4a16_ws_gemm(*args[:5], 256, 128, 64, 3, loader=False).cpu(), want)  # 2 M tiles


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_n", [128, 256])
def test_w8a16_ws_converter_variants_give_the_same_bits(block_n):
    """INT8 codes through the converter (all of a tile's code slices read before the first store), with and
    without the loader warp, with 8 converter warps and in 256-row tiles: x is the identity, so each output is
    code * scale rounded once, bit for bit the same in every variant."""
    if not _ws_runs():
        pytest.skip("the Gluon kernel needs sm_90 and Gluon")
    from roofline.kernels import ws_gemm

    g = torch.Generator().manual_seed(3)
    n, k = 300, 512
    q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
    scales = torch.rand(n, generator=g) + 0.5
    x = torch.eye(k).to(torch.bfloat16).cuda()
    want = (q.float() * scales[:, None]).to(torch.bfloat16).t()  # [K, N]
    args = (x, q.cuda(), scales.cuda(), 128, block_n, 64, 3)
    for kw in (dict(), dict(loader=False), dict(loader=False, cvt_warps=8)):
        if block_n == 256 and (kw.get("cvt_warps") == 8 or kw.get("loader", True)):
            continue  # 128 x 256 needs the MMA's 168 registers: no loader warp, 4 converter warps (ptxas)
        assert torch.equal(ws_gemm.w8a16_ws_gemm(*args, **kw).cpu(), want), kw
    got = ws_gemm.w8a16_ws_gemm(x, q.cuda(), scales.cuda(), 256, 128, 64, 3, loader=False)
    assert torch.equal(got.cpu(), want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_w4a16_gemm_takes_the_ws_kernel_for_a_ws_config(monkeypatch):
    """``quant_gemm.w4a16_gemm`` with a ws config runs ``ws_gemm.w4a16_ws_gemm`` on sm_90 (no silent fallback
    to the Triton kernel), and the Triton kernel for a group it cannot tile (32 under BLOCK_K 64); both right."""
    if not _ws_runs():
        pytest.skip("the Gluon kernel needs sm_90 and Gluon")
    from roofline.kernels import ws_gemm

    calls = []
    real = ws_gemm.w4a16_ws_gemm
    monkeypatch.setattr(ws_gemm, "w4a16_ws_gemm", lambda *a, **kw: calls.append(a[4]) or real(*a, **kw))
    for group in (64, 32):
        cw = _int4_case(256, 512, group, torch.bfloat16, seed=group)
        p = _to(qg.prepare_int4(cw, torch.bfloat16), "cuda")
        x = torch.randn(100, 512, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16).cuda()
        out = qg.w4a16_gemm(x, p.qweight, p.scales, p.zeros, group, config=W4_WS_CONFIGS["ws128"])
        assert rel_err(out.cpu(), x.cpu().double() @ _int4_f64(cw).t()) < TOL[torch.bfloat16]
    assert calls == [64]


@pytest.mark.parametrize("ptx", [False, pytest.param(True, marks=gpu_only, id="ptx")])
@pytest.mark.parametrize("dtype", DTYPES)
def test_w8a16_extreme_codes(dtype, ptx, monkeypatch):
    # -128 and 127 through each conversion (the 0x4B000080 float; with ``ptx``, on an sm_90 GPU in 16 bits, the
    # inline-PTX one, which splits the sign bit from the low 7 bits): canonical codes stop at -127, the kernel
    # takes any int8. Every q * s here is exact in bf16.
    monkeypatch.setattr(qg, "_PTX_CVT_ON", ptx)
    q = torch.tensor([[-128, 127, -1, 0] * 8, [1, -127, 5, -5] * 8] * 8, dtype=torch.int8)
    s = torch.tensor([0.5, 2.0] * 8)
    x = torch.eye(32)[:3].to(dtype)
    for cfg in (TILED, GEMV_SPLIT, SWAP):
        out = qg.w8a16_gemm(x.to(DEVICE), q.to(DEVICE), s.to(DEVICE), config=cfg)
        assert torch.equal(out.cpu().float(), (q.float() * s[:, None]).t()[:3])


def test_swap_ab_is_refused_outside_the_8bit_weight_only_formats():
    cw = _int4_case(32, 64, 32, torch.float32)
    p = _to(qg.prepare_int4(cw, torch.float32), DEVICE)
    x = torch.randn(2, 64).to(DEVICE)
    with pytest.raises(ValueError, match="swap_ab is a weight-only 8-bit"):
        qg.w4a16_gemm(x, p.qweight, p.scales, p.zeros, 32, config=SWAP)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 96, 512), (4, 50, 136)])
@pytest.mark.parametrize("cfg", ["default", "split3"])
def test_dense_gemv_matches_f64(m, n, k, cfg, dtype):
    g = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    out = qg.dense_gemv(x.to(DEVICE), w.to(DEVICE), config=CONFIGS[cfg])
    assert rel_err(out.cpu(), x.double() @ w.double().t()) < TOL[dtype]


# ---------------------------------------------------------------------------------------- GEMV (M <= 4, no tl.dot)

# (M, N, K, G): N tails against BLOCK_N 16/32/64/128, 2-12 groups, a group that is not a power of two (96: the
# kernel's BLOCK_K becomes 32), M = 1..4 (BLOCK_M 4 with masked rows at M = 3).
GEMV_W4 = [(1, 72, 256, 32), (2, 40, 384, 128), (3, 130, 192, 64), (4, 33, 288, 96)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,group_size", GEMV_W4)
@pytest.mark.parametrize("cfg", ["default", "gemv", "gemv1", "gemv1split"])
def test_gemv_w4a16_matches_f64(m, n, k, group_size, cfg, dtype):
    assert qg.pick_config("int4", m).gemv  # the CONFIGS rows for M <= 4 are the GEMV
    cw = _int4_case(n, k, group_size, dtype, seed=m * n)
    p = _to(qg.prepare_int4(cw, dtype), DEVICE)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    out = qg.w4a16_gemm(x.to(DEVICE), p.qweight, p.scales, p.zeros, group_size, config=CONFIGS[cfg])
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out.cpu(), x.double() @ _int4_f64(cw).t()) < TOL[dtype]


def test_gemv_w4a16_extreme_codes_and_fallback():
    # Codes 0 and 15 in every nibble position (bits 28..31 set the sign of the int32 word), zero points 0 and
    # 15, x = one-hot rows: each output is one dequantized weight, exact in fp32.
    n, k, g = 16, 64, 32
    q = torch.zeros(n, k, dtype=torch.uint8)
    q[::2] = 15
    q[:, 7::8] = 15 - q[:, 7::8]
    cw = Int4Weight(q=q, scales=torch.full((n, k // g), 0.5), zeros=torch.zeros(n, k // g, dtype=torch.uint8),
                    group_size=g)
    cw.zeros[:, 1] = 15
    p = _to(qg.prepare_int4(cw, torch.float32), DEVICE)
    x = torch.eye(k)[[0, 7, 39, 63]]
    for cfg in (GEMV_SPLIT, GEMV_ONE, GEMV_ONE_SPLIT):  # 4 rows per program; one row (the 2-D stream)
        out = qg.w4a16_gemm(x.to(DEVICE), p.qweight, p.scales, p.zeros, g, config=cfg)
        assert torch.equal(out.cpu(), (x.double() @ _int4_f64(cw).t()).float())
    # G = 4 (a word spans two groups): the GEMV config falls back to the tl.dot variant.
    c4 = _int4_case(24, 64, 4, torch.float32, seed=3)
    p4 = _to(qg.prepare_int4(c4, torch.float32), DEVICE)
    xr = torch.randn(2, 64, generator=torch.Generator().manual_seed(4))
    out = qg.w4a16_gemm(xr.to(DEVICE), p4.qweight, p4.scales, p4.zeros, 4, config=GEMV_ONE)
    assert rel_err(out.cpu(), xr.double() @ _int4_f64(c4).t()) < TOL[torch.float32]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 70, 200), (3, 33, 136), (4, 40, 256)])  # K tails at BLOCK_K 32 / 64
def test_gemv_w8a16_dense_int8_match_f64(m, n, k, dtype):
    g = torch.Generator().manual_seed(m + k)
    w = torch.randn(n, k, generator=g)
    cw = quantize_int8_per_channel(w)
    x = torch.randn(m, k, generator=g).to(dtype)
    w8 = cw.q.double() * cw.scales.double()[:, None]
    xq, xs = quantize_per_token_int8(x.float())
    for cfg in (None, GEMV_SPLIT, GEMV_ONE):
        out = qg.w8a16_gemm(x.to(DEVICE), cw.q.to(DEVICE), cw.scales.to(DEVICE), config=cfg)
        assert out.shape == (m, n) and rel_err(out.cpu(), x.double() @ w8.t()) < TOL[dtype]
        wd = w.to(dtype)
        out = qg.dense_gemv(x.to(DEVICE), wd.to(DEVICE), config=cfg)
        assert rel_err(out.cpu(), x.double() @ wd.double().t()) < TOL[dtype]
        out = qg.int8_gemm(xq.to(DEVICE), xs.to(DEVICE), cw.q.to(DEVICE), cw.scales.to(DEVICE), dtype, config=cfg)
        assert rel_err(out.cpu(), (xq.double() * xs.double()) @ w8.t()) < TOL[dtype]


def _fp8_wo_case(m, n, k, dtype):
    from roofline.quant.quantize import quantize_fp8_per_channel

    g = torch.Generator().manual_seed(m * k)
    cw = quantize_fp8_per_channel(torch.randn(n, k, generator=g))
    q8, ws = cw.q.to(torch.float8_e4m3fn), cw.scales.float()
    x = torch.randn(m, k, generator=g).to(dtype)
    return x, q8, ws, x.double() @ (q8.double() * ws.double()[:, None]).t()  # the E4M3 values, x unrounded


def test_fp8_weight_only_twin_and_errors():
    x, q8, ws, exact = _fp8_wo_case(3, 33, 136, torch.float32)
    assert rel_err(qg.ref_fp8_w8a16_gemm(x, q8, ws), exact) < TOL[torch.float32]
    with pytest.raises(ValueError, match="want float8_e4m3fn q"):
        qg.fp8_w8a16_gemm(x.to(DEVICE), q8.to(torch.int8).to(DEVICE), ws.to(DEVICE))
    with pytest.raises(ValueError, match="x has 16 input channels, the weight K=136"):
        qg.fp8_w8a16_gemm(x[:, :16].to(DEVICE), q8.to(DEVICE), ws.to(DEVICE))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the interpreter cannot load fp8)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 70, 200), (3, 33, 136), (20, 40, 256), (1, 4096, 4096)])  # 20: tl.dot
def test_gpu_fp8_weight_only_matches_f64(m, n, k, dtype):
    x, q8, ws, exact = _fp8_wo_case(m, n, k, dtype)
    for cfg in (None, GEMV_SPLIT, GEMV_ONE, SMALL_SPLIT, TILED, SWAP, SWAP_SPLIT, GemmConfig(64, 128, 128, 8, 4, swap_ab=True)):
        out = qg.fp8_w8a16_gemm(x.cuda(), q8.cuda(), ws.cuda(), config=cfg)
        assert out.shape == (m, n) and out.dtype == dtype
        assert rel_err(out.cpu(), exact) < TOL[dtype]


# ---------------------------------------------------------------------------------------- W8A8 GEMV (fused quant)

def _w8a8_case(m, n, k, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0, k // 3] = -40.0  # an outlier sets row 0's scale (from a negative value)
    w = torch.randn(n, k, generator=g)
    return x, w


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 70, 200), (3, 33, 1500), (4, 40, 256)])  # K tails; 1500: two amax chunks
def test_w8a8_gemv_int8_equals_quantize_then_exact_product(m, n, k, dtype):
    x, w = _w8a8_case(m, n, k, dtype, seed=m * k)
    cw = quantize_int8_per_channel(w)
    xq, xs = qg.ref_per_token_quant_int8(x)
    exact = (xq.double() @ cw.q.double().t()) * xs.double() * cw.scales.double()[None, :]  # float64, same codes
    for cfg in (None, GEMV_SPLIT, GEMV_ONE):
        out = qg.w8a8_gemv(x.to(DEVICE), cw.q.to(DEVICE), cw.scales.to(DEVICE), config=cfg)
        assert out.shape == (m, n) and out.dtype == dtype
        # The int32 sums are exact; what is left is the fp32 epilogue (and split sums) and the output rounding.
        assert rel_err(out.cpu(), exact) < {torch.float32: 1e-6}.get(dtype, TOL[dtype])
    ref = qg.ref_w8a8_gemv(x, cw.q, cw.scales)
    assert rel_err(ref, exact) < {torch.float32: 1e-6}.get(dtype, TOL[dtype])
    # And the activation quantization is real: the unquantized-x product differs by far more.
    assert rel_err((x.double() @ (cw.q.double() * cw.scales.double()[:, None]).t()).float(), exact) > 1e-4


def test_w8a8_gemv_rejects_bad_input():
    q = torch.zeros(8, 32, dtype=torch.int8, device=DEVICE)
    s = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="want int8 or float8_e4m3fn wq"):
        qg.w8a8_gemv(torch.randn(1, 32, device=DEVICE), q.float(), s)
    with pytest.raises(ValueError, match="GEMV config"):
        qg.w8a8_gemv(torch.randn(1, 32, device=DEVICE), q, s, config=TILED)
    with pytest.raises(ValueError, match="x has 16 input channels, the weight K=32"):
        qg.w8a8_gemv(torch.randn(1, 16, device=DEVICE), q, s)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the interpreter's fp8 cast is wrong)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", [(1, 70, 200), (3, 33, 1500), (4, 4096, 4096)])
def test_gpu_w8a8_gemv_fp8_equals_quantize_then_scaled_mm(m, n, k, dtype):
    from roofline.quant.quantize import quantize_fp8_per_channel

    x, w = _w8a8_case(m, n, k, dtype, seed=m + k)
    cw = quantize_fp8_per_channel(w)
    q8, ws = cw.q.to(torch.float8_e4m3fn).cuda(), cw.scales.float().cuda()
    xc = x.cuda()
    out = qg.w8a8_gemv(xc, q8, ws)
    xq, xs = qg.ref_per_token_quant_fp8(xc)  # bit-exact with the Triton quantizer on the GPU
    exact = (xq.double() @ q8.double().t()) * xs.double() * ws.double()[None, :]
    assert rel_err(out, exact) < {torch.float32: 1e-6}.get(dtype, TOL[dtype])
    if k % 16 == 0 and n % 16 == 0:  # torch._scaled_mm's alignment
        sm = torch._scaled_mm(xq, q8.t(), scale_a=xs, scale_b=ws[None, :], out_dtype=torch.bfloat16)
        assert rel_err(sm, exact) < TOL[torch.bfloat16]


# ---------------------------------------------------------------------------------------- FP8 quantizer

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 64), (3, 300), (2, 5000)])  # 5000: two passes of the 4096-wide block
def test_per_token_quant_fp8_scales(m, k, dtype):
    # Shapes, dtypes and scales everywhere; the codes only on the GPU (test below): the Triton CPU
    # interpreter's fp32 -> fp8 conversion drops the carry across a power of two.
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 4).to(dtype)
    x[0, 5] = -1000.0  # amax from a negative value
    q, s = qg.per_token_quant_fp8(x.to(DEVICE))
    assert q.dtype == torch.float8_e4m3fn and q.shape == (m, k) and s.shape == (m, 1) and s.dtype == torch.float32
    rq, rs = qg.ref_per_token_quant_fp8(x)
    assert torch.equal(s.cpu(), rs)  # IEEE amax / 448, bit-exact
    _, cs = quantize_per_token_fp8(x)  # the canonical quantizer: scales within 1 ulp
    assert torch.allclose(s.cpu(), cs, rtol=2.0**-23, atol=0)
    assert torch.isfinite(q.float()).all() and float(q.float().abs().max()) <= 448.0
    assert float(q[0, 5].float()) == -448.0  # the amax element maps to -448 exactly
    assert torch.equal(qg.per_token_quant_fp8(torch.zeros(2, 8, device=DEVICE))[1].cpu(), torch.full((2, 1), 1e-10))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (the interpreter's fp8 cast is wrong)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m,k", [(1, 4096), (7, 300), (2, 5000)])
def test_gpu_per_token_quant_fp8_exact(m, k, dtype):
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 4).to(dtype).cuda()
    q, s = qg.per_token_quant_fp8(x)
    rq, rs = qg.ref_per_token_quant_fp8(x)
    assert torch.equal(s, rs) and torch.equal(q.view(torch.uint8), rq.view(torch.uint8))  # bit-exact
    cq, cs = quantize_per_token_fp8(x)  # 1-ulp scales: codes within one E4M3 step (1/8 relative)
    assert torch.allclose(s, cs, rtol=2.0**-23, atol=0)
    assert torch.allclose(q.float(), cq.float(), rtol=2.0**-3, atol=2.0**-9)


# ---------------------------------------------------------------------------------------- W8A8

@pytest.mark.parametrize("out_dtype", DTYPES)
@pytest.mark.parametrize("m,n,k", [(1, 64, 256), (6, 72, 192), (40, 48, 200)])
@pytest.mark.parametrize("cfg", ["default", "split3", "tiled"])
def test_int8_gemm_matches_f64(m, n, k, cfg, out_dtype):
    g = torch.Generator().manual_seed(m * n)
    cw = quantize_int8_per_channel(torch.randn(n, k, generator=g))
    xq, xs = quantize_per_token_int8(torch.randn(m, k, generator=g) * 3)
    out = qg.int8_gemm(xq.to(DEVICE), xs.to(DEVICE), cw.q.to(DEVICE), cw.scales.to(DEVICE), out_dtype,
                       config=CONFIGS[cfg])
    assert out.shape == (m, n) and out.dtype == out_dtype
    ref64 = (xq.double() * xs.double()) @ (cw.q.double() * cw.scales.double()[:, None]).t()
    assert rel_err(out.cpu(), ref64) < TOL[out_dtype]
    assert rel_err(out, qg.ref_int8_gemm(xq.to(DEVICE), xs.to(DEVICE), cw.q.to(DEVICE), cw.scales.to(DEVICE),
                                         out_dtype)) < TOL[out_dtype]


def test_int8_gemm_integer_accumulation_is_exact():
    # Scales 1: every output is an integer sum of products (|sum| < 2^24), exact in fp32.
    g = torch.Generator().manual_seed(5)
    xq = torch.randint(-127, 128, (3, 256), generator=g, dtype=torch.int8)
    wq = torch.randint(-127, 128, (40, 256), generator=g, dtype=torch.int8)
    one_m, one_n = torch.ones(3, 1), torch.ones(40)
    exact = (xq.long() @ wq.long().t()).float()  # integer matmul on the CPU (CUDA has none)
    for cfg in (TILED, GEMV_SPLIT):
        out = qg.int8_gemm(xq.to(DEVICE), one_m.to(DEVICE), wq.to(DEVICE), one_n.to(DEVICE), torch.float32,
                           config=cfg)
        assert torch.equal(out.cpu(), exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("m,k", [(1, 64), (5, 300), (2, 5000)])  # 5000 > the 4096-wide block: two passes
def test_per_token_quant_int8(m, k, dtype):
    x = (torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 4).to(dtype).to(DEVICE)
    q, s = qg.per_token_quant_int8(x)
    rq, rs = qg.ref_per_token_quant_int8(x)
    assert q.dtype == torch.int8 and s.shape == (m, 1) and s.dtype == torch.float32
    assert torch.equal(q, rq) and torch.equal(s, rs)  # bit-exact with the twin
    cq, cs = quantize_per_token_int8(x)  # the canonical quantizer: within 1 LSB, scales within 1 ulp
    assert int((q.int() - cq.int()).abs().max()) <= 1
    assert torch.allclose(s, cs, rtol=2.0**-23, atol=0)


def test_per_token_quant_int8_known_answer():
    # amax 127 -> scale exactly 1: ties round half to even (torch.round), -0.5 -> 0; an all-zero row.
    x = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, -127.0, 3.49], [0.0] * 8], device=DEVICE)
    q, s = qg.per_token_quant_int8(x)
    assert q.tolist() == [[127, 0, 2, 2, 0, -2, -127, 3], [0] * 8]
    assert s.flatten().tolist() == [1.0, pytest.approx(1e-10)]


# ---------------------------------------------------------------------------------------- dequantize

@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k,group_size", [(70, 96, 32), (33, 256, 64), (64, 384, 128)])
def test_dequantize_int4_exact(n, k, group_size, dtype):
    cw = _int4_case(n, k, group_size, dtype, seed=k)
    p = _to(qg.prepare_int4(cw, dtype), DEVICE)
    w = qg.dequantize_int4(p.qweight, p.scales, p.zeros, group_size)
    assert w.shape == (n, k) and w.dtype == dtype
    assert torch.equal(w.cpu(), cw.dequantize(dtype))  # same fp32 products, one rounding
    assert torch.equal(w, qg.ref_dequantize_int4(p.qweight, p.scales, p.zeros, group_size))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_int8_exact(dtype):
    cw = quantize_int8_per_channel(torch.randn(70, 100))
    w = qg.dequantize_int8(cw.q.to(DEVICE), cw.scales.to(DEVICE), dtype)
    assert torch.equal(w.cpu(), cw.dequantize(dtype))
    assert torch.equal(w, qg.ref_dequantize_int8(cw.q.to(DEVICE), cw.scales.to(DEVICE), dtype))


# ---------------------------------------------------------------------------------------- GPU, bf16

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("m", [1, 4, 16, 64, 300])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_default_configs_at_model_sizes(m, dtype):
    # The CONFIGS rows on the GPU (split-K with real atomics, every M bucket) at a Llama-sized K.
    n, k, group_size = 1000, 4096, 128
    cw = _int4_case(n, k, group_size, dtype, seed=m)
    p = _to(qg.prepare_int4(cw, dtype), "cuda")
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m)).to(dtype).cuda()
    out = qg.w4a16_gemm(x, p.qweight, p.scales, p.zeros, group_size)
    assert rel_err(out.cpu(), x.cpu().double() @ _int4_f64(cw).t()) < TOL[dtype]
    c8 = quantize_int8_per_channel(torch.randn(n, k))
    p8 = _to(qg.prepare_int8(c8), "cuda")
    w8 = (c8.q.double() * c8.scales.double()[:, None]).t()
    assert rel_err(qg.w8a16_gemm(x, p8.q, p8.scales).cpu(), x.cpu().double() @ w8) < TOL[dtype]
    xq, xs = qg.per_token_quant_int8(x)
    out8 = qg.int8_gemm(xq, xs, p8.q, p8.scales, dtype)
    assert rel_err(out8.cpu(), (xq.cpu().double() * xs.cpu().double()) @ w8) < TOL[dtype]
    wd = torch.randn(n, k, dtype=dtype, device="cuda")
    assert rel_err(qg.dense_gemv(x, wd).cpu(), x.cpu().double() @ wd.cpu().double().t()) < TOL[dtype]


# ---------------------------------------------------------------------------------------- bench script

def _sweep_module():
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[2] / "bench" / "gpu_quant_sweep.py"
    spec = importlib.util.spec_from_file_location("gpu_quant_sweep", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_sweep_table_takes_the_largest_m_won_at_every_smaller_m():
    sw = _sweep_module()
    r = lambda fmt, m, path, us: dict(fmt=fmt, n=4, k=8, m=m, path=path, us=us)  # noqa: E731
    rows = [r("int4", 1, "other", 9.0), r("int4", 1, "gemv", 3.0), r("int4", 1, "gemv", 2.0),
            r("int4", 4, "other", 9.0), r("int4", 4, "gemv", 5.0),
            r("int4", 64, "other", 4.0), r("int4", 64, "tiled", 6.0),  # lost at 64 ...
            r("int4", 256, "other", 9.0), r("int4", 256, "tiled", 1.0),  # ... so 256 does not count
            r("dense", 1, "other", 1.0), r("dense", 1, "gemv", 2.0),
            # Below M = 16 the tiled kernel counts with its M = 16 time (its masked rows cost nothing extra).
            r("fp8_w8a16", 1, "other", 5.0), r("fp8_w8a16", 1, "gemv", 6.0), r("fp8_w8a16", 16, "other", 5.0),
            r("fp8_w8a16", 16, "tiled", 4.0),
            dict(fmt="fp8", n=4, k=8, m=1, path="gemv", error="boom")]  # rows without a time are ignored
    table, best = sw.fused_max_m(rows)
    assert table == {"int4": [dict(n=4, k=8, fused_max_m=4)], "dense": [dict(n=4, k=8, fused_max_m=0)],
                     "fp8_w8a16": [dict(n=4, k=8, fused_max_m=16)]}
    assert best[("int4", 4, 8, 1, "gemv")] == 2.0


def test_sweep_table_keeps_the_fastest_tiled_config_per_m():
    sw = _sweep_module()
    a, b = dict(block_m=64, block_n=64, block_k=64, num_warps=4, num_stages=4), dict(block_m=64, block_n=128, block_k=128,
                                                                                    num_warps=8, num_stages=4, swap_ab=True)
    rows = [dict(fmt="int8", n=4, k=8, m=64, path="tiled", config=a, us=9.0),
            dict(fmt="int8", n=4, k=8, m=64, path="tiled", config=b, us=5.0),
            dict(fmt="int8", n=4, k=8, m=16, path="tiled", config=b, us=7.0),
            dict(fmt="int8", n=4, k=8, m=16, path="tiled", config=a, us=3.0),
            dict(fmt="int8", n=4, k=8, m=16, path="tiled", config=b, error="rel err 1e0")]  # a failed check: never
    table = sw.build_table(rows, "test")
    assert table["tiled"] == {"int8": [dict(n=4, k=8, m=16, config=a, us=3.0), dict(n=4, k=8, m=64, config=b, us=5.0)]}


def test_engine_reads_the_dispatch_table(monkeypatch):
    from roofline.kernels import linear_dispatch as gemm

    table = {"gemv": {"int4": [dict(n=4096, k=4096, m=1, config=dict(block_m=1, block_n=64, block_k=128, num_warps=4,
                                                                      num_stages=1, gemv=True)),
                               dict(n=4096, k=4096, m=4, config=dict(block_m=2, block_n=32, block_k=64, num_warps=2,
                                                                     num_stages=1, split_k=4, gemv=True))]},
             "fused_max_m": {"int4": [dict(n=4096, k=4096, fused_max_m=16), dict(n=28672, k=4096, fused_max_m=256)],
                             "dense": [dict(n=4096, k=4096, fused_max_m=64)]}}
    monkeypatch.setattr(gemm, "_table", lambda device: table)
    dev = torch.device("cuda")
    assert gemm.use_fused("int4", 16, 4096, 4096, dev) and not gemm.use_fused("int4", 17, 4096, 4096, dev)
    assert gemm.use_fused("int4", 256, 28000, 4096, dev)  # the nearest measured shape
    assert gemm.use_fused("dense", 4, 4096, 4096, dev) and not gemm.use_fused("dense", 5, 4096, 4096, dev)  # GEMV only
    assert gemm.use_fused("fp8", 4, 4096, 4096, dev) and not gemm.use_fused("fp8", 5, 4096, 4096, dev)  # default
    # FP8 weight-only (tl.dot path too, not GEMV-only): M <= 16 without a measured row.
    assert gemm.use_fused("fp8_w8a16", 16, 4096, 4096, dev) and not gemm.use_fused("fp8_w8a16", 17, 4096, 4096, dev)
    assert gemm.kernel_config("int4", 1, 4096, 4096, dev) == GemmConfig(1, 64, 128, 4, 1, gemv=True)
    assert gemm.kernel_config("int4", 3, 6144, 4096, dev) == GemmConfig(2, 32, 64, 2, 1, split_k=4, gemv=True)
    assert gemm.kernel_config("int4", 5, 4096, 4096, dev) is None and gemm.kernel_config("int8", 1, 64, 64, dev) is None
    # Above the GEMV's rows: the tiled rows, the smallest measured M >= the call's M of the nearest (N, K).
    swap = dict(block_m=64, block_n=128, block_k=128, num_warps=8, num_stages=4, swap_ab=True)
    table["tiled"] = {"int8": [dict(n=4096, k=4096, m=16, config=dict(block_m=16, block_n=32, block_k=128, num_warps=4,
                                                                       num_stages=4)),
                               dict(n=4096, k=4096, m=64, config=swap),
                               dict(n=28672, k=4096, m=16, config=dict(block_m=16, block_n=64, block_k=64, num_warps=4,
                                                                        num_stages=3))]}
    assert gemm.kernel_config("int8", 5, 4096, 4096, dev) == GemmConfig(16, 32, 128, 4, 4)
    assert gemm.kernel_config("int8", 17, 4000, 4096, dev) == GemmConfig(**swap)
    assert gemm.kernel_config("int8", 64, 4096, 4096, dev).swap_ab
    assert gemm.kernel_config("int8", 65, 4096, 4096, dev) is None  # past the largest measured M: CONFIGS' default
    assert gemm.kernel_config("int8", 40, 28672, 4096, dev) is None  # that shape measured only M = 16
    # A shape swept at large M only (rows from M = 128): its rows serve M = 65..128, not M = 8 or 64.
    table["tiled"]["int8"] = [dict(n=4096, k=4096, m=128, config=swap), dict(n=4096, k=4096, m=256, config=swap)]
    assert gemm.kernel_config("int8", 8, 4096, 4096, dev) is None
    assert gemm.kernel_config("int8", 64, 4096, 4096, dev) is None
    assert gemm.kernel_config("int8", 65, 4096, 4096, dev) == GemmConfig(**swap)
    assert gemm.kernel_config("int8", 200, 4096, 4096, dev) == GemmConfig(**swap)


@pytest.mark.parametrize("tensor_cores", [True, False])
def test_w8a8_path_and_the_producers_quantization_agree(monkeypatch, tensor_cores):
    """One decision for a W8A8 linear's matmul (``w8a8_path``) serves the linear and the kernel producing its input:
    the producer writes the codes (``input_quant_format``) exactly where the linear would quantize in a pass of its
    own before a GEMM that takes codes. No table: fp8 weight-only to M = 16, the self-quantizing GEMVs to M = 4."""
    from roofline.kernels import linear_dispatch as gemm

    monkeypatch.setattr(gemm, "_table", lambda device: {})
    monkeypatch.setattr(gemm, "kernels_on", lambda device: object())
    monkeypatch.setattr(gemm, "fp8_tensor_cores", lambda device: tensor_cores)
    dev = torch.device("cuda")
    paths = {(meth, m): gemm.w8a8_path(meth, m, 4096, 4096, dev) for meth in ("fp8", "smoothquant")
             for m in (1, 4, 5, 16, 17, 2048)}
    if tensor_cores:
        assert [paths[("fp8", m)] for m in (1, 16, 17, 2048)] == ["weight_only", "weight_only", "quantize", "quantize"]
    else:  # FP8 emulation: the quantizer, then the emulated matmul
        assert {paths[("fp8", m)] for m in (1, 16, 17, 2048)} == {"quantize"}
    assert [paths[("smoothquant", m)] for m in (1, 4, 5, 2048)] == ["gemv", "gemv", "quantize", "quantize"]
    for (meth, m), path in paths.items():
        fmt = gemm.input_quant_format(meth, m, 4096, 4096, dev)
        takes_codes = path == "quantize" and (meth == "smoothquant" or tensor_cores)
        assert fmt == ({"fp8": "fp8", "smoothquant": "int8"}[meth] if takes_codes else None), (meth, m, path)
    monkeypatch.setattr(gemm, "kernels_on", lambda device: None)  # no Triton kernels: the torch / CPU paths
    assert gemm.w8a8_path("smoothquant", 1, 4096, 4096, dev) == "quantize"
    assert gemm.input_quant_format("fp8", 2048, 4096, 4096, dev) is None
