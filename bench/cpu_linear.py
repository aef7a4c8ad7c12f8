"""The small-M CPU linears against the library kernels they replace, in one process, over the default model's 121
linears (30 layers of qkv 960x576, o 576x576, gate_up 3072x576, down 576x1536, and the 49152x576 LM head: 546 MB
of distinct fp32 weights, 273 MB in bf16, so nothing stays in cache), at M rows:

- ``--dtype float32``: ``roofline.kernels.cpu_f32.linear_f32`` against ``F.linear`` (MKL);
- ``--dtype bfloat16``: ``roofline.kernels.cpu_bf16.tile_linear`` (AMX, else AVX-512 BF16) on ``tile_pack``'s
  layout against oneDNN with the weight packed once in its own layout and ``F.linear``.

    python bench/cpu_linear.py [--dtype float32|bfloat16] [--ms 1,2,4,8,16,17,24,32,48] [--repeats 5]
        [--json OUT.json]

Prints per M: ms per pass of all 121 linears for each kernel, the ratio of the best library kernel to ours, and
the weight bytes ours streamed per second. Past the engine's row limits the loop is timed through the library."""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch
import torch.nn.functional as F

from roofline.kernels import cpu_bf16
from roofline.kernels.cpu_paged_attention import _library

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,2,4,8,16,17,24,32,48")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--json")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    lib = _library()
    if isinstance(lib, str):
        raise SystemExit(f"no C++ library: {lib}")
    torch.manual_seed(0)
    ws = [(torch.randn(n, k) * 0.02).to(dtype) for n, k in SHAPES]
    nbytes = sum(w.numel() * w.element_size() for w in ws)
    threads = torch.get_num_threads()

    def ours_f32(x: torch.Tensor, w) -> torch.Tensor:
        y = torch.empty(x.shape[0], w.shape[0], dtype=dtype)
        if not lib.roofline_linear_f32(x.data_ptr(), w.data_ptr(), 0, y.data_ptr(), x.shape[0], w.shape[0],
                                       w.shape[1], threads):
            raise SystemExit("roofline_linear_f32 declined (no AVX-512F?)")
        return y

    def ours_bf16(x: torch.Tensor, p) -> torch.Tensor:
        if (y := cpu_bf16.tile_linear(x, p)) is None:
            raise SystemExit("tile_linear declined (no AVX-512 BF16 / AMX, or past its rows)")
        return y

    if dtype == torch.float32:
        kernels = {"F.linear": (F.linear, ws), "ours": (ours_f32, ws)}
    else:  # oneDNN on its own layout, packed once (the engine's path without tile kernels)
        if not cpu_bf16.tiles_available():
            raise SystemExit("no tile kernel here (AVX-512 BF16 or AMX-BF16)")
        kernels = {"F.linear": (F.linear, ws), "ours": (ours_bf16, [cpu_bf16.tile_pack(w) for w in ws]),
                   "onednn": (lambda x, p: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""),
                              [torch.ops.mkldnn._reorder_linear_weight(w) for w in ws])}

    def one_pass(m: int, kernel, weights) -> float:
        xs = {k: torch.randn(m, k).to(dtype) for k in (576, 1536)}
        t = time.perf_counter()
        for w in weights:
            kernel(xs[w.shape[1] if w.dim() == 2 else w.shape[1] * 32], w)
        return time.perf_counter() - t

    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")),
               platform.processor())
    print(f"{cpu}, {threads} threads, torch {torch.__version__}; {len(ws)} linears, {nbytes / 1e6:.0f} MB "
          f"{args.dtype}")
    names = list(kernels)
    print(f"{'M':>4} " + " ".join(f"{n + ' ms':>12}" for n in names) + f" {'best lib/ours':>13} {'ours GB/s':>10}")
    rows = []
    for m in (int(v) for v in args.ms.split(",")):
        times = {}
        for name, (kernel, weights) in kernels.items():
            one_pass(m, kernel, weights)  # warm
            times[name] = min(one_pass(m, kernel, weights) for _ in range(args.repeats)) * 1e3
        best_lib = min(t for n, t in times.items() if n != "ours")
        rows.append(dict(m=m, **{f"{n}_ms": t for n, t in times.items()}, ratio=best_lib / times["ours"],
                         ours_gbs=nbytes / times["ours"] / 1e6))
        print(f"{m:>4} " + " ".join(f"{times[n]:>12.1f}" for n in names)
              + f" {rows[-1]['ratio']:>13.2f} {rows[-1]['ours_gbs']:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(cpu=cpu, threads=threads, torch=torch.__version__, dtype=args.dtype, weight_bytes=nbytes,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
