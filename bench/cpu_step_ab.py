"""Decode step time of the default model on CPU at batch 1 and 32, generate-level: (time of 129 tokens - time of 1
token) / 128 per batch, best of 2, after a warm-up. Run once per code tree to A/B them, alternated:

    for i in 1 2; do for t in OLD_TREE NEW_TREE; do PYTHONPATH=$t python bench/cpu_step_ab.py $t int8; done; done

Arguments: a label, the quantization (``none``, ``int8``, ...), optionally the dtype (default ``bfloat16``;
``float32``: the CPU's default) and the KV cache dtype (default ``auto``; ``int8``, ``fp8_e4m3``); with a KV cache
dtype it also prints the prefill time of one 1,000-token prompt (best of 2). ``ROOFLINE_CPU_PLAN=0`` in the environment A/Bs the decode plan in one tree."""

import sys
import time

from roofline import LLM, SamplingParams

label, quant = sys.argv[1], sys.argv[2]
dtype = sys.argv[3] if len(sys.argv) > 3 else "bfloat16"
kv = sys.argv[4] if len(sys.argv) > 4 else "auto"
llm = LLM(device="cpu", dtype=dtype, quantization=None if quant == "none" else quant, max_model_len=1024,
          kv_cache_dtype=kv, enable_prefix_caching=False)
if kv != "auto":
    long_prompt = {"prompt_token_ids": [100 + (7 * i) % 40000 for i in range(1000)]}
    sp1 = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    llm.generate([long_prompt], sp1, use_tqdm=False)
    ts = []
    for _ in range(2):
        t0 = time.perf_counter()
        llm.generate([long_prompt], sp1, use_tqdm=False)
        ts.append(time.perf_counter() - t0)
    print(f"RESULT {label} {quant} {dtype} kv {kv} prefill 1000 tokens: {min(ts) * 1e3:.0f} ms", flush=True)
for batch in (1, 32):
    prompts = [f"Write a long story number {i} about a lighthouse keeper and the sea." for i in range(batch)]

    def timed(n: int, prompts: list[str] = prompts) -> float:
        sp = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        t0 = time.perf_counter()
        llm.generate(prompts, sp, use_tqdm=False)
        return time.perf_counter() - t0

    timed(4)
    best = min((timed(129) - timed(1)) / 128 for _ in range(2))
    print(f"RESULT {label} {quant} {dtype} kv {kv} batch {batch}: {best * 1e3:.2f} ms/step", flush=True)
