"""``--quantization int8`` on CPU (W8A8 dynamic, ``roofline.kernels.cpu_int8``): the arithmetic against a float64
reference, exact per-row integer work (a row's output does not depend on its batch-mates), the layer path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roofline.kernels.quant_types import quantize_per_token_int8
from roofline.kernels.cpu_int8 import quantize_rows_int8, w8a8_dynamic_linear
from roofline.quant.quantize import quantize_int8_per_channel

# (M, N, K): decode and prefill rows at the default model's shapes (qkv 960 x 576, down 576 x 1536) and odd sizes.
SHAPES = [(1, 960, 576), (32, 576, 1536), (5, 37, 19), (70, 3072, 576)]


def _ref(x: torch.Tensor, q: torch.Tensor, ws: torch.Tensor) -> torch.Tensor:
    """float64 x_q * s_x @ (q * s_w)^T with x rounded per token as the format defines (scale amax / 127 in fp32)."""
    xs = (x.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-10)
    xq = torch.round(x / xs).clamp(-127, 127)
    return (xq.double() * xs.double()) @ (q.double() * ws.double()[:, None]).t()


@pytest.mark.parametrize("m,n,k", SHAPES)
def test_w8a8_dynamic_matches_float64(m, n, k):
    gen = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=gen) * 0.05
    x = torch.randn(m, k, generator=gen) * 3
    x[:, 0] *= 20  # an outlier channel, as real activations have
    cw = quantize_int8_per_channel(w)
    out = w8a8_dynamic_linear(x, cw.q, cw.scales)
    ref = _ref(x, cw.q, cw.scales)
    assert out.dtype == torch.float32 and out.shape == (m, n)
    # int32 accumulation is exact; the only rounding is the float32 epilogue (2 products): measured <= 3e-7.
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err < 2e-6, err
    # The activation rounding is real: the unquantized product differs by far more.
    dense = x.double() @ (cw.q.double() * cw.scales.double()[:, None]).t()
    assert ((dense - ref).abs().max() / ref.abs().max()).item() > 1e-4


def test_row_quantizer_equals_per_token_int8():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(9, 576, generator=gen) * torch.logspace(-6, 3, 9)[:, None]
    x[3] = 0.0  # an all-zero row takes the scale floor and codes 0
    q, s = quantize_rows_int8(x)
    q_ref, s_ref = quantize_per_token_int8(x)
    assert torch.equal(q, q_ref) and torch.equal(s, s_ref)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and not q[3].any()


def test_rows_are_batch_invariant():
    """A row alone (M = 1, the decode GEMV shape) and inside a batch of 32 gives bit-identical outputs."""
    gen = torch.Generator().manual_seed(2)
    cw = quantize_int8_per_channel(torch.randn(3072, 576, generator=gen) * 0.05)
    x = torch.randn(32, 576, generator=gen)
    batched = w8a8_dynamic_linear(x, cw.q, cw.scales)
    for i in (0, 17, 31):
        assert torch.equal(w8a8_dynamic_linear(x[i:i + 1], cw.q, cw.scales), batched[i:i + 1])


def test_bf16_activations_bias_and_leading_dims():
    gen = torch.Generator().manual_seed(3)
    cw = quantize_int8_per_channel(torch.randn(64, 32, generator=gen))
    bias = torch.randn(64, generator=gen)
    x = torch.randn(2, 3, 32, generator=gen)
    out = w8a8_dynamic_linear(x.bfloat16(), cw.q, cw.scales, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (2, 3, 64)
    ref = w8a8_dynamic_linear(x.bfloat16().float(), cw.q, cw.scales, bias)
    assert torch.allclose(out.float(), ref, rtol=1e-2, atol=1e-2)


def test_bad_shapes_name_the_values():
    cw = quantize_int8_per_channel(torch.randn(8, 16))
    with pytest.raises(ValueError, match=r"x \[\.\.\., 12\] needs int8 qweight \[N, 12\], got torch.int8 \(8, 16\)"):
        w8a8_dynamic_linear(torch.randn(2, 12), cw.q, cw.scales)
    with pytest.raises(ValueError, match=r"got torch.float32 \(8, 16\)"):
        w8a8_dynamic_linear(torch.randn(2, 16), cw.q.float(), cw.scales)


def test_int8_method_on_cpu_runs_w8a8():
    """``--quantization int8``'s layer on CPU computes the W8A8 dynamic product (not the weight-only one)."""
    from roofline.quant.int8 import Int8LinearMethod

    gen = torch.Generator().manual_seed(4)
    w = torch.randn(48, 40, generator=gen) * 0.1
    layer, method = nn.Module(), Int8LinearMethod()
    method.create_weights(layer, 40, [48], torch.float32, lambda p, t, s=None: p.data.copy_(t))
    layer.weight.data.copy_(w)
    method.process_weights_after_loading(layer)
    x = torch.randn(3, 40, generator=gen)
    out = method.apply(layer, x)
    cw = quantize_int8_per_channel(w)
    assert torch.equal(out, w8a8_dynamic_linear(x, cw.q, cw.scales))
    err = ((out.double() - _ref(x, cw.q, cw.scales)).abs().max() / out.abs().max()).item()
    assert err < 2e-6
