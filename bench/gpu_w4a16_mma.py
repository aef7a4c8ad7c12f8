"""INT4 decode GEMMs on the GPU, per Llama-3-8B projection and M: the Gluon tensor-core kernel
(``roofline.kernels.w4a16_mma``, every tile and split) against the Triton INT4 path the dispatch table picks
today and bf16 cuBLAS, in one process. Each time is a cold-L2 CUDA-graph replay (``gpu_quant_sweep.Sweep``);
each mma config is checked against a float64 oracle first. Prints a table (us, fraction of the measured read
bandwidth counting codes + scales + zeros + activations, speedups) and writes JSON.

    python bench/gpu_w4a16_mma.py --out $OUT/w4a16_mma.json [--ms 1,2,4,8,16,32,64] [--shapes qkv,o,gate_up,down]
        [--table roofline/kernels/dispatch_tables/NVIDIA_H200.json]   # write the fastest config per (shape, M)
                                                                      # as the table's "int4_mma" rows
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# (BN, num_warps) by BLOCK_M: in the first sweep (64, 4) won only at M > 16, (256, 8) only at M <= 16
TILES = {8: [(128, 4), (128, 8), (256, 8)], 16: [(128, 4), (128, 8), (256, 8)], 32: [(64, 4), (128, 4), (128, 8)],
         64: [(64, 4), (128, 4), (64, 8)]}
SPLITS = [None, 1, 2, 4, 8, 16]
TOL = 4e-3


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,2,4,8,16,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--table", default=None, help="a dispatch table JSON whose int4_mma rows for the measured (N, K, M) "
                    "are replaced (rows of other M are kept)")
    ap.add_argument("--stages", default="1,2", help="comma list of MmaConfig.stages to sweep (>= 3: the cp.async ring)")
    ap.add_argument("--splits", default="none,1,2,4,8,16")
    ap.add_argument("--persist", default="0", help="comma list of MmaConfig.persistent (programs per SM; 0: one "
                    "program per work item) to sweep; persistent configs take stages 1 with x prefetched only")
    ap.add_argument("--table-flat", default=None, help="also write a table (like --table) from the configs with "
                    "persistent = 0 only: the baseline of a persistent-grid A/B")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F
    from gpu_quant_sweep import Sweep

    from roofline.hardware import measure_read_bandwidth
    from roofline.kernels import linear_dispatch
    from roofline.kernels.quant_gemm import prepare_int4
    from roofline.kernels.quant_layouts import unpack_int4
    from roofline.kernels.switch import set_kernels_enabled
    from roofline.kernels.w4a16_mma import MmaConfig, pick_tile, repack_int4_mma, w4a16_mma_gemm
    from roofline.quant.quantize import quantize_int4_rtn

    set_kernels_enabled(True)
    sw = Sweep(SimpleNamespace(dry_run=False, reps=args.reps))
    bw = measure_read_bandwidth("cuda")
    print(f"{torch.cuda.get_device_name()}  torch {torch.__version__}  read bandwidth {bw / 1e12:.3f} TB/s", flush=True)
    rows, best, best_flat = [], [], []
    t0 = time.time()
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        w = torch.randn(n, k, device="cuda") * 0.02
        p = prepare_int4(quantize_int4_rtn(w, 128), torch.bfloat16)
        qm = repack_int4_mma(p.qweight)
        q = unpack_int4(p.qweight).float()
        sc = p.scales.float().t().repeat_interleave(128, dim=1)
        zr = p.zeros.float().t().repeat_interleave(128, dim=1)
        dense = ((q - zr) * sc).bfloat16()  # the same weight in bf16, for cuBLAS
        w64 = ((q.double() - zr.double()) * sc.double())
        del q, sc, zr, w
        layer = SimpleNamespace(qweight=p.qweight, scales=p.scales, zeros=p.zeros, int4_group_size=128)
        wbytes = n * k // 2 + 2 * (k // 128) * n * 2
        for m in [int(v) for v in args.ms.split(",")]:
            x = (torch.randn(m, k, device="cuda") * 0.5).bfloat16()
            ref = x.double() @ w64.t()
            act = m * (k + n) * 2
            floor_us = (wbytes + act) / bw * 1e6
            t_bf16 = sw.time_us(lambda x=x, dense=dense: F.linear(x, dense))
            t_old = sw.time_us(lambda x=x, layer=layer: linear_dispatch.w4a16(x, layer))
            err_old = sw.rel(linear_dispatch.w4a16(x, layer), ref)
            bm = pick_tile(m).block_m
            cands = []
            for bn, nw in TILES[bm]:
                if n % bn:
                    continue
                for stages in [int(v) for v in args.stages.split(",")]:
                    for pre in ((True, False) if bm <= 16 else (False,)):
                        for split, persist in [(None if v == "none" else int(v), int(p))
                                               for v in args.splits.split(",") for p in args.persist.split(",")]:
                            if persist and (stages != 1 or not pre):
                                continue
                            cfg = MmaConfig(bm, bn, nw, stages, pre, split, persist)
                            try:
                                out = w4a16_mma_gemm(x, qm, p.scales, p.zeros, config=cfg)
                                err = sw.rel(out, ref)
                                if not err < TOL:
                                    rows.append(dict(shape=shape, m=m, config=cfg._asdict(), error=f"rel err {err:.2e}"))
                                    print(f"  WRONG {shape} M={m} {cfg}: rel err {err:.2e}", flush=True)
                                    continue
                                us = sw.time_us(lambda x=x, qm=qm, p=p, cfg=cfg: w4a16_mma_gemm(
                                    x, qm, p.scales, p.zeros, config=cfg))
                            except Exception as e:  # noqa: BLE001 - compile / launch failures recorded, sweep goes on
                                msg = str(e).splitlines()[0][:200] if str(e) else ""
                                rows.append(dict(shape=shape, m=m, config=cfg._asdict(),
                                                 error=f"{type(e).__name__}: {msg}"))
                                print(f"  FAIL {shape} M={m} {cfg}: {rows[-1]['error']}", flush=True)
                                continue
                            cands.append((us, cfg, err))
                            rows.append(dict(shape=shape, m=m, config=cfg._asdict(), us=us, rel_err=err,
                                             frac_of_read_bw=floor_us / us))
            default_us = None
            flat = [c for c in cands if not c[1].persistent]
            if flat:
                us, cfg, err = min(flat, key=lambda c: c[0])
                best_flat.append(dict(shape=shape, n=n, k=k, m=m, config=cfg._asdict(), us=us, triton_us=t_old))
            if cands:
                us, cfg, err = min(cands, key=lambda c: c[0])
                default = [c for c in cands if c[1] == pick_tile(m)]
                default_us = default[0][0] if default else None
                best.append(dict(shape=shape, n=n, k=k, m=m, config=cfg._asdict(), us=us, default_us=default_us,
                                 triton_us=t_old, bf16_us=t_bf16, floor_us=floor_us, rel_err=err,
                                 triton_rel_err=err_old))
                print(f"{shape:>8} M={m:<3} mma {us:7.1f} us ({floor_us / us:.2f} of read BW) {tuple(cfg)} "
                      f"| default {default_us if default_us is None else round(default_us, 1)} | triton {t_old:7.1f} "
                      f"| bf16 {t_bf16:7.1f} | mma vs triton {t_old / us:.2f}x, vs bf16 {t_bf16 / us:.2f}x",
                      flush=True)
    print(f"done in {time.time() - t0:.0f} s")
    Path(args.out).write_text(json.dumps(dict(
        bench="gpu_w4a16_mma", device=torch.cuda.get_device_name(), torch=torch.__version__,
        triton=__import__("triton").__version__, read_bytes_per_s=bw, best=best, rows=rows), indent=1))
    for path, chosen in ((args.table, best), (args.table_flat, best_flat)):
        if not path:
            continue
        table = json.loads(Path(path).read_text()) if Path(path).is_file() else {}
        fresh = {(b["n"], b["k"], b["m"]): dict(n=b["n"], k=b["k"], m=b["m"], config=b["config"], us=b["us"],
                                                 triton_us=b["triton_us"]) for b in chosen}
        kept = [r for r in table.get("int4_mma", []) if (r["n"], r["k"], r["m"]) not in fresh]  # other M buckets
        table["int4_mma"] = sorted(kept + list(fresh.values()), key=lambda r: (r["n"], r["k"], r["m"]))
        Path(path).write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {len(chosen)} int4_mma rows to {path}")


if __name__ == "__main__":
    main()
