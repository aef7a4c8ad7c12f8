"""CPU micro-benchmark for issue 32: the linear layers of a decode step, measured in one run.

Prints the CPU model and matrix extensions (``roofline.cpu``), then, alternating A/B in the same process:
(a) bf16 vs fp32 weights: 24 ``F.linear`` of 896 -> 4864 (Qwen2.5-0.5B MLP shape), batch 1 and 32, median
    of 9 steps, best of 3 rounds, ratio bf16/fp32 (< 1: bf16 faster);
(b) 1 vs 2 threads at batch 1 (fp32), without and with a busy ``python -c 'while 1: pass'`` beside it.
Run: ``python -m roofline.bench.cpu``. Timings are noisy on shared machines: read the ratios.
"""

from __future__ import annotations

import subprocess
import sys
import time

import torch

from roofline.cpu import detect_cpu_features, startup_line


def _step_ms(weights: list[torch.Tensor], x: torch.Tensor, steps: int = 9) -> float:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        for w in weights:
            torch.nn.functional.linear(x, w)
        times.append(time.perf_counter() - t)
    return sorted(times)[steps // 2] * 1e3


def main() -> None:
    feats = detect_cpu_features()
    print(startup_line(feats, "float32", torch.get_num_threads()))
    w32 = [torch.randn(4864, 896) for _ in range(24)]
    w16 = [w.bfloat16() for w in w32]
    for b in (1, 32):
        x = torch.randn(b, 896)
        a, c = [], []
        for _ in range(3):
            a.append(_step_ms(w32, x))
            c.append(_step_ms(w16, x.bfloat16()))
        print(f"batch {b}: fp32 {min(a):.2f} ms, bf16 {min(c):.2f} ms, bf16/fp32 {min(c) / min(a):.2f}")
    x = torch.randn(1, 896)
    threads = torch.get_num_threads()
    for busy in (False, True):
        proc = subprocess.Popen([sys.executable, "-c", "while 1: pass"]) if busy else None
        try:
            res: dict[int, list[float]] = {1: [], 2: []}
            for _ in range(3):
                for n in (1, 2):
                    torch.set_num_threads(n)
                    res[n].append(_step_ms(w32, x))
        finally:
            if proc is not None:
                proc.kill()
                proc.wait()
            torch.set_num_threads(threads)
        print(f"busy={busy}: 1 thread {min(res[1]):.2f} ms, 2 threads {min(res[2]):.2f} ms, "
              f"2t/1t {min(res[2]) / min(res[1]):.2f}")


if __name__ == "__main__":
    main()
