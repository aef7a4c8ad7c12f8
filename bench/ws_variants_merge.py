"""Merge ``bench/gpu_ws_variants.py``'s timings into a dispatch table: per format (int8, int4), projection and M,
the fastest ws variant becomes the ``tiled`` row where it beat the table's kernel by more than ``--margin``, and
(int4) dequantize + cuBLAS too; INT4's ``fused_max_m`` then reaches the largest probed M up to which our kernel
beat dequantize + cuBLAS at every probed M. Runs on the CPU (no GPU needed): the table is then committed and timed
end to end by ``bench decode``.

Usage: python bench/ws_variants_merge.py VARIANTS.json TABLE.json [--margin 0.02] [--dry-run]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

_NAME = re.compile(r"^ws (\d+)x(\d+)x(\d+) s(\d+) (ld|nold) cvt(\d+)(?: pf1)?$")  # pf1: 2026-12-07's rows


def config_of(path: str) -> dict:
    """The table config of a variant's name ("ws 256x128x64 s3 nold cvt4"): ws 1 with the loader warp, 2 without.
    Rows of 8 converter warps are never merged (GemmConfig has no such field: they lost everywhere)."""
    bm, bn, bk, st, ld, cvt = _NAME.match(path).groups()
    cfg = dict(block_m=int(bm), block_n=int(bn), block_k=int(bk), num_warps=4 if bm == "64" else 8,
               num_stages=int(st), unpack=0, gemv=False, swap_ab=False, ws=1 if ld == "ld" else 2)
    return cfg


def merge(rows: list[dict], table: dict, margin: float) -> list[str]:
    """Apply ``rows`` to ``table`` in place; returns one line per change."""
    log = []
    by = {}
    for r in rows:
        if "us" in r:
            by.setdefault((r["fmt"], r["n"], r["k"], r["m"]), []).append(r)
    for fmt in sorted({k[0] for k in by}):
        for n, k in sorted({(kk[1], kk[2]) for kk in by if kk[0] == fmt}):
            ms = sorted(kk[3] for kk in by if kk[:3] == (fmt, n, k))
            ours_won = []
            for m in ms:
                rs = by[(fmt, n, k, m)]
                ws = min((r for r in rs if _NAME.match(r["path"]) and " cvt4" in r["path"]),
                         key=lambda r: r["us"], default=None)
                cur = next((r for r in rs if r["path"] == "table"), None)
                deq = next((r for r in rs if r["path"] == "dequant"), None)
                if ws is None:
                    ours_won.append(False)
                    continue
                beats_table = cur is None or ws["us"] < cur["us"] * (1 - margin)
                ours_won.append(deq is None or ws["us"] < deq["us"] or (cur is not None and cur["us"] < deq["us"]))
                if beats_table and (deq is None or ws["us"] < deq["us"]):
                    tiled = table.setdefault("tiled", {}).setdefault(fmt, [])
                    tiled[:] = [t for t in tiled if (t["n"], t["k"], t["m"]) != (n, k, m)]
                    tiled.append(dict(n=n, k=k, m=m, config=config_of(ws["path"]), us=ws["us"]))
                    tiled.sort(key=lambda t: (t["n"], t["k"], t["m"]))
                    log.append(f"{fmt} n={n} k={k} M={m}: {ws['path']} {ws['us']:.1f} us (table "
                               f"{cur['us'] if cur else float('nan'):.1f}"
                               + (f", dequant {deq['us']:.1f}" if deq else "") + ")")
            if fmt == "int4":  # dequantize + cuBLAS above the run of probed M that our kernels won
                run = 0
                for m, won in zip(ms, ours_won, strict=True):
                    if not won:
                        break
                    run = m
                for t in table["fused_max_m"]["int4"]:
                    if (t["n"], t["k"]) == (n, k) and run > t["fused_max_m"]:
                        log.append(f"int4 n={n} k={k}: fused_max_m {t['fused_max_m']} -> {run}")
                        t["fused_max_m"] = run
    return log


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("variants")
    ap.add_argument("table")
    ap.add_argument("--margin", type=float, default=0.02)
    ap.add_argument("--dry-run", action="store_true")
    args = ap.parse_args()
    rows = json.loads(Path(args.variants).read_text())["rows"]
    table = json.loads(Path(args.table).read_text())
    for line in merge(rows, table, args.margin):
        print(line)
    if not args.dry_run:
        Path(args.table).write_text(json.dumps(table, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
