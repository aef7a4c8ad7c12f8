"""CPU micro-benchmark for issue 32: the linear layers of a decode step, measured in one run.

Prints the CPU model and matrix extensions (``roofline.cpu``), then, alternating A/B in the same process:
(a) bf16 vs fp32 weights: 24 ``F.linear`` of 896 -> 4864 (Qwen2.5-0.5B MLP shape), batch 1 and 32, median
    of 9 steps, best of 3 rounds, ratio bf16/fp32 (< 1: bf16 faster);
(b) 1 vs 2 threads at batch 1 (fp32), without and with a busy ``python -c 'while 1: pass'`` beside it;
(c) beside a busy process, the default model's batch-1 decode step under OpenMP's wait policy (libgomp reads
    it when torch loads, so each point is a fresh child process): pinned points, spinning (ACTIVE) and purely
    passive (``GOMP_SPINCOUNT=0``) at 1 and every core, then roofline's own policy (bounded spin, pool sized at
    start-up and re-sized by ``roofline.cpu.ThreadGovernor``) with the busy process there from the start and
    arriving after start-up; 2 rounds, best kept; the ratios printed are roofline's points against the best
    pinned one (<= 1: roofline's policy is never slower than the best of 1 and 2 threads).
(d) ``--gemm``: the default model's 121 linears of one decode step (distinct weights, so none stays in cache)
    in fp32, bf16, INT8 W8A16 (``torch._weight_int8pack_mm``) and INT8 W8A8 dynamic (``roofline.kernels.cpu_int8``)
    at M = 1 and 32, alternated, ratios against fp32;
(e) ``--table``: the README's CPU table, end to end on the default model, alternated round by round in one
    process: roofline fp32 / bf16 / int8 (W8A8) decode steps at batch 1 and 32, each beside its floor (the
    bound model's, ``LLM.decode_floor``: the format's weight bytes and the KV read over the bandwidth measured
    here), HF transformers eager fp32 at batch 1, and llama.cpp (``--llamacpp``: llama-cpp-python on the same
    GGUF, same thread count, greedy) at batch 1 where ``llama_cpp`` imports; ``--json PATH`` writes the rows.
Run: ``python -m roofline.bench.cpu`` ((a)-(c); ``--wait-policy``: (c) alone). Timings are noisy on shared
machines: read the ratios.
"""

from __future__ import annotations

import os
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


BUSY = [sys.executable, "-c", "while 1: pass"]


def _child(threads: int, busy: str) -> None:
    """One point of (c): the default model's batch-1 fp32 decode step (32 greedy tokens, median of 3 runs after
    a warm-up), printed in ms with the thread count at the end. ``threads`` 0: roofline's own policy (its
    start-up choice and governor); else pinned (the parent also sets OMP_NUM_THREADS). ``busy``: ``start``
    starts a busy process before the engine is built, ``late`` after the warm-up, so that only the governor
    can see it. A real step has hundreds of small ops, each an OpenMP fork/join, which is where spinning
    threads collapse; a few large GEMMs would hide it."""
    proc = subprocess.Popen(BUSY) if busy == "start" else None
    try:
        if threads:
            torch.set_num_threads(threads)
        from roofline import LLM, SamplingParams

        llm = LLM(device="cpu", dtype="float32", max_model_len=512)
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        llm.generate(["Once upon a time"], params, use_tqdm=False)
        if busy == "late":
            proc = subprocess.Popen(BUSY)
            time.sleep(0.5)
        times = []
        for _ in range(3):
            st = llm.engine.stats
            n0, t0 = st.num_decode_steps, st.decode_time_s
            llm.generate(["Once upon a time"], params, use_tqdm=False)
            times.append((st.decode_time_s - t0) / (st.num_decode_steps - n0) * 1e3)
        print(sorted(times)[1], torch.get_num_threads())
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


