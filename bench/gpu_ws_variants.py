"""The warp-specialized Gluon GEMM (``ws_gemm``) at M = 128 / 256 with more converter warps and 256-row tiles,
INT8 (per channel) and INT4 (g128), Llama-3-8B's four projections, against bf16 cuBLAS and the committed table's
kernel; timed as ``gpu_quant_sweep.Sweep.time_us`` does (CUDA graph, L2 flushed), each candidate checked against
float64 first (``TOL``).

Why: at stop 59 (H100) the ws kernel's time doubled from M = 128 to 256 (INT4 gate_up 115 -> 217 us, INT8 84 ->
152) while cuBLAS bf16 went 91 -> 103: each 128-row tile converts the whole weight again, and four converter warps
(one a scheduler) convert at ~5 codes a cycle an SM. Variants: ``cvt`` 8 converter warps; ``BM256`` one program
for 256 rows (two warpgroups, two m64 wgmma each a K step), so each weight tile is converted once.

Usage (GPU, repo root): python bench/gpu_ws_variants.py --out OUT.json [--ms 128,256] [--formats int8,int4]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# (block_m, block_n, block_k, stages, loader, cvt_warps). The converter's read-ahead (the "pf1" rows of
# bench/results/ws-variants-h100-20261207/, against "pf0" without it) is no longer optional.
VARIANTS = [
    (128, 128, 64, 4, True, 4), (128, 128, 64, 4, False, 8), (128, 256, 64, 3, False, 4),
    (256, 128, 64, 3, False, 4), (256, 128, 64, 4, False, 4),
]


def main() -> int:
    import torch
    import torch.nn.functional as F
    from gpu_quant_sweep import SHAPES, TOL, Sweep

    from roofline.kernels import quant_gemm as qg
    from roofline.kernels import ws_gemm
    from roofline.kernels.dequant import dequantize_int4
    from roofline.kernels.linear_dispatch import kernel_config
    from roofline.kernels.quant_layouts import prepare_int4
    from roofline.quant.quantize import quantize_int4_rtn

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="128,256")
    ap.add_argument("--formats", default="int8,int4")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    args.dry_run = False
    sw = Sweep(args)
    g = 128
    rows, dev = [], torch.device("cuda")
    counters = torch.zeros(1 << 14, dtype=torch.int32, device=dev)
    for fmt in args.formats.split(","):
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            gen = torch.Generator(device="cuda").manual_seed(n + k)
            w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
            dense = w.to(torch.bfloat16)
            if fmt == "int4":
                cw = quantize_int4_rtn(w, g)
                p = prepare_int4(cw, torch.bfloat16)
                gi = torch.arange(k, device="cuda") // g
                ref_w = (cw.q.double() - cw.zeros.double()[:, gi]) * p.scales.t().double()[:, gi]
            else:
                scale = (w.abs().amax(1) / 127).float()
                q8 = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8)
                ref_w = q8.double() * scale.double()[:, None]
            for m in [int(v) for v in args.ms.split(",")]:
                x = (torch.randn(m, k, device="cuda") * 0.5).to(torch.bfloat16)
                ref = x.double() @ ref_w.t()
                cur = kernel_config(fmt, m, n, k, dev)
                if fmt == "int4":
                    cands = [("dequant", lambda: F.linear(x, dequantize_int4(p.qweight, p.scales, p.zeros, g,
                                                                              torch.bfloat16))),
                             ("table", lambda: qg.w4a16_gemm(x, p.qweight, p.scales, p.zeros, g, config=cur))]
                else:
                    cands = [("table", lambda: qg.w8a16_gemm(x, q8, scale, config=cur))]
                cands.insert(0, ("bf16", lambda: F.linear(x, dense)))
                for bm, bn, bk, st, loader, cvt in VARIANTS:
                    if bm > m:
                        continue
                    name = f"ws {bm}x{bn}x{bk} s{st} {'ld' if loader else 'nold'} cvt{cvt}"
                    wq = p.qweight if fmt == "int4" else q8
                    why = ws_gemm.ws_unsupported_reason(x, wq, bm, bn, bk, st, g if fmt == "int4" else None)
                    if why:
                        rows.append(dict(fmt=fmt, shape=shape, m=m, path=name, error=why))
                        continue
                    if fmt == "int4":
                        def fn(bm=bm, bn=bn, bk=bk, st=st, loader=loader, cvt=cvt):
                            return ws_gemm.w4a16_ws_gemm(x, p.qweight, p.scales, p.zeros, g, bm, bn, bk, st,
                                                         counters=counters, loader=loader, cvt_warps=cvt)
                    else:
                        def fn(bm=bm, bn=bn, bk=bk, st=st, loader=loader, cvt=cvt):
                            return ws_gemm.w8a16_ws_gemm(x, q8, scale, bm, bn, bk, st, counters=counters,
                                                         loader=loader, cvt_warps=cvt)
                    cands.append((name, fn))
                for path, fn in cands:
                    row = dict(fmt=fmt, shape=shape, n=n, k=k, m=m, path=path)
                    try:
                        if path != "bf16":
                            row["rel_err"] = err = sw.rel(fn(), ref)
                            if not err < TOL:
                                raise RuntimeError(f"rel err {err:.2e}")
                        row["us"] = sw.time_us(fn)
                    except Exception as e:  # noqa: BLE001 - recorded, the probe goes on
                        row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                    rows.append(row)
                    print(f"{fmt} {shape:>8} M={m:<4} {path:<34} "
                          + (f"{row['us']:7.1f} us" if "us" in row else row["error"]), flush=True)
            Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                      rows=rows), indent=1))  # so far: a timeout keeps it
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                              rows=rows), indent=1))
    print("\nlayer sums (us; best ws = the fastest variant per projection):")
    for fmt in args.formats.split(","):
        for m in [int(v) for v in args.ms.split(",")]:
            def best(pred, fmt=fmt, m=m):
                return sum(min((r["us"] for r in rows if r["fmt"] == fmt and r["m"] == m and r["shape"] == s
                                and "us" in r and pred(r["path"])), default=float("nan"))
                           for s in args.shapes.split(","))
            base = best(lambda p: p == "ws 128x128x64 s4 ld cvt4")
            print(f"{fmt} M={m}: bf16 {best(lambda p: p == 'bf16'):.0f}  table {best(lambda p: p == 'table'):.0f}"
                  f"  ws 128x128 ld cvt4 {base:.0f}  best cvt4 {best(lambda p: p.startswith('ws') and 'cvt4' in p):.0f}"
                  f"  best ws {best(lambda p: p.startswith('ws')):.0f}")
            for s in args.shapes.split(","):
                rs = sorted((r for r in rows if r["fmt"] == fmt and r["m"] == m and r["shape"] == s and "us" in r
                             and r["path"].startswith("ws")), key=lambda r: r["us"])
                if rs:
                    print(f"    {s:>8}: best {rs[0]['path']} {rs[0]['us']:.1f} us")
    return 0


if __name__ == "__main__":
    sys.exit(main())
