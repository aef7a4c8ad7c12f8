"""The EAGLE draft's LM head alone, full vocabulary vs the truncated one of bench/draft_vocab_map.py, timed
alternately in one process (median of 40 calls each) at 1 and 13 rows (a chain's pass; a 16-node tree's 1 + 3 x 4
frontier). CPU, fp32, the default model. Usage: python bench/draft_vocab_ab.py"""
import time

import torch

from roofline import LLM

kw = dict(max_model_len=512, dtype="float32", device="cpu", attention_backend="torch", kv_cache_memory="128MiB")
full = LLM(speculative_config={"method": "eagle", "num_speculative_tokens": 4, "adaptive": False}, **kw)
trunc = LLM(speculative_config={"method": "eagle", "model": "/tmp/eagle3/eagle-v8192", "num_speculative_tokens": 4,
                                "adaptive": False}, **kw)
torch.set_grad_enabled(False)
for a in (1, 13):
    x = torch.randn(a, 576)
    t = {"full": [], "v8192": []}
    for _ in range(40):
        for name, llm in (("full", full), ("v8192", trunc)):
            w = llm.engine.worker
            t0 = time.perf_counter()
            w.proposer.logits(w, x)
            t[name].append(time.perf_counter() - t0)
    med = {k: sorted(v)[len(v) // 2] * 1e3 for k, v in t.items()}
    print(f"rows {a}: draft LM head full {med['full']:.2f} ms, v8192 {med['v8192']:.2f} ms, "
          f"ratio {med['full'] / med['v8192']:.2f}x")
