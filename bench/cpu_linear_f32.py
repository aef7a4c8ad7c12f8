"""The small-M fp32 linear on CPU (``roofline.kernels.cpu_f32.linear_f32``) against ``F.linear`` (MKL), in one
process, over the default model's 121 linears (30 layers of qkv 960x576, o 576x576, gate_up 3072x576, down
576x1536, and the 49152x576 LM head: 546 MB of distinct fp32 weights, so nothing stays in cache), at M rows.

    python bench/cpu_linear_f32.py [--ms 1,2,4,8,16,17,24,32,48] [--repeats 5] [--json OUT.json]

Prints per M: ms per pass of all 121 linears for each kernel, the ratio F.linear / ours, and the weight bytes
streamed per second. Past ``MAX_ROWS`` the engine keeps F.linear (the loop is timed through the library there)."""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

from roofline.kernels.cpu_paged_attention import _library

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,8,16,17,24,32,48")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--json")
    args = ap.parse_args()
    lib = _library()
    if isinstance(lib, str):
        raise SystemExit(f"no C++ library: {lib}")
    torch.manual_seed(0)
    ws = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    nbytes = sum(w.numel() * 4 for w in ws)
    threads = torch.get_num_threads()

    def ours(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        y = torch.empty(x.shape[0], w.shape[0])
        if not lib.roofline_linear_f32(x.data_ptr(), w.data_ptr(), 0, y.data_ptr(), x.shape[0], w.shape[0],
                                       w.shape[1], threads):
            raise SystemExit("roofline_linear_f32 declined (no AVX-512F?)")
        return y

    def one_pass(m: int, kernel) -> float:
        xs = {k: torch.randn(m, k) for k in (576, 1536)}
        t = time.perf_counter()
        for w in ws:
            kernel(xs[w.shape[1]], w)
        return time.perf_counter() - t

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"{cpu}, {threads} threads, torch {torch.__version__}; {len(ws)} linears, {nbytes / 1e6:.0f} MB fp32")
    print(f"{'M':>4} {'F.linear ms':>12} {'ours ms':>9} {'ratio':>6} {'ours GB/s':>10}")
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        times = {}
        for name, kernel in (("F.linear", F.linear), ("ours", ours)):
            one_pass(m, kernel)  # warm
            times[name] = min(one_pass(m, kernel) for _ in range(args.repeats)) * 1e3
        rows.append(dict(m=m, f_linear_ms=times["F.linear"], ours_ms=times["ours"],
                         ratio=times["F.linear"] / times["ours"], ours_gbs=nbytes / times["ours"] / 1e6))
        r = rows[-1]
        print(f"{m:>4} {r['f_linear_ms']:>12.1f} {r['ours_ms']:>9.1f} {r['ratio']:>6.2f} {r['ours_gbs']:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu, threads=threads, torch=torch.__version__, weight_bytes=nbytes, rows=rows), f,
                      indent=1)


if __name__ == "__main__":
    main()
