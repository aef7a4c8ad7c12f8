"""INT8 W8A16 at M = 128 / 256 with 128-row swap-AB tiles (one program converts each weight tile once for all rows)
against the table's tiled row and bf16 cuBLAS, timed as ``gpu_quant_sweep.Sweep.time_us`` does (in a CUDA graph,
L2 flushed). Writes ``--out`` JSON rows in the sweep's format and ``--table``: ``--merge-into``'s table with the
``tiled`` int8 rows at these M replaced where a probed tile won (each checked against float64 first).

Usage (GPU, repo root): python bench/gpu_w8_swap_probe.py --out OUT.json --merge-into TABLE --table NEW_TABLE
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

TILES = [(128, 64, 128, 4, 3), (128, 64, 64, 4, 4), (128, 128, 64, 8, 3), (128, 128, 128, 8, 2), (128, 64, 128, 8, 3)]
# Unswapped tiles (x as wgmma's A from shared memory, the converted codes staged to shared memory as B), 128 rows of
# x a program: does the shared-memory B path beat the register-A swap at M = 128 / 256 (`--no-swap-tiles` omits)?
NOSWAP_TILES = [(128, 128, 64, 8, 3), (128, 256, 64, 8, 3), (128, 128, 128, 8, 3), (128, 128, 64, 4, 4)]


def main() -> int:
    import torch
    import torch.nn.functional as F
    from gpu_quant_sweep import SHAPES, TOL, Sweep, ws_configs

    from roofline.kernels import quant_gemm as qg
    from roofline.kernels.linear_dispatch import kernel_config
    from roofline.quant.quantize import quantize_int8_per_channel

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--merge-into", required=True)
    ap.add_argument("--table", required=True)
    ap.add_argument("--ms", default="128,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--no-swap-tiles", action="store_true", help="also time the unswapped NOSWAP_TILES")
    ap.add_argument("--ws", action="store_true", help="also time the warp-specialized Gluon GEMM (sweep's WS_TILES)")
    args = ap.parse_args()
    args.dry_run = False
    sw = Sweep(args)
    table = json.loads(Path(args.merge_into).read_text())
    rows, dev = [], torch.device("cuda")
    for shape, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        c8 = quantize_int8_per_channel(w)
        dense = w.to(torch.bfloat16)
        ref_w = c8.q.double() * c8.scales.double()[:, None]
        for m in map(int, args.ms.split(",")):
            x = (torch.randn(m, k, device="cuda") * 0.5).to(torch.bfloat16)
            ref = x.double() @ ref_w.t()
            cur = kernel_config("int8", m, n, k, dev)
            cands = [("bf16", None), ("table", cur)] + [("probe", qg.GemmConfig(*t, swap_ab=True)) for t in TILES]
            if args.no_swap_tiles:
                cands += [("probe", qg.GemmConfig(*t)) for t in NOSWAP_TILES]
            if args.ws:
                cands += [("ws", cfg) for cfg in ws_configs(x, c8.q)]
            for path, cfg in cands:
                fn = (lambda: F.linear(x, dense)) if path == "bf16" else (
                    lambda cfg=cfg: qg.w8a16_gemm(x, c8.q, c8.scales, config=cfg))
                row = dict(shape=shape, n=n, k=k, m=m, fmt="int8", path=path,
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
            got = [r for r in rows if (r["shape"], r["m"]) == (shape, m) and "us" in r]
            best = min((r for r in got if r["path"] != "bf16"), key=lambda r: r["us"])
            bf = next(r["us"] for r in got if r["path"] == "bf16")
            tab = next((r["us"] for r in got if r["path"] == "table"), None)
            print(f"{shape:>8} M={m:<4} bf16 {bf:7.1f}  table {tab:7.1f}  best {best['us']:7.1f} ({best['path']}) "
                  f"{best['config']}", flush=True)
            ws = [r for r in got if r["path"] == "ws"]
            if ws:
                w = min(ws, key=lambda r: r["us"])
                print(f"{'':>8} ws best {w['us']:7.1f} {w['config']}", flush=True)
            if best["path"] in ("probe", "ws"):
                tiled = table.setdefault("tiled", {}).setdefault("int8", [])
                tiled[:] = [r for r in tiled if (r["n"], r["k"], r["m"]) != (n, k, m)]
                tiled.append(dict(n=n, k=k, m=m, config=best["config"], us=best["us"]))
                tiled.sort(key=lambda r: (r["n"], r["k"], r["m"]))
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                              rows=rows), indent=1))
    Path(args.table).write_text(json.dumps(table, indent=1))
    for m in map(int, args.ms.split(",")):
        for path in ("bf16", "table"):
            tot = sum(r["us"] for r in rows if r["m"] == m and r["path"] == path and "us" in r)
            print(f"[layer sum] M={m} {path}: {tot:.0f} us")
        tot = sum(min(r["us"] for r in rows if (r["shape"], r["m"]) == (s, m) and r["path"] != "bf16" and "us" in r)
                  for s in SHAPES)
        print(f"[layer sum] M={m} best int8: {tot:.0f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
