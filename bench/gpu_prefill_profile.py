"""One paged prefill-attention launch at 8k (bf16, 32/8 heads, D 128, GPU default block size) for ncu.

Usage (device): ncu --kernel-name regex:_prefill_kernel --launch-skip 1 --launch-count 1 \
    --metrics <list> python3 bench/gpu_prefill_profile.py
"""
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_prefill_sweep import inputs  # noqa: E402

from roofline.kernels.prefill_attention import paged_prefill_attention  # noqa: E402

q, kc, vc, meta = inputs(2, 8192, 32, 8, 128, 64)
out = torch.empty_like(q)
for _ in range(2):
    paged_prefill_attention(q, kc, vc, meta, 1 / math.sqrt(128), out=out)
torch.cuda.synchronize()
