"""An adaptive EAGLE engine (speculation mostly off) against a plain one, bf16 on CPU, in one process: two 256-token
requests, 3 rounds alternated, best of each. Run: PYTHONPATH=. python bench/spec_adaptive_ab.py"""
import time
from roofline import LLM, SamplingParams
spec = {"method": "eagle", "num_speculative_tokens": 2, "tree_topk": 4, "tree_budget": 8}
plain = LLM(device="cpu", dtype="bfloat16", max_model_len=1024, kv_cache_memory="256MiB")
ad = LLM(device="cpu", dtype="bfloat16", max_model_len=1024, kv_cache_memory="256MiB", speculative_config=spec)
p = ["Write a long story about a lighthouse keeper and the sea.", "Explain how a refrigerator works in detail."]
sp = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
for llm in (plain, ad): llm.generate(p[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
res = {"plain": [], "adaptive": []}
for rep in range(3):
    for name, llm in (("plain", plain), ("adaptive", ad)):
        t0 = time.perf_counter()
        for q in p: llm.generate([q], sp, use_tqdm=False)
        res[name].append(time.perf_counter() - t0)
print({k: [round(x, 3) for x in v] for k, v in res.items()})
print("ratio (plain/adaptive, best):", round(min(res["plain"]) / min(res["adaptive"]), 3))
st = ad.engine.spec_stats
print("on", st.num_steps_on, "off", st.num_steps_off)
