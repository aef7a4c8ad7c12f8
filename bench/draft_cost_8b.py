"""Separate int4 self-draft at the llama-3-8b shape (dummy weights, GPU): time per token of plain decoding and
per speculative step with the draft pinned at gamma 3, and the policy's measured draft cost c (one draft pass
over one plain step). Batch 1, a 64-token prompt, 64 greedy tokens, each config timed twice after a warm-up.
This is the script of `bench/results/spec-20261203b/draft-9559885/` (run there inline, at 9559885).

    PYTHONPATH=. python bench/draft_cost_8b.py
"""

import time

import torch

from roofline import LLM, SamplingParams

sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
prompt = [{"prompt_token_ids": list(range(100, 164))}]
for spec in (None, {"method": "draft_model", "quantization": "int4", "num_speculative_tokens": 3, "adaptive": False}):
    llm = LLM(model="llama-3-8b", load_format="dummy", device="cuda", max_model_len=1024, kv_cache_memory="8GiB",
              speculative_config=spec)
    llm.generate(prompt, sp, use_tqdm=False)
    for _ in range(2):
        b = llm.engine.spec_stats.copy() if spec else None
        torch.cuda.synchronize()
        t = time.perf_counter()
        llm.generate(prompt, sp, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        st = llm.engine.spec_stats.since(b).as_dict() if spec else {}
        n = st.get("num_drafts") or 64
        print(f"llama-3-8b dummy, batch 1, {spec}: {dt / 64 * 1e3:.2f} ms/token, {dt / n * 1e3:.2f} ms/step; "
              f"{st}; policy c {getattr(llm.engine.spec_policy, 'draft_cost', None)}", flush=True)
    del llm
    torch.cuda.empty_cache()
