"""SiLU-and-mul (Triton) against ref_silu_and_mul and a float64 reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import DEVICE, DTYPES, TOL, rel_err  # noqa: E402

from roofline.kernels.activation import ref_silu_and_mul, silu_and_mul  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 64), (5, 2 * 1536), (17, 2 * 1000), (2, 3, 2 * 96)])
def test_silu_and_mul(shape, dtype):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype).to(DEVICE)
    out = silu_and_mul(x)
    inter = shape[-1] // 2
    assert out.shape == (*shape[:-1], inter) and out.dtype == dtype
    # Same two roundings as torch on separate tensors (exp implementations may differ by an ulp).
    assert rel_err(out, ref_silu_and_mul(x)) < TOL[dtype]
    x64 = x.double().cpu()
    f64 = torch.nn.functional.silu(x64[..., :inter]) * x64[..., inter:]
    assert rel_err(out.cpu(), f64) < TOL[dtype]


def test_odd_width_rejected():
    with pytest.raises(ValueError, match="must be even"):
        silu_and_mul(torch.randn(2, 7, device=DEVICE))
