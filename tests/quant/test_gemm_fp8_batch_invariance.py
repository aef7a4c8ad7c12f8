"""FP8 W8A8 on CPU (the emulated path): a row's output does not depend on the other rows of the batch.

Issue 31 item 4: ``serve -q fp8`` on CPU gave a greedy request a different output beside batch-mates (0/10
identical). The activation scales were already per token; the emulated matmul was not row-invariant: a float32
``xq @ w.T`` takes a GEMV path at M = 1 and a blocked GEMM above, which sum K in different orders (measured:
0.125 apart on values ~1e4 at K = 576). The emulation now accumulates in float64, which is exact for E4M3 x E4M3
products (see ``roofline.kernels.linear_dispatch.fp8_w8a8``), so every row is bit-identical whatever M is.
"""

from __future__ import annotations

import pytest
import torch

from roofline.kernels import linear_dispatch as gemm
from roofline.quant.quantize import quantize_fp8_per_channel


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(576, 576), (1536, 576), (576, 1536)])
def test_fp8_emulated_rows_do_not_depend_on_batch(dtype, n, k):
    gen = torch.Generator().manual_seed(n + k)
    w = quantize_fp8_per_channel(torch.randn(n, k, generator=gen))
    q = w.q.to(torch.float8_e4m3fn)
    x = (torch.randn(64, k, generator=gen) * 3).to(dtype)
    dense = gemm.fp8_emulation_weight(q)
    full = gemm.fp8_w8a8(x, q, w.scales.float(), dense=dense)
    for m in (1, 2, 3, 8, 17, 64):
        part = gemm.fp8_w8a8(x[:m], q, w.scales.float(), dense=dense)
        assert torch.equal(part, full[:m]), f"M={m}: max diff {(part.float() - full[:m].float()).abs().max()}"
    # Each row alone equals its row in the batch (decode at batch 1 vs batch 64).
    alone = torch.cat([gemm.fp8_w8a8(x[i:i + 1], q, w.scales.float(), dense=dense) for i in range(64)])
    assert torch.equal(alone, full)


def test_fp8_emulated_matches_float64_oracle():
    gen = torch.Generator().manual_seed(0)
    w = quantize_fp8_per_channel(torch.randn(256, 512, generator=gen))
    q = w.q.to(torch.float8_e4m3fn)
    x = torch.randn(5, 512, generator=gen)
    out = gemm.fp8_w8a8(x, q, w.scales.float(), dense=gemm.fp8_emulation_weight(q))
    s = (x.double().abs().amax(-1, keepdim=True) / 448).clamp(min=1e-12)
    xq = (x.double() / s).float().to(torch.float8_e4m3fn).double()
    oracle = (xq @ q.double().t()) * s * w.scales.double()[None, :]
    rel = ((out.double() - oracle).abs().max() / oracle.abs().max()).item()
    assert rel < 1e-6, rel
    # Against the unquantized product the error is the format's (E4M3: ~2^-4 relative per value).
    exact = x.double() @ (q.double() * w.scales.double()[:, None]).t()
    assert ((out.double() - exact).abs().max() / exact.abs().max()).item() < 0.1
