"""Where a decode step's GPU time goes: the engine's real decode steps (dummy weights at a named shape, CUDA
graphs as configured) under ``torch.profiler``; prints the kernels by total time per step, their count per
step, and the sum against the step's wall time and floor.

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
    if args.out:
        Path(args.out).write_text(json.dumps(dict(model=args.model, batch=args.batch, context=args.context,
                                                  step_ms=step_ms, kernel_us_per_step=total,
                                                  launches_per_step=launches,
                                                  kernels=[dict(name=a, us=b, count=c) for a, b, c in rows]),
                                             indent=1))
    engine.executor.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
