"""Where the INT8 / FP8 weight-only swap-AB GEMM loses to bf16 at M = 128 / 256 (issue 28), and whether a cheaper
conversion makes 16-row tensor-core tiles beat the FMA GEMV at M = 1 / 16: the code conversion or
the register-A ``wgmma`` itself. One minimal swap-AB kernel (out^T = W @ x^T, the weight tile converted in registers
as the MMA's A operand), timed per conversion:

- ``i8_bf16``: int8 -> bf16 as ``quant_gemm`` does it (``0x4B000080 + q`` read as fp32, minus 2^23 + 128, then a
  cvt to bf16): about 3.5 instructions an element;
- ``i8_bf16x4``: int8 -> bf16 four at a time in inline PTX, x and the MMA stay bf16: two ``prmt`` put the bytes b
  under zero high bytes, then per pair ``A = 0x4300 | (b & 0x7F)`` (128 + low 7 bits) and ``B = 0x4300 | (b & 0x80)``
  (128, or 256 where the sign bit is set) by one ``lop3`` each, and ``sub.bf16x2`` gives A - B = q exactly
  (2 instructions an element);
- ``i8_f16x4``: int8 -> fp16 four at a time in inline PTX (xor 0x80 per byte, two ``prmt`` into ``0x64XX`` halves =
  1024 + 128 + q, two ``sub.f16x2``: 1.25 instructions an element), with x in fp16 and an fp16 MMA;
- ``f8_bf16`` / ``f8_f16``: E4M3 -> bf16 (via Triton's cast) and -> fp16 (``cvt.rn.f16x2.e4m3x2``);
- ``w16``: a 16-bit weight loaded straight into the A operand (no conversion: the structure's own cost).

Against cuBLAS bf16 and our table's kernel (``quant_gemm.w8a16_gemm``), all timed as ``gpu_quant_sweep.Sweep``
does (CUDA graph, L2 flushed), each checked against float64 first. Prints a table; writes ``--out`` JSON.

Usage (GPU, repo root): python bench/gpu_w8_convert_probe.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from roofline.kernels.quant_gemm import _int8x4_to_16bit  # noqa: E402 - after the path set-up

MODES = {"i8_bf16": 0, "i8_bf16x4": 5, "i8_f16x4": 1, "f8_bf16": 2, "f8_f16": 3, "w16": 4}
TILES = [(128, 64, 128, 4, 3), (128, 128, 64, 8, 3), (256, 64, 64, 8, 3), (64, 64, 128, 4, 4)]
# M <= 16 (decode at batch 1-16): 16-row tiles, narrow N so that the small projections still fill the SMs
TILES_SMALL = [(16, 64, 128, 4, 4), (16, 32, 128, 4, 4), (16, 64, 256, 4, 3), (16, 128, 128, 4, 4)]


@triton.jit
def _swap_kernel(X, W, S, Out, M, N, K, MODE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 BLOCK_K: tl.constexpr):
    pid_m = tl.program_id(0)  # fastest: the programs that share a weight tile run together (one HBM read)
    pid_n = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mmask = offs_m < M
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for kt in range(0, tl.cdiv(K, BLOCK_K)):
        ks = kt * BLOCK_K + offs_k
        x = tl.load(X + offs_m[:, None] * K + ks[None, :], mask=mmask[:, None], other=0)
        wp = W + offs_n[:, None].to(tl.int64) * K + ks[None, :]
        if MODE == 0:
            w = tl.load(wp)
            wf = ((w.to(tl.int32) + 0x4B000080).to(tl.float32, bitcast=True) - 8388736.0).to(x.dtype)
        elif MODE == 1:
            wf = _int8x4_to_16bit(tl.load(wp), tl.float16)
        elif MODE == 5:
            wf = _int8x4_to_16bit(tl.load(wp), tl.bfloat16)
        elif MODE == 2 or MODE == 3:
            wf = tl.load(wp.to(tl.pointer_type(tl.uint8))).to(tl.float8e4nv, bitcast=True).to(x.dtype)
        else:
            wf = tl.load(wp)
        acc = tl.dot(wf, tl.trans(x), acc)
    acc = tl.trans(acc) * tl.load(S + offs_n)[None, :]
    tl.store(Out + offs_m[:, None] * N + offs_n[None, :], acc.to(Out.dtype.element_ty), mask=mmask[:, None])


def main() -> int:
    import torch
    import torch.nn.functional as F
    from gpu_quant_sweep import SHAPES, TOL, Sweep

    from roofline.kernels import quant_gemm as qg
    from roofline.kernels.linear_dispatch import kernel_config
    from roofline.quant.quantize import quantize_int8_per_channel

    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,16,64,128,256")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--modes", default=",".join(MODES), help=f"comma list of {', '.join(MODES)}")
    args = ap.parse_args()
    args.dry_run = False
    sw = Sweep(args)
    rows, dev = [], torch.device("cuda")
    for shape, (n, k) in SHAPES.items():
        gen = torch.Generator(device="cuda").manual_seed(n + k)
        w = torch.randn(n, k, device="cuda", generator=gen) * 0.02
        c8 = quantize_int8_per_channel(w)
        ones = torch.ones(n, device="cuda")
        f8 = (w / w.abs().amax(1, keepdim=True) * 448).to(torch.float8_e4m3fn)
        dense = w.to(torch.bfloat16)
        ref = {"i8": c8.q.double() * c8.scales.double()[:, None], "f8": f8.double(), "w16": dense.double()}
        for m in map(int, args.ms.split(",")):
            xb = (torch.randn(m, k, device="cuda", generator=gen) * 0.5).to(torch.bfloat16)
            xh = xb.to(torch.float16)
            cands = [("bf16", None, lambda: F.linear(xb, dense), "w16"),
                     ("table", None, lambda: qg.w8a16_gemm(xb, c8.q, c8.scales,
                                                          config=kernel_config("int8", m, n, k, dev)), "i8")]
            for mode, code in [(md, MODES[md]) for md in args.modes.split(",")]:
                x = xh if mode.endswith(("f16", "f16x4")) else xb
                wt = {0: c8.q, 1: c8.q, 5: c8.q, 2: f8, 3: f8, 4: dense}[code]
                s = c8.scales if code in (0, 1, 5) else ones
                for bm, bn, bk, nw, ns in TILES_SMALL if m <= 16 else TILES:
                    out = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)

                    def fn(x=x, wt=wt, s=s, out=out, code=code, bm=bm, bn=bn, bk=bk, nw=nw, ns=ns):
                        _swap_kernel[(triton.cdiv(m, bm), n // bn)](x, wt, s, out, m, n, k, MODE=code, BLOCK_M=bm,
                                                                    BLOCK_N=bn, BLOCK_K=bk, num_warps=nw,
                                                                    num_stages=ns)
                        return out
                    cands.append((mode, (bm, bn, bk, nw, ns), fn, {0: "i8", 1: "i8", 5: "i8", 2: "f8", 3: "f8", 4: "w16"}[code]))
            for path, tile, fn, refk in cands:
                row = dict(shape=shape, n=n, k=k, m=m, path=path, tile=tile)
                try:
                    err = sw.rel(fn(), xb.double() @ ref[refk].t())
                    row["rel_err"] = err
                    if not err < TOL:
                        raise RuntimeError(f"rel err {err:.2e}")
                    row["us"] = sw.time_us(fn)
                except Exception as e:  # noqa: BLE001 - resources, compile: recorded, the probe goes on
                    row["error"] = f"{type(e).__name__}: {str(e)[:200]}"
                rows.append(row)
            best = {}
            for r in rows:
                if (r["shape"], r["m"]) == (shape, m) and "us" in r and r["us"] < best.get(r["path"], (1e9,))[0]:
                    best[r["path"]] = (r["us"], r["tile"])
            errs = {r["path"]: r["error"][:90] for r in rows if (r["shape"], r["m"]) == (shape, m) and "error" in r}
            print(f"{shape:>8} M={m:<4} " + "  ".join(f"{p} {u:6.1f}" for p, (u, _) in best.items()), flush=True)
            for p, e in errs.items():
                print(f"    {p}: {e}", flush=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                              triton=triton.__version__, rows=rows), indent=1))
    for m in map(int, args.ms.split(",")):
        paths = sorted({r["path"] for r in rows})
        sums = {p: sum(min((r["us"] for r in rows if (r["shape"], r["m"], r["path"]) == (s, m, p) and "us" in r),
                           default=float("nan")) for s in SHAPES) for p in paths}
        print(f"[layer sum] M={m} " + "  ".join(f"{p} {v:.0f}" for p, v in sums.items()), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
