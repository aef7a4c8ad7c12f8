"""Token trees on the GPU: the verify pass goes through the Triton prefill kernel's ancestor mask
(``paged_prefill_attention(tree_mask=...)``) and EAGLE's tree drafting through the same kernel on its one-layer
pool. Random weights at the default model's shape with random-weight heads (greedy identity does not depend
on the head's quality), fp32, CUDA graphs on (tree steps run eager)."""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.spec_decode.heads import DraftHeadConfig, save_head

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_eagle_and_medusa_trees_are_token_identical_on_the_gpu(tmp_path, device="cuda", backend="triton"):
    # fp32: the tree pass runs the prefill kernel where plain decoding runs the decode kernel; in bf16 their
    # rounding differs enough to flip near-ties of random weights (the chain's verify uses decode rows instead).
    kw = dict(model="smollm2-135m", load_format="dummy", device=device, dtype="float32", max_model_len=512,
              kv_cache_memory="2GiB", attention_backend=backend)
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 140 + 9 * i))} for i in range(3)]
    sp = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    plain = LLM(**kw)
    ref = [o.outputs[0].token_ids for o in plain.generate(prompts, sp, use_tqdm=False)]
    mc = plain.engine.worker.model_config
    g = torch.Generator().manual_seed(0)
    for method in ("eagle", "medusa"):
        cfg = DraftHeadConfig.for_target(method, mc, num_heads=3 if method == "medusa" else 0)
        h, i = mc.hidden_size, mc.intermediate_size
        q, kv = mc.num_attention_heads * mc.head_dim, mc.num_key_value_heads * mc.head_dim
        shapes = ({"fc.weight": (h, 2 * h), "fc.bias": (h,), "layer.input_layernorm.weight": (h,),
                   "layer.post_attention_layernorm.weight": (h,), "layer.self_attn.q_proj.weight": (q, h),
                   "layer.self_attn.k_proj.weight": (kv, h), "layer.self_attn.v_proj.weight": (kv, h),
                   "layer.self_attn.o_proj.weight": (h, q), "layer.mlp.gate_proj.weight": (i, h),
                   "layer.mlp.up_proj.weight": (i, h), "layer.mlp.down_proj.weight": (h, i)}
                  if method == "eagle" else {f"heads.{k}.{n}": s for k in range(3)
                                             for n, s in (("weight", (h, h)), ("bias", (h,)))})
        save_head(str(tmp_path / method), cfg, {n: torch.randn(s, generator=g) * 0.02 for n, s in shapes.items()})
        spec = {"method": method, "model": str(tmp_path / method), "num_speculative_tokens": 3, "tree_topk": 3,
                "tree_budget": 10, "adaptive": False}
        llm = LLM(speculative_config=spec, **kw)
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert got == ref, method
        assert llm.engine.spec_stats.num_drafts > 0
