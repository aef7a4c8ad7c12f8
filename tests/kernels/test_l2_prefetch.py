"""The L2 weight prefetch (``roofline.kernels.l2_prefetch``): which layers ask, which tensor they warm, and that
turning it on changes no result (it is a hint; the GPU tests run the real kernel, the CPU ones the decisions)."""

from __future__ import annotations

import json

import pytest
import torch

from roofline.kernels import l2_prefetch, linear_dispatch


@pytest.fixture
def prefetch_on(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "MAX_BYTES", 8 * 2**20)
    monkeypatch.setattr(l2_prefetch, "SITES", frozenset({"o_proj", "gate_up_proj", "down_proj"}))


def test_enabled_only_for_named_sites_at_decode_sizes(prefetch_on, monkeypatch):
    assert l2_prefetch.enabled(1, "o_proj")
    assert l2_prefetch.enabled(l2_prefetch.MAX_M, "down_proj")
    assert not l2_prefetch.enabled(l2_prefetch.MAX_M + 1, "o_proj")  # prefill: the GEMM is compute-bound
    assert not l2_prefetch.enabled(1, "qkv_proj")  # not a site
    monkeypatch.setattr(l2_prefetch, "MAX_BYTES", 0)
    assert not l2_prefetch.enabled(1, "o_proj")


def test_cpu_tensor_is_a_no_op():
    assert l2_prefetch.prefetch(torch.zeros(64, 64), max_bytes=2**20) == 0


def test_streamed_weight_is_what_the_gemm_reads():
    class Layer(torch.nn.Module):
        pass

    dense = Layer()
    dense.weight = torch.zeros(8, 16)
    assert linear_dispatch.streamed_weight(dense, 1) is dense.weight
    quant = Layer()
    quant.weight_scale, quant.qweight = torch.ones(8), torch.zeros(8, 16, dtype=torch.int8)
    assert linear_dispatch.streamed_weight(quant, 1) is quant.qweight
    assert linear_dispatch.streamed_weight(Layer(), 1) is None


def _tiny_llama(path, hidden=64, inter=128):
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": hidden,
              "intermediate_size": inter, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512}
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


def test_layers_ask_for_their_own_weight(prefetch_on, monkeypatch, tmp_path):
    """A CPU Llama with the prefetch on: each decode step asks o_proj, gate_up_proj and down_proj (not qkv) of
    each of its 2 layers for the tensor its GEMM streams; the CPU prefetch launches nothing, so tokens are the
    same as with it off, when nobody asks."""
    from roofline import LLM, SamplingParams

    asked = []
    real = linear_dispatch.streamed_weight
    monkeypatch.setattr(linear_dispatch, "streamed_weight",
                        lambda layer, m: asked.append((layer.prefix, m)) or real(layer, m))
    llm = LLM(_tiny_llama(tmp_path), load_format="dummy", device="cpu", attention_backend="torch",
              dtype="float32", max_model_len=64, num_kv_blocks=8)
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    prompt = {"prompt_token_ids": [1, 2, 3, 4, 5]}
    on = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    decode = sorted({name for name, m in asked if m == 1})
    assert decode == [f"model.layers.{i}.{s}" for i in (0, 1)
                      for s in ("mlp.down_proj", "mlp.gate_up_proj", "self_attn.o_proj")], asked
    assert all(m in (1, 5) for _, m in asked)  # the 5-token prefill is within MAX_M too
    monkeypatch.setattr(l2_prefetch, "MAX_BYTES", 0)
    asked.clear()
    off = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0].token_ids
    assert asked == [] and on == off and len(on) == 4


needs_hopper = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0),
                                  reason="needs an sm_90 GPU (bulk L2 prefetch)")


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int32, torch.float8_e4m3fn])
@pytest.mark.parametrize("kind", ["bulk", "line"])
def test_gpu_prefetch_leaves_the_weight_and_the_gemv_unchanged(dtype, kind, monkeypatch):
    from roofline.kernels.quant_gemm import dense_gemv

    monkeypatch.setattr(l2_prefetch, "KIND", kind)

    w = torch.randn(1000, 520, device="cuda").to(dtype) if dtype != torch.int32 else \
        torch.randint(-2**31, 2**31 - 1, (1000, 520), device="cuda", dtype=torch.int32)
    before = w.clone()
    n = l2_prefetch.prefetch(w, max_bytes=w.numel() * w.element_size())
    assert n == w.numel() * w.element_size() // 16 * 16
    assert l2_prefetch.prefetch(w, max_bytes=100) == 96  # capped, rounded down to 16 bytes
    torch.cuda.synchronize()
    assert torch.equal(w.view(torch.uint8), before.view(torch.uint8))
    wb = torch.randn(4096, 1024, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 1024, device="cuda", dtype=torch.bfloat16)
    cold = dense_gemv(x, wb)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):  # captured, as the decode graphs capture it
        l2_prefetch.prefetch(wb, max_bytes=2**30)
        out = dense_gemv(x, wb)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, cold)


@pytest.mark.gpu
@needs_hopper
@pytest.mark.parametrize("quantization", [None, "int4"])
def test_gpu_decode_with_prefetch_is_unchanged(quantization, tmp_path, monkeypatch):
    """A bf16 Llama decoding with CUDA graphs: greedy tokens and logprobs identical with the prefetch on and off."""
    from roofline import LLM, SamplingParams

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 1000, "hidden_size": 512,
              "intermediate_size": 1024, "num_hidden_layers": 2, "num_attention_heads": 8,
              "num_key_value_heads": 2, "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    prompt = {"prompt_token_ids": list(range(3, 40))}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1)
    runs = []
    for mb in (8, 0):
        monkeypatch.setattr(l2_prefetch, "MAX_BYTES", mb * 2**20)
        llm = LLM(str(tmp_path), load_format="dummy", dtype="bfloat16", quantization=quantization,
                  max_model_len=256, max_num_seqs=4, kv_cache_memory="64MiB")
        out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
        runs.append((out.token_ids, [{t: lp.logprob for t, lp in p.items()} for p in out.logprobs]))
        del llm
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]
