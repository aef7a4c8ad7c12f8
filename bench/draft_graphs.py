"""Separate draft model: the time of a speculative decode with its passes replaying CUDA graphs against
running them eager (GPU). Random weights at the default model's shape, an int8 draft (so acceptance is ~0: every
step is 3 draft passes plus a verify pass), batch 1, greedy, 128 tokens, each mode timed twice after a warm-up.

    python bench/draft_graphs.py
"""

import time

import torch

from roofline import LLM, SamplingParams

SPEC = {"method": "draft_model", "quantization": "int8", "num_speculative_tokens": 3, "adaptive": False}
llm = LLM(model="smollm2-135m", load_format="dummy", device="cuda", dtype="bfloat16", max_model_len=512, kv_cache_memory="4GiB",
          speculative_config=SPEC)
draft = llm.engine.worker.draft
sp = SamplingParams(temperature=0.0, max_tokens=128, ignore_eos=True)
prompt = [{"prompt_token_ids": list(range(100, 164))}]
graphs = draft.graphs
for name in ("graphs", "eager", "graphs", "eager"):
    draft.graphs = graphs if name == "graphs" else None
    llm.generate(prompt, sp, use_tqdm=False)
    torch.cuda.synchronize()
    t = time.perf_counter()
    llm.generate(prompt, sp, use_tqdm=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    print(f"separate int8 draft (random weights, default-model shape), batch 1, gamma 3, 128 tokens, draft passes "
          f"{name}: {dt * 1e3:.1f} ms, {dt / 128 * 1e3:.2f} ms per token", flush=True)
