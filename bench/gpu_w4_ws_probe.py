"""INT4 (g128) at M = 128 / 256 through the warp-specialized Gluon GEMM (``ws_gemm.w4a16_ws_gemm``: the converter
partition dequantizes each code tile into shared memory) against the two paths the dispatch table chooses between
there today, bf16 cuBLAS as the yardstick; timed as ``gpu_quant_sweep.Sweep.time_us`` does (CUDA graph, L2
flushed), every candidate checked against float64 first.

- "dequant": ``dequantize_int4`` then ``F.linear`` (the path above the table's ``fused_max_m``);
- "table": our Triton INT4 kernel with the table's config for M (``kernel_config``);
- "ws": ``gpu_quant_sweep.WS_TILES`` (those the kernel runs for these shapes: ``ws_configs``).

Writes ``--out`` (rows in the sweep's format) and ``--table``: ``--merge-into``'s table where, per projection,
the run of probed M (ascending) on which one of our kernels (ws or the Triton INT4) beat dequantize + cuBLAS gets
that kernel's config as its ``tiled`` int4 rows, and ``fused_max_m`` becomes the run's last M (dequantize + cuBLAS
above it; no run: capped below the smallest probed M). The ws kernel dequantizes in packed 16-bit math (its
default); ``--fp32`` also times the fp32 form of the same tiles ("ws_fp32", not merged).

Usage (GPU, repo root): python bench/gpu_w4_ws_probe.py --out OUT.json --merge-into TABLE --table NEW_TABLE
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))


def main() -> int:
    import torch
    import torch.nn.functional as F
    from gpu_quant_sweep import SHAPES, TOL, Sweep, ws_configs

    from roofline.kernels import quant_gemm as qg
    from roofline.kernels import ws_gemm
    from roofline.kernels.dequant import dequantize_int4
    from roofline.kernels.linear_dispatch import kernel_config
    from roofline.kernels.quant_layouts import prepare_int4
    from roofline.quant.quantize import quantize_int4_rtn

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--merge-into", required=True)
    ap.add_argument("--table", required=True)
    ap.add_argument("--ms", default="128,256")
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--fp32", action="store_true", help="also time the ws kernel's fp32 INT4 dequantization")
    args = ap.parse_args()
    args.dry_run = False
    sw = Sweep(args)
    table = json.loads(Path(args.merge_into).read_text())
    g = args.group_size
    ms = [int(m) for m in args.ms.split(",")]
    rows, dev = [], torch.device("cuda")
    counters = torch.zeros(1 << 14, dtype=torch.int32, device=dev)  # split-K arrivals, left zeroed by the kernel
    for shape, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        cw = quantize_int4_rtn(w, g)
        p = prepare_int4(cw, torch.bfloat16)
        dense = w.to(torch.bfloat16)
        gi = torch.arange(k, device="cuda") // g
        ref_w = (cw.q.double() - cw.zeros.double()[:, gi]) * p.scales.t().double()[:, gi]
        won = {}
        for m in ms:
            x = (torch.randn(m, k, device="cuda") * 0.5).to(torch.bfloat16)
            ref = x.double() @ ref_w.t()
            cands = [("bf16", None, lambda: F.linear(x, dense)),
                     ("dequant", None, lambda: F.linear(x, dequantize_int4(p.qweight, p.scales, p.zeros, g,
                                                                            torch.bfloat16)))]
            cur = kernel_config("int4", m, n, k, dev)
            cands.append(("table", cur, lambda cfg=cur: qg.w4a16_gemm(x, p.qweight, p.scales, p.zeros, g, config=cfg)))
            for cfg in ws_configs(x, p.qweight, g):
                cands.append(("ws", cfg, lambda cfg=cfg: qg.w4a16_gemm(x, p.qweight, p.scales, p.zeros, g,
                                                                         config=cfg)))
                if args.fp32:  # the fp32 dequantization (the same bits; not selectable from the table)
                    cands.append(("ws_fp32", cfg, lambda cfg=cfg: ws_gemm.w4a16_ws_gemm(
                        x, p.qweight, p.scales, p.zeros, g, cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_stages,
                        counters=counters, loader=cfg.ws != 2, int4_packed=False)))
            for path, cfg, fn in cands:
                row = dict(shape=shape, n=n, k=k, m=m, fmt="int4", path=path,
                           config=None if cfg is None else {kk: v for kk, v in asdict(cfg).items() if v is not None})
                try:
                    if path != "bf16":
                        err = sw.rel(fn(), ref)
                        row["rel_err"] = err
                        if not err < TOL:
                            raise RuntimeError(f"rel err {err:.2e}")
                    row["us"] = sw.time_us(fn)
                except Exception as e:  # noqa: BLE001 - resources, compile: recorded, the probe goes on
                    row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
                rows.append(row)
            got = {path: min((r for r in rows if (r["shape"], r["m"], r["path"]) == (shape, m, path) and "us" in r),
                             key=lambda r: r["us"], default=None)
                   for path in ("bf16", "dequant", "table", "ws", "ws_fp32")}
            us = {path: (r["us"] if r else float("nan")) for path, r in got.items()}
            print(f"{shape:>8} M={m:<4} bf16 {us['bf16']:7.1f}  dequant {us['dequant']:7.1f}  table {us['table']:7.1f}"
                  f"  ws {us['ws']:7.1f} (fp32 {us['ws_fp32']:7.1f}) {got['ws'] and got['ws']['config']}", flush=True)
            ours = [r for r in (got["ws"], got["table"]) if r is not None]
            best = min(ours, key=lambda r: r["us"]) if ours else None
            won[m] = best if best and (got["dequant"] is None or best["us"] < got["dequant"]["us"]) else None
        # Our kernel up to the end of the run of probed M (ascending) where it beat dequantize + cuBLAS; dequantize
        # + cuBLAS above. Below the smallest probed M the table's value stands.
        run = []
        for m in ms:
            if won[m] is None:
                break
            run.append(m)
        tiled = table.setdefault("tiled", {}).setdefault("int4", [])
        tiled[:] = [r for r in tiled if (r["n"], r["k"]) != (n, k) or r["m"] < min(ms)]
        tiled += [dict(n=n, k=k, m=m, config=won[m]["config"], us=won[m]["us"]) for m in run
                  if won[m]["config"] is not None]
        tiled.sort(key=lambda r: (r["n"], r["k"], r["m"]))
        for r in table["fused_max_m"]["int4"]:
            if (r["n"], r["k"]) == (n, k):
                r["fused_max_m"] = max(run) if run else min(r["fused_max_m"], min(ms) - 1)
        print(f"{shape:>8} -> our kernel at M = {run or 'none'} ({[won[m]['path'] for m in run]}), dequantize + "
              f"cuBLAS above", flush=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                              rows=rows), indent=1))
    Path(args.table).write_text(json.dumps(table, indent=1))
    for m in ms:
        for path in ("bf16", "dequant", "table", "ws", "ws_fp32"):
            tot = sum(min((r["us"] for r in rows if (r["shape"], r["m"], r["path"]) == (s, m, path) and "us" in r),
                          default=float("nan")) for s in SHAPES)
            print(f"[layer sum] M={m} {path}: {tot:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
