"""Issue 30: EAGLE-1 head recipes compared on one data set, on a GPU.

``roofline train-draft --cache-dir DIR`` leaves the regenerated answers and their target features in
``DIR/data-*.pt``. This trains one head per recipe from that file, each for the same wall-clock time and from the
same seed, and prints (and writes to ``OUT/recipes.json``) each head's held-out top-1 agreement of the first draft
step and of a second step that reads the head's own predicted features (``train_head``'s ``val_top1_step2``).
Each head is written as ``OUT/NAME`` with the 8192-token draft vocabulary, as the shipped head is, so that
``roofline bench spec --speculative-configs '{"method": "eagle", "model": "OUT/NAME", ...}'`` measures its
acceptance.

    python bench/gpu_train_recipes.py --model /tmp/smol.gguf --cache /tmp/cache/data-....pt --seconds 120 \\
        --out $OUT/recipes base='{}' noise='{"feature_noise": 0.1}' cls1='{"cls_weight": 1.0}'

A recipe is ``NAME=JSON`` with any of ``cls_weight``, ``unroll``, ``feature_noise``, ``lr``, ``batch_size`` and
``aux_layers``. A cache written with ``--aux-layers`` (``data-...-aux2_15.pt``: each sequence's features [T, (1 + n) H],
the final ones first) serves both kinds of recipe: one whose ``aux_layers`` names the cache's layers trains EAGLE-3's
feature fusion on all of them, one without trains on the final features alone, so the two differ in nothing else.
Only the columns a recipe reads are moved to the GPU (the cache is read memory-mapped).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from dataclasses import replace

import torch

from roofline.llm import LLM
from roofline.spec_decode import train
from roofline.spec_decode.heads import save_head

KEYS = {"cls_weight", "unroll", "feature_noise", "lr", "batch_size", "aux_layers"}


def cache_aux_layers(path: str) -> tuple[int, ...]:
    """The fused layers a ``train-draft --cache-dir`` file holds, from its name's ``-auxA_B`` tag (() if none)."""
    m = re.search(r"-aux(\d+(?:_\d+)*)\.pt$", path)
    return tuple(int(x) for x in m.group(1).split("_")) if m else ()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--cache", required=True, help="a train-draft --cache-dir data-*.pt file")
    ap.add_argument("--seconds", type=float, default=120.0, help="training time per recipe")
    ap.add_argument("--draft-vocab-size", type=int, default=8192)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", required=True)
    ap.add_argument("recipes", nargs="+", help="NAME=JSON")
    args = ap.parse_args()
    recipes = []
    for r in args.recipes:
        name, _, spec = r.partition("=")
        kw = json.loads(spec or "{}")
        if not name or set(kw) - KEYS:
            raise SystemExit(f"recipe {r!r}: want NAME=JSON with keys among {sorted(KEYS)}")
        if tuple(kw.get("aux_layers", ())) not in ((), cache_aux_layers(args.cache)):
            raise SystemExit(f"recipe {name}: aux_layers {kw['aux_layers']} but the cache holds "
                             f"{list(cache_aux_layers(args.cache))}")
        recipes.append((name, kw))
    llm = LLM(args.model, device=args.device, dtype="auto", enforce_eager=True, enable_prefix_caching=False,
              kv_cache_memory="1GiB", max_model_len=512)
    t0 = time.perf_counter()
    seqs, feats_cpu = torch.load(args.cache, map_location="cpu", mmap=True)
    hidden = llm.engine.worker.model_config.hidden_size
    print(f"{len(seqs)} sequences, {sum(len(s) for s, _ in seqs)} tokens from {args.cache} in "
          f"{time.perf_counter() - t0:.0f} s", flush=True)
    tmap = train.token_map_from(seqs, args.draft_vocab_size, llm.engine.worker.model_config.vocab_size)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for name, kw in recipes:
        kw = dict(kw)
        lr, bs = kw.pop("lr", 3e-4), kw.pop("batch_size", 32)
        aux = tuple(kw.pop("aux_layers", ()))
        width = hidden * (1 + len(aux))
        t1 = time.perf_counter()
        feats = [f[:, :width].to(args.device) for f in feats_cpu]
        print(f"recipe {name}: features [T, {width}] on {args.device} in {time.perf_counter() - t1:.0f} s", flush=True)
        cfg, tensors, losses, stats = train.train_head(llm, "eagle", seqs, feats, steps=1_000_000, batch_size=bs,
                                                       lr=lr, max_seconds=args.seconds, progress=False,
                                                       cls_rows=4096, aux_layers=aux, **kw)
        tensors["token_map"] = tmap
        del feats
        stats.update(recipe=name, lr=lr, batch_size=bs, first_loss=losses[0], last_loss=losses[-1],
                     num_sequences=len(seqs), aux_layers=list(aux), **kw)
        cfg = replace(cfg, draft_vocab_size=args.draft_vocab_size, training=stats)
        d = os.path.join(args.out, name)
        save_head(d, cfg, tensors, torch.float16)
        train.plot_losses(losses, os.path.join(d, "loss.png"), f"eagle recipe {name}")
        row = {k: stats[k] for k in ("recipe", "val_top1", "val_top1_step2", "steps", "seconds", "last_loss")}
        row.update(kw, lr=lr, aux_layers=list(aux))
        rows.append(row)
        print(json.dumps(row), flush=True)
    with open(os.path.join(args.out, "recipes.json"), "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
