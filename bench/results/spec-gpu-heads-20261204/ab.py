"""Interleaved batch-1 A/B of speculative configs against plain decoding on one shared CPU (issue 30).

Like ``roofline bench spec`` (same prompts: ``roofline.bench.spec.workload_prompts``, seed 0, so the ShareGPT ones
are among the 64 held out from training; same greedy chat requests, one at a time), but each prompt runs on
the baseline and every config in turn (the order rotated by one at each prompt), so load from other jobs on the
machine hits all of them alike; speed = summed tokens / summed seconds, ratios against the baseline of the same
run. Greedy identity: each config's tokens against the baseline's, per prompt. The JSON is rewritten after
every prompt.

    python bench/results/spec-gpu-heads-20261204/ab.py --workload sharegpt --num-prompts 6 --max-tokens 96 \
        --out FILE.json CONFIG_JSON ...
"""

from __future__ import annotations

import argparse
import json

from roofline.bench.spec import _run, workload_prompts
from roofline.llm import LLM


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("configs", nargs="+")
    p.add_argument("--workload", default="sharegpt")
    p.add_argument("--num-prompts", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=96)
    p.add_argument("--kv-cache-memory", default="256MiB")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    common = dict(device="cpu", dtype="float32", max_model_len=2048, enable_prefix_caching=False,
                  kv_cache_memory=a.kv_cache_memory)
    base = LLM(**common)
    prompts = workload_prompts(a.workload, base.tokenizer, a.num_prompts, 0)
    names = ["none"] + a.configs
    engines = [base] + [LLM(speculative_config=json.loads(c), **common) for c in a.configs]
    for llm in engines:
        _run(llm, prompts[:1], 8)
    tot = {n: dict(tokens=0, seconds=0.0, drafted=0, accepted=0, passes=0, emitted=0, on=0, off=0, identical=0,
                   runs=0, per_prompt_tok_s=[]) for n in names}

    def dump() -> None:
        b = tot["none"]["tokens"] / tot["none"]["seconds"]
        rows = []
        for n in names:
            d = tot[n]
            row = dict(config=n, tok_per_s=d["tokens"] / d["seconds"], speedup=d["tokens"] / d["seconds"] / b,
                       per_prompt_tok_s=d["per_prompt_tok_s"], output_tokens=d["tokens"], seconds=d["seconds"])
            if n != "none":
                row.update(acceptance_rate=d["accepted"] / d["drafted"] if d["drafted"] else None,
                           mean_acceptance_length=d["emitted"] / d["passes"] if d["passes"] else None,
                           greedy_identical=f"{d['identical']}/{d['runs']}", steps_on=d["on"], steps_off=d["off"],
                           accepted_per_position=d.get("acc_pos"), drafted_per_position=d.get("dr_pos"))
            rows.append(row)
        with open(a.out, "w") as f:
            json.dump(dict(workload=a.workload, num_prompts=len(prompts), max_tokens=a.max_tokens, device="cpu",
                           dtype="float32", interleave="per prompt, engine order rotated by one each prompt",
                           rows=rows), f, indent=1)
        return rows

    for p_i, prompt in enumerate(prompts):  # per prompt, every engine, in an order rotated each prompt
        order = list(range(len(names)))
        order = order[p_i % len(order):] + order[:p_i % len(order)]
        outs_by = {}
        for i in order:
            outs, t, sd = _run(engines[i], [prompt], a.max_tokens)
            outs_by[i] = outs[0]
            d = tot[names[i]]
            n = len(outs[0])
            d["tokens"] += n
            d["seconds"] += t
            d["per_prompt_tok_s"].append(n / t)
            if sd is not None:
                raw = sd.as_dict_raw()
                d["drafted"] += raw["num_draft_tokens"]
                d["accepted"] += raw["num_accepted_tokens"]
                d["passes"] += raw["num_drafts"]
                d["emitted"] += raw["num_emitted_tokens"]
                d["on"] += sd.num_steps_on
                d["off"] += sd.num_steps_off
                for key, src in (("acc_pos", raw["accepted_per_position"]), ("dr_pos", raw["drafted_per_position"])):
                    cur = d.setdefault(key, [])
                    cur += [0] * (len(src) - len(cur))
                    for j, x in enumerate(src):
                        cur[j] += x
            print(f"prompt {p_i} {names[i]}: {n} tokens {t:.1f} s {n / t:.1f} tok/s", flush=True)
        for i in range(1, len(names)):
            tot[names[i]]["identical"] += int(outs_by[i] == outs_by[0])
            tot[names[i]]["runs"] += 1
        dump()
    rows = dump()
    for row in rows:
        print(f"{row['config']:<100} {row['tok_per_s']:7.1f} tok/s {row['speedup']:5.2f}x "
              f"acc.len {row.get('mean_acceptance_length')} alpha {row.get('acceptance_rate')} "
              f"on/off {row.get('steps_on')}/{row.get('steps_off')} identical {row.get('greedy_identical', '-')}",
              flush=True)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
