# ruff: noqa: B023  (every lambda below runs in the iteration that made it)
"""The INT4 tensor-core GEMM as decode runs it: L launches over L distinct weights of one Llama-3-8B projection,
back to back in one CUDA graph with programmatic dependent launch (so the weights come from HBM, not L2, and the
launch ramp and tail are paid as in a decode step). Per launch: microseconds and the fraction of read bandwidth
(codes + scales + zeros, measured `x.sum()` bandwidth in the same process), for

- ``mma``: ``w4a16_mma_gemm`` with a per-item grid (program = column tile x K split), several splits;
- ``persist``: the same kernel on a persistent grid (P programs per SM, each one stream of k-tiles);
- ``wgmma``: the Hopper kernel (``gluon_w4a16_wgmma``: register-A ``wgmma``, x staged in shared memory);
- ``triton``: the Triton INT4 path (``linear_dispatch.w4a16`` on the GPTQ layout), which the table weighs the mma
  kernel against;
- ``bf16``: cuBLAS (`F.linear`) on bf16 weights of the same shape (4x the bytes), for reference.

Every mma / persist config is first checked against a float64 oracle (rel err < 4e-3). ``--table`` / ``--table-flat``
write the fastest config per (shape, M), with and without persistent configs, as a dispatch table's ``int4_mma``
rows (``bench/gpu_w4a16_mma.py``'s format; rows of other M are kept).

    python bench/gpu_w4_chain.py --out $OUT/w4_chain.json [--ms 1,8,16,32,64] [--shapes qkv,o,gate_up,down]
        [--chain 12] [--table T.json] [--table-flat F.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}

def median_ms(run, n: int) -> float:
    """Median device milliseconds of ``run()`` over ``n`` calls, CUDA events around each."""
    t = []
    for _ in range(n):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        torch.cuda.synchronize()
        t.append(a.elapsed_time(b))
    return statistics.median(t)


def chain_us(fns) -> float:
    """Microseconds per launch of ``fns`` run in order inside one CUDA graph (median of 7 replays)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for f in fns:
            f()
    g.replay()
    torch.cuda.synchronize()
    us = median_ms(g.replay, 7) * 1e3
    del g
    return us / len(fns)


