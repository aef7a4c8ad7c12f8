import sys, time, json, torch
from roofline import LLM, SamplingParams
from roofline.bench.datasets import sample_sharegpt
from roofline.kernels import cpu_paged_attention as cpa, cpu_bf16
llm = LLM(device="cpu", dtype="bfloat16", kv_cache_dtype=sys.argv[3] if len(sys.argv) > 3 else "float32", enable_prefix_caching=False)
max_len = llm.engine.config.scheduler_config.max_model_len
reqs = sample_sharegpt(llm.tokenizer, 32, seed=0, max_prompt_len=min(1024, max_len // 2), max_total_len=min(2048, max_len))
prompts = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": r.prompt}])} for r in reqs]
sp = SamplingParams(temperature=0.0, max_tokens=128)
llm.generate(prompts[:4], SamplingParams(max_tokens=4), use_tqdm=False)
res = []
outs = {}
for rnd in range(int(sys.argv[1]) if len(sys.argv) > 1 else 2):
    for on in (False, True):
        cpa.ENABLED = on
        t = time.perf_counter(); o = llm.generate(prompts, sp, use_tqdm=False); el = time.perf_counter() - t
        s = llm.last_run_stats
        ids = [x.outputs[0].token_ids for x in o]
        same = sum(a == b for a, b in zip(ids, outs.setdefault(on, ids)))
        ref = outs[False]
        agree = sum(a == b for a, b in zip(ids, ref))
        r = dict(round=rnd, kernel=on, wall_s=el, tok_s=s.output_tok_per_s, decode_step_ms=s.mean_decode_step_s * 1e3,
                 batch=s.mean_decode_batch, kv=s.mean_decode_kv_tokens, outputs_equal_to_sdpa=agree)
        res.append(r); print(json.dumps(r), flush=True)
json.dump(res, open(sys.argv[2] if len(sys.argv) > 2 else "/tmp/ab/kernel.json", "w"), indent=1)
