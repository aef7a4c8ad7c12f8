"""Where a decode step's GPU time goes: the engine's real decode steps (dummy weights at a named shape, CUDA
graphs as configured) under ``torch.profiler``; prints the kernels by total time per step, their count per
step, and the sum against the step's wall time and floor.

With programmatic dependent launch a kernel starts before its predecessor ends and waits (``gdc_wait``) inside,
so its duration counts time that another kernel also counts, and the durations do not add up to the step. The
second table attributes the GPU timeline instead: kernels sorted by start, each is charged the time by which it
moves the running end of the timeline (``max(0, end_i - max_{j<i} end_j)``), and the idle gaps between kernels
are charged to the kernel after them. These charges sum to the GPU busy span, so they say which kernels (and
gaps) make the step, i.e. what a faster kernel would actually save.

Usage (H200, repo root): PYTHONPATH=. python bench/gpu_decode_profile.py --model qwen3-30b-a3b --batch 1
    [--context 512] [--steps 8] [--quantization int8] [--enforce-eager] [--out OUT.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def timeline_charges(prof, cuda: bool) -> tuple[dict[str, float], dict[str, float], float]:
    """(charged us by kernel name, idle gap us charged by name, busy span us) of the profiled device kernels."""
    import torch

    dev = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    evs = sorted(((ev.time_range.start, ev.time_range.end, ev.name) for ev in prof.events()
                  if ev.device_type == dev), key=lambda e: e[0])
    charged: dict[str, float] = {}
    gaps: dict[str, float] = {}
    span = 0.0
    front = None
    for start, end, name in evs:
        if front is None:
            front = start
        gap = max(0.0, start - front)
        step = max(0.0, end - max(front, start))
        charged[name] = charged.get(name, 0.0) + gap + step
        gaps[name] = gaps.get(name, 0.0) + gap
        span += gap + step
        front = max(front, end)
    return charged, gaps, span


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-30b-a3b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import torch
    from torch.profiler import ProfilerActivity, profile

    from roofline.bench.decode import add_parser, build_engine, time_decode

    sub = argparse.ArgumentParser().add_subparsers()
    add_parser(sub)
    ns = sub.choices["decode"].parse_args(["--model", args.model, "--steps", str(args.steps)]
                                          + (["--enforce-eager"] if args.enforce_eager else []))
    engine = build_engine(ns, args.batch, args.context + 64, quantization=args.quantization)
    warm = time_decode(engine, args.batch, args.context, steps=args.steps, warmup=3)
    cuda = torch.cuda.is_available()
    with profile(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as prof:
        times = time_decode(engine, args.batch, args.context, steps=args.steps, warmup=0)
    step_ms = sorted(warm)[len(warm) // 2] * 1e3
    kernels: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == (torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU):
            kernels.setdefault(ev.name, []).append(ev.device_time_total if hasattr(ev, "device_time_total")
                                                   else ev.cuda_time_total)
    # steps executed under the profiler: the async timing launches one more step than it times
    n = len(times) + (1 if engine.config.async_scheduling else 0)
    rows = sorted(((name, sum(v) / n, len(v) / n) for name, v in kernels.items()), key=lambda r: -r[1])
    charged, gaps, span = timeline_charges(prof, cuda)
    ch_rows = sorted(((name, charged[name] / n, gaps.get(name, 0.0) / n) for name in charged), key=lambda r: -r[1])
    total = sum(r[1] for r in rows)
    launches = sum(r[2] for r in rows)
    w = engine.worker
    floor_ms = w.weight_bytes_per_step / 4.8e12 * 1e3
    print(f"model {args.model} batch {args.batch} context {args.context}: step {step_ms:.3f} ms (median of "
          f"{len(warm)} unprofiled), GPU kernel time {total / 1e3:.3f} ms/step in {launches:.0f} launches/step; "
          f"weight bytes/step {w.weight_bytes_per_step / 1e9:.2f} GB ({floor_ms:.3f} ms at 4.8 TB/s)")
    print(f"{'us/step':>9} {'n/step':>7} {'us each':>8}  kernel")
    for name, us, cnt in rows[:args.top]:
        print(f"{us:>9.1f} {cnt:>7.1f} {us / max(cnt, 1e-9):>8.2f}  {name[:110]}")
    print(f"timeline: GPU span {span / n / 1e3:.3f} ms/step, idle gaps {sum(gaps.values()) / n / 1e3:.3f} ms/step; "
          "charged = how far each kernel moves the timeline's end (its gap before it included)")
    print(f"{'charged':>9} {'gap':>7}  kernel")
    for name, us, gap in ch_rows[:args.top]:
        print(f"{us:>9.1f} {gap:>7.1f}  {name[:110]}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(model=args.model, batch=args.batch, context=args.context,
                                                  step_ms=step_ms, kernel_us_per_step=total,
                                                  launches_per_step=launches, span_us_per_step=span / n,
                                                  charged=[dict(name=a, us=b, gap_us=c) for a, b, c in ch_rows],
                                                  kernels=[dict(name=a, us=b, count=c) for a, b, c in rows]),
                                             indent=1))
    engine.executor.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
