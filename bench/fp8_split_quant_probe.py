"""Issue 29: a fast two-term E4M3 quantizer for the FP8 prefill kernel's q (``per_token_quant_fp8_split``), on a GPU.

Until 2026-12-07 the quantizer computed lo = e4m3(x / scale - hi) in torch (five fp32 passes: 2.0 ms of the 2.7 ms
it took at 32k tokens x 32 heads x 128 on an H100); a fused Triton kernel doing the same in registers took 0.18 ms
but stored NaN codes in lo. This probe runs candidate kernels
on the same rows, counts their codes that differ from the torch twin (``ref_per_token_quant_fp8_split``), shows
the first mismatches, and times each (CUDA events, median of 20):

    bits   act_quant.SPLIT_LO = "bits" (the default): fused, hi read back from its bits (no fp8 -> f32 cast)
    A      fused, as the kernel that failed: lo = (y - hi.to(f32)).to(e4m3)
The committed logs (bench/results/fp8-prefill-h100-20261207b/quantizer/) also have two candidates since dropped:
an inline-PTX cvt.rn.satfinite.e4m3x2.f32 kernel ("ptx", bit-exact, 0.26-0.32 ms) and lo alone with hi read back
from memory ("D", right up to the sign of zero as "bits" was before the twin's clamp, 0.86 ms).

Usage (a GPU machine): python bench/fp8_split_quant_probe.py [--rows 1048576] [--k 128]
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from roofline.kernels import act_quant


@triton.jit
def _split_kernel(X, Hi, Lo, S, M, stride_x, K: tl.constexpr, ROWS: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, K)
    rmask = rows < M
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=rmask[:, None], other=0.0).to(tl.float32)
    scale = tl.maximum(tl.div_rn(tl.max(tl.abs(x), axis=1), 448.0), 1e-10)
    y = tl.div_rn(x, tl.zeros(x.shape, tl.float32) + scale[:, None])
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    offs = rows[:, None] * K + cols[None, :]
    hi = y.to(tl.float8e4nv)
    lo = (y - hi.to(tl.float32)).to(tl.float8e4nv)
    tl.store(Hi + offs, hi, mask=rmask[:, None])
    tl.store(Lo + offs, lo, mask=rmask[:, None])
    tl.store(S + rows, scale, mask=rmask)


def run(x2: torch.Tensor, mode: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    m, k = x2.shape
    rows = 16
    hi = torch.empty((m, k), dtype=torch.float8_e4m3fn, device=x2.device)
    lo = torch.empty_like(hi)
    scale = torch.empty((m, 1), dtype=torch.float32, device=x2.device)
    if mode in ("torch", "bits"):
        act_quant.SPLIT_LO = mode
        return act_quant.per_token_quant_fp8_split(x2)
    if mode == "one-term":
        h, s = act_quant.per_token_quant_fp8(x2)
        return h, h, s
    _split_kernel[(triton.cdiv(m, rows),)](x2, hi, lo, scale, m, x2.stride(0), K=k, ROWS=rows, num_warps=4)
    return hi, lo, scale


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=32768 * 32)
    ap.add_argument("--k", type=int, default=128)
    args = ap.parse_args()
    torch.manual_seed(0)
    x = torch.randn(args.rows, args.k, device="cuda", dtype=torch.bfloat16) * 3
    x[::97] *= 40  # rows of another magnitude
    x[5, 7] = 0.0
    want_hi, want_lo, want_s = act_quant.ref_per_token_quant_fp8_split(x)
    print(f"rows {args.rows} x {args.k} bf16, {torch.cuda.get_device_name()}, triton {triton.__version__}")
    print(f"{'mode':9s} {'hi diff':>9s} {'lo diff':>9s} {'lo NaN':>8s} {'scale diff':>10s} {'median ms':>10s}")
    for mode in ("torch", "one-term", "bits", "A"):
        try:
            hi, lo, s = run(x, mode)
            torch.cuda.synchronize()
        except Exception as e:  # a variant that does not build is a finding, not a stop
            print(f"{mode:9s} FAILED: {type(e).__name__}: {str(e)[:300]}")
            continue
        hi_d = int((hi.view(torch.uint8) != want_hi.view(torch.uint8)).sum())
        lo_d = int((lo.view(torch.uint8) != want_lo.view(torch.uint8)).sum())
        lo_nan = int(lo.float().isnan().sum())
        s_d = int((s.view(-1) != want_s.view(-1)).sum())
        times = []
        for _ in range(20):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run(x, mode)
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        print(f"{mode:9s} {hi_d:9d} {lo_d:9d} {lo_nan:8d} {s_d:10d} {statistics.median(times):10.3f}")
        if lo_d and mode != "one-term":
            bad = (lo.view(torch.uint8) != want_lo.view(torch.uint8)).nonzero()[:6]
            for r, c in bad.tolist():
                y = float(x[r, c].float() / want_s[r, 0])
                print(f"    [{r},{c}] x {float(x[r, c]):+.6g} y {y:+.6g} hi {float(want_hi[r, c].float()):+g} "
                      f"lo got {float(lo[r, c].float()):+g} (0x{int(lo.view(torch.uint8)[r, c]):02x}) want "
                      f"{float(want_lo[r, c].float()):+g} (0x{int(want_lo.view(torch.uint8)[r, c]):02x})")


if __name__ == "__main__":
    main()
