import sys, json
from roofline import LLM, SamplingParams
from roofline.bench.datasets import sample_sharegpt
from roofline.kernels import cpu_paged_attention as cpa
ref = LLM(device="cpu", dtype="float32", enable_prefix_caching=False)
max_len = ref.engine.config.scheduler_config.max_model_len
reqs = sample_sharegpt(ref.tokenizer, 32, seed=0, max_prompt_len=min(1024, max_len // 2), max_total_len=min(2048, max_len))
prompts = [{"prompt_token_ids": ref.apply_chat_template([{"role": "user", "content": r.prompt}])} for r in reqs]
sp = SamplingParams(temperature=0.0, max_tokens=128)
want = [o.outputs[0].token_ids for o in ref.generate(prompts, sp, use_tqdm=False)]
del ref
def prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y: break
        n += 1
    return n
res = {}
for kv in ("float32", "bfloat16"):
    llm = LLM(device="cpu", dtype="bfloat16", kv_cache_dtype=kv, enable_prefix_caching=False)
    for on in (False, True):
        cpa.ENABLED = on
        got = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        s = llm.last_run_stats
        pre = [prefix(a, b) for a, b in zip(got, want)]
        r = dict(kv=kv, kernel=on, identical_to_fp32=sum(a == b for a, b in zip(got, want)), mean_matching_prefix=sum(pre) / len(pre),
                 decode_step_ms=s.mean_decode_step_s * 1e3, tok_s=s.output_tok_per_s)
        print(json.dumps(r), flush=True); res[f"{kv}-{on}"] = r
    del llm
json.dump(res, open(sys.argv[1], "w"), indent=1)
