"""Measure the quantized-GEMM dispatch table on this GPU: the best small-M GEMV config per (format, N, K, M) and,
for each (format, N, K), the largest M up to which our kernel beats the other path; check every kernel against
float64 on the way. Writes the JSON (every timing) and the table ``roofline/kernels/dispatch_tables/<device>.json``
reads (``--table``), which the engine uses from then on (``roofline.kernels.linear_dispatch``).

Usage (on the H200, repo root, PYTHONPATH=.): python bench/gpu_quant_sweep.py --out OUT.json --table TABLE.json
``--dry-run`` runs it on the CPU under TRITON_INTERPRET=1 at tiny shapes (checks the script, not speed).

Formats and the paths compared (weights of the Llama-3-8B projections, bf16 activations):

=========  =====================================  ================================================
format     ours                                   the other path
=========  =====================================  ================================================
dense      dense_gemv (M <= 4)                    F.linear (cuBLAS)
int4       w4a16_gemm (GEMV M <= 4, tiled above)  dequantize_int4 + F.linear
int8       w8a16_gemm (GEMV M <= 4, tiled above)  dequantize_int8 + F.linear
int8_int8  w8a8_gemv (M <= 4, quantizes x)        per_token_quant_int8 + int8_gemm (tensor cores)
fp8        w8a8_gemv (M <= 4, quantizes x)        per_token_quant_fp8 + torch._scaled_mm
=========  =====================================  ================================================

Every timing is GPU time inside a CUDA graph, as the engine's decode steps run (``Sweep.time_us``: no host launch
time, L2 evicted before each call), beside the bound (weight bytes of the format + activations) / copy bandwidth
measured here.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
DRY_SHAPES = {"qkv": (96, 256), "down": (64, 512)}
GROUP = 128
TOL = 1e-2  # ||out - ref64|| / ||ref64|| in bf16
# GEMV candidates (block_m, block_n, block_k, num_warps), chosen from sm_90 compiles without spills.
# INT4 at M = 1 is the 2-D one-row stream (16-byte word loads, no layout conversion in the loop): wide N tiles.
GEMV_N_LANES = {1: [(1, 64, 128, 4), (1, 128, 128, 4), (1, 256, 128, 8), (1, 256, 64, 4), (1, 512, 64, 8),
                    (1, 512, 32, 4), (1, 1024, 32, 8), (1, 128, 64, 4)],
                4: [(2, 32, 128, 4), (2, 64, 64, 4), (2, 32, 64, 2), (4, 32, 128, 4), (4, 32, 64, 2), (1, 64, 128, 4)]}
GEMV_K_LANES = {1: [(1, 8, 256, 4), (1, 16, 256, 4), (1, 8, 512, 4), (1, 16, 512, 8), (1, 4, 512, 4), (1, 4, 1024, 8)],
                4: [(2, 8, 256, 4), (2, 8, 512, 4), (2, 4, 1024, 8), (4, 8, 256, 4), (4, 4, 512, 4), (1, 8, 512, 4)]}
W8A8_K_LANES = {1: [(1, 8, 256, 4), (1, 16, 256, 4), (1, 8, 512, 4), (1, 16, 512, 8)],
                4: [(2, 8, 256, 4), (2, 8, 512, 4), (4, 8, 256, 4), (1, 8, 512, 4)]}
SPLITS = [None, 1, 2, 4, 8]
TILED_M = [16, 32, 64, 128, 256, 4096]
# Swap-AB tiles for the weight-only 8-bit formats (out^T = W @ x^T, the codes converted into the MMA's A operand):
# (block_n, block_k, num_warps, num_stages); block_m follows M (16 up to 128 rows of x a program, and half that).
SWAP_TILES = [(64, 64, 4, 4), (64, 128, 4, 4), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 8, 4), (64, 256, 4, 3),
              (128, 64, 8, 5), (256, 64, 8, 3)]
# The warp-specialized Gluon GEMM (roofline.kernels.ws_gemm; sm_90, INT8 and INT4): (block_m, block_n, block_k,
# stages, ws): ws 1 with a loader warp, 2 the converter issues the copies (168 registers for a 128-row MMA, which
# 128 x 256 needs)
WS_TILES = [(64, 128, 64, 4, 1), (64, 256, 64, 4, 1), (128, 128, 64, 4, 1), (128, 64, 128, 3, 1), (64, 128, 128, 3, 1),
            (128, 256, 64, 3, 2), (128, 128, 64, 4, 2), (64, 256, 64, 4, 2)]


def ws_configs(x, q, group_size=None, max_block_m=128):
    """``GemmConfig``s of the WS_TILES (``block_m`` <= ``max_block_m``) that the ws kernel runs for this x and these
    codes (``q`` int8 [N, K], or with ``group_size`` INT4 qweight): a refused tile would be timed as the Triton
    fallback under a ws name."""
    from roofline.kernels.quant_gemm import GemmConfig
    from roofline.kernels.ws_gemm import ws_unsupported_reason

    return [GemmConfig(bm, bn, bk, bm // 16, st, ws=ws) for bm, bn, bk, st, ws in WS_TILES
            if bm <= max_block_m and ws_unsupported_reason(x, q, bm, bn, bk, st, group_size) is None]


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--table", default=None, help="write the dispatch table here")
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--shapes", default=None)
    ap.add_argument("--formats", default=None, help="comma list of formats to sweep (default: all)")
    ap.add_argument("--merge-into", default=None,
                    help="an existing table: keep its rows for the formats not swept, write the union to --table")
    ap.add_argument("--from-json", default=None, help="rebuild --table from an earlier run's --out JSON (no GPU)")
    ap.add_argument("--skip-gemv", action="store_true",
                    help="time the tiled kernels only (no M = 1 / 4 GEMV stage); with --merge-into the swept formats "
                         "keep the earlier table's gemv rows")
    ap.add_argument("--ws", action="store_true", help="int8: also time the warp-specialized Gluon GEMM (WS_TILES)")
    ap.add_argument("--tiled-ms", default=None, help=f"comma list of M for the tiled stage (default {TILED_M})")
    return ap.parse_args(argv)


class Sweep:
    def __init__(self, args):
        import torch

        self.torch, self.args = torch, args
        self.dev = "cpu" if args.dry_run else "cuda"
        self.dtype = torch.float16 if args.dry_run else torch.bfloat16
        self.rows: list[dict] = []
        self.checks: list[dict] = []
        self.failures: list[str] = []
        self.t0 = time.time()
        self.flush = torch.empty(64 * 2**20 if self.dev == "cuda" else 16, dtype=torch.int8, device=self.dev)

    def time_us(self, fn) -> float:
        """GPU microseconds of one ``fn()`` with a cold L2, as the engine runs it (inside a CUDA graph, so no host
        launch time): ``reps`` x [64 MiB write that evicts L2, fn] captured in one graph, minus a graph of the
        writes alone, each replayed 5 times (medians). Host-timed once on the CPU."""
        torch = self.torch
        fn()
        if self.dev != "cuda":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e6
        reps = self.args.reps
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graphs = []
        for with_fn in (True, False):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(reps):
                    self.flush.zero_()
                    if with_fn:
                        fn()
            graphs.append(g)
        times = []
        for g in graphs:
            samples = []
            for _ in range(5):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                torch.cuda.synchronize()
                samples.append(a.elapsed_time(b))
            times.append(statistics.median(samples))
        del graphs
        return max(1e3 * (times[0] - times[1]) / reps, 1e-3)

    def bandwidth(self) -> float:
        torch = self.torch
        n = 2**30 if self.dev == "cuda" else 2**20
        src = torch.ones(n // 4, device=self.dev)
        dst = torch.empty_like(src)
        return 2 * n / (self.time_us(lambda: dst.copy_(src)) * 1e-6)

    def rel(self, out, ref64) -> float:
        o = out.double()
        if not bool(self.torch.isfinite(o).all()):
            return float("inf")
        return float((o - ref64).norm() / ref64.norm().clamp_min(1e-30))

    def record(self, **row):
        self.rows.append(row)
        if "error" in row:
            print(f"  {row['shape']:>8} M={row['m']:<5} {row['path']:<24} {row.get('config', '')} error: {row['error']}",
                  flush=True)


def fused_max_m(rows: list[dict]) -> tuple[dict, dict]:
    """Per format and (N, K): the largest measured M up to which our kernel (its GEMV or tiled rows, the fastest
    config; below M = 16 the tiled kernel counts with its M = 16 time) beat the "other" path at every measured M
    (0 = lost at the smallest). Returns (that
    ``{fmt: [{"n", "k", "fused_max_m"}]}``, and the best time per (fmt, n, k, m, path))."""
    t: dict = {}
    for r in rows:
        if "us" in r:
            key = (r["fmt"], r["n"], r["k"], r["m"], r["path"])
            t[key] = min(t.get(key, float("inf")), r["us"])
    out: dict = {}
    for fmt in dict.fromkeys(key[0] for key in t):
        for n, k in sorted({key[1:3] for key in t if key[0] == fmt}):
            best_m = 0
            for m in sorted({key[3] for key in t if key[0] == fmt and key[1:3] == (n, k)}):
                mine = min(t.get((fmt, n, k, m, p), float("inf")) for p in ("gemv", "tiled"))
                if m < TILED_M[0]:  # the tiled kernel's time at M = 16 bounds its time below (rows past M are masked)
                    mine = min(mine, t.get((fmt, n, k, TILED_M[0], "tiled"), float("inf")))
                if (fmt, n, k, m, "other") in t and mine < t[(fmt, n, k, m, "other")]:
                    best_m = m
                elif mine != float("inf"):
                    break
            out.setdefault(fmt, []).append(dict(n=n, k=k, fused_max_m=best_m))
    return out, t


def build_table(rows: list[dict], source: str) -> dict:
    """The dispatch table from the sweep's rows: ``gemv`` = per (format, N, K, M in {1, 4}) the fastest correct
    config among the GEMV candidates and, for the weight-only formats, the tiled tl.dot configs of 16-row tiles
    timed at M = 16 (rows past M are masked, so their M = 16 time bounds their time at M <= 4); ``tiled`` = per
    (format, N, K, M >= 16) the fastest tiled config; ``fused_max_m`` as :func:`fused_max_m`."""
    fused, _ = fused_max_m(rows)
    gemv: dict = {}
    for fmt in dict.fromkeys(r["fmt"] for r in rows):
        for n, k in sorted({(r["n"], r["k"]) for r in rows if r["fmt"] == fmt}):
            for m in (1, 4):
                cands = [r for r in rows if "us" in r and r["fmt"] == fmt and (r["n"], r["k"]) == (n, k)
                         and ((r["path"] == "gemv" and r["m"] == m)
                              or (r["path"] == "tiled" and r["m"] == 16 and r["config"]["block_m"] == 16))]
                if not cands:
                    continue
                best = min(cands, key=lambda r: r["us"])
                other = [r["us"] for r in rows if "us" in r and r["fmt"] == fmt and (r["n"], r["k"], r["m"]) == (n, k, m)
                         and r["path"] == "other"]
                gemv.setdefault(fmt, []).append(dict(n=n, k=k, m=m, config=best["config"], us=best["us"],
                                                     timed_at_m=best["m"], other_us=min(other) if other else None))
    # tiled = per (format, N, K, M >= 16) the fastest correct tiled config (linear_dispatch.kernel_config: the row of
    # the smallest measured M >= the call's M).
    tiled: dict = {}
    for r in rows:
        if "us" in r and r["path"] == "tiled":
            key = (r["fmt"], r["n"], r["k"], r["m"])
            if key not in tiled or r["us"] < tiled[key]["us"]:
                tiled[key] = dict(n=r["n"], k=r["k"], m=r["m"], config=r["config"], us=r["us"])
    by_fmt: dict = {}
    for (fmt, *_), row in sorted(tiled.items()):
        by_fmt.setdefault(fmt, []).append(row)
    return {"_source": source, "gemv": gemv, "fused_max_m": fused, "tiled": by_fmt}


def main(argv=None) -> int:
    import torch
    import torch.nn.functional as F
    import triton

    from roofline.kernels import quant_gemm as qg
    from roofline.quant.quantize import quantize_fp8_per_channel, quantize_int4_rtn, quantize_int8_per_channel

    args = parse_args(argv)
    if args.from_json:
        doc = json.loads(Path(args.from_json).read_text())
        table = build_table(doc["rows"], f"bench/gpu_quant_sweep.py on the {doc['device']}, {doc['date'][:10]} (rebuilt "
                            "from its JSON): gemv = the fastest correct small-M config per (format, N, K, M); "
                            "fused_max_m = the largest measured M up to which our kernel beat the other path at every "
                            "measured M (0 = never)")
        Path(args.table).write_text(json.dumps(table, indent=1))
        print(json.dumps(table["fused_max_m"]))
        return 0
    sw = Sweep(args)
    formats = args.formats.split(",") if args.formats else ["dense", "int4", "int8", "int8_int8", "fp8", "fp8_w8a16"]
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    if args.shapes:
        shapes = {s: shapes[s] for s in args.shapes.split(",")}
    tiled_ms = [int(v) for v in args.tiled_ms.split(",")] if args.tiled_ms else TILED_M
    bw = sw.bandwidth()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    dt = sw.dtype
    C = qg.GemmConfig
    best_gemv: dict = {}
    for shape, (n, k) in shapes.items():
        gen = torch.Generator(device=sw.dev).manual_seed(n + k)
        w = torch.randn(n, k, device=sw.dev, generator=gen) * 0.02
        c4 = quantize_int4_rtn(w, GROUP)
        c4.scales = c4.scales.to(dt).float()
        p4 = qg.prepare_int4(c4, dt)
        c8 = quantize_int8_per_channel(w)
        cf = quantize_fp8_per_channel(w)
        f8, f8s = cf.q.to(torch.float8_e4m3fn), cf.scales.float()
        dense = w.to(dt)
        grp = torch.arange(k, device=sw.dev) // GROUP
        ref_w = {"dense": dense.double(), "int4": (c4.q.double() - c4.zeros.double()[:, grp]) * c4.scales.double()[:, grp],
                 "int8": c8.q.double() * c8.scales.double()[:, None]}
        wbytes = {"dense": n * k * 2, "int4": p4.weight_bytes(), "int8": n * k + 4 * n, "int8_int8": n * k + 4 * n,
                  "fp8": n * k + 4 * n, "fp8_w8a16": n * k + 4 * n}
        ref_w["fp8_w8a16"] = f8.double() * f8s.double()[:, None]
        del w

        def ours(fmt, x, cfg=None):
            if fmt == "dense":
                return qg.dense_gemv(x, dense, config=cfg)
            if fmt == "int4":
                return qg.w4a16_gemm(x, p4.qweight, p4.scales, p4.zeros, GROUP, config=cfg)
            if fmt == "int8":
                return qg.w8a16_gemm(x, c8.q, c8.scales, config=cfg)
            if fmt == "int8_int8":
                return qg.w8a8_gemv(x, c8.q, c8.scales, config=cfg)
            if fmt == "fp8_w8a16":
                return qg.fp8_w8a16_gemm(x, f8, f8s, config=cfg)
            return qg.w8a8_gemv(x, f8, f8s, config=cfg)

        def other(fmt, x):
            if fmt == "dense":
                return F.linear(x, dense)
            if fmt == "int4":
                return F.linear(x, qg.dequantize_int4(p4.qweight, p4.scales, p4.zeros, GROUP))
            if fmt == "int8":
                return F.linear(x, qg.dequantize_int8(c8.q, c8.scales, dt))
            if fmt == "int8_int8":
                return qg.int8_gemm(*qg.per_token_quant_int8(x), c8.q, c8.scales, dt, config=qg.pick_config("int8_int8", 16))
            if fmt == "fp8_w8a16" and sw.dev != "cuda":
                return qg.ref_fp8_w8a16_gemm(x, f8, f8s)
            if sw.dev != "cuda":
                return qg.ref_w8a8_gemv(x, f8, f8s)
            xq, xs = qg.per_token_quant_fp8(x)
            return torch._scaled_mm(xq, f8.t(), scale_a=xs, scale_b=f8s[None, :], out_dtype=dt)

        def ref64(fmt, x):
            if fmt in ref_w:
                return x.double() @ ref_w[fmt].t()
            wq = c8.q if fmt == "int8_int8" else f8
            xq, xs = (qg.ref_per_token_quant_int8 if fmt == "int8_int8" else qg.ref_per_token_quant_fp8)(x)
            return (xq.double() @ wq.double().t()) * xs.double() * (c8.scales if fmt == "int8_int8" else f8s).double()

        def timed(fmt, m, path, fn, x, cfg=None, split=None, check=True):
            row = dict(shape=shape, n=n, k=k, m=m, fmt=fmt, path=path)
            if cfg is not None:
                row["config"] = {kk: v for kk, v in asdict(cfg).items() if v is not None}
            try:
                out = fn()
                if check and not (args.dry_run and fmt.startswith("fp8")):  # the interpreter cannot run fp8
                    err = sw.rel(out, ref64(fmt, x))
                    row["rel_err"] = err
                    if not err < TOL:
                        sw.failures.append(f"{shape} M={m} {path} {row.get('config')}: rel err {err:.2e}")
                        row["error"] = f"rel err {err:.2e} >= {TOL}"  # never a candidate for the table
                        sw.record(**row)
                        return None
                us = sw.time_us(fn)
            except Exception as e:  # noqa: BLE001 - compile / launch / resources: recorded, the sweep goes on
                row["error"] = f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0][:160]
                sw.record(**row)
                return None
            act = m * (k + n) * 2
            row.update(us=us, bound_us=(wbytes[fmt] + act) / bw * 1e6, frac_of_bound=(wbytes[fmt] + act) / bw * 1e6 / us)
            sw.record(**row)
            return us

        # ---- small M: every GEMV candidate x split, against the other path
        for m in () if args.skip_gemv else (1, 4):
            x = (torch.randn(m, k, device=sw.dev) * 0.5).to(dt)
            for fmt in formats:
                if args.dry_run and fmt == "fp8_w8a16":
                    continue
                cands = (GEMV_N_LANES if fmt == "int4" else W8A8_K_LANES if fmt in ("int8_int8", "fp8") else GEMV_K_LANES)[m]
                if args.dry_run:
                    cands = cands[:2]
                base = timed(fmt, m, "other", lambda: other(fmt, x), x, check=fmt != "fp8_w8a16")  # other: W8A8
                best = None
                for bm, bn, bk, nw in cands:
                    for split in SPLITS if not args.dry_run else (None, 2):
                        cfg = C(bm, bn, bk, nw, 1, split_k=split, gemv=True)
                        us = timed(fmt, m, "gemv", lambda cfg=cfg: ours(fmt, x, cfg), x, cfg)
                        if us is not None and (best is None or us < best[0]):
                            best = (us, cfg)
                if best is not None:
                    best_gemv.setdefault(fmt, []).append(dict(
                        n=n, k=k, m=m, config={kk: v for kk, v in asdict(best[1]).items() if v is not None},
                        us=best[0], other_us=base, frac_of_bound=(wbytes[fmt] + m * (k + n) * 2) / bw * 1e6 / best[0]))
                    print(f"[gemv] {shape:>8} M={m} {fmt:<9} best {best[0]:7.1f} us "
                          f"({(wbytes[fmt] + m * (k + n) * 2) / bw * 1e6 / best[0]:.2f} of bound) vs other "
                          f"{base if base is None else round(base, 1)} us  {best[1]}", flush=True)
        # ---- larger M: our tiled kernels (default config and neighbours) against the other paths
        for m in ([20] if args.dry_run else tiled_ms):
            x = (torch.randn(m, k, device=sw.dev) * 0.5).to(dt)
            for fmt in [f for f in ("dense", "int8_int8", "fp8") if f in formats]:
                timed(fmt, m, "other", lambda fmt=fmt: other(fmt, x), x)
            for fmt in [f for f in ("int4", "int8", "fp8_w8a16") if f in formats]:
                if args.dry_run and fmt == "fp8_w8a16":
                    continue
                timed(fmt, m, "other", lambda fmt=fmt: other(fmt, x), x, check=fmt != "fp8_w8a16")
                default = qg.pick_config(fmt, m)
                alts = [default]
                if not args.dry_run:
                    bm = min(128, max(16, triton.next_power_of_2(m)))
                    alts += [C(bm, 64, 64, 4, 3, unpack=1), C(min(bm, 64), 128, 64, 4, 2, unpack=1),
                             C(bm, 128, 64 if fmt == "int4" else 128, 8, 2, unpack=1)]
                if fmt != "int4":
                    sm = min(128, max(16, triton.next_power_of_2(m)))  # 256 rows: > 227 KB of shared memory
                    tiles = SWAP_TILES if not args.dry_run else [(32, 64, 4, 1)]
                    alts += [C(bm_, bn, bk, nw, st, swap_ab=True) for bn, bk, nw, st in tiles
                             for bm_ in dict.fromkeys((sm, max(16, sm // 2)))]
                    if m >= 128 and not args.dry_run:  # bench/gpu_w8_swap_probe.py's winners on the H200, 2026-12-07
                        alts += [C(128, 64, 128, 4, 3, swap_ab=True), C(128, 128, 64, 4, 4)]
                if fmt == "int8" and args.ws and not args.dry_run:
                    alts += ws_configs(x, c8.q, max_block_m=128 if m >= 64 else 64)
                for cfg in dict.fromkeys(alts):
                    timed(fmt, m, "tiled", lambda cfg=cfg: ours(fmt, x, cfg), x, cfg)
        print(f"{shape} done at {time.time() - sw.t0:.0f} s", flush=True)

    # ---- the table: best GEMV configs, and per (fmt, N, K) the largest M where ours beat the other path at every
    # measured M up to it (GEMV formats at M <= 4; weight-only also the tiled kernel above).
    fused_max, t = fused_max_m(sw.rows)
    dev = torch.cuda.get_device_name() if sw.dev == "cuda" else "cpu (interpreter)"
    table = build_table(sw.rows, f"bench/gpu_quant_sweep.py on the {dev}, {time.strftime('%Y-%m-%d')}: gemv = the "
                        "fastest correct small-M config per (format, N, K, M); tiled = the fastest tiled config per (format, N, K, M >= 16); "
                        "fused_max_m = the largest measured M up "
                        "to which our kernel beat the other path at every measured M (0 = never)")
    result = dict(bench="quant_sweep", device=dev, torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%dT%H:%M:%S%z"), copy_bytes_per_s=bw, group_size=GROUP, shapes=shapes,
                  rows=sw.rows, failures=sw.failures, table=table, elapsed_s=time.time() - sw.t0)
    Path(args.out).write_text(json.dumps(result, indent=1))
    if args.merge_into:
        old = json.loads(Path(args.merge_into).read_text())
        for part in ("gemv", "fused_max_m", "tiled"):
            if part == "gemv" and args.skip_gemv:  # nothing swept there: the earlier rows, every format's
                table[part] = old.get(part, {})
            else:
                table[part] = {**{f: r for f, r in old.get(part, {}).items() if f not in formats}, **table[part]}
        if args.skip_gemv:  # below the smallest swept M the earlier table's verdict stands
            for fmt, rows in table["fused_max_m"].items():
                for r in rows:
                    was = [o["fused_max_m"] for o in old.get("fused_max_m", {}).get(fmt, [])
                           if (o["n"], o["k"]) == (r["n"], r["k"])]
                    if r["fused_max_m"] == 0 and was:
                        r["fused_max_m"] = min(was[0], min(tiled_ms) - 1)
        table["_source"] += f"; formats {','.join(formats)} re-swept, the others kept from the earlier table"
    if args.table:
        Path(args.table).parent.mkdir(parents=True, exist_ok=True)
        Path(args.table).write_text(json.dumps(table, indent=1))
    print(f"wrote {args.out} ({len(sw.rows)} rows) in {time.time() - sw.t0:.0f} s")
    for fmt, rows in fused_max.items():
        print(f"[fused_max_m] {fmt:<9} " + " ".join(f"({r['n']},{r['k']}):{r['fused_max_m']}" for r in rows))
    for m in tiled_ms if not args.dry_run else [20]:
        line = []
        for fmt in formats:
            tot = sum(min(t.get((fmt, n, k, m, p), float("inf")) for p in ("other", "tiled")) for n, k in shapes.values())
            line.append(f"{fmt} {tot:.0f}")
        print(f"[layer sum] M={m}: " + ", ".join(line) + " us")
    if sw.failures:
        print("FAILURES:\n  " + "\n  ".join(sw.failures[:30]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
