"""Prefill-sized GEMMs (M >= 2048) per weight format, through the engine's own linear paths
(``roofline.kernels.linear_dispatch``), against bf16 cuBLAS (``F.linear``) measured in the same process.

Issue 28's targets at M >= 2048: fp8 W8A8 >= 1.5x bf16, int8 SmoothQuant (W8A8) >= 1.3x, int4 (W4A16 g128) >= 0.9x.
Paths timed (llama-3-8b projections, bf16 activations, random weights):

==============  ===========================================================================
bf16            ``F.linear`` (cuBLAS)
fp8             ``fp8_w8a8``: per-token E4M3 quantization (Triton) + ``torch._scaled_mm`` (cuBLASLt)
int8_w8a8       ``int8_w8a8``: per-token INT8 quantization (Triton) + our INT8 tensor-core GEMM
int8_w8a8_torch the same with ``torch._int_mm`` (cuBLASLt) and a float32 rescale, for comparison
int4            ``w4a16``: at this M, dequantize to bf16 (Triton) + ``F.linear``
int8            ``w8a16`` (weight-only): dequantize + ``F.linear``
==============  ===========================================================================

Each path is checked against float64 (relative Frobenius error printed). Times are CUDA-event medians of
``--reps`` back-to-back calls after warm-up (these GEMMs take 0.1-2 ms, so launch gaps do not matter).

``--producer``: each path also runs the kernel that produces its input in a decoder layer, as the engine does:
residual add + RMSNorm before qkv and gate_up, SiLU-and-mul (of a [M, 2K] gate_up output) before down, nothing
before o (attention). Two more paths then show the fusion of issue 28: ``fp8_fused`` / ``int8_w8a8_fused``, the
producer writing the per-token codes itself (``roofline.kernels.act_quant.rmsnorm_quant`` /
``silu_and_mul_quant``) so the linear skips its quantizer.

Usage (H200, repo root): PYTHONPATH=. python bench/gpu_prefill_gemm.py --out OUT.json [--ms 2048,4096,8192]
[--producer]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="2048,4096,8192")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--producer", action="store_true", help="time each path with the kernel producing its input")
    args = ap.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from roofline.kernels import act_quant
    from roofline.kernels import linear_dispatch as ld
    from roofline.kernels.activation import silu_and_mul
    from roofline.kernels.rmsnorm import fused_add_rmsnorm
    from roofline.kernels.switch import set_kernels_enabled
    from roofline.quant.quantize import quantize_fp8_per_channel, quantize_int4_rtn, quantize_int8_per_channel

    dev, dt = torch.device("cuda"), torch.bfloat16
    torch.manual_seed(0)
    set_kernels_enabled(True)  # the Triton kernels, as the engine's worker turns them on

    def time_ms(fn) -> float:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(args.reps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            samples.append(a.elapsed_time(b))
        return statistics.median(samples)

    def int_mm_path(x, layer):
        qk = ld._quant_kernels(x)
        xq, xs = qk.per_token_quant_int8(x)
        acc = torch._int_mm(xq, layer.qweight.t())
        return (acc.float() * xs * layer.weight_scale[None, :]).to(x.dtype)

    def producer_of(name, m, k, norm_w):
        """(the producer's inputs, the producer, its fused-quantization form) of a projection's input."""
        if args.producer and name == "down":  # x = silu_and_mul(the gate_up output)
            return ((torch.randn(m, 2 * k, device=dev, dtype=dt),), silu_and_mul, act_quant.silu_and_mul_quant)
        if args.producer and name != "o":  # x = rmsnorm(h + residual)
            def produce(h, r):
                return fused_add_rmsnorm(h, r, norm_w, 1e-5)[0]

            def produce_q(h, r, fmt):
                return act_quant.rmsnorm_quant(h, r, norm_w, 1e-5, fmt)[:2]

            return (torch.randn(m, k, device=dev, dtype=dt), torch.randn(m, k, device=dev, dtype=dt)), produce, produce_q
        return (torch.randn(m, k, device=dev, dtype=dt),), (lambda v: v), None

    def with_producer(path, fn0, produce, produce_q):
        if path.endswith("_fused"):  # the producer writes the codes; the linear takes them
            fmt = "fp8" if path.startswith("fp8") else "int8"
            return lambda *a: fn0(act_quant.QuantizedActivation(*produce_q(*a, fmt), dt))
        return lambda *a: fn0(produce(*a))

    # Clocks up before the first timed point (the first shape measured ~8% slow without this).
    a = torch.randn(4096, 4096, device=dev, dtype=dt)
    for _ in range(200):
        a @ a
    torch.cuda.synchronize()
    rows = []
    print(f"{'shape':>8} {'M':>5} {'path':>16} {'ms':>8} {'TFLOP/s':>8} {'vs bf16':>8} {'rel err':>9}", flush=True)
    for name in args.shapes.split(","):
        n, k = SHAPES[name]
        w = torch.randn(n, k, device=dev, dtype=torch.float32) * 0.02
        w8 = quantize_int8_per_channel(w)
        f8 = quantize_fp8_per_channel(w)
        w4 = quantize_int4_rtn(w, 128)
        l_int8 = SimpleNamespace(**ld.prepare_int8_w8a8(w8))
        l_w4 = SimpleNamespace(**ld.prepare_w4a16(w4, dt), int4_group_size=128)
        fq, fs = f8.q.contiguous(), f8.scales.float().contiguous()
        wb = w.to(dt)
        refs = {"bf16": wb.double(), "fp8": f8.dequantize(torch.float64), "int8_w8a8": w8.dequantize(torch.float64),
                "int8_w8a8_torch": w8.dequantize(torch.float64), "int4": w4.dequantize(torch.float64),
                "int8": w8.dequantize(torch.float64)}
        paths = {
            "bf16": lambda x, wb=wb: F.linear(x, wb),
            "fp8": lambda x, fq=fq, fs=fs: ld.fp8_w8a8(x, fq, fs),
            "int8_w8a8": lambda x, lay=l_int8: ld.int8_w8a8(x, lay),
            "int8_w8a8_torch": lambda x, lay=l_int8: int_mm_path(x, lay),
            "int4": lambda x, lay=l_w4: ld.w4a16(x, lay),
            "int8": lambda x, lay=l_int8: ld.w8a16(x, lay),
        }
        if args.producer and name != "o":
            refs["fp8_fused"], refs["int8_w8a8_fused"] = refs["fp8"], refs["int8_w8a8"]
            paths["fp8_fused"] = lambda qa, fq=fq, fs=fs: ld.fp8_w8a8(qa, fq, fs)
            paths["int8_w8a8_fused"] = lambda qa, lay=l_int8: ld.int8_w8a8(qa, lay)
        norm_w = (1 + 0.1 * torch.randn(k, device=dev)).to(dt)
        for m in (int(v) for v in args.ms.split(",")):
            src, produce, produce_q = producer_of(name, m, k, norm_w)
            x = produce(*src)
            base = None
            for path, fn0 in paths.items():
                fn = with_producer(path, fn0, produce, produce_q)
                try:
                    out = fn(*src)
                    ref = x.double() @ refs[path].t()
                    err = float((out.double() - ref).norm() / ref.norm())
                    ms = time_ms(lambda fn=fn, src=src: fn(*src))
                except Exception as e:  # noqa: BLE001 - report and go on
                    print(f"{name:>8} {m:>5} {path:>16} error: {type(e).__name__}: {e}", flush=True)
                    rows.append(dict(shape=name, n=n, k=k, m=m, path=path, error=str(e)))
                    continue
                tflops = 2 * m * n * k / ms / 1e9
                base = ms if path == "bf16" else base
                ratio = base / ms if base else float("nan")
                rows.append(dict(shape=name, n=n, k=k, m=m, path=path, ms=ms, tflops=tflops, speedup_vs_bf16=ratio,
                                 rel_err=err))
                print(f"{name:>8} {m:>5} {path:>16} {ms:>8.3f} {tflops:>8.1f} {ratio:>7.2f}x {err:>9.2e}", flush=True)
        del w, w8, f8, w4
        torch.cuda.empty_cache()
    # per path: geometric mean of the speedup over all shapes and M, and the sum-of-time ratio (a prefill's mix)
    print("\npath: total time of all shapes x M vs bf16 (a prefill's mix of projections)")
    summary = {}
    for path in dict.fromkeys(r["path"] for r in rows):
        got = [r for r in rows if r["path"] == path and "ms" in r]
        keys = {(r["shape"], r["m"]) for r in got}
        bf = sum(r["ms"] for r in rows if r["path"] == "bf16" and "ms" in r and (r["shape"], r["m"]) in keys)
        mine = sum(r["ms"] for r in got)
        if mine:
            summary[path] = bf / mine
            print(f"  {path:>16}: {bf / mine:.2f}x  ({len(got)} points)")
    info = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                triton=__import__("triton").__version__, producer=args.producer, rows=rows, summary=summary)
    Path(args.out).write_text(json.dumps(info, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
