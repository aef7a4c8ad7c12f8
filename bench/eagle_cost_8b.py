"""EAGLE at the llama-3-8b shape (issue 30's projection at 8B): the draft cost and the verify cost of a token tree
on a GPU, measured with dummy target weights and a random EAGLE head of the 8B's shape (one Llama-3-8B decoder layer,
fc [4096, 8192], a 32,768-token draft vocabulary as EAGLE-3 uses for Llama-3). Random weights accept nothing, so
the tokens per verify pass come from the default model's trained head instead (measured on the CPU), and the
speedup printed is a projection:

    projected speedup = tokens per pass (default model) x plain ms per token / (draft + verify) ms per step

Batch 1 and 8, a 64-token prompt each, 64 greedy tokens, each config timed twice after a warm-up, speculation pinned
(``adaptive: false``). Usage (repo root, GPU): PYTHONPATH=. python bench/eagle_cost_8b.py [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time

import torch

# (depth, top-k, node budget) -> tokens per verify pass of the shipped SmolLM2-135M head on held-out ShareGPT and
# HumanEval (CPU, bf16, 8 prompts each; bench/results/eagle-recipes-h100-20261206/, README issue 30 rows)
TREES = {(1, 3, 3): (1.619, 1.534), (2, 4, 8): (1.862, 1.720), (4, 4, 16): (1.965, 1.789)}
DRAFT_VOCAB = 32768


def random_head(directory: str, model: str) -> None:
    from roofline.model_config import model_preset
    from roofline.spec_decode.heads import DraftHeadConfig, EagleHead, save_head

    mc = model_preset(model)
    cfg = DraftHeadConfig.for_target("eagle", mc)
    cfg = DraftHeadConfig(**{**cfg.__dict__, "draft_vocab_size": DRAFT_VOCAB, "training": {"random": True}})
    torch.manual_seed(0)
    tensors = EagleHead(cfg).export()
    tensors["token_map"] = torch.arange(DRAFT_VOCAB, dtype=torch.int64)
    save_head(directory, cfg, tensors, dtype=torch.bfloat16)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--model", default="llama-3-8b", help="a dummy-weight preset (smollm2-135m checks the script)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--max-tokens", type=int, default=64)
    args = ap.parse_args()

    from roofline import LLM, SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    rows = []
    with tempfile.TemporaryDirectory() as head:
        random_head(head, args.model)
        configs = [None] + [{"method": "eagle", "model": head, "num_speculative_tokens": d, "tree_topk": k,
                             "tree_budget": n, "adaptive": False} for d, k, n in TREES]
        for spec in configs:
            llm = LLM(model=args.model, load_format="dummy", device=args.device, max_model_len=1024,
                      kv_cache_memory="8GiB", max_num_seqs=8, speculative_config=spec)
            for b in (int(v) for v in args.batches.split(",")):
                prompts = [{"prompt_token_ids": list(range(100 + i, 164 + i))} for i in range(b)]
                llm.generate(prompts, sp, use_tqdm=False)  # warm-up: graphs, compiles
                for rep in range(2):
                    before = llm.engine.spec_stats.copy() if spec else None
                    sync()
                    t = time.perf_counter()
                    llm.generate(prompts, sp, use_tqdm=False)
                    sync()
                    dt = time.perf_counter() - t
                    st = llm.engine.spec_stats.since(before).as_dict() if spec else {}
                    row = dict(batch=b, rep=rep, ms_per_token=dt / args.max_tokens * 1e3, spec=None if spec is None else
                               {k: spec[k] for k in ("num_speculative_tokens", "tree_topk", "tree_budget")},
                               draft_ms_per_step=st.get("draft_ms_per_step"),
                               verify_ms_per_step=st.get("verify_ms_per_step"), steps_on=st.get("num_steps_on"))
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            del llm
            if args.device == "cuda":
                torch.cuda.empty_cache()
    print("\nprojection (not measured): tokens per pass of the default model's head x plain / speculating step")
    for b in sorted({r["batch"] for r in rows}):
        plain = min(r["ms_per_token"] for r in rows if r["batch"] == b and r["spec"] is None)
        for (d, k, n), (share, human) in TREES.items():
            got = [r for r in rows if r["batch"] == b and r["spec"] and r["spec"]["tree_budget"] == n]
            if not got or got[-1]["draft_ms_per_step"] is None:
                continue
            draft = min(r["draft_ms_per_step"] for r in got)
            verify = min(r["verify_ms_per_step"] for r in got)
            step = draft + verify
            print(f"batch {b}: depth {d} top-{k} {n} nodes: plain {plain:.2f} ms, draft {draft:.2f} ms (c "
                  f"{draft / plain:.3f}), verify {verify:.2f} ms (r {verify / plain:.3f}); projected "
                  f"{share * plain / step:.2f}x ShareGPT, {human * plain / step:.2f}x HumanEval")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(device=torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                           model=args.model, torch=torch.__version__, rows=rows,
                           trees={f"{d},{k},{n}": v for (d, k, n), v in TREES.items()}), f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
