"""``--quantization int8`` on CPU (W8A8 dynamic, ``roofline.kernels.cpu_int8``): the arithmetic against a float64
reference, exact per-row integer work (a row's output does not depend on its batch-mates), the layer path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from roofline.kernels import cpu_bf16, cpu_int8
from roofline.kernels.cpu_int8 import quantize_rows_int8, w8a8_dynamic_linear
from roofline.kernels.quant_types import quantize_per_token_int8
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
    with pytest.raises(ValueError, match=r"N = 8 output channels; weight_scale has 9 \(each needs 8\)"):
        w8a8_dynamic_linear(torch.randn(2, 16), cw.q, torch.ones(9))
    with pytest.raises(ValueError, match=r"weight_scale has 8 and bias 7 \(each needs 8\)"):
        w8a8_dynamic_linear(torch.randn(1, 16), cw.q, cw.scales, torch.zeros(7))


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


# The INT8 LM head on CPU (``roofline.quant.int8.CpuW8A8LMHeadMethod``), on a tiny random Llama with a tied head.
TINY_TIED = {"architectures": ["LlamaForCausalLM"], "vocab_size": 96, "hidden_size": 64, "intermediate_size": 128,
             "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 256, "rope_theta": 10000.0, "eos_token_id": 1, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def tiny_tied_dir(tmp_path_factory):
    import json

    path = tmp_path_factory.mktemp("tiny_tied")
    (path / "config.json").write_text(json.dumps(TINY_TIED))
    return path


def _tiny(path, quantization, dtype="float32"):
    from roofline import LLM

    return LLM(str(path), load_format="dummy", device="cpu", attention_backend="torch", dtype=dtype,
               quantization=quantization, max_model_len=128, block_size=16, kv_cache_memory="16MiB")


@pytest.mark.parametrize("quantization", ["int8", "smoothquant"])
def test_lm_head_is_w8a8_on_cpu_and_keeps_the_tie(tiny_tied_dir, quantization):
    llm = _tiny(tiny_tied_dir, quantization)
    model = llm.engine.worker.model
    head, embed = model.lm_head, model.model.embed_tokens
    assert head.weight is embed.weight and embed.weight.dtype == torch.float32  # the lookup keeps the float table
    cw = quantize_int8_per_channel(embed.weight)
    assert head.qweight.dtype == torch.int8 and torch.equal(head.qweight, cw.q)
    assert torch.equal(head.weight_scale, cw.scales)
    hidden = torch.randn(5, 64, generator=torch.Generator().manual_seed(5))
    logits = model.compute_logits(hidden)
    assert logits.dtype == torch.float32 and logits.shape == (5, 96)
    ref = _ref(hidden, cw.q, cw.scales)
    assert ((logits.double() - ref).abs().max() / ref.abs().max()).item() < 2e-6
    dense = hidden.double() @ embed.weight.double().t()  # the 16-bit head's product: the head is really INT8
    assert ((dense - ref).abs().max() / ref.abs().max()).item() > 1e-4
    # The decode floor's weight bytes: the INT8 head copy, not the float table (which a step only looks up rows of).
    worker = llm.engine.worker
    float_table = embed.weight.numel() * embed.weight.element_size()
    assert worker.weight_bytes_per_step == worker.weight_bytes - float_table


def test_int8_head_greedy_rows_are_batch_invariant(tiny_tied_dir):
    """The format's promise with the INT8 head too: a prompt's greedy tokens alone equal its tokens in a batch."""
    from roofline import SamplingParams

    llm = _tiny(tiny_tied_dir, "int8")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    prompts = [[5, 9, 14, 2], [7, 7, 30], [11, 40, 3, 3, 8]]
    batched = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                                                           use_tqdm=False)]
    alone = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
             for p in prompts]
    assert batched == alone and all(len(t) == 12 for t in batched)


def test_lm_head_method_off_cpu_and_without_copy_is_the_16bit_head():
    """Off the CPU (here a meta tensor) the method adds nothing, and without ``qweight`` it is ``F.linear``: GPU heads
    stay 16-bit."""
    from roofline.quant.int8 import CpuW8A8LMHeadMethod

    method = CpuW8A8LMHeadMethod()
    meta = nn.Module()
    meta.weight = nn.Parameter(torch.empty(8, 4, device="meta"), requires_grad=False)
    method.process_weights_after_loading(meta)
    assert not hasattr(meta, "qweight")
    layer = nn.Module()
    layer.weight = nn.Parameter(torch.randn(8, 4, dtype=torch.bfloat16), requires_grad=False)
    x = torch.randn(3, 4, dtype=torch.bfloat16)
    assert torch.equal(method.apply(layer, x), torch.nn.functional.linear(x, layer.weight))


@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (49152, 576), (7, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_row_cpp_gemv_is_bit_identical_to_the_torch_path(n, k, dtype):
    """``gemv_w8a8`` (one row in C++: the quantization and VNNI dot products) against the torch path it replaces
    at M = 1: the same codes, exact int32 sums, the same fp32 scale products, bias add and cast: bit-identical,
    with and without a bias of either dtype; and ``w8a8_dynamic_linear`` takes it at one row."""
    from roofline.kernels import cpu_int8

    gen = torch.Generator().manual_seed(n + k)
    cw = quantize_int8_per_channel(0.02 * torch.randn(n, k, generator=gen))
    q, s = cw.q.to(torch.int8).contiguous(), cw.scales.float().contiguous()
    x = (3 * torch.randn(1, k, generator=gen)).to(dtype)
    for bias in (None, torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()):
        got = cpu_int8.gemv_w8a8(x, q, s, bias)
        if got is None:
            pytest.skip("no AVX-512 VNNI or no C++ library on this CPU")
        xq, xs = quantize_rows_int8(x.float())
        want = torch._int_mm(xq.expand(2, -1).contiguous(), q.t())[:1] * (xs * s)  # _int_mm wants M > 1
        want = (want if bias is None else want + bias).to(dtype)
        assert got.dtype == dtype and torch.equal(got, want)
        assert torch.equal(w8a8_dynamic_linear(x.reshape(1, 1, k), q, s, bias).reshape(1, n), got)


def test_one_row_cpp_gemv_declines_what_it_does_not_cover():
    from roofline.kernels import cpu_int8

    q, s = torch.zeros(8, 96, dtype=torch.int8), torch.ones(8)
    assert cpu_int8.gemv_w8a8(torch.randn(1, 96), q, s) is None  # K % 64
    q, s = torch.zeros(8, 128, dtype=torch.int8), torch.ones(8)
    assert cpu_int8.gemv_w8a8(torch.randn(2, 128), q, s) is None  # two rows
    assert cpu_int8.gemv_w8a8(torch.randn(1, 128).half(), q, s) is None  # fp16
    assert cpu_int8.gemv_w8a8(torch.randn(1, 128), q, s.double()) is None  # fp64 scales
    assert cpu_int8.gemv_w8a8(torch.randn(1, 128), torch.zeros(128, 8, dtype=torch.int8).t(), s) is None  # layout


needs_amx_int8 = pytest.mark.skipif(not cpu_int8.amx_int8_available(), reason="needs AMX-INT8 and the C++ library")
needs_vnni_int8 = pytest.mark.skipif(not cpu_int8.vnni_int8_available(),
                                     reason="needs AVX-512 VNNI and the C++ library")
needs_int8_tiles = pytest.mark.skipif(not (cpu_int8.amx_int8_available() or cpu_int8.vnni_int8_available()),
                                      reason="needs AMX-INT8 or AVX-512 VNNI and the C++ library")


@needs_int8_tiles
def test_tile_pack_int8_is_the_tdpbssd_tile_layout():
    q = torch.randint(-127, 128, (32, 128), dtype=torch.int8, generator=torch.Generator().manual_seed(1))
    p = cpu_int8.tile_pack_int8(q)
    assert p.shape == (2, 2, 16, 64) and p.dtype == torch.int8
    for n, k, r, c, i in ((0, 0, 0, 0, 0), (1, 1, 15, 15, 3), (1, 0, 3, 7, 2), (0, 1, 9, 4, 1)):
        assert p[n, k, r, 4 * c + i] == q[16 * n + c, 64 * k + 4 * r + i]
    assert cpu_int8.tile_pack_int8(q[:, :96].contiguous()) is None  # K % 64
    assert cpu_int8.tile_pack_int8(q[:24]) is None  # N % 16


def _check_w8a8_tiles(kernel, m, n, k, dtype):
    """``kernel`` (M rows: the same per-row quantization, exact int32 sums, the same fp32 epilogue) gives every row
    the bits of ``gemv_w8a8`` on that row alone and of the torch path on the batch, with and without a bias of either
    dtype; and ``w8a8_dynamic_linear`` with the tiles gives the same bits at any M."""
    gen = torch.Generator().manual_seed(m * 7 + n + k)
    cw = quantize_int8_per_channel(0.02 * torch.randn(n, k, generator=gen))
    q, s = cw.q.to(torch.int8).contiguous(), cw.scales.float().contiguous()
    p = cpu_int8.tile_pack_int8(q)
    x = (3 * torch.randn(m, k, generator=gen)).to(dtype)
    x[:, 1] *= 30  # an outlier channel sets each row's scale
    for bias in (None, torch.randn(n, generator=gen), torch.randn(n, generator=gen).bfloat16()):
        got = kernel(x, p, s, bias)
        assert got is not None and got.dtype == dtype and got.shape == (m, n)
        xq, xs = quantize_rows_int8(x.float())
        want = torch._int_mm(xq.expand(max(m, 2), -1).contiguous(), q.t())[:m] * (xs * s)  # _int_mm wants M > 1
        want = (want if bias is None else want + bias).to(dtype)
        assert torch.equal(got, want)
        for r in (0, m - 1):
            assert torch.equal(cpu_int8.gemv_w8a8(x[r:r + 1], q, s, bias), got[r:r + 1])
        assert torch.equal(w8a8_dynamic_linear(x, q, s, bias, packed=p), got)


@needs_amx_int8
@pytest.mark.parametrize("m", [2, 7, 16, 17, 32, 33, 70])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (49152, 576), (48, 64)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_amx_w8a8_rows_are_bit_identical_to_the_gemv_and_the_torch_path(m, n, k, dtype):
    """AMX-INT8 (TDPBSSD), at every row-chunk tail (1-16 and 17-31 rows of a chunk of 32)."""
    if n == 49152 and m > 17:
        pytest.skip("the LM head shape at a few row counts is enough")
    _check_w8a8_tiles(cpu_int8.amx_linear_w8a8, m, n, k, dtype)


@needs_vnni_int8
@pytest.mark.parametrize("m", [1, 2, 7, 8, 9, 33, 64, 100, 256])
@pytest.mark.parametrize("n,k", [(960, 576), (576, 1536), (49152, 576), (48, 64), (16, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vnni_w8a8_rows_are_bit_identical_to_the_gemv_and_the_torch_path(m, n, k, dtype):
    """AVX-512 VNNI (vpdpbusd against the tiles' rows): every block of 8 rows and its tails, panels of 32 columns
    and a last one of 16."""
    if n == 49152 and m > 9:
        pytest.skip("the LM head shape at a few row counts is enough")
    _check_w8a8_tiles(cpu_int8.vnni_linear_w8a8, m, n, k, dtype)


@needs_vnni_int8
def test_one_row_takes_the_vnni_tiles_without_amx(monkeypatch):
    """Without AMX-INT8 a single row with tiles goes through the VNNI GEMM (faster than the GEMV at M = 1 on an AMD
    EPYC Zen 4) and not through ``gemv_w8a8``; without tiles it still takes the GEMV. Same bits either way."""
    monkeypatch.setattr(cpu_int8, "amx_int8_available", lambda: False)
    gen = torch.Generator().manual_seed(5)
    cw = quantize_int8_per_channel(0.02 * torch.randn(96, 576, generator=gen))
    q, s = cw.q.to(torch.int8).contiguous(), cw.scales.float().contiguous()
    x = torch.randn(1, 576, generator=gen)
    want = cpu_int8.gemv_w8a8(x, q, s)
    calls = []
    gemv = cpu_int8.gemv_w8a8
    monkeypatch.setattr(cpu_int8, "gemv_w8a8", lambda *a, **kw: calls.append(1) or gemv(*a, **kw))
    assert torch.equal(w8a8_dynamic_linear(x, q, s, packed=cpu_int8.tile_pack_int8(q)), want)
    assert calls == []
    assert torch.equal(w8a8_dynamic_linear(x, q, s), want)
    assert calls == [1]


@needs_int8_tiles
@pytest.mark.parametrize("kernel", ["amx_linear_w8a8", "vnni_linear_w8a8"])
def test_tile_w8a8_declines_what_it_does_not_cover(kernel):
    if kernel == "amx_linear_w8a8" and not cpu_int8.amx_int8_available():
        pytest.skip("no AMX-INT8 here")
    if kernel == "vnni_linear_w8a8" and not cpu_int8.vnni_int8_available():
        pytest.skip("no AVX-512 VNNI here")
    fn = getattr(cpu_int8, kernel)
    q = torch.zeros(32, 128, dtype=torch.int8)
    p, s = cpu_int8.tile_pack_int8(q), torch.ones(32)
    assert fn(torch.randn(2, 64), p, s) is None  # K is not the tiles'
    assert fn(torch.randn(2, 128).half(), p, s) is None  # fp16
    assert fn(torch.randn(2, 128), p, torch.ones(16)) is None  # scales for another N
    assert fn(torch.randn(2, 128), p, s, torch.ones(32).double()) is None  # fp64 bias
    assert fn(torch.randn(2, 128), torch.cat([p, p], 1)[:, ::2], s) is None  # tiles not contiguous
    assert fn(torch.randn(2, 128), p.reshape(2, 2, 32, 32), s) is None  # not [N/16, K/64, 16, 64]
    if kernel == "vnni_linear_w8a8":
        assert fn(torch.randn(cpu_bf16.TILE_MAX_ROWS + 1, 128), p, s) is None  # past its rows


@needs_int8_tiles
@pytest.mark.parametrize("m", [1, 3])
def test_w8a8_nan_rows_come_out_nan_as_in_the_torch_path(m):
    """A NaN in a row makes torch's per-token scale NaN, so that whole output row is NaN; the C++ quantizers (the
    one-row GEMV, the tile kernels) did the same only since 2026-12-07 (they had dropped the NaN and returned finite
    values). Other rows keep their bits."""
    gen = torch.Generator().manual_seed(3)
    cw = quantize_int8_per_channel(0.02 * torch.randn(64, 128, generator=gen))
    q, s = cw.q.to(torch.int8).contiguous(), cw.scales.float().contiguous()
    x = torch.randn(m, 128, generator=gen)
    x[0, 3] = float("nan")
    got = w8a8_dynamic_linear(x, q, s, packed=cpu_int8.tile_pack_int8(q))
    assert got[0].isnan().all()
    if m > 1:
        assert not got[1:].isnan().any()
        assert torch.equal(got[1:], w8a8_dynamic_linear(x[1:], q, s))  # the torch path on the other rows
    assert w8a8_dynamic_linear(x, q, s)[0].isnan().all()  # the torch path: the same NaN row
