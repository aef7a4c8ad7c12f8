"""One device call for the Triton kernels: GPU tests, `bench attention` and fused-op measurements.

Usage (on the H200, from the repo root):  python3 bench/gpu_kernels.py [--out DIR] [--quick] [--no-sweep]
Writes under DIR (default $OUT or bench/results): pytest.log, attention-*.json, ops.json,
and prints a short table last. Every timing is a triton.testing.do_bench median (L2 flushed per call).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))



def run_tests(out: Path) -> dict:
    t0 = time.time()
    cmd = [sys.executable, "-m", "pytest", "tests/kernels", "-m", "gpu or not gpu", "-q", "-p", "no:cacheprovider",
           "-n", "8"]  # xdist: the many kernel specialisations compile in parallel
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=400)
    (out / "pytest.log").write_text(proc.stdout + proc.stderr)
    tail = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    print(proc.stdout[-3000:], flush=True)
    return dict(returncode=proc.returncode, summary=tail, seconds=time.time() - t0)


def bench_ops(read_bw: float, log) -> list[dict]:
    """Fused small ops vs their torch twins at llama-3-8b sizes (bytes = minimal reads + writes)."""
    rows: list[dict] = []
    for t in (8, 8192):
        _ops_at(t, read_bw, rows, log)
    return rows


def _ops_at(t: int, read_bw: float, rows: list[dict], log) -> None:
    import torch
    from triton.testing import do_bench

    from roofline.kernels import activation, rmsnorm, rope_cache

    bf = torch.bfloat16
    x = torch.randn(t, 4096, device="cuda", dtype=bf)
    r = torch.randn_like(x)
    w = torch.randn(4096, device="cuda", dtype=bf)
    g = torch.randn(t, 2 * 14336, device="cuda", dtype=bf)
    q = torch.randn(t, 32, 128, device="cuda", dtype=bf)
    k = torch.randn(t, 8, 128, device="cuda", dtype=bf)
    v = torch.randn_like(k)
    kc = torch.empty(t // 16 + 1, 16, 8, 128, device="cuda", dtype=bf)
    vc = torch.empty_like(kc)
    pos = torch.randint(0, 8192, (t,), device="cuda")
    slots = torch.randperm(kc.shape[0] * 16, device="cuda")[:t]
    cs = torch.randn(8192, 128, device="cuda")
    cases = [
        ("fused_add_rmsnorm", 4 * x.numel() * 2, lambda: rmsnorm.fused_add_rmsnorm(x, r, w, 1e-5),
         lambda: rmsnorm.ref_fused_add_rmsnorm(x, r, w, 1e-5)),
        ("silu_and_mul", 3 * g.numel() // 2 * 2, lambda: activation.silu_and_mul(g),
         lambda: activation.ref_silu_and_mul(g)),
        ("rope_and_cache", (2 * q.numel() + 4 * k.numel() + 2 * v.numel()) * 2,
         lambda: rope_cache.rope_and_cache(q, k, v, pos, cs, kc, vc, slots),
         lambda: rope_cache.ref_rope_and_cache(q, k, v, pos, cs, kc, vc, slots)),
    ]
    for name, nbytes, ours, ref in cases:
        t_ours = do_bench(ours, return_mode="median")
        t_ref = do_bench(ref, return_mode="median")
        rows.append(dict(op=name, tokens=t, bytes=nbytes, ours_ms=t_ours, torch_ms=t_ref,
                         ours_frac=nbytes / (t_ours * 1e-3) / read_bw, speedup=t_ref / t_ours))
        log(f"op {name:>18} T={t:>5}: ours {t_ours * 1e3:8.1f} us ({rows[-1]['ours_frac']:.2f} of read)  "
            f"torch {t_ref * 1e3:8.1f} us  x{t_ref / t_ours:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "bench" / "results")))
    ap.add_argument("--no-tests", action="store_true")
    ap.add_argument("--no-sweep", action="store_true")
    ap.add_argument("--quick", action="store_true", help="fewer attention points")
    ap.add_argument("--no-ops", action="store_true", help="skip the fused-op measurements")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    lines: list[str] = []

    def log(msg: str) -> None:
        print(msg, flush=True)
        lines.append(msg)

    summary = {}
    if not a.no_tests:
        summary["tests"] = run_tests(out)
        log(f"tests: {summary['tests']}")

    import torch

    from roofline.bench.attention import add_parser, measure_read_bandwidth_cuda, run_attention_bench

    p = argparse.ArgumentParser()
    add_parser(p.add_subparsers())
    argv = ["attention", "--out-dir", str(out)] + ([] if a.no_sweep else ["--sweep"])
    if a.quick:
        argv += ["--seqs", "8k", "--batches", "8", "--ctxs", "32k"]
    t0 = time.time()
    run_attention_bench(p.parse_args(argv))
    log(f"attention bench: {time.time() - t0:.0f} s")

    if a.no_ops:
        print(f"\n==== summary ====\ntests: {summary.get('tests', {}).get('summary')}")
        return 0
    bw = measure_read_bandwidth_cuda()["read_bytes_per_s"]
    t0 = time.time()
    ops = bench_ops(bw, log)
    log(f"ops: {time.time() - t0:.0f} s")
    (out / "ops.json").write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  read_bytes_per_s=bw, ops=ops), indent=1, default=str))
    (out / "gpu_kernels.log").write_text("\n".join(lines))

    print("\n==== summary ====")
    print(f"tests: {summary.get('tests', {}).get('summary')}")
    print(f"read bandwidth {bw / 1e12:.2f} TB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
