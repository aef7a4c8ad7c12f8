"""Batch-1 decode lead: how fast do the library paths stream a bf16 weight at M = 1?

For each llama-3-8b projection, times F.linear(x, W) (what the engine calls), torch.mv(W, x),
W @ x^T, and x @ W^T with W pre-transposed (a column-major copy), with CUDA graphs off, median of
triton.testing.do_bench. Reports bytes/s over the weight read against a 4 GiB read measured in the same
process. Usage: python bench/gpu_gemv_variants.py OUT_DIR
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}


def main() -> int:
    out_dir = sys.argv[1]
    buf = torch.ones(2**30, dtype=torch.float32, device="cuda")
    read = 4 * 2**30 / (do_bench(buf.sum, return_mode="median") / 1e3)
    del buf
    rows = []
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        wt = w.t().contiguous()  # [k, n]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        variants = {
            "F.linear": lambda x=x, w=w: F.linear(x, w),
            "torch.mv": lambda x=x, w=w: torch.mv(w, x[0]),
            "W@x^T": lambda x=x, w=w: w @ x.t(),
            "x@Wt (col-major copy)": lambda x=x, wt=wt: x @ wt,
        }
        ref = F.linear(x, w).float()
        for vname, fn in variants.items():
            out = fn().float().reshape(ref.shape)
            err = ((out - ref).norm() / ref.norm()).item()
            ms = do_bench(fn, return_mode="median")
            bps = n * k * 2 / (ms / 1e3)
            rows.append(dict(proj=name, variant=vname, ms=ms, bytes_per_s=bps, frac_of_read=bps / read, rel_err=err))
            print(f"{name:>8} {vname:>22} {ms * 1e3:8.1f} us {bps / 1e12:6.2f} TB/s {bps / read:6.3f} of read  err {err:.1e}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "gemv-variants-h200.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__, read_bytes_per_s=read, rows=rows), f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
