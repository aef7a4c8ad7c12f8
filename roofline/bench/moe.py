"""``roofline bench moe``: one MoE layer's routed experts, the fused Triton kernel against the expert loop and
against its bound, at M = 1, 8, 64, 2048 tokens, measured in one process.

Shapes come from a preset (``--model mixtral-8x7b``: 8 experts, top-2, H 4096, I 14336; ``qwen3-30b-a3b``:
128 experts, top-8, H 2048, I 768). Routing is a softmax over random logits (close to uniform), the same for
every implementation at a given M.

For each weight format (``--quantization none,int8,fp8``) and M the table prints:
- ``loop``: the expert loop (``ref_fused_moe``: per touched expert, index, gate/up, SiLU-and-mul, down,
  ``index_add_``; Hugging Face's and gpt-fast's structure), eager;
- ``fused``: ``fused_moe`` on its default path for M, captured in a CUDA graph (as the engine runs decode),
  and the two paths forced (``gemv``: the small-M path; ``grouped``: sort/align + two grouped GEMMs);
- the bound: max(bytes / read bandwidth, FLOPs / bf16 GEMM rate), both measured in this process; bytes are
  the distinct experts this routing touches times one expert's bytes, plus activations in and out;
- ``loop/fused`` and ``of bound`` (bound time / fused time);
- ``align us``: the sort/align step alone (one Triton program), at the default config's BLOCK_M, and ``config``:
  the path and tiles the default dispatch picked (``fused_moe_config``: the measured table, or the heuristic
  with ``--moe-config none``; ``--moe-config PATH`` loads another table, e.g. a fresh tune).
With several formats, each row also gives its fused time over the first format's (int8 vs bf16 experts).
Each timed call runs ``--rotate`` routings in turn (different experts each, so the weights come from DRAM, not
the L2) and its time is divided by that count; ``touched`` and the bound are the mean over them.
Times are ``triton.testing.do_bench``-style medians of CUDA-event timings. Writes ``bench/results/moe-*.json``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from typing import Any

from roofline.costmodel.moe import moe_step_bytes as _moe_step_bytes


def _time(fn, device: str, iters: int, warmup: int = 3) -> float:
    """Median seconds of ``fn()`` (``hardware._time_rounds``: CUDA events on a GPU, perf_counter on a CPU)."""
    from roofline.hardware import _time_rounds

    return statistics.median(_time_rounds(fn, device, iters, warmup))


def _graphed(fn, device: str):
    """``fn`` captured in a CUDA graph (replayed by the returned callable); ``fn`` itself on a CPU."""

    if not device.startswith("cuda"):
        return fn
    from roofline.worker.cuda_graph import capture_graph

    return capture_graph(fn, warmup=2)[0].replay


def _cfg_text(cfg: dict | None) -> str:
    if not cfg:
        return "-"
    if cfg["path"] == "gemv":
        return f"gemv n{cfg['block_n']} k{cfg['block_k']} w{cfg['num_warps']}"
    if cfg["path"] == "loop":
        return "loop"
    return (f"{cfg['block_m']}x{cfg['block_n']}x{cfg['block_k']} g{cfg['group_m']} w{cfg['num_warps']} "
            f"s{cfg['num_stages']}")


def make_experts(num_experts: int, hidden: int, inter: int, dtype, device: str, quantization: str | None,
                 seed: int = 0) -> dict[str, Any]:
    """Random experts (uniform in +-0.02, as dummy weights) in ``quantization`` (None, int8 or fp8)."""
    import torch

    from roofline.quant.moe import MOE_METHODS

    gen = torch.Generator(device=device).manual_seed(seed)
    w13 = torch.empty(num_experts, 2 * inter, hidden, dtype=dtype, device=device).uniform_(-0.02, 0.02,
                                                                                           generator=gen)
    w2 = torch.empty(num_experts, hidden, inter, dtype=dtype, device=device).uniform_(-0.02, 0.02, generator=gen)
    if quantization is None:
        return dict(w13=w13, w2=w2)
    method = MOE_METHODS[quantization]
    out: dict[str, Any] = {}
    for name, w in (("w13", w13), ("w2", w2)):
        parts = [method.quantize(w[e]) for e in range(num_experts)]
        out[name] = torch.stack([p.q for p in parts])
        out[f"{name}_scale"] = torch.stack([p.scales for p in parts]).float()
    return out


def run_moe_bench(args: argparse.Namespace) -> int:
    import torch

    from roofline.bench.common import parse_sizes, write_result
    from roofline.config import model_preset
    from roofline.hardware import measure_gemm_flops, measure_read_bandwidth
    from roofline.kernels import fused_moe_config
    from roofline.kernels.fused_moe import fused_moe, moe_align_block_size, ref_fused_moe
    from roofline.layers.moe import select_experts

    device = args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    on_cuda = device.startswith("cuda")
    mc = model_preset(args.model)
    if not mc.is_moe:
        raise SystemExit(f"roofline bench moe: {args.model} is not a mixture-of-experts preset")
    num_experts, top_k, hidden, inter = mc.num_experts, mc.num_experts_per_tok, mc.hidden_size, mc.moe_intermediate_size
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[args.dtype]
    sizes = parse_sizes(args.tokens)
    quants = [None if q in ("none", "") else q for q in args.quantization.split(",")]
    if args.moe_config != "default":
        fused_moe_config.set_config_table(args.moe_config)
    bandwidth = measure_read_bandwidth(device)
    peak = measure_gemm_flops(device, n=8192 if on_cuda else 1024, rounds=10)
    print(f"{torch.cuda.get_device_name() if on_cuda else 'CPU'}: read {bandwidth / 1e12:.3f} TB/s, dense GEMM "
          f"{peak / 1e12:.1f} TFLOP/s (measured in this process)")
    print(f"{args.model}: {num_experts} experts, top-{top_k}, H {hidden}, I {inter}, {args.dtype}"
          + ("" if on_cuda else "; no CUDA: the fused Triton kernel is skipped, the loop alone is timed"))
    rows: list[dict[str, Any]] = []
    first: dict[int, float] = {}
    for quant in quants:
        w = make_experts(num_experts, hidden, inter, dtype, device, quant)
        s13, s2 = w.get("w13_scale"), w.get("w2_scale")
        expert_bytes = sum(t.numel() * t.element_size() for t in w.values()) / num_experts
        print(f"\nexperts {quant or args.dtype}: {expert_bytes / 1e6:.1f} MB each")
        print(f"{'M':>6} {'touched':>8} {'loop ms':>9} {'fused ms':>9} {'gemv ms':>9} {'grouped ms':>10} "
              f"{'bound ms':>9} {'loop/fused':>10} {'of bound':>9} {'align us':>8}  config"
              + ("  vs first" if len(quants) > 1 else ""))
        for m in sizes:
            gen = torch.Generator(device=device).manual_seed(m)
            # R routings (and inputs), run in turn: consecutive calls touch different experts, so a small shape's
            # weights (Qwen3's 8 int8 experts are 38 MB) are not served from the 50 MB L2 on the next call.
            routes = []
            for _ in range(args.rotate):
                x = torch.randn(m, hidden, dtype=dtype, device=device, generator=gen)
                tw, ids = select_experts(torch.randn(m, num_experts, device=device, generator=gen), top_k, True)
                routes.append((x, tw, ids))
            touched = statistics.mean(int(torch.unique(r[2]).numel()) for r in routes)
            moved = touched * expert_bytes + 2 * m * hidden * x.element_size()
            bound = max(moved / bandwidth, 2.0 * m * top_k * 3 * hidden * inter / peak)
            wts = (w["w13"], w["w2"])

            def each(fn, routes=routes, wts=wts, scales=(s13, s2), **kw):
                return lambda: [fn(x, *wts, tw, ids, *scales, **kw) for x, tw, ids in routes]
            loop = _time(each(ref_fused_moe), device, args.iters) / args.rotate
            row: dict[str, Any] = dict(quantization=quant or "none", tokens=m, touched_experts=touched,
                                       bytes=moved, bound_ms=bound * 1e3, loop_ms=loop * 1e3, rotate=args.rotate)
            if on_cuda:
                fmt_name = {None: args.dtype}.get(quant, quant)
                cfg = fused_moe_config.get_config(m, num_experts, top_k, inter, hidden, fmt_name, torch.device(device))
                row["config"] = cfg.to_dict()
                align = _graphed(functools.partial(moe_align_block_size, routes[0][2], num_experts,
                                                   cfg.block_m if cfg.path == "grouped" else 16), device)
                row["align_us"] = _time(align, device, args.iters) * 1e6
                for name, small in (("fused", None), ("gemv", True), ("grouped", False)):
                    if small and m > args.gemv_max_tokens:
                        row[f"{name}_ms"] = None
                        continue
                    fn = each(fused_moe, small_m=small)
                    if not (name == "fused" and cfg.path == "loop"):  # the loop syncs: eager, not captured
                        fn = _graphed(fn, device)
                    row[f"{name}_ms"] = _time(fn, device, args.iters) * 1e3 / args.rotate
                x, tw, ids = routes[0]
                if m <= 64:  # the kernel against the float64 loop, as the GPU test bounds it
                    ref = ref_fused_moe(x, *wts, tw, ids, s13, s2, compute_dtype=torch.float64)
                    out = fused_moe(x, *wts, tw, ids, s13, s2).double()
                    row["rel_err"] = ((out - ref).abs().max() / ref.abs().max()).item()
                row["loop_over_fused"] = row["loop_ms"] / row["fused_ms"]
                row["fraction_of_bound"] = row["bound_ms"] / row["fused_ms"]
                first.setdefault(m, row["fused_ms"])
                row["fused_vs_first"] = first[m] / row["fused_ms"]
            rows.append(row)

            def fmt(v, width=9):
                return f"{v:>{width}.3f}" if isinstance(v, float) else f"{'-':>{width}}"
            print(f"{m:>6} {touched:>8.1f} {fmt(row['loop_ms'])} {fmt(row.get('fused_ms'))} {fmt(row.get('gemv_ms'))} "
                  f"{fmt(row.get('grouped_ms'), 10)} {fmt(row['bound_ms'])} {fmt(row.get('loop_over_fused'), 10)} "
                  f"{fmt(row.get('fraction_of_bound'))} {fmt(row.get('align_us'), 8)}  {_cfg_text(row.get('config'))}"
                  + (f"  {row['fused_vs_first']:.2f}x" if len(quants) > 1 and on_cuda else ""), flush=True)
        if on_cuda:
            torch.cuda.empty_cache()
    path = write_result(args.out_dir, f"moe-{args.model}", dict(moe_config=args.moe_config,
        model=args.model, device=device, dtype=args.dtype, num_experts=num_experts, top_k=top_k, hidden=hidden,
        intermediate=inter, read_bandwidth_bytes_per_s=bandwidth, peak_flops=peak, rows=rows))
    print(f"wrote {path}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("moe", help="fused MoE kernel vs the expert loop and its bound, per token count")
    p.add_argument("--model", default="mixtral-8x7b", help="MoE preset (mixtral-8x7b, qwen3-30b-a3b)")
    p.add_argument("--tokens", default="1,8,64,2048", help="token counts M")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--quantization", default="none,int8",
                   help="expert formats, comma-separated (none, int8, fp8); the first is the baseline")
    p.add_argument("--gemv-max-tokens", type=int, default=64, help="largest M at which the GEMV path is timed")
    p.add_argument("--moe-config", default="default",
                   help="tile configs: default (the committed table of this device, else the heuristic), none (the "
                        "heuristic by M), or a table JSON (bench/gpu_moe_tune.py --table)")
    p.add_argument("--rotate", type=int, default=4,
                   help="routings run in turn per timed call (weights from DRAM, not L2); times are per call")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--device", default="auto")
    p.add_argument("--out-dir", default="bench/results")
    p.set_defaults(func=run_moe_bench)
    return p



moe_step_bytes = _moe_step_bytes  # bench decode's import (the function lives in roofline.costmodel.moe)
