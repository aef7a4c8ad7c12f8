import time, sys, cProfile, pstats
from roofline import LLM, SamplingParams
spec = None if sys.argv[1] == "plain" else {"method": "eagle", "num_speculative_tokens": 1, "tree_topk": 3, "tree_budget": 3}
llm = LLM(device="cpu", max_model_len=1024, speculative_config=spec)
prompts = ["Write a long story about a lighthouse keeper and the sea."]
sp = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
t0 = time.perf_counter(); llm.generate(prompts, sp, use_tqdm=False); t = time.perf_counter() - t0
print(sys.argv[1], f"{t / 200 * 1e3:.2f} ms/token")
if len(sys.argv) > 2:
    pr = cProfile.Profile(); pr.enable(); llm.generate(prompts, sp, use_tqdm=False); pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(18)
