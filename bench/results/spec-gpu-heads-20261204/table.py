"""Print the markdown table of an ``ab.py`` JSON: python table.py ab-sharegpt.json"""

import json
import statistics
import sys


def name(cfg: str) -> str:
    if cfg == "none":
        return "plain"
    c = json.loads(cfg)
    head = {"smollm2-135m-eagle-v8192": "8k vocab", "smollm2-135m-eagle": "full vocab"}.get(
        (c.get("model") or "").rstrip("/").split("/")[-1], "")
    if not c.get("model") and c["method"] in ("eagle", "medusa"):
        head = "shipped" + (" (8k vocab)" if c["method"] == "eagle" else "")
    kind = (f"tree depth {c['num_speculative_tokens']}, top-{c['tree_topk']}, {c['tree_budget']} nodes"
            if c.get("tree_topk") else f"chain k {c['num_speculative_tokens']}")
    pol = "adaptive" if c.get("adaptive", True) else "fixed"
    return f"{c['method']}{' ' + head if head else ''}, {kind}, {pol}"


for path in sys.argv[1:]:
    d = json.load(open(path))
    print(f"{d['workload']}, {d['num_prompts']} prompts x {d['max_tokens']} tokens ({path})\n")
    base = d["rows"][0]["per_prompt_tok_s"]
    print("| config | tok/s | vs plain (summed) | vs plain (median of per-prompt ratios) | tokens / verify pass | alpha | accepted / drafted per depth | on / off steps "
          "| greedy identical |")
    print("|---|---:|---:|---:|---:|---:|---|---|---:|")
    for r in d["rows"]:
        acc, dr = r.get("accepted_per_position"), r.get("drafted_per_position")
        pos = ", ".join(f"{a}/{b}" for a, b in zip(acc, dr, strict=True)) if acc else ""
        mal, ar = r.get("mean_acceptance_length"), r.get("acceptance_rate")
        med = statistics.median(x / b for x, b in zip(r["per_prompt_tok_s"], base, strict=True))
        print(f"| {name(r['config'])} | {r['tok_per_s']:.1f} | {r['speedup']:.2f}x | {med:.2f}x | "
              f"{'' if mal is None else f'{mal:.2f}'} | {'' if ar is None else f'{ar:.3f}'} | {pos} | "
              f"{'' if r['config'] == 'none' else str(r.get('steps_on')) + ' / ' + str(r.get('steps_off'))} | "
              f"{r.get('greedy_identical', '')} |")
    print()
