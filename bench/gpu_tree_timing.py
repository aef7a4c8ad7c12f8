"""Where a speculative step's time goes on a GPU, without the model file: the default model's shape with dummy
weights and random-weight heads (acceptance ~0, so tokens per pass ~1; the draft and verify milliseconds per
speculating step are what this measures), bf16, batch 1, against plain decoding in the same process.

    python bench/gpu_tree_timing.py [OUT_JSON]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "spec_decode"))
from test_tree_gpu import _random_head  # noqa: E402

from roofline import LLM, SamplingParams  # noqa: E402

KW = dict(model="smollm2-135m", load_format="dummy", device="cuda", dtype="bfloat16", max_model_len=1024,
          kv_cache_memory="2GiB", attention_backend="triton", max_num_seqs=8)
CONFIGS = [None,
           {"method": "eagle", "num_speculative_tokens": 3, "adaptive": False},
           {"method": "eagle", "num_speculative_tokens": 1, "tree_topk": 3, "tree_budget": 3, "adaptive": False},
           {"method": "eagle", "num_speculative_tokens": 4, "tree_topk": 4, "tree_budget": 16, "adaptive": False},
           {"method": "medusa", "num_speculative_tokens": 3, "tree_topk": 3, "tree_budget": 10, "adaptive": False}]


def main() -> None:
    prompts = [{"prompt_token_ids": list(range(100 + 7 * i, 400 + 9 * i))} for i in range(4)]
    sp = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
    rows, ref, heads = [], None, {}
    with tempfile.TemporaryDirectory() as d:
        for spec in CONFIGS:
            if spec is not None:
                spec = {**spec, "model": heads[spec["method"]]}
            llm = LLM(speculative_config=spec, **KW)
            if spec is None:
                mc = llm.engine.worker.model_config
                heads.update({m: _random_head(Path(d), m, mc) for m in ("eagle", "medusa")})
            for p in prompts:  # warm every prompt (compiles, graphs), then time each alone: batch 1
                llm.generate([p], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)
            before = llm.engine.spec_stats.copy() if spec is not None else None
            torch.cuda.synchronize()
            t0, outs = time.perf_counter(), []
            for p in prompts:
                outs.append(llm.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids)
            dt = time.perf_counter() - t0
            n = sum(len(o) for o in outs)
            row = dict(config=spec and {k: v for k, v in spec.items() if k != "model"}, tok_s=n / dt,
                       ms_per_token=1e3 * dt / n)
            if spec is None:
                ref = outs
            else:
                st = llm.engine.spec_stats.since(before)
                row.update(identical=sum(a == b for a, b in zip(outs, ref, strict=True)),
                           draft_ms_per_step=st.draft_ms_per_step, verify_ms_per_step=st.verify_ms_per_step,
                           tokens_per_pass=st.mean_acceptance_length, steps=st.num_drafts)
            rows.append(row)
            print(json.dumps(row), flush=True)
            del llm
            torch.cuda.empty_cache()
    out = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows)
    if len(sys.argv) > 1:
        Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