def main(argv=None) -> int:
    from types import SimpleNamespace

    from roofline.kernels import linear_dispatch
    from roofline.kernels.switch import set_kernels_enabled
    from roofline.kernels.w4a16_mma import MmaConfig, repack_int4_mma, w4a16_mma_gemm

    set_kernels_enabled(True)

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,8,16,32,64")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--chain", type=int, default=12)
    ap.add_argument("--splits", default="none,2,4,8,16")
    ap.add_argument("--persist", default="2,4")
    ap.add_argument("--table", default=None)
    ap.add_argument("--table-flat", default=None)
    args = ap.parse_args(argv)
    from roofline.hardware import measure_read_bandwidth

    bw = measure_read_bandwidth("cuda")
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}: read bandwidth {bw / 1e12:.2f} TB/s, {sms} SMs", flush=True)
    rows, t0 = [], time.time()
    splits = [None if s == "none" else int(s) for s in args.splits.split(",")]
    for shape in args.shapes.split(","):
        n, k = SHAPES[shape]
        kt = k // 128
        g = torch.Generator(device="cuda").manual_seed(0)
        ws = []
        for _ in range(args.chain):
            qw = sum((torch.randint(0, 16, (k // 8, n), device="cuda", dtype=torch.int32, generator=g) << (4 * i))
                     for i in range(8))  # GPTQ words: nibble i = channel 8 r + i
            s = (torch.rand(kt, n, device="cuda", generator=g) * 0.02 + 0.005).bfloat16()
            z = torch.randint(0, 16, (kt, n), device="cuda", generator=g).bfloat16()
            ws.append((repack_int4_mma(qw.to(torch.int32)), s, z, qw))
        nbytes = n * k // 2 + 2 * kt * n * 2
        wbf = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in range(4)]
        for m in [int(v) for v in args.ms.split(",")]:
            x = (torch.randn(m, k, device="cuda", generator=g) * 0.5).bfloat16()
            qm0, s0, z0, qw0 = ws[0]
            q = torch.stack([(qw0 >> (4 * i)) & 0xF for i in range(8)], dim=1).reshape(k, n).double()  # [K, N]
            ref = x.double() @ ((q - z0.double().repeat_interleave(128, 0)) * s0.double().repeat_interleave(128, 0))

            def record(kind, cfg, us, err=None, b=nbytes):
                rows.append(dict(shape=shape, n=n, k=k, m=m, kind=kind, config=cfg, us=us, rel_err=err,
                                 frac_of_read_bw=b / (us * 1e-6) / bw))
                print(f"{shape:>8} M={m:<3} {kind:<8} {str(cfg):<90} {us:8.2f} us  {rows[-1]['frac_of_read_bw']:.3f}"
                      + (f"  err {err:.1e}" if err is not None else ""), flush=True)

            bm = 8 if m <= 8 else 16 if m <= 16 else 32 if m <= 32 else 64
            tiles = ((128, 4), (128, 8), (256, 8)) if bm <= 16 else ((64, 4), (128, 4), (128, 8))
            cfgs = []
            for bn, nw in tiles:
                for sp in splits:
                    if bm <= 16:
                        cfgs.append(MmaConfig(bm, bn, nw, 1, False, sp))
                        cfgs.append(MmaConfig(bm, bn, nw, 1, True, sp))
                        for p in [int(v) for v in args.persist.split(",") if v]:
                            cfgs.append(MmaConfig(bm, bn, nw, 1, True, sp, p))
                    else:
                        cfgs += [MmaConfig(bm, bn, nw, st, False, sp) for st in (1, 2)]
            if torch.cuda.get_device_capability(0)[0] == 9:
                cfgs += [MmaConfig(bm, bn, nw, split_k=sp, wgmma=pipe)
                         for bn, nw in ((64, 4), (128, 4), (128, 8), (256, 8)) for sp in splits for pipe in (1, 2)]
            for cfg in cfgs:
                try:
                    out = w4a16_mma_gemm(x, qm0, s0, z0, config=cfg)
                    err = float((out.double() - ref).norm() / ref.norm())
                    kind = "wgmma" if cfg.wgmma else "persist" if cfg.persistent else "mma"
                    if not err < 4e-3:
                        record(kind, cfg._asdict(), float("nan"), err)
                        continue
                    us = chain_us([lambda w=w: w4a16_mma_gemm(x, w[0], w[1], w[2], config=cfg) for w in ws])
                    record(kind, cfg._asdict(), us, err)
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(shape=shape, m=m, config=cfg._asdict(), error=repr(e)[:300]))
                    print(f"{shape} M={m} {cfg} error {e!r}"[:400], flush=True)
            layers = [SimpleNamespace(qweight=w[3], scales=w[1], zeros=w[2], int4_group_size=128) for w in ws]
            us = chain_us([lambda lay=lay: linear_dispatch.w4a16(x, lay) for lay in layers])
            record("triton", "linear_dispatch.w4a16 (GPTQ layout)", us)
            us = chain_us([lambda w=w: F.linear(x, w) for w in wbf] * 2)
            record("bf16", "cuBLAS F.linear", us, b=n * k * 2)
        print(f"[{time.time() - t0:.0f} s]", flush=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                                              read_bytes_per_s=bw, rows=rows), indent=1))
    write_tables(args, rows)
    print("\nbest per (shape, M, kind):")
    best = {}
    for r in rows:
        if r.get("us") is not None and r["us"] == r["us"]:
            key = (r["shape"], r["m"], r["kind"])
            if key not in best or r["us"] < best[key]["us"]:
                best[key] = r
    for key, r in sorted(best.items()):
        print(f"  {key[0]:>8} M={key[1]:<3} {key[2]:<8} {r['us']:8.2f} us {r['frac_of_read_bw']:.3f}  {r['config']}")
    return 0


def write_tables(args, rows) -> None:
    """``--table`` (every config) and ``--table-flat`` (the mma.sync kernel's per-item grid only): the fastest config per (N, K, M)
    with the Triton path's time beside it, merged into the JSON file's ``int4_mma`` rows."""
    for path, flat in ((args.table, False), (args.table_flat, True)):
        if not path:
            continue
        fresh = {}
        for r in rows:
            if r.get("kind") not in ("mma", "persist", "wgmma") or not r["us"] == r["us"] \
                    or (flat and r["kind"] != "mma"):
                continue
            key = (r["n"], r["k"], r["m"])
            triton_us = next(t["us"] for t in rows if t.get("kind") == "triton" and (t["n"], t["k"], t["m"]) == key)
            if key not in fresh or r["us"] < fresh[key]["us"]:
                fresh[key] = dict(n=r["n"], k=r["k"], m=r["m"], config=r["config"], us=r["us"], triton_us=triton_us)
        p = Path(path)
        table = json.loads(p.read_text()) if p.is_file() else {}
        kept = [r for r in table.get("int4_mma", []) if (r["n"], r["k"], r["m"]) not in fresh]
        table["int4_mma"] = sorted(kept + list(fresh.values()), key=lambda r: (r["n"], r["k"], r["m"]))
        p.write_text(json.dumps(table, indent=1) + "\n")
        print(f"wrote {len(fresh)} int4_mma rows to {path}")


if __name__ == "__main__":
    sys.exit(main())
