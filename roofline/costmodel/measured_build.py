"""Build ``measured_tables/<device>.json`` (:mod:`roofline.costmodel.measured`) from committed benchmark JSONs.

For each ``--quantization`` and projection of the measured model, the GPU time of the kernel that
``roofline.kernels.linear_dispatch`` runs at each measured M, chosen by the same rules the dispatch applies to the
device's dispatch table (``roofline/kernels/dispatch_tables/<device>.json``):

=============  =====================================================================================================
quantization   kernel at M rows (source of its time)
=============  =====================================================================================================
none           M = 1 where the table's ``fused_max_m["dense"]`` >= 1: the split-K GEMV (table ``gemv``); else cuBLAS
               (``bf16_us`` of the INT4 tensor-core sweep, which timed ``F.linear`` at every M it swept)
int4           the tensor-core kernel where the table's ``int4_mma`` row says it beat the Triton path (``us``), else
               the Triton INT4 kernel (``triton_us``), M in 1..64; ``int4_triton``: the Triton kernel alone (a
               run without the tensor-core layout, e.g. ``bench decode``'s ``int4/auto+triton`` rows)
int8           M = 1 and 2..4: the table's ``gemv`` rows (a GEMV, or the tiled kernel timed at M = 16); M = 16, 64:
               the tiled kernel's default config up to ``fused_max_m["int8"]``, else dequantize + cuBLAS (the sweep)
fp8            weight-only (``fp8_w8a16``) up to ``fused_max_m["fp8_w8a16"]`` (GEMV rows, then the tiled kernel);
               above, per-token quantization + ``torch._scaled_mm`` (the sweep's ``other`` path of ``fp8_w8a16``)
smoothquant    per-token quantization + the Triton INT8 tensor-core GEMM (``fused_max_m["int8_int8"]`` is 0): the
               table's ``other_us`` at M = 1 and 4, the only M measured
=============  =====================================================================================================

The calibration is the bf16 (``quantization none``) rows of one measured ``roofline bench decode`` run.

``python -m roofline.costmodel.measured_build`` rewrites the H200 table from the default sources.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
H200_SOURCES = {
    "dispatch_table": "roofline/kernels/dispatch_tables/NVIDIA_H200.json",
    "int4_mma_sweep": "bench/results/int4-mma-20261204/w4a16_mma-call2.json",
    "quant_sweep": "bench/results/decode-kernels-20261204/sweep-dense-int8-fp8wo.json",
    "decode_run": "bench/results/int4-mma-20261204/decode-int4-mma-vs-triton-call2.json",
}
H200_MODEL = {"name": "llama-3-8b", "num_layers": 32, "vocab_size": 128256,
              "projections": {"qkv": [6144, 4096], "o": [4096, 4096], "gate_up": [28672, 4096],
                              "down": [4096, 14336]}}


def _row(rows: list[dict], n: int, k: int, **match: Any) -> dict:
    hits = [r for r in rows if (r["n"], r["k"]) == (n, k) and all(r.get(a) == b for a, b in match.items())]
    if not hits:
        raise ValueError(f"no measured row for N {n}, K {k}, {match}")
    return hits[0]


def _fused_max_m(table: dict, fmt: str, n: int, k: int) -> int:
    return _row(table["fused_max_m"][fmt], n, k)["fused_max_m"]


def _sweep_us(sweep: dict, fmt: str, path: str, n: int, k: int, m: int) -> float:
    """The first timed row of (fmt, path, N, K, M): for ``tiled``, the default config (the sweep times it first)."""
    return next(r["us"] for r in sweep["rows"] if "us" in r and (r["fmt"], r["path"], r["n"], r["k"], r["m"])
                == (fmt, path, n, k, m))


def _gemv_point(table: dict, fmt: str, n: int, k: int, m: int) -> list[Any]:
    r = _row(table["gemv"][fmt], n, k, m=m)
    return [m, r["us"], "gemv" if r["config"].get("gemv") else f"tiled (timed at M = {r['timed_at_m']})"]


def kernel_points(table: dict, mma: dict, sweep: dict, n: int, k: int) -> dict[str, list[list[Any]]]:
    """``{quantization: [[m, us, path], ...]}`` for one [N, K] projection (module docstring for the rules)."""
    best = [r for r in mma["best"] if (r["n"], r["k"]) == (n, k)]
    out: dict[str, list[list[Any]]] = {"none": [], "int4": [], "int4_triton": [], "int8": [], "fp8": [],
                                       "smoothquant": []}
    for r in sorted(best, key=lambda r: r["m"]):
        m = r["m"]
        if m == 1 and _fused_max_m(table, "dense", n, k) >= 1:
            out["none"].append(_gemv_point(table, "dense", n, k, 1))
        else:
            out["none"].append([m, r["bf16_us"], "cublas"])
    for r in sorted((r for r in table["int4_mma"] if (r["n"], r["k"]) == (n, k)), key=lambda r: r["m"]):
        mma_wins = r["us"] <= r["triton_us"]
        out["int4"].append([r["m"], r["us"] if mma_wins else r["triton_us"], "mma" if mma_wins else "triton"])
        out["int4_triton"].append([r["m"], r["triton_us"], "triton"])  # the Triton INT4 path alone (no mma layout)
    for q, fmt in (("int8", "int8"), ("fp8", "fp8_w8a16")):
        limit = _fused_max_m(table, fmt, n, k)
        out[q] += [_gemv_point(table, fmt, n, k, 1), _gemv_point(table, fmt, n, k, 4)]
        for m in (16, 64):
            if m <= limit:
                out[q].append([m, _sweep_us(sweep, fmt, "tiled", n, k, m), "tiled"])
            else:
                out[q].append([m, _sweep_us(sweep, fmt, "other", n, k, m),
                               "dequantize + cublas" if q == "int8" else "w8a8 scaled_mm"])
    if _fused_max_m(table, "int8_int8", n, k) > 0:
        raise ValueError("smoothquant's GEMV wins somewhere in this table: extend the builder")
    out["smoothquant"] = [[m, _row(table["gemv"]["int8_int8"], n, k, m=m)["other_us"], "int8 tensor-core gemm"]
                          for m in (1, 4)]
    return out


def build_table(sources: dict[str, str], model: dict[str, Any], root: Path = ROOT) -> dict[str, Any]:
    """The measured table from the benchmark JSONs named in ``sources`` (paths relative to ``root``)."""
    data = {key: json.loads((root / path).read_text()) for key, path in sources.items()}
    table = {k: v for k, v in data["dispatch_table"].items() if not k.startswith("_")}
    kernels: dict[str, dict[str, list]] = {}
    for name, (n, k) in model["projections"].items():
        for q, pts in kernel_points(table, data["int4_mma_sweep"], data["quant_sweep"], n, k).items():
            kernels.setdefault(q, {})[name] = pts
    run = data["decode_run"]
    bf16 = sorted((r for r in run["rows"] if r["quantization"] == "none"), key=lambda r: r["batch"])
    contexts = {r["context"] for r in bf16}
    if len(contexts) != 1 or run["model"] != model["name"]:
        raise ValueError(f"the calibration run must be {model['name']} at one context, got {run['model']} {contexts}")
    context = contexts.pop()
    return {
        "_source": "roofline.costmodel.measured_build from " + ", ".join(sources.values()),
        "device": run["device"],
        "model": model,
        "kernels_us": kernels,
        "calibration": {
            "source": f"{sources['decode_run']} (bench decode, commit {run['git_commit'][:7]}, {run['date'][:10]}): "
                      "bf16 decode steps",
            "quantization": "none", "context": context, "kv_cache_dtype": "auto",
            "kv_bytes_per_sequence": run["kv_formats"][bf16[0]["config"]]["kv_bytes_per_token"] * context,
            "read_bandwidth_bytes_per_s": run["read_bandwidth_bytes_per_s"],
            "steps": [[r["batch"], r["step_ms"] * 1e-3] for r in bf16],
        },
    }


def main(argv: list[str] | None = None) -> int:
    out = Path(__file__).with_name("measured_tables") / "NVIDIA_H200.json"
    table = build_table(H200_SOURCES, H200_MODEL)
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
