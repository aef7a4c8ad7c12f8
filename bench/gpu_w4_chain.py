# ruff: noqa: B023  (every lambda below runs in the iteration that made it)
"""The INT4 tensor-core GEMM as decode runs it: L launches over L distinct weights of one Llama-3-8B projection,
back to back in one CUDA graph with programmatic dependent launch (so the weights come from HBM, not L2, and the
launch ramp and tail are paid as in a decode step). Per launch: microseconds and the fraction of read bandwidth
(codes + scales + zeros, measured `x.sum()` bandwidth in the same process), for

- ``mma``: ``w4a16_mma_gemm`` with a per-item grid (program = column tile x K split), several splits;
- ``persist``: the same kernel on a persistent grid (P programs per SM, each one stream of k-tiles);
- ``loads``: a kernel with exactly the mma kernel's weight loads and no arithmetic (XOR of the words): the
  memory side's ceiling for this access pattern;
- ``bf16``: cuBLAS (`F.linear`) on bf16 weights of the same shape (4x the bytes), for reference.

Every mma / persist config is first checked against a float64 oracle (rel err < 4e-3).

    python bench/gpu_w4_chain.py --out $OUT/w4_chain.json [--ms 1,8] [--shapes qkv,o,gate_up,down] [--chain 12]
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

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl

    @gluon.jit
    def _loads_kernel(W, Out, N, K, k_tiles_per_split, BN: gl.constexpr, NUM_WARPS: gl.constexpr):
        # The mma kernel's weight loads (same layout, one tile ahead), XOR-reduced: no dequantization, no MMA.
        pid_n = gl.program_id(0)
        split = gl.program_id(1)
        C: gl.constexpr = BN // 16
        w_layout: gl.constexpr = gl.BlockedLayout([1, 2, 1, 1, 4], [1, 1, 8, 4, 1], [NUM_WARPS, 1, 1, 1, 1],
                                                  [4, 1, 3, 2, 0])
        l4: gl.constexpr = gl.SliceLayout(4, w_layout)
        offs_c = gl.arange(0, C, layout=gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(3, l4))))
        offs_h = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(2, gl.SliceLayout(3, l4))))
        offs_g = gl.arange(0, 8, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(3, l4))))
        offs_t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, l4))))
        offs_rb = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, gl.SliceLayout(
            3, w_layout)))))
        n4 = pid_n * BN + offs_c[:, None, None, None] * 16 + offs_h[None, :, None, None] * 8 \
            + offs_g[None, None, :, None]
        w_off = ((n4 * 16 + offs_t[None, None, None, :] * 4)[:, :, :, :, None] + offs_rb[None, None, None, None, :])
        tile_words = 16 * N
        kt_start = split * k_tiles_per_split
        kt_end = gl.minimum(kt_start + k_tiles_per_split, K // 128)
        acc = gl.zeros([C, 2, 8, 4, 4], gl.int32, w_layout)
        w_next = gl.load(W + kt_start.to(gl.int64) * tile_words + w_off)
        for kt in range(kt_start, kt_end):
            words = w_next
            w_next = gl.load(W + gl.minimum(kt + 1, kt_end - 1).to(gl.int64) * tile_words + w_off)
            acc = acc ^ words
        gl.store(Out + w_off * 0, acc)  # one word, any thread's: the loads must not be dead code
except Exception:  # noqa: BLE001
    gluon = None


def read_bandwidth() -> float:
    x = torch.ones(2**30 // 2, dtype=torch.bfloat16, device="cuda")
    for _ in range(3):
        x.sum()
    torch.cuda.synchronize()
    t = []
    for _ in range(10):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        x.sum()
        b.record()
        torch.cuda.synchronize()
        t.append(a.elapsed_time(b) * 1e-3)
    return 2**30 / statistics.median(t)


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
    t = []
    for _ in range(7):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        torch.cuda.synchronize()
        t.append(a.elapsed_time(b) * 1e3)
    del g
    return statistics.median(t) / len(fns)


def main(argv=None) -> int:
    from roofline.kernels.w4a16_mma import MmaConfig, repack_int4_mma, w4a16_mma_gemm

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default="1,8")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--chain", type=int, default=12)
    ap.add_argument("--splits", default="none,2,4,8,16")
    ap.add_argument("--persist", default="1,2,4")
    args = ap.parse_args(argv)
    bw = read_bandwidth()
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

            bm = 8 if m <= 8 else 16
            cfgs = []
            for bn, nw in ((128, 4), (128, 8), (256, 8)):
                for sp in splits:
                    cfgs.append(MmaConfig(bm, bn, nw, 1, True, sp))
                    for p in [int(v) for v in args.persist.split(",")]:
                        if sp is None or kt % sp == 0:
                            cfgs.append(MmaConfig(bm, bn, nw, 1, True, sp, p))
            for cfg in cfgs:
                try:
                    out = w4a16_mma_gemm(x, qm0, s0, z0, config=cfg)
                    err = float((out.double() - ref).norm() / ref.norm())
                    if not err < 4e-3:
                        record("persist" if cfg.persistent else "mma", cfg._asdict(), float("nan"), err)
                        continue
                    us = chain_us([lambda w=w: w4a16_mma_gemm(x, w[0], w[1], w[2], config=cfg) for w in ws])
                    record("persist" if cfg.persistent else "mma", cfg._asdict(), us, err)
                except Exception as e:  # noqa: BLE001
                    rows.append(dict(shape=shape, m=m, config=cfg._asdict(), error=repr(e)[:300]))
                    print(f"{shape} M={m} {cfg} error {e!r}"[:400], flush=True)
            if gluon is not None and m == 1:
                sink = torch.empty(1, dtype=torch.int32, device="cuda")
                for bn, nw in ((128, 4), (128, 8)):
                    for sp in (1, 4, 8, 16):
                        per = -(-kt // sp)
                        us = chain_us([lambda w=w: _loads_kernel[(n // bn, -(-kt // per))](
                            w[0], sink, n, k, per, BN=bn, NUM_WARPS=nw, num_warps=nw) for w in ws])
                        record("loads", dict(block_n=bn, num_warps=nw, split_k=sp), us, b=n * k // 2)
            us = chain_us([lambda w=w: F.linear(x, w) for w in wbf] * 2)
            record("bf16", "cuBLAS F.linear", us, b=n * k * 2)
        print(f"[{time.time() - t0:.0f} s]", flush=True)
    Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(0), torch=torch.__version__,
                                              read_bytes_per_s=bw, rows=rows), indent=1))
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


if __name__ == "__main__":
    sys.exit(main())
