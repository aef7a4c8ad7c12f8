"""Norm + per-token quantization and SiLU-and-mul + per-token quantization in one kernel (issue 28): bit-identical
to the two kernels they replace, and close to a float64 reference."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernel_cases import DEVICE, DTYPES  # noqa: E402

from roofline.kernels.act_quant import (  # noqa: E402
    QuantizedActivation,
    per_token_quant_fp8,
    per_token_quant_fp8_split,
    per_token_quant_int8,
    ref_per_token_quant_fp8_split,
    ref_rmsnorm_quant,
    ref_silu_and_mul_quant,
    rmsnorm_quant,
    silu_and_mul_quant,
)
from roofline.kernels.activation import silu_and_mul  # noqa: E402
from roofline.kernels.rmsnorm import fused_add_rmsnorm, rmsnorm  # noqa: E402

QUANT = {"int8": per_token_quant_int8, "fp8": per_token_quant_fp8}
# The 16-bit activation's own rounding before it is quantized (twice its unit roundoff; fp32: the norm's sums).
ROUND = {torch.float32: 1e-6, torch.float16: 2.0**-10, torch.bfloat16: 2.0**-7}


def _bits(q: torch.Tensor) -> torch.Tensor:
    return q.view(torch.uint8) if q.dtype == torch.float8_e4m3fn else q


def _assert_same_codes(q, s, two_q, two_s, dtype, width=0):
    """The fused kernel's codes and scales against the two kernels'. Bit for bit for a 16-bit row of at most 1,024
    channels (or any row without a sum: SiLU-and-mul, ``width`` 0). Otherwise the norm's fp32 sum of squares may be
    added in another order (the row laid out for a 1-byte store; an H100 gave other codes in fp32 at 576 channels,
    2026-12-06; act_quant's module docstring): scales within one 16-bit rounding (2 ulp in fp32), codes within one
    step."""
    if dtype != torch.float32 and width <= 1024:
        assert torch.equal(s, two_s) and torch.equal(_bits(q), _bits(two_q))
        return
    assert torch.allclose(s, two_s, rtol=2.0**-22 if dtype == torch.float32 else 2.0**-7, atol=0)
    if q.dtype == torch.int8:
        assert int((q.int() - two_q.int()).abs().max()) <= 1
    else:
        assert torch.allclose(q.float(), two_q.float(), rtol=2.0**-3, atol=2.0**-9)


def _dequant(q, s):
    return q.double().cpu() * s.double().cpu()


def _assert_within_a_code_step(q, s, f64, dtype):
    """Each dequantized code within the quantization's own error of the float64 value: half an INT8 step
    (scale / 2), or E4M3's half ulp (2^-4 relative, 2^-10 x scale in its subnormals), plus the 16-bit rounding.
    E4M3 codes only on the GPU: the Triton CPU interpreter's fp32 -> fp8 cast drops the carry across a power of
    two (see ``per_token_quant_fp8``), so there the codes are checked only against the two-kernel path."""
    if q.dtype == torch.float8_e4m3fn and not q.is_cuda:
        return
    deq, f64, scale = _dequant(q, s), f64.double().cpu(), s.double().cpu()
    if q.dtype == torch.int8:
        bound = 0.5 * scale + ROUND[dtype] * f64.abs()
    else:
        bound = (2.0**-4 + ROUND[dtype]) * f64.abs() + 2.0**-10 * scale
    assert bool(((deq - f64).abs() <= bound * 1.01 + 1e-12).all()), float(((deq - f64).abs() - bound).max())


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,residual", [((1, 64), True), ((7, 576), True), ((5, 300), False), ((3, 2, 256), True),
                                            ((3, 4096), True)])
def test_rmsnorm_quant_is_the_two_kernels_bit_for_bit(shape, residual, dtype, fmt):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 3).to(dtype).to(DEVICE)
    x[..., 0, 3] = -40.0  # a massive activation: the row's amax, negative
    res = (torch.randn(shape, generator=g) * 2).to(dtype).to(DEVICE) if residual else None
    w = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(dtype).to(DEVICE)
    q, s, new_res = rmsnorm_quant(x, res, w, 1e-5, fmt)
    if residual:
        normed, two_res = fused_add_rmsnorm(x, res, w, 1e-5)
        assert torch.equal(new_res, two_res) and new_res.shape == x.shape
    else:
        normed = rmsnorm(x, w, 1e-5)
        assert new_res is None
    two_q, two_s = QUANT[fmt](normed)
    rows = x.numel() // shape[-1]
    assert q.shape == (rows, shape[-1]) and s.shape == (rows, 1) and s.dtype == torch.float32
    assert q.dtype == (torch.float8_e4m3fn if fmt == "fp8" else torch.int8)
    _assert_same_codes(q, s, two_q, two_s, dtype, width=shape[-1])
    # against float64: the HF norm of x + residual, then the dequantized codes
    x64 = x.double().cpu() + (res.double().cpu() if residual else 0)
    f64 = w.double().cpu() * x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)
    _assert_within_a_code_step(q, s, f64.reshape(rows, -1), dtype)
    rq, rs, _ = ref_rmsnorm_quant(x, res, w, 1e-5, fmt)  # the twin: the same but for the norm's last-bit rounding
    _assert_within_a_code_step(q, s, _dequant(rq, rs), dtype)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 2 * 64), (6, 2 * 1000), (2, 3, 2 * 96)])
def test_silu_and_mul_quant_is_the_two_kernels_bit_for_bit(shape, dtype, fmt):
    g = torch.Generator().manual_seed(shape[-1])
    x = (torch.randn(shape, generator=g) * 4).to(dtype).to(DEVICE)
    q, s = silu_and_mul_quant(x, fmt)
    two_q, two_s = QUANT[fmt](silu_and_mul(x))
    rows, inter = x.numel() // shape[-1], shape[-1] // 2
    assert q.shape == (rows, inter) and s.shape == (rows, 1)
    _assert_same_codes(q, s, two_q, two_s, dtype)
    x64 = x.double().cpu().reshape(rows, -1)
    f64 = torch.nn.functional.silu(x64[:, :inter]) * x64[:, inter:]
    _assert_within_a_code_step(q, s, f64, dtype)
    rq, rs = ref_silu_and_mul_quant(x, fmt)
    _assert_within_a_code_step(q, s, _dequant(rq, rs), dtype)


def test_int8_codes_are_the_twins_on_exact_rows():
    # Rows whose norm is exact (x = +-1 everywhere, weight 1: rstd = 1): the twin and the kernel agree bit for
    # bit (amax 1 -> scale 1/127; code = round(x * 127)). Ties (round half to even) are the shared code rounding's
    # (``_to_codes``), tested through the plain quantizer in test_quant_gemm.py::test_per_token_quant_int8_known_answer.
    x = torch.tensor([[1.0, -1.0, 1.0, 1.0], [-1.0, -1.0, 1.0, -1.0]], device=DEVICE)
    w = torch.ones(4, device=DEVICE)
    q, s, _ = rmsnorm_quant(x, None, w, 0.0, "int8")
    rq, rs, _ = ref_rmsnorm_quant(x, None, w, 0.0, "int8")
    assert q.tolist() == rq.tolist() == [[127, -127, 127, 127], [-127, -127, 127, -127]]
    assert torch.equal(s, rs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(5, 3, 128), (37, 64), (1, 1024)])
def test_fp8_split_carries_twice_the_bits(shape, dtype):
    """q = (hi + lo) * scale (the FP8 prefill kernel's q): the kernel is its twin (bit for bit on the GPU; the CPU
    interpreter's fp32 -> fp8 cast is not exact, so there the scales only), hi is per_token_quant_fp8's codes, and
    the two terms' error against float64 is within 2^-8 relative + 2^-10 x scale (E4M3's subnormal half step),
    where hi alone is only within 2^-4 relative: the second term cuts the error norm 8-fold at least."""
    g = torch.Generator().manual_seed(shape[0])
    x = (torch.randn(shape, generator=g) * torch.logspace(-2, 1, shape[-1])).to(dtype).to(DEVICE)
    hi, lo, s = per_token_quant_fp8_split(x)
    rhi, rlo, rs = ref_per_token_quant_fp8_split(x)
    assert torch.equal(s, rs)
    if x.is_cuda:
        assert torch.equal(_bits(hi), _bits(rhi)) and torch.equal(_bits(lo), _bits(rlo))
        one_hi, one_s = per_token_quant_fp8(x)
        assert torch.equal(_bits(one_hi), _bits(hi)) and torch.equal(one_s, s)
    f64 = x.double().cpu().reshape(hi.shape)
    scale = rs.double().cpu()
    two = (rhi.double() + rlo.double()).cpu() * scale
    one = rhi.double().cpu() * scale
    err2, err1 = (two - f64).abs(), (one - f64).abs()
    assert bool((err2 <= 2.0**-8 * f64.abs() + 2.0**-10 * scale + 1e-12).all()), float((err2 / f64.abs()).max())
    assert float(err2.norm()) < float(err1.norm()) / 8


def test_quantized_activation_reports_its_shape_and_format():
    a = QuantizedActivation(torch.zeros(3, 8, dtype=torch.int8), torch.ones(3, 1), torch.bfloat16)
    assert a.shape == (3, 8) and a.fmt == "int8" and a.device.type == "cpu"
    assert QuantizedActivation(torch.zeros(1, 8, dtype=torch.float8_e4m3fn), torch.ones(1, 1), torch.float16).fmt == "fp8"


def test_bad_arguments_are_refused():
    x = torch.randn(2, 8, device=DEVICE)
    with pytest.raises(ValueError, match="'int4'"):
        rmsnorm_quant(x, None, torch.ones(8, device=DEVICE), 1e-6, "int4")
    with pytest.raises(ValueError, match=r"\(8,\)"):
        rmsnorm_quant(x, None, torch.ones(6, device=DEVICE), 1e-6, "int8")
    with pytest.raises(ValueError, match="residual"):
        rmsnorm_quant(x, torch.randn(2, 6, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6, "int8")
    with pytest.raises(ValueError, match="even"):
        silu_and_mul_quant(torch.randn(2, 7, device=DEVICE), "fp8")
    with pytest.raises(ValueError, match="'e5m2'"):
        silu_and_mul_quant(x, "e5m2")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (W8A8 tensor-core paths)")
@pytest.mark.parametrize("quantization", ["fp8", "smoothquant"])
def test_gpu_model_with_fused_input_quantization_is_unchanged(quantization, tmp_path, monkeypatch):
    """A bf16 Llama with W8A8 linears, prefilling 96 tokens (above the decode sizes, so qkv, gate_up and down
    quantize their inputs per token): the norms and SiLU-and-mul writing the codes themselves give the same
    prompt logprobs and greedy tokens, bit for bit, as the separate quantizer (at 256 channels both kernels lay the
    norm's row out alike; past 1,024 a rare code moves by one step: act_quant's module docstring)."""
    import json

    from roofline import LLM, SamplingParams
    from roofline.kernels import act_quant
    from roofline.layers.linear import LinearBase

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 256,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompt = {"prompt_token_ids": [int(t) for t in torch.randint(0, 1000, (96,), generator=torch.Generator()
                                                                 .manual_seed(1))]}
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, prompt_logprobs=1)
    calls = {"norm": 0, "silu": 0}
    fused_norm, fused_silu = act_quant.rmsnorm_quant, act_quant.silu_and_mul_quant

    def count(name, fn):
        def wrapped(*args):
            calls[name] += 1
            return fn(*args)
        return wrapped

    monkeypatch.setattr(act_quant, "rmsnorm_quant", count("norm", fused_norm))
    monkeypatch.setattr(act_quant, "silu_and_mul_quant", count("silu", fused_silu))
    runs = []
    for fused in (True, False):
        if not fused:  # the layers never ask for codes: each W8A8 linear quantizes its own input
            monkeypatch.setattr(LinearBase, "input_quant", lambda self, x: None)
        llm = LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", quantization=quantization,
                  enforce_eager=True, max_model_len=256, max_num_seqs=4, kv_cache_memory="64MiB")
        out = llm.generate(prompt, params, use_tqdm=False)[0]
        runs.append((out.outputs[0].token_ids, [None if p is None else {t: lp.logprob for t, lp in p.items()}
                                                for p in out.prompt_logprobs]))
        if fused:  # 2 layers x 2 norms and 2 SiLU-and-muls in the prefill
            assert calls["norm"] >= 4 and calls["silu"] >= 2, calls
        del llm
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]
