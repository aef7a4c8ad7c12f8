"""One split-KV decode launch each for bf16, fp8 (codes -> fp16) and int8 at batch 8 x 32k, for ncu.

Usage (device): ncu -k regex:_split -c 3 --metrics ... python3 bench/gpu_decode_quant_profile.py
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_decode_quant_variants import decode  # noqa: E402

batch, ctx, heads, hkv, d, bs = 8, 32768, 32, 8, 128, 64
nb = ctx // bs
tables = torch.randperm(batch * nb, device="cuda").to(torch.int32).view(batch, nb)
seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
kf = torch.randn(batch * nb, bs, hkv, d, device="cuda", dtype=torch.bfloat16)
vf = torch.randn_like(kf)
ones = torch.ones(hkv, device="cuda")
k8 = kf.clamp(-4, 4).mul(30).to(torch.int8)
s8 = torch.full(kf.shape[:3], 1 / 30, device="cuda")
out = torch.empty_like(q)
sc = 1 / math.sqrt(d)
decode(q, kf, vf, None, None, tables, seq_lens, sc, 0, 0, 64, 4, 2, out)
decode(q, kf.to(torch.float8_e4m3fn), vf.to(torch.float8_e4m3fn), ones, ones, tables, seq_lens, sc, 2, 1, 64, 4, 2, out)
decode(q, k8, k8, s8, s8, tables, seq_lens, sc, 1, 0, 64, 4, 2, out)
torch.cuda.synchronize()
