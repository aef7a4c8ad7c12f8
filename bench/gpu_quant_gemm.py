"""Quantized linear-layer GEMMs on the GPU: correctness at the Llama-3-8B shapes, then timing against
the read bound, and the M at which each fused kernel stops beating "dequantize, then cuBLAS".

Usage (on the H200, from the repo root, PYTHONPATH=.):
    python bench/gpu_quant_gemm.py --out $OUT/quant_gemm.json
    TRITON_INTERPRET=1 python bench/gpu_quant_gemm.py --dry-run --out /tmp/q.json   # CPU, tiny shapes

(a) Correctness, bf16 (fp16 in --dry-run): every kernel of roofline/kernels/quant_gemm.py against a float64
    reference from the canonical quantized form, at each shape and one M per config bucket; prints the max
    relative error. A failure exits non-zero (after the JSON is written).
(b) Timing, median of --reps calls timed with CUDA events (L2 flushed before each call), for qkv / o / gate_up / down at
    M in {1, 4, 16, 64, 256, 1024, 4096}: bf16 F.linear (cuBLAS), dense_gemv (M <= 16), w4a16 fused,
    w4 dequantize + F.linear, w8a16 fused, w8 dequantize + F.linear, int8_gemm alone and with
    per_token_quant_int8, torch._int_mm (M > 16, int32 out), fp8 torch._scaled_mm alone and with a
    per-token quantization (E4M3, rowwise scales). Each row: time, TFLOP/s, and the fraction of the read
    bound = (weight bytes of the format + activation bytes in and out) / copy bandwidth measured in this
    process (2 x bytes of a 1 GiB device-to-device copy per second).
    At M in (1, 4, 16) also the two small-M variants by name, whatever CONFIGS picks: "... gemv" (the FMA
    stream, GemmConfig.gemv) and "... dot" (tl.dot on rows padded to 16); and the Triton quantizers alone
    ("int8 quant", "fp8 tquant") and fp8 with the Triton quantizer ("fp8 tquant+_scaled_mm", the engine's path).
    Every launch is wrapped: an error (compile, launch, shared memory) is a row with "error", the rest runs.
(c) A small config sweep at M = 1 and 16 (GEMV and tl.dot variants of w4a16, w8a16, int8_gemm, dense_gemv) to
    retune CONFIGS, if time is left; each sweep output is compared with the default config's
    (rel_err_vs_default, a failure above TOL).
The JSON holds every row, the sweep, the correctness checks, a ``dispatch`` table (for each method: w4, w8 fused
vs dequant + F.linear, dense: dense_gemv vs F.linear, and (N, K), the M where fused wins) and
``dispatch_table_file``: the same in roofline/quant/dispatch_tables/<device>.json's format, ready to copy.
The whole script keeps to --budget-s (default 140 s on one H200; rows past it are recorded as skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
M_VALUES = [1, 4, 16, 64, 256, 1024, 4096]
CHECK_M = [1, 3, 16, 48, 200, 300]  # one M per CONFIGS bucket (GEMV 1, GEMV 3 of 4 rows, <=16, <=64, <=256, more)
GEMV_M = (1, 4, 16)  # M of the explicit "... gemv" / "... dot" timing rows
DRY_SHAPES = {"qkv": (96, 128), "o": (64, 128), "gate_up": (160, 128), "down": (64, 256)}
DRY_M = [1, 3, 20]
GROUP_SIZE = 128
TOL = 1e-2  # ||out - ref64|| / ||ref64||, bf16 (fp16 in --dry-run: same bound, it is looser there)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(os.environ.get("OUT", "bench/results"), "quant_gemm.json"),
                    help="JSON output path (default $OUT/quant_gemm.json)")
    ap.add_argument("--dry-run", action="store_true",
                    help="CPU under TRITON_INTERPRET=1 at tiny shapes, fp16 (checks the script, not speed)")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"comma list of {sorted(SHAPES)}")
    ap.add_argument("--m", default=None, help="comma list of M (default 1,4,16,64,256,1024,4096)")
    ap.add_argument("--group-size", type=int, default=GROUP_SIZE)
    ap.add_argument("--reps", type=int, default=30, help="timed calls per row (median reported)")
    ap.add_argument("--no-sweep", action="store_true", help="skip the M = 1/16 config sweep")
    ap.add_argument("--budget-s", type=float, default=140.0,
                    help="wall-clock budget: timing rows past it are skipped (recorded), the sweep runs only "
                         "before 60%% of it")
    args = ap.parse_args(argv)
    bad = [s for s in args.shapes.split(",") if s not in SHAPES]
    if bad:
        ap.error(f"unknown shape(s) {bad}; choose from {sorted(SHAPES)}")
    args.shape_list = args.shapes.split(",")
    args.m_list = [int(v) for v in args.m.split(",")] if args.m else (DRY_M if args.dry_run else M_VALUES)
    if any(m < 1 for m in args.m_list):
        ap.error("M values must be >= 1")
    return args


class Bench:
    def __init__(self, args: argparse.Namespace):
        import torch

        self.args = args
        self.torch = torch
        self.dev = "cpu" if args.dry_run else "cuda"
        self.dtype = torch.float16 if args.dry_run else torch.bfloat16
        self.t0 = time.time()
        self.failures: list[str] = []
        self.checks: list[dict] = []
        self.rows: list[dict] = []
        self.sweep: list[dict] = []
        self._flush = None

    def elapsed(self) -> float:
        return time.time() - self.t0

    def time_ms(self, fn) -> float:
        """Median ms of ``--reps`` calls, each after a 256 MiB write that evicts L2 (50 MiB on the H200), timed
        with CUDA events around the call alone (what triton.testing.do_bench does, with a fixed count so
        that a 5 us kernel does not run thousands of times). One untimed call first (compile, warm-up)."""
        torch = self.torch
        fn()
        reps = self.args.reps
        if self.dev != "cuda":
            samples = []
            for _ in range(min(reps, 2)):
                t = time.perf_counter()
                fn()
                samples.append((time.perf_counter() - t) * 1e3)
            return statistics.median(samples)
        if self._flush is None:
            self._flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
        for _ in range(2):
            fn()
        for i in range(reps):
            self._flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends, strict=True))

    def bandwidth(self) -> dict:
        torch = self.torch
        nbytes = (2**30) if self.dev == "cuda" else (2**22)
        src = torch.ones(nbytes // 4, dtype=torch.float32, device=self.dev)
        dst = torch.empty_like(src)
        copy_ms = self.time_ms(lambda: dst.copy_(src))
        read_ms = self.time_ms(lambda: src.sum())
        return dict(copy_bytes_per_s=2 * nbytes / (copy_ms * 1e-3), read_bytes_per_s=nbytes / (read_ms * 1e-3))

    # ------------------------------------------------------------------------------------ weights

    def make_weights(self, n: int, k: int) -> dict:
        from roofline.kernels import quant_gemm as qg
        from roofline.quant.quantize import (
            quantize_fp8_per_channel,
            quantize_int4_rtn,
            quantize_int8_per_channel,
        )

        torch = self.torch
        g = torch.Generator(device=self.dev).manual_seed(n * 7 + k)
        w = torch.randn(n, k, device=self.dev, generator=g) * 0.02
        c4 = quantize_int4_rtn(w, self.args.group_size)
        c4.scales = c4.scales.to(self.dtype).float()  # what the kernel stores, so ref64 sees the same weight
        c8 = quantize_int8_per_channel(w)
        cf8 = quantize_fp8_per_channel(w)
        return dict(
            dense=w.to(self.dtype), c4=c4, p4=qg.prepare_int4(c4, self.dtype), c8=c8, p8=qg.prepare_int8(c8),
            fp8_t=cf8.q.t(), fp8_scale=cf8.scales.reshape(1, -1).float(),  # [K, N] column-major, [1, N]
        )

    # ------------------------------------------------------------------------------------ (a) correctness

    def check(self, name: str, shape: str, m: int, out, ref64) -> None:
        torch = self.torch
        out64 = out.double()
        err = float("inf") if not torch.isfinite(out64).all() else \
            float((out64 - ref64).norm() / ref64.norm().clamp_min(1e-30))
        ok = err < TOL
        self.checks.append(dict(kernel=name, shape=shape, m=m, rel_err=err, tol=TOL, ok=ok))
        if not ok:
            self.failures.append(f"{name} {shape} M={m}: rel err {err:.3e} >= {TOL}")

    def check_exact(self, name: str, shape: str, m: int, ok: bool, detail: str = "") -> None:
        self.checks.append(dict(kernel=name, shape=shape, m=m, exact=True, ok=bool(ok), detail=detail))
        if not ok:
            self.failures.append(f"{name} {shape} M={m}: not exact {detail}")

    def correctness(self, shape: str, n: int, k: int, wts: dict) -> None:
        from roofline.kernels import quant_gemm as qg
        from roofline.quant.quantize import quantize_per_token_fp8, quantize_per_token_int8

        torch = self.torch
        c4, p4, c8, p8 = wts["c4"], wts["p4"], wts["c8"], wts["p8"]
        grp = torch.arange(k, device=self.dev) // c4.group_size
        w4_64 = (c4.q.double() - c4.zeros.double()[:, grp]) * c4.scales.double()[:, grp]
        w8_64 = c8.q.double() * c8.scales.double()[:, None]
        wd_64 = wts["dense"].double()
        d4 = qg.dequantize_int4(p4.qweight, p4.scales, p4.zeros, c4.group_size)
        self.check_exact("dequantize_int4", shape, 0, torch.equal(d4, c4.dequantize(self.dtype)))
        d8 = qg.dequantize_int8(p8.q, p8.scales, self.dtype)
        self.check_exact("dequantize_int8", shape, 0, torch.equal(d8, c8.dequantize(self.dtype)))
        del d4, d8
        for m in DRY_M if self.args.dry_run else CHECK_M:
            x = (torch.randn(m, k, device=self.dev) * 0.5).to(self.dtype)
            x64 = x.double()
            self.check("w4a16_gemm", shape, m, qg.w4a16_gemm(x, p4.qweight, p4.scales, p4.zeros, c4.group_size),
                       x64 @ w4_64.t())
            self.check("w8a16_gemm", shape, m, qg.w8a16_gemm(x, p8.q, p8.scales), x64 @ w8_64.t())
            self.check("dense_gemv", shape, m, qg.dense_gemv(x, wts["dense"]), x64 @ wd_64.t())
            xq, xs = qg.per_token_quant_int8(x)
            rq, rs = qg.ref_per_token_quant_int8(x)
            cq, _ = quantize_per_token_int8(x)
            lsb = int((xq.int() - cq.int()).abs().max())
            self.check_exact("per_token_quant_int8", shape, m, torch.equal(xq, rq) and torch.equal(xs, rs) and lsb <= 1,
                             f"max |q - quantize_per_token_int8| = {lsb} LSB")
            xq64 = xq.double() * xs.double()
            self.check("int8_gemm", shape, m, qg.int8_gemm(xq, xs, p8.q, p8.scales, self.dtype), xq64 @ w8_64.t())
            if m > 16:  # torch._int_mm needs M > 16
                try:
                    acc = torch._int_mm(xq, p8.q.t())  # exact int32; float64 sums of int products are exact too
                    self.check_exact("torch._int_mm", shape, m, torch.equal(acc.double(),
                                                                            xq.double() @ p8.q.double().t()))
                except RuntimeError as e:
                    self.checks.append(dict(kernel="torch._int_mm", shape=shape, m=m, error=str(e)[:200]))
            try:
                tq, ts = qg.per_token_quant_fp8(x)
                rq, rs = qg.ref_per_token_quant_fp8(x)
                fq, fs = quantize_per_token_fp8(x)
                self.check_exact("per_token_quant_fp8", shape, m, torch.equal(ts, rs) and torch.equal(
                    tq.view(torch.uint8), rq.view(torch.uint8)) or self.args.dry_run,  # interpreter: fp8 cast wrong
                    f"max |scale - quantize_per_token_fp8| = {float((ts - fs).abs().max()):.3e}")
            except Exception as e:  # noqa: BLE001 - recorded
                self.failures.append(f"per_token_quant_fp8 {shape} M={m}: {type(e).__name__}: {str(e)[:200]}")
            try:
                fq, fs = quantize_per_token_fp8(x)
                out = torch._scaled_mm(fq, wts["fp8_t"], scale_a=fs, scale_b=wts["fp8_scale"], out_dtype=self.dtype)
                ref = (fq.double() * fs.double()) @ (wts["fp8_t"].double() * wts["fp8_scale"].double())
                self.check("fp8 _scaled_mm", shape, m, out, ref)
            except (RuntimeError, NotImplementedError) as e:  # CPU builds may lack fp8 _scaled_mm
                self.checks.append(dict(kernel="fp8 _scaled_mm", shape=shape, m=m, error=str(e)[:200]))
        worst = {}
        for c in self.checks:
            if c.get("shape") == shape and "rel_err" in c:
                worst[c["kernel"]] = max(worst.get(c["kernel"], 0.0), c["rel_err"])
        print(f"[check] {shape:>8} N={n} K={k}: " + "  ".join(f"{kk} {v:.1e}" for kk, v in worst.items()), flush=True)

    # ------------------------------------------------------------------------------------ (b) timing

    def methods(self, m: int, wts: dict, x) -> dict:
        """name -> (callable, bytes of the format's weights)."""
        import torch.nn.functional as F

        from roofline.kernels import quant_gemm as qg
        from roofline.quant.quantize import quantize_per_token_fp8

        torch = self.torch
        p4, p8, g = wts["p4"], wts["p8"], wts["c4"].group_size
        dense = wts["dense"]
        b16 = dense.numel() * dense.element_size()
        b4, b8 = p4.weight_bytes(), p8.weight_bytes()
        bf8 = wts["fp8_t"].numel() + 4 * wts["fp8_t"].shape[1]
        xq, xs = qg.per_token_quant_int8(x)
        fq, fs = quantize_per_token_fp8(x)
        out: dict = {"bf16 F.linear": (lambda: F.linear(x, dense), b16)}
        if m <= 16:
            out["dense_gemv"] = (lambda: qg.dense_gemv(x, dense), b16)
        if m in GEMV_M:  # both small-M variants by name (the default above is one of them)
            gv = {f: qg.pick_config(f, min(m, 4)) for f in ("int4", "int8", "int8_int8", "dense")}
            dt = {f: qg.pick_config(f, 16) for f in gv}
            for tag, c in (("gemv", gv), ("dot", dt)):
                out[f"w4a16 {tag}"] = (lambda c=c: qg.w4a16_gemm(x, p4.qweight, p4.scales, p4.zeros, g,
                                                                 config=c["int4"]), b4)
                out[f"w8a16 {tag}"] = (lambda c=c: qg.w8a16_gemm(x, p8.q, p8.scales, config=c["int8"]), b8)
                out[f"int8_gemm {tag}"] = (lambda c=c: qg.int8_gemm(xq, xs, p8.q, p8.scales, self.dtype,
                                                                    config=c["int8_int8"]), b8)
                out[f"dense {tag}"] = (lambda c=c: qg.dense_gemv(x, dense, config=c["dense"]), b16)
        out.update({
            "w4a16 fused": (lambda: qg.w4a16_gemm(x, p4.qweight, p4.scales, p4.zeros, g), b4),
            "w4 dequant+F.linear": (lambda: F.linear(x, qg.dequantize_int4(p4.qweight, p4.scales, p4.zeros, g)), b4),
            "w8a16 fused": (lambda: qg.w8a16_gemm(x, p8.q, p8.scales), b8),
            "w8 dequant+F.linear": (lambda: F.linear(x, qg.dequantize_int8(p8.q, p8.scales, self.dtype)), b8),
            "int8_gemm": (lambda: qg.int8_gemm(xq, xs, p8.q, p8.scales, self.dtype), b8),
            "int8 quant+int8_gemm": (lambda: qg.int8_gemm(*qg.per_token_quant_int8(x), p8.q, p8.scales, self.dtype), b8),
            "int8 quant": (lambda: qg.per_token_quant_int8(x), 0),
            "fp8 tquant": (lambda: qg.per_token_quant_fp8(x), 0),
        })
        if m > 16:
            out["torch._int_mm"] = (lambda: torch._int_mm(xq, p8.q.t()), b8)
        out["fp8 _scaled_mm"] = (lambda: torch._scaled_mm(fq, wts["fp8_t"], scale_a=fs, scale_b=wts["fp8_scale"],
                                                          out_dtype=self.dtype), bf8)

        def fp8_quant_mm():
            q, s = quantize_per_token_fp8(x)
            return torch._scaled_mm(q, wts["fp8_t"], scale_a=s, scale_b=wts["fp8_scale"], out_dtype=self.dtype)

        def fp8_tquant_mm():
            q, s = qg.per_token_quant_fp8(x)
            return torch._scaled_mm(q, wts["fp8_t"], scale_a=s, scale_b=wts["fp8_scale"], out_dtype=self.dtype)

        out["fp8 quant+_scaled_mm"] = (fp8_quant_mm, bf8)
        out["fp8 tquant+_scaled_mm"] = (fp8_tquant_mm, bf8)
        return out

    def timing(self, shape: str, n: int, k: int, wts: dict, bw: float) -> None:
        torch = self.torch
        for m in self.args.m_list:
            x = (torch.randn(m, k, device=self.dev) * 0.5).to(self.dtype)
            act_bytes = m * k * x.element_size() + m * n * x.element_size()
            try:
                methods = self.methods(m, wts, x)
            except Exception as e:  # noqa: BLE001 - e.g. a quantizer that fails to compile: recorded, next M
                self.rows.append(dict(shape=shape, n=n, k=k, m=m, method="(methods)", error=str(e)[:200]))
                print(f"  {shape:>8} M={m:<5} methods error: {type(e).__name__}: {str(e)[:200]}", flush=True)
                continue
            for name, (fn, wbytes) in methods.items():
                row = dict(shape=shape, n=n, k=k, m=m, method=name, weight_bytes=wbytes, act_bytes=act_bytes)
                if self.elapsed() > self.args.budget_s:
                    row["skipped"] = "time budget"
                    self.rows.append(row)
                    continue
                try:
                    ms = self.time_ms(fn)
                except Exception as e:  # noqa: BLE001 - compile / launch / resources: recorded, the rest runs
                    row["error"] = f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0][:200]
                    self.rows.append(row)
                    print(f"  {shape:>8} M={m:<5} {name:<22} error: {row['error']}", flush=True)
                    continue
                bound_ms = (wbytes + act_bytes) / bw * 1e3
                row.update(ms=ms, tflops=2 * m * n * k / (ms * 1e-3) / 1e12, bound_ms=bound_ms,
                           frac_of_read_bound=bound_ms / ms)
                self.rows.append(row)
                print(f"  {shape:>8} M={m:<5} {name:<24} {ms * 1e3:9.1f} us {row['tflops']:8.1f} TFLOP/s "
                      f"{row['frac_of_read_bound']:6.3f} of read bound", flush=True)

    # ------------------------------------------------------------------------------------ (c) sweep

    def config_sweep(self, shape: str, n: int, k: int, wts: dict, bw: float) -> None:
        from roofline.kernels import quant_gemm as qg

        C = qg.GemmConfig
        torch = self.torch
        p4, p8, g = wts["p4"], wts["p8"], wts["c4"].group_size
        # Few candidates: each new (config, split) pair is a compile (~1-3 s). split_k None = choose_split_k.
        # GEMV (gemv=True): block_m rows per program; tl.dot: the best of the 2026-12-01 sweep per format.
        gemv = {
            "int4": [C(1, bn, 128, w, 3, split_k=sk, gemv=True) for bn, w, sk in
                     ((64, 4, None), (128, 4, None), (256, 4, None), (128, 8, None), (128, 4, 1), (256, 8, 2))],
            "int8": [C(1, bn, bk, w, 3, gemv=True) for bn, bk, w in
                     ((32, 256, 8), (16, 256, 4), (64, 128, 8), (16, 512, 8), (8, 512, 4))],
            "int8_int8": [C(1, bn, bk, w, 3, gemv=True) for bn, bk, w in ((32, 256, 8), (16, 512, 8))],
            "dense": [C(1, bn, bk, w, 3, gemv=True) for bn, bk, w in
                      ((16, 256, 4), (32, 256, 8), (8, 512, 4), (32, 128, 4), (16, 512, 8))],
        }
        dot = {
            "int4": [C(16, 64, 128, 4, 3, unpack=1), C(16, 64, 128, 4, 3, split_k=8, unpack=1)],
            "int8": [C(16, 32, 128, 4, 4), C(16, 64, 128, 4, 3)],
            "int8_int8": [C(16, 64, 128, 4, 4)],
            "dense": [C(16, 64, 128, 4, 4, split_k=8), C(16, 32, 256, 4, 4)],
        }
        xq_cache = {}

        def call(fmt, x, cfg):
            if fmt == "int4":
                return qg.w4a16_gemm(x, p4.qweight, p4.scales, p4.zeros, g, config=cfg)
            if fmt == "int8":
                return qg.w8a16_gemm(x, p8.q, p8.scales, config=cfg)
            if fmt == "int8_int8":
                xq, xs = xq_cache.setdefault(id(x), qg.per_token_quant_int8(x))
                return qg.int8_gemm(xq, xs, p8.q, p8.scales, self.dtype, config=cfg)
            return qg.dense_gemv(x, wts["dense"], config=cfg)

        wbytes = {"int4": p4.weight_bytes(), "int8": p8.weight_bytes(), "int8_int8": p8.weight_bytes(),
                  "dense": wts["dense"].numel() * wts["dense"].element_size()}
        for m in (1, 16):
            x = (torch.randn(m, k, device=self.dev) * 0.5).to(self.dtype)
            for fmt in gemv:
                # At M = 16 the GEMV runs 4 rows per program (4 row tiles re-read the weight, mostly from L2).
                cfgs = [c if m == 1 else C(4, max(8, c.block_n // 2), c.block_k, c.num_warps, c.num_stages,
                                           split_k=c.split_k, gemv=True) for c in gemv[fmt][:3]] + dot[fmt]
                try:
                    ref = call(fmt, x, None).double()
                except Exception as e:  # noqa: BLE001 - recorded; the candidates still run
                    ref = None
                    self.failures.append(f"sweep default {fmt} {shape} M={m}: {type(e).__name__}: {str(e)[:200]}")
                for cfg in cfgs:
                    if self.elapsed() > self.args.budget_s:
                        return
                    row = dict(shape=shape, n=n, k=k, m=m, format=fmt, config=dict(cfg.__dict__))
                    try:
                        out = call(fmt, x, cfg)
                        if ref is not None:
                            err = float((out.double() - ref).norm() / ref.norm().clamp_min(1e-30))
                            row["rel_err_vs_default"] = err
                            if not err < TOL:
                                self.failures.append(f"sweep {fmt} {shape} M={m} {cfg}: rel err vs default {err:.2e}")
                        ms = self.time_ms(lambda c=cfg: call(fmt, x, c))
                    except Exception as e:  # noqa: BLE001 - compile / launch / resources: recorded, next one
                        row["error"] = f"{type(e).__name__}: " + (str(e).splitlines() or [""])[0][:200]
                        self.sweep.append(row)
                        print(f"[sweep] {shape:>8} M={m:<3} {fmt:<9} {cfg} error: {row['error']}", flush=True)
                        continue
                    row.update(ms=ms, frac_of_read_bound=(wbytes[fmt] + 2 * m * (n + k)) / bw / (ms * 1e-3))
                    self.sweep.append(row)
            for fmt in gemv:
                done = [r for r in self.sweep if r["shape"] == shape and r["m"] == m and r["format"] == fmt and "ms" in r]
                if done:
                    best = min(done, key=lambda r: r["ms"])
                    print(f"[sweep] {shape:>8} M={m:<3} {fmt:<9} best {best['ms'] * 1e3:7.1f} us "
                          f"({best['frac_of_read_bound']:.3f} of read bound) {best['config']}", flush=True)


def dispatch_table(rows: list[dict]) -> list[dict]:
    """For each (method, N, K): the M values where the fused kernel beats the dense path at the same M."""
    pairs = {"w4": ("w4a16 fused", "w4 dequant+F.linear"), "w8": ("w8a16 fused", "w8 dequant+F.linear"),
             "dense": ("dense_gemv", "bf16 F.linear")}
    out = []
    t = {(r["method"], r["n"], r["k"], r["m"]): r["ms"] for r in rows if "ms" in r}
    for method, (fused, other) in pairs.items():
        for n, k in sorted({(r["n"], r["k"]) for r in rows}):
            ms_all = sorted({m for (meth, nn, kk, m) in t if meth == fused and (nn, kk) == (n, k)})
            wins = [m for m in ms_all if (other, n, k, m) in t and t[(fused, n, k, m)] < t[(other, n, k, m)]]
            both = [m for m in ms_all if (other, n, k, m) in t]
            out.append(dict(method=method, fused=fused, dense_path=other, n=n, k=k, m_measured=both,
                            fused_wins_at_m=wins, speedup={m: t[(other, n, k, m)] / t[(fused, n, k, m)] for m in both}))
    return out


def dispatch_table_file(dispatch: list[dict], source: str) -> dict:
    """``dispatch`` (from :func:`dispatch_table`) in roofline/quant/dispatch_tables/<device>.json's format:
    ``{"int4" | "int8": [{"n", "k", "fused_max_m"}]}``, ``fused_max_m`` the largest measured M up to which the
    fused kernel won at every measured M (0 = lost at the smallest), since ``use_fused`` takes ``m <= fused_max_m``."""
    out: dict = {"_source": source}
    for method, fmt in (("w4", "int4"), ("w8", "int8")):
        rows = []
        for d in dispatch:
            if d["method"] != method or not d["m_measured"]:
                continue
            best = 0
            for m in sorted(d["m_measured"]):
                if m not in d["fused_wins_at_m"]:
                    break
                best = m
            rows.append(dict(n=d["n"], k=d["k"], fused_max_m=best))
        out[fmt] = rows
    return out


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.dry_run:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton compiles anything
    import torch
    import triton

    if not args.dry_run and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run (TRITON_INTERPRET=1) on a CPU", file=sys.stderr)
        return 2
    b = Bench(args)
    shapes = DRY_SHAPES if args.dry_run else SHAPES
    bw = b.bandwidth()
    print(f"copy {bw['copy_bytes_per_s'] / 1e12:.2f} TB/s, read {bw['read_bytes_per_s'] / 1e12:.2f} TB/s "
          f"(the read bound uses copy)", flush=True)
    for shape in args.shape_list:
        n, k = shapes[shape]
        wts = b.make_weights(n, k)
        for stage in (b.correctness, b.timing):
            try:  # one kernel that fails to launch must not hide the others' figures
                stage(shape, n, k, wts) if stage == b.correctness else stage(shape, n, k, wts, bw["copy_bytes_per_s"])
            except Exception as e:  # noqa: BLE001 - recorded and reported, exit status 1
                b.failures.append(f"{shape} {stage.__name__}: {type(e).__name__}: {str(e)[:200]}")
                print(f"{shape} {stage.__name__} FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
        del wts
        if b.dev == "cuda":
            torch.cuda.empty_cache()
    if not args.no_sweep and b.elapsed() < 0.6 * args.budget_s:
        for shape in args.shape_list:
            n, k = shapes[shape]
            try:
                wts = b.make_weights(n, k)
                b.config_sweep(shape, n, k, wts, bw["copy_bytes_per_s"])
                del wts
            except Exception as e:  # noqa: BLE001 - recorded; the JSON is still written
                b.failures.append(f"{shape} config_sweep: {type(e).__name__}: {str(e)[:200]}")
                print(f"{shape} config_sweep FAILED: {type(e).__name__}: {str(e)[:200]}", flush=True)
    result = dict(
        bench="quant_gemm", device=torch.cuda.get_device_name() if b.dev == "cuda" else "cpu (interpreter)",
        dry_run=args.dry_run, torch=torch.__version__, triton=triton.__version__, commit=_git_commit(),
        date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        dtype=str(b.dtype), group_size=args.group_size, shapes={s: shapes[s] for s in args.shape_list},
        bandwidth=bw, configs=_configs(),
        correctness=b.checks, failures=b.failures, rows=b.rows, sweep=b.sweep, dispatch=dispatch_table(b.rows),
    )
    result["dispatch_table_file"] = dispatch_table_file(
        result["dispatch"], f"bench/gpu_quant_gemm.py on the {result['device']}, {result['date'][:10]} (commit "
        f"{(result['commit'] or '?')[:7]}): the largest M of {sorted(set(args.m_list))} up to which the fused Triton "
        "kernel beat dequantize + cuBLAS at every measured M; 0 = never")
    result["elapsed_s"] = b.elapsed()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=_json_default))
    print(f"wrote {out} ({len(b.rows)} rows, {len(b.sweep)} sweep rows) in {b.elapsed():.0f} s")
    for d in result["dispatch"]:
        print(f"[dispatch] {d['method']:<5} N={d['n']:<6} K={d['k']:<6} fused wins at M {d['fused_wins_at_m']}")
    print("[dispatch_table_file] " + json.dumps({f: v for f, v in result["dispatch_table_file"].items()
                                                  if not f.startswith("_")}))
    if b.failures:
        print("CORRECTNESS FAILURES:\n  " + "\n  ".join(b.failures), file=sys.stderr)
        return 1
    return 0


def _configs():
    """CONFIGS as JSON: (largest M or None for the last row, the config's fields)."""
    from roofline.kernels.quant_gemm import CONFIGS

    return {f: [(m if m < 2**31 else None, c.__dict__) for m, c in rows] for f, rows in CONFIGS.items()}


def _json_default(o):
    return str(o)  # torch dtypes and anything else without a JSON form


if __name__ == "__main__":
    sys.exit(main())
