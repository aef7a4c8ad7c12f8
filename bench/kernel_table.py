"""The decode kernel table of docs/kernels.md from committed H200 sweep JSONs (no GPU): per Llama-3-8B projection
and M, the time of the kernel the dispatch table picks for each weight format and its fraction of the read
bandwidth, counting the bytes actually read (codes, scales, zeros, and x in/out).

    python bench/kernel_table.py [--bw 4.3e12]

Sources: ``bench/results/decode-kernels-20261204/sweep-dense-int8-fp8wo.json`` (bf16, INT8 W8A16, FP8 W8A16 GEMV and
16-row tiles; cuBLAS and ``_scaled_mm`` W8A8 as "other") and ``bench/results/int4-mma-20261204/w4a16_mma-call2.json``
(INT4: the Gluon mma kernel and the Triton path). Measured M: 1, 4, 16, 64 for the first, 1, 4, 8, 16, 32, 64 for
INT4; the 16-row tiles serve M = 5-16, so their M = 16 time is also the M = 8 time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def weight_bytes(fmt: str, n: int, k: int) -> int:
    if fmt == "bf16":
        return 2 * n * k
    if fmt == "int4":
        return n * k // 2 + 2 * (k // 128) * n * 2  # codes + bf16 scales and zeros, group 128
    return n * k + 4 * n  # int8 / fp8 codes + fp32 channel scales


def best_8bit(rows: list[dict], fmt: str, shape: str, m: int) -> float | None:
    """The fastest of our kernels and the other path for ``fmt`` at (shape, m), as the dispatch picks it."""
    cands = [r["us"] for r in rows if r.get("fmt") == fmt and r.get("shape") == shape and r.get("m") == m
             and "us" in r and "error" not in r]
    return min(cands) if cands else None


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--bw", type=float, default=4.3e12, help="read bandwidth, bytes/s (bench decode measured 4.3-4.4)")
    args = ap.parse_args(argv)
    eight = json.loads((ROOT / "bench/results/decode-kernels-20261204/sweep-dense-int8-fp8wo.json").read_text())["rows"]
    four = json.loads((ROOT / "bench/results/int4-mma-20261204/w4a16_mma-call2.json").read_text())["best"]
    print("| format | M | " + " | ".join(f"{s} us (of BW)" for s in SHAPES) + " |")
    print("|---|---:|" + "---:|" * len(SHAPES))
    for fmt, label in (("dense", "bf16"), ("int8", "int8 W8A16"), ("fp8_w8a16", "fp8 (W8A16 <= 16, W8A8 above)"),
                       ("int4", "int4 g128")):
        for m in (1, 8, 64):
            cells = []
            for shape, (n, k) in SHAPES.items():
                if fmt == "int4":
                    row = next((b for b in four if b["shape"] == shape and b["m"] == m), None)
                    us = None if row is None else min(row["us"], row["triton_us"])
                else:
                    us = best_8bit(eight, fmt, shape, 16 if m == 8 else m)
                if us is None:
                    cells.append("-")
                    continue
                byts = weight_bytes("bf16" if fmt == "dense" else fmt, n, k) + 2 * m * (n + k)
                cells.append(f"{us:.1f} ({byts / (us * 1e-6) / args.bw:.2f})")
            print(f"| {label} | {m} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
