"""torch.profiler over 8 decode-only steps of the main job (bf16, float32 KV cache) inside llm.generate, once
every prompt is prefilled (32 rows decoding)."""
import sys, time, torch
from roofline import LLM, SamplingParams
from roofline.bench.datasets import sample_sharegpt
import roofline.attention.torch_backend as tb
print("roofline:", tb.__file__, flush=True)
llm = LLM(dtype="bfloat16", kv_cache_dtype="float32", max_num_batched_tokens=int(sys.argv[1]))
eng = llm.engine
max_len = eng.config.scheduler_config.max_model_len
reqs = sample_sharegpt(llm.tokenizer, 32, seed=0, max_prompt_len=min(1024, max_len // 2), max_total_len=min(2048, max_len))
prompts = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": r.prompt}])} for r in reqs]
params = SamplingParams(temperature=0.0, max_tokens=128)
state = {"n": 0, "prof": None, "t": []}
orig_step = eng.step
def step():
    sch = eng.scheduler
    ready = not sch.num_waiting and len(sch.running) == 32 and all(s.num_computed_tokens >= s.num_prompt_tokens for s in sch.running)
    if ready and state["n"] < 3 + 16:
        state["n"] += 1
        if state["n"] == 4:
            state["prof"] = torch.profiler.profile(); state["prof"].__enter__()
        t0 = time.perf_counter(); r = orig_step(); state["t"].append((time.perf_counter() - t0) * 1e3)
        if state["n"] == 3 + 8:
            state["prof"].__exit__(None, None, None)
        return r
    return orig_step()
eng.step = step
llm.generate(prompts, params, use_tqdm=False)
t = state["t"]
print(f"steps timed (32 rows): warm-up {t[:3]}, profiled {[round(x, 1) for x in t[3:11]]}, unprofiled {[round(x, 1) for x in t[11:]]}")
s = llm.last_run_stats
print(f"run: decode step {s.mean_decode_step_s * 1e3:.1f} ms (batch {s.mean_decode_batch:.1f}, kv {s.mean_decode_kv_tokens:.0f})")
print(state["prof"].key_averages().table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=45))
