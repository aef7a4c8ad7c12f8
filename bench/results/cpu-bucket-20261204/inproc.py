"""Main-job workload (32 ShareGPT chats, 128 greedy tokens, bf16 + float32 KV) on one engine, decode_bucket
policies alternated round by round; fixed token budget so the scheduling (and greedy outputs) are deterministic."""
import json, sys, time
import roofline.attention.torch_backend as tb
from roofline import LLM, SamplingParams
from roofline.bench.datasets import sample_sharegpt
print("roofline:", tb.__file__, flush=True)
budget, rounds, out_path = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
new = tb.decode_bucket
def quarter(n, bs):
    b = 1
    while b < n:
        b = b + 1 if b < 4 else (b * 5 + 3) // 4
    return b
def capped(keys):
    def f(n, bs):
        old = tb.DECODE_BUCKET_MAX_STEP_KEYS; tb.DECODE_BUCKET_MAX_STEP_KEYS = keys
        try: return new(n, bs)
        finally: tb.DECODE_BUCKET_MAX_STEP_KEYS = old
    return f
policies = {"quarter (old)": quarter, "pow2 cap 512 keys (new)": capped(512), "pow2 cap 256 keys": capped(256)}
llm = LLM(dtype="bfloat16", kv_cache_dtype="float32", max_num_batched_tokens=budget, enable_prefix_caching=False)
eng = llm.engine
max_len = eng.config.scheduler_config.max_model_len
reqs = sample_sharegpt(llm.tokenizer, 32, seed=0, max_prompt_len=min(1024, max_len // 2), max_total_len=min(2048, max_len))
prompts = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": r.prompt}])} for r in reqs]
params = SamplingParams(temperature=0.0, max_tokens=128)
res = {n: {"step_ms": [], "tok_s": [], "outputs": None} for n in policies}
for r in range(rounds):
    for name, f in policies.items():
        tb.decode_bucket = f
        outs = llm.generate(prompts, params, use_tqdm=False)
        s = llm.last_run_stats
        ids = [list(o.outputs[0].token_ids) for o in outs]
        res[name]["step_ms"].append(round(s.mean_decode_step_s * 1e3, 1))
        res[name]["tok_s"].append(round(s.output_tok_per_s, 1))
        if res[name]["outputs"] is None:
            res[name]["outputs"] = ids
        same_self = sum(a == b for a, b in zip(ids, res[name]["outputs"]))
        print(f"round {r + 1} {name}: decode step {s.mean_decode_step_s * 1e3:.1f} ms (batch {s.mean_decode_batch:.1f}, "
              f"kv {s.mean_decode_kv_tokens:.0f}), {s.output_tok_per_s:.1f} tok/s; outputs as its round 1: {same_self}/32",
              flush=True)
tb.decode_bucket = new
ref = res["quarter (old)"]["outputs"]
for name in policies:
    o = res[name]["outputs"]
    print(f"{name}: greedy outputs identical to old: {sum(a == b for a, b in zip(o, ref))}/32; "
          f"first differing token (of 128) where different: {[next(i for i, (x, y) in enumerate(zip(a, b)) if x != y) if a != b else None for a, b in zip(o, ref) if a != b]}")
json.dump({"budget": budget, "results": res}, open(out_path, "w"))
