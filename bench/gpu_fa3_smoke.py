"""Gluon prefill variants on small cases, one kernel kind per process (bench/gpu_fa3.sh runs each under `timeout`,
so a kernel that hangs on an mbarrier is named and skipped instead of stalling the run).

    python3 bench/gpu_fa3_smoke.py VARIANT...   (names of gpu_fa3_bench.GLUON_VARIANTS; prints "PASS name" per pass)

Cases: a chunked ragged batch over a 1k-4k context (ctx > 0), GQA 32/8, D 128, bf16, pages of 16 and 256, NaN
in every stale cache slot; checked against the Triton kernel (max-abs < 3e-2) . Exit status 0 if all pass.
"""

from __future__ import annotations

import math
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "kernels"), str(ROOT / "bench")]

from gpu_fa3_bench import GLUON_VARIANTS  # noqa: E402
from kernel_cases import make_paged_case, poison_stale_slots  # noqa: E402

from roofline.kernels.gluon_prefill import gluon_prefill_attention, gluon_unsupported_reason  # noqa: E402
from roofline.kernels.prefill_attention import paged_prefill_attention  # noqa: E402


def smoke(name: str) -> bool:
    cfg = GLUON_VARIANTS[name]
    ok = True
    for block_size in (16, 256):  # the pages of the benchmark (paged16 and contig): its compiles are cached
        q, kc, vc, meta = make_paged_case([300, 1, 129, 64, 1000], [1000, 515, 129, 4000, 1000], 32, 8, 128,
                                          block_size, torch.bfloat16, seed=block_size)
        poison_stale_slots(kc, vc, meta)
        assert gluon_unsupported_reason(q, kc, vc, config=cfg) is None
        scale = 1 / math.sqrt(128)
        out = gluon_prefill_attention(q, kc, vc, meta, scale, config=cfg)
        torch.cuda.synchronize()
        ref = paged_prefill_attention(q, kc, vc, meta, scale)
        err = (out.float() - ref.float()).abs().max().item()
        good = math.isfinite(err) and err < 3e-2
        ok &= good
        print(f"smoke {name} block {block_size}: max-abs vs triton {err:.3e} {'OK' if good else 'BAD'}", flush=True)
    return ok


def main() -> int:
    failed = 0
    for name in sys.argv[1:]:
        print(f"start {name}", flush=True)  # the last "start" without a PASS/FAIL names a hang
        ok = smoke(name)
        print(f"{'PASS' if ok else 'FAIL'} {name}", flush=True)
        failed += not ok
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
