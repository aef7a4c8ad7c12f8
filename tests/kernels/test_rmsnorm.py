"""RMSNorm / fused add+RMSNorm (Triton) against their ref_ twins and a float64 reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import DEVICE, DTYPES, TOL, rel_err  # noqa: E402

from roofline.kernels.rmsnorm import fused_add_rmsnorm, ref_fused_add_rmsnorm, ref_rmsnorm, rmsnorm  # noqa: E402

SHAPES = [(1, 64), (7, 576), (33, 1000), (4, 3, 256)]


def _f64_rmsnorm(x, weight, eps):
    x64 = x.double().cpu()
    return weight.double().cpu() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rmsnorm(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE)
    out = rmsnorm(x, w, 1e-6)
    assert out.shape == x.shape and out.dtype == dtype
    assert rel_err(out, ref_rmsnorm(x, w, 1e-6)) < TOL[dtype]
    assert rel_err(out.cpu(), _f64_rmsnorm(x, w, 1e-6)) < TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fused_add_rmsnorm(shape, dtype):
    g = torch.Generator().manual_seed(shape[0])
    x = torch.randn(shape, generator=g).to(dtype).to(DEVICE)
    res = (torch.randn(shape, generator=g) * 2).to(dtype).to(DEVICE)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE)
    normed, new_res = fused_add_rmsnorm(x, res, w, 1e-5)
    ref_normed, ref_res = ref_fused_add_rmsnorm(x, res, w, 1e-5)
    # The residual add rounds once in the input dtype, exactly like torch: bit-identical.
    assert torch.equal(new_res, ref_res)
    assert rel_err(normed, ref_normed) < TOL[dtype]
    assert rel_err(normed.cpu(), _f64_rmsnorm(x.double() + res.double(), w, 1e-5)) < TOL[dtype]


def test_fp32_weight_promotes_like_hf():
    g = torch.Generator().manual_seed(128)  # seeded, as every case here: a failure reproduces
    x = torch.randn(3, 128, generator=g).half().to(DEVICE)
    w = torch.rand(128, generator=g).to(DEVICE)
    out = rmsnorm(x, w, 1e-6)
    assert out.dtype == torch.float32
    assert rel_err(out, ref_rmsnorm(x, w, 1e-6)) < 1e-6


def test_weight_shape_error():
    with pytest.raises(ValueError, match="does not match hidden size 64"):
        rmsnorm(torch.randn(2, 64, device=DEVICE), torch.ones(32, device=DEVICE), 1e-6)
