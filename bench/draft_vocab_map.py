"""Give the shipped EAGLE head a truncated draft vocabulary for a CPU measurement (issue 30): the K most frequent
tokens of 3,000 ShareGPT answers (the file's last ones; not the target's own answers, which `train-draft
--draft-vocab-size` counts), written to /tmp/eagle3/eagle-v<K>. Usage: python bench/draft_vocab_map.py 8192"""
import dataclasses
import sys

import torch

from roofline.bench.datasets import load_sharegpt_conversations
from roofline.bench.serve import load_tokenizer
from roofline.spec_decode.heads import load_head, save_head
from roofline.spec_decode.train import token_map_from

k = int(sys.argv[1])
tok = load_tokenizer(None)
cfg, t = load_head("roofline/spec_decode/heads/smollm2-135m-eagle", "eagle")
pairs = list(load_sharegpt_conversations())[-3000:]
seqs = [(tok(g).input_ids[:256], 0) for _, g in pairs]
t["token_map"] = token_map_from(seqs, k, cfg.vocab_size)
save_head(f"/tmp/eagle3/eagle-v{k}", dataclasses.replace(cfg, draft_vocab_size=k), t, torch.float16)
print("ok", k)
