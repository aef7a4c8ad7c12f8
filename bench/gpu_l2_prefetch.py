"""Does ``roofline.kernels.l2_prefetch`` put a weight into L2 ahead of the GEMV that reads it? (issue 28)

For each weight size: flush L2 (write a 512 MB buffer), optionally launch the prefetch (bulk or per line), let
the GPU spin for ``--gap-us`` (long enough that the host has queued the GEMV before the GPU reaches it: at 10 us
the events timed the host's launch), then time only the GEMV with CUDA events. Prints the GEMV's time cold,
after each prefetch, and with the weight left hot in L2 by a previous GEMV, and the fraction of the cold-to-hot
gap each prefetch closed. Run on the GPU: ``python bench/gpu_l2_prefetch.py``.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch

from roofline.kernels import l2_prefetch
from roofline.kernels.quant_gemm import dense_gemv


def _cycles(us: float) -> int:
    return int(us * torch.cuda.get_device_properties(0).clock_rate / 1e3)  # clock_rate in kHz


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="4096x1024,4096x4096,6144x4096,8192x4096,14336x4096")
    ap.add_argument("--gap-us", type=float, default=200.0)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    dev = torch.device("cuda")
    flush = torch.empty(512 * 2**20, dtype=torch.uint8, device=dev)
    rows = []
    for spec in args.sizes.split(","):
        n, k = (int(v) for v in spec.split("x"))
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16)
        x = torch.randn(1, k, device=dev, dtype=torch.bfloat16)
        ref = (x.float() @ w.float().T)
        out = dense_gemv(x, w)
        err = (out.float() - ref).abs().max().item()
        times = {}
        for mode in ("cold", "bulk", "line", "hot"):
            ts = []
            for _ in range(args.reps):
                flush.add_(1)
                if mode in ("bulk", "line"):
                    l2_prefetch.KIND = mode
                    l2_prefetch.prefetch(w, max_bytes=w.numel() * 2)
                if mode == "hot":
                    dense_gemv(x, w)
                torch.cuda._sleep(_cycles(args.gap_us))
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                dense_gemv(x, w)
                b.record()
                torch.cuda.synchronize()
                ts.append(a.elapsed_time(b) * 1e3)
            times[mode] = statistics.median(ts)
        closed = {m: (times["cold"] - times[m]) / max(times["cold"] - times["hot"], 1e-9) for m in ("bulk", "line")}
        mb = w.numel() * 2 / 2**20
        rows.append({"n": n, "k": k, "mb": mb, **{f"{m}_us": v for m, v in times.items()}, "closed": closed,
                     "max_abs_err": err})
        print(f"{n}x{k} ({mb:.1f} MB): cold {times['cold']:.1f} us, bulk-prefetched {times['bulk']:.1f}, "
              f"line-prefetched {times['line']:.1f}, hot {times['hot']:.1f}; closed {closed['bulk']:.2f} / "
              f"{closed['line']:.2f} of the gap (GEMV max err {err:.2e})", flush=True)
    if args.out:
        json.dump({"device": torch.cuda.get_device_name(), "gap_us": args.gap_us, "rows": rows},
                  open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
