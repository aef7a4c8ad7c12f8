"""Debug: the adaptive policy's state (plain / verify timings, c, its last decision) after each of 4 HumanEval chats
with the shipped EAGLE head at depth 1 top-3 (CPU, bf16). Run from the repository root."""
from roofline import LLM, SamplingParams
from roofline.bench.spec import workload_prompts
llm = LLM(dtype="bfloat16", device="cpu", max_model_len=1024, kv_cache_memory="256MiB",
          speculative_config={"method": "eagle", "num_speculative_tokens": 1, "tree_topk": 3, "tree_budget": 3})
texts = workload_prompts("humaneval", llm.tokenizer, 4, seed=0)
for t in texts:
    llm.chat([{"role": "user", "content": t}], SamplingParams(temperature=0, max_tokens=128), use_tqdm=False)
    pol = llm.engine.spec.policy
    print(pol.probe_interval, pol.steps_off, "catch", round(pol.catch_up_cost,3), "plain_s", {k: round(v*1e3, 2) for k, v in pol.plain_s.items()}, "verify_s", {k: round(v*1e3, 2) for k, v in pol.verify_s.items()},
          "c", round(pol.draft_cost, 3), "last", pol.last, flush=True)
st = llm.engine.spec_stats
print(st.as_dict() if hasattr(st, "as_dict") else st)
