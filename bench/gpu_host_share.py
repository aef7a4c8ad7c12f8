"""Host share of an offline-throughput run, from a profile: 1 - (GPU kernel time) / (wall time).

Runs ``roofline bench throughput`` (so the same workload and engine as the throughput figure) with the
timed ``LLM.generate`` call wrapped in ``torch.profiler`` (CUDA activity only). The GPU is busy for the
sum of kernel durations (kernels of one stream do not overlap); the rest of the wall time the GPU waits
for the host (scheduling, input preparation, launches, syncs). Works on any commit with the same CLI, so a
before/after pair can run in one device call.

Usage: python bench/gpu_host_share.py OUT.json -- <bench throughput args>
"""

from __future__ import annotations

import argparse
import json
import sys
import time


def main() -> int:
    out_path = sys.argv[1]
    bench_args = sys.argv[sys.argv.index("--") + 1:]
    import torch
    from torch.profiler import ProfilerActivity, profile

    import roofline.llm as llm_mod
    from roofline.bench.throughput import add_parser

    real_generate = llm_mod.LLM.generate
    record = {}

    def generate(self, prompts, *args, **kwargs):
        if len(prompts) <= 8:  # the bench's warm-up call
            return real_generate(self, prompts, *args, **kwargs)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            outs = real_generate(self, prompts, *args, **kwargs)
            torch.cuda.synchronize()
            wall = time.perf_counter() - t0
        kernel_us = sum(e.self_device_time_total for e in prof.key_averages())
        record.update(wall_s=wall, gpu_kernel_s=kernel_us / 1e6, host_share=1 - kernel_us / 1e6 / wall,
                      output_tokens=sum(len(c.token_ids) for o in outs for c in o.outputs))
        return outs

    llm_mod.LLM.generate = generate
    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    args = p.parse_args(["throughput", *bench_args])
    args.func(args)
    print(f"HOSTSHARE wall {record['wall_s']:.2f} s, GPU kernels {record['gpu_kernel_s']:.2f} s, "
          f"host share {record['host_share']:.3f}, output tok/s under the profiler "
          f"{record['output_tokens'] / record['wall_s']:.0f}")
    with open(out_path, "w") as f:
        json.dump(dict(record, argv=bench_args, device=torch.cuda.get_device_name(), torch=torch.__version__), f,
                  indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
