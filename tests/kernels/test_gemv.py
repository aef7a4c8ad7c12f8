"""Small-M Triton GEMV against F.linear (its ref_ twin) and a float64 reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import DEVICE, DTYPES, TOL, rel_err  # noqa: E402

from roofline.kernels.gemv import fast_linear, linear_small_m, ref_linear_small_m  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("m,n,k,bias", [(1, 96, 256, False), (3, 50, 300, True), (16, 64, 512, False),
                                        (20, 33, 128, True)])
def test_linear_small_m(m, n, k, bias, dtype):
    g = torch.Generator().manual_seed(m * n)
    x = torch.randn(m, k, generator=g).to(dtype).to(DEVICE)
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(DEVICE)
    b = torch.randn(n, generator=g).to(dtype).to(DEVICE) if bias else None
    cfg = None if DEVICE == "cuda" else dict(BLOCK_N=16, BLOCK_K=64, num_stages=1)
    out = linear_small_m(x, w, b, config=cfg)
    assert out.shape == (m, n) and out.dtype == dtype
    assert rel_err(out, ref_linear_small_m(x, w, b)) < TOL[dtype]
    want = x.double().cpu() @ w.double().cpu().T + (b.double().cpu() if bias else 0)
    assert rel_err(out.cpu(), want) < TOL[dtype]


def test_fast_linear_falls_back_on_cpu_and_large_m():
    x = torch.randn(40, 32)
    w = torch.randn(16, 32)
    assert torch.equal(fast_linear(x, w), torch.nn.functional.linear(x, w))


def test_shape_error():
    with pytest.raises(ValueError, match="does not match weight"):
        linear_small_m(torch.randn(1, 8, device=DEVICE), torch.randn(4, 16, device=DEVICE))
