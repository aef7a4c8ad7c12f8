"""An adaptive EAGLE engine (speculation mostly off) against a plain one, bf16 on CPU, in one process: two 256-token
requests per round, 3 rounds alternated, best of each. Run: ``PYTHONPATH=. python bench/spec_adaptive_ab.py``."""

from __future__ import annotations

import time

from roofline import LLM, SamplingParams

SPEC = {"method": "eagle", "num_speculative_tokens": 2, "tree_topk": 4, "tree_budget": 8}
PROMPTS = ["Write a long story about a lighthouse keeper and the sea.", "Explain how a refrigerator works in detail."]


def main() -> None:
    plain = LLM(device="cpu", dtype="bfloat16", max_model_len=1024, kv_cache_memory="256MiB")
    adaptive = LLM(device="cpu", dtype="bfloat16", max_model_len=1024, kv_cache_memory="256MiB",
                   speculative_config=SPEC)
    sp = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    engines = {"plain": plain, "adaptive": adaptive}
    for llm in engines.values():  # warm-up
        llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(3):
        for name, llm in engines.items():
            t0 = time.perf_counter()
            for prompt in PROMPTS:
                llm.generate([prompt], sp, use_tqdm=False)
            seconds[name].append(time.perf_counter() - t0)
    print({name: [round(s, 3) for s in v] for name, v in seconds.items()})
    print(f"adaptive vs plain (best of each): {min(seconds['plain']) / min(seconds['adaptive']):.3f}x")
    stats = adaptive.engine.spec_stats
    print(f"speculation on {stats.num_steps_on} / off {stats.num_steps_off} steps")


if __name__ == "__main__":
    main()
