"""GPU check: greedy generation on the default model, Triton backend vs the pure-torch backend.

Runs each variant in its own process (the kernel dispatch is chosen once per process), 8 prompts x 32 new
tokens, greedy, ignore_eos, and compares token ids:
    torch-eager   disable_triton_kernels, attention_backend=torch, no CUDA graphs (pure torch)
    torch-graph   the same with CUDA graphs requested: the torch backend cannot be captured, so it runs eager
    triton-eager  Triton attention + fused kernels, no CUDA graphs
    triton-graph  Triton attention + fused kernels, decode replayed from CUDA graphs
Usage: python bench/gpu_engine_parity.py MODEL.gguf OUT_DIR [--dtype bfloat16]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The three primary colors are",
    "Translate to French: Good morning, how are you?",
    "List three uses of copper:",
    "In 1969, the first humans",
]

VARIANTS = {
    "torch-eager": dict(env={}, backend="torch", eager=True, no_kernels=True),
    "torch-graph": dict(env={}, backend="torch", eager=False, no_kernels=True),
    "triton-eager": dict(env={}, backend="triton", eager=True, no_kernels=False),
    "triton-graph": dict(env={}, backend="triton", eager=False, no_kernels=False),
}


def run_variant(model: str, name: str, dtype: str) -> dict:
    import torch

    from roofline import LLM, SamplingParams

    v = VARIANTS[name]
    llm = LLM(model, dtype=dtype, attention_backend=v["backend"], enforce_eager=v["eager"], max_model_len=1024,
              gpu_memory_utilization=0.3, disable_triton_kernels=v["no_kernels"])
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    # Batch of one as well: the same prompt alone must give the same tokens.
    alone = llm.generate(PROMPTS[:1], params, use_tqdm=False)[0].outputs[0].token_ids
    return dict(variant=name, dtype=dtype, device=torch.cuda.get_device_name(),
                tokens=[o.outputs[0].token_ids for o in outs], texts=[o.outputs[0].text for o in outs],
                alone_first=alone, graphs=llm.engine.worker.graphs is not None)


def main() -> int:
    if len(sys.argv) >= 4 and sys.argv[1] == "--variant":
        name, model, dtype = sys.argv[2], sys.argv[3], sys.argv[4]
        print("RESULT " + json.dumps(run_variant(model, name, dtype)))
        return 0
    model, out_dir = sys.argv[1], sys.argv[2]
    dtype = sys.argv[sys.argv.index("--dtype") + 1] if "--dtype" in sys.argv else "bfloat16"
    results = {}
    for name, v in VARIANTS.items():
        env = dict(os.environ, **v["env"])
        proc = subprocess.run([sys.executable, __file__, "--variant", name, model, dtype], env=env,
                              capture_output=True, text=True, timeout=400)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            print(f"{name}: FAILED rc={proc.returncode}\n{proc.stderr[-3000:]}")
            continue
        results[name] = json.loads(line[len("RESULT "):])
    ref = results.get("torch-eager")
    summary = {}
    for name, r in results.items():
        if ref is None:
            break
        same = [a == b for a, b in zip(r["tokens"], ref["tokens"], strict=True)]
        first_diff = []
        for a, b in zip(r["tokens"], ref["tokens"], strict=True):
            first_diff.append(next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None))
        summary[name] = dict(identical_prompts=sum(same), of=len(same), first_divergence=first_diff,
                             alone_equals_batched=r["alone_first"] == r["tokens"][0])
        print(f"{name:>13}: {sum(same)}/{len(same)} prompts token-identical to torch-eager; "
              f"first divergence per prompt {first_diff}; alone==batched {summary[name]['alone_equals_batched']}")
    if ref is not None:
        for p, t in zip(PROMPTS, ref["texts"], strict=True):
            print(f"  {p!r} -> {t[:60]!r}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"gpu-engine-parity-{dtype}.json"), "w") as f:
        json.dump(dict(summary=summary, results=results), f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