# (c)'s points: name -> (environment changes, pinned threads or 0 for roofline's policy, when the load starts)
def _wait_points(cores: int) -> dict[str, tuple[dict[str, str], int, str]]:
    pts: dict[str, tuple[dict[str, str], int, str]] = {}
    for t in sorted({1, cores}):
        pts[f"spinning {t}t"] = ({"OMP_WAIT_POLICY": "ACTIVE", "OMP_NUM_THREADS": str(t)}, t, "start")
        pts[f"passive {t}t"] = ({"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "0", "OMP_NUM_THREADS": str(t)},
                                t, "start")
    pts["roofline"] = ({}, 0, "start")  # bounded spin, pool sized at start-up
    pts["roofline, load after start-up"] = ({}, 0, "late")  # bounded spin, the governor re-sizes the pool
    return pts


def wait_policy_beside_busy(rounds: int = 2) -> dict[str, float]:
    """(c): ms per step for each point of ``_wait_points`` beside one busy process, best over ``rounds``; the
    ratios printed are roofline's two points against the best pinned point (issue 32: <= 1, never slower than
    the best of 1 and 2 threads in the same conditions)."""
    cores = max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1)
    best: dict[str, float] = {}
    threads_seen: dict[str, int] = {}
    clean = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "OMP_NUM_THREADS")}
    for _ in range(rounds):
        for name, (env, threads, busy) in _wait_points(cores).items():
            out = subprocess.run([sys.executable, "-m", "roofline.bench.cpu", "--child", str(threads), "--busy", busy],
                                 env={**clean, **env}, capture_output=True, text=True, check=True,
                                 timeout=900).stdout
            ms, n = out.strip().splitlines()[-1].split()
            best[name] = min(best.get(name, float("inf")), float(ms))
            threads_seen[name] = int(n)
    pinned = min(v for k, v in best.items() if not k.startswith("roofline"))
    print("beside a busy process, ms per batch-1 decode step (threads at the end): "
          + ", ".join(f"{k} {v:.2f} ({threads_seen[k]}t)" for k, v in best.items()))
    print(f"roofline / best pinned: {best['roofline'] / pinned:.2f}; with the load arriving after start-up: "
          f"{best['roofline, load after start-up'] / pinned:.2f}")
    return best


def build_parser():
    """The one parser of ``python -m roofline.bench.cpu``: unknown arguments and ``--help`` never run a benchmark."""
    import argparse

    from roofline.bench import cpu_table

    p = argparse.ArgumentParser(
        prog="python -m roofline.bench.cpu",
        description="CPU benchmarks of issue 32. No option: (a)-(c), bf16 vs fp32 linears, 1 vs 2 threads, "
                    "the OpenMP wait policy beside a busy process.")
    p.add_argument("--wait-policy", action="store_true", help="(c) alone")
    p.add_argument("--child", type=int, default=None, metavar="THREADS", help=argparse.SUPPRESS)  # one (c) point
    p.add_argument("--busy", choices=("start", "late"), default="start", help=argparse.SUPPRESS)
    cpu_table.add_arguments(p)
    return p


def main(argv: list[str] | None = None) -> None:
    """Parse ``argv`` (default ``sys.argv[1:]``) and run the benchmarks it names (module docstring).

    Raises:
        SystemExit: unknown arguments or ``--help`` (argparse: nothing runs), bad ``--rounds``/``--tokens``/
            ``--json``, or a --table option without --table (``cpu_table.check_arguments``).
    """
    from roofline.bench import cpu_table

    parser = build_parser()
    args = parser.parse_args(argv)
    cpu_table.check_arguments(parser, args)
    if args.child is not None:
        _child(args.child, args.busy)
        return
    if args.gemm or args.table:
        cpu_table.run(args)
        return
    if args.wait_policy:  # (c) alone
        print(startup_line(detect_cpu_features(), "float32", torch.get_num_threads()))
        wait_policy_beside_busy()
        return
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
    wait_policy_beside_busy()


if __name__ == "__main__":
    main()
