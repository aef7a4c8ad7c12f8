"""Issue 30: does EAGLE-3's low / mid-level feature fusion raise the EAGLE head's agreement with the target?

An A/B on the CPU at equal optimizer steps, the same data, batches and seed: the shipped EAGLE-1 head
(``roofline/spec_decode/heads/smollm2-135m-eagle``, trained on an H100) fine-tuned further

- ``eagle1``: on the final normed features alone (as shipped);
- ``fuse-2-15``: with the residual streams entering layers 2 and 15 fused in (``heads.fuse_features``; the fusing
  weight starts at zero, so the head starts where ``eagle1`` does);
- ``fuse-2-15-27``: with layers 2, 15 and 27 (vLLM's EAGLE-3 choice for 30 layers: 2, L // 2, L - 3);

plus ``shipped`` (one step at lr 1e-12: the starting point on the same held-out rows). Each head is saved under
``OUT/heads/NAME`` (fp16, the shipped head's draft vocabulary) for ``roofline bench spec``. Reports the held-out
top-1 agreement of the first draft step (``val_top1``) and of a second step on the head's own features
(``val_top1_step2``), the proxies for depth-1 and depth-2 acceptance (``roofline.spec_decode.train``).

    python bench/eagle_fusion_probe.py --num-prompts 600 --max-tokens 128 --steps 400 --out /tmp/fusion
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import time
from dataclasses import replace

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--variants", default="shipped,eagle1,fuse-2-15,fuse-2-15-27")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_num_threads(os.cpu_count() or 1)

    from roofline.llm import LLM
    from roofline.spec_decode.features import batched_target_features
    from roofline.spec_decode.heads import bundled_head, load_head, save_head
    from roofline.spec_decode.train import regenerate, train_head, train_prompts

    aux = (2, 15, 27)
    llm = LLM(None, device="cpu", dtype="float32", max_model_len=256 + args.max_tokens + 16,
              enable_prefix_caching=False, kv_cache_memory="2GiB", max_num_batched_tokens=1024)
    mc = llm.engine.worker.model_config
    data = os.path.join(args.out, f"data-{args.num_prompts}-{args.max_tokens}.pt")
    t0 = time.perf_counter()
    if os.path.isfile(data):
        seqs, feats = torch.load(data)
    else:
        prompts = train_prompts(llm.tokenizer, args.num_prompts, seed=11)  # not the shipped head's seed-1 set
        seqs = regenerate(llm, prompts, args.max_tokens, max_seconds=None)
        t1 = time.perf_counter()
        feats = batched_target_features(llm, seqs, progress=True, aux_layers=aux)
        print(f"regenerated {len(seqs)} in {t1 - t0:.0f} s, features in {time.perf_counter() - t1:.0f} s", flush=True)
        torch.save((seqs, feats), data)
    h = mc.hidden_size
    _, init = load_head(bundled_head("eagle", mc), "eagle")
    results = {}
    for name in args.variants.split(","):
        layers = () if name in ("shipped", "eagle1") else tuple(int(x) for x in name.split("-")[1:])
        width = h * (1 + len(layers))
        use = [f[:, :width] if not layers or layers == aux[:len(layers)] else None for f in feats]
        assert all(u is not None for u in use), f"{name}: layers must be a prefix of {aux}"
        t = time.perf_counter()
        steps, lr = (1, 1e-12) if name == "shipped" else (args.steps, args.lr)
        cfg, tensors, losses, stats = train_head(llm, "eagle", seqs, use, steps=steps, batch_size=args.batch_size,
                                                 lr=lr, seed=0, cls_weight=1.0, aux_layers=layers, init=init,
                                                 progress=False)
        # the shipped head's truncated draft vocabulary, so the engine A/B differs in the training alone
        tensors["token_map"] = init["token_map"]
        save_head(os.path.join(args.out, "heads", name), replace(cfg, draft_vocab_size=len(init["token_map"]),
                                                                 training=dict(stats, probe=vars(args))),
                  tensors, torch.float16)
        stats.update(name=name, aux_layers=list(layers), first_loss=losses[0], last_loss=losses[-1],
                     wall_s=time.perf_counter() - t)
        results[name] = stats
        print(f"{name:14s} steps {stats['steps']:4d}  val_top1 {stats['val_top1']:.4f}  val_top1_step2 "
              f"{stats['val_top1_step2']:.4f}  loss {losses[0]:.3f} -> {losses[-1]:.3f}  ({stats['wall_s']:.0f} s, "
              f"{stats['val_rows']} held-out rows)", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    meta = dict(cpu=platform.processor() or open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0],
                torch=torch.__version__, commit=commit, args=vars(args),
                sequences=len(seqs), tokens=sum(len(i) for i, _ in seqs))
    with open(os.path.join(args.out, "fusion.json"), "w") as f:
        json.dump(dict(meta=meta, results=results), f, indent=1)


if __name__ == "__main__":
    main()
