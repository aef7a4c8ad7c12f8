"""Compile the Gluon INT4 mma GEMM (``roofline/kernels/gluon_w4a16.py``) for sm_90 without a GPU and print its
resources and inner-loop SASS mix. Run with a Triton that has Gluon (3.6, as on the H200), e.g.
``/work/tr36/bin/python bench/gluon_aot_w4a16.py 16,128,4 64,128,4``  (BLOCK_M,BN,NUM_WARPS[,PDL[,STAGES[,PERSIST]]])."""

import collections
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

path = Path(__file__).resolve().parents[1] / "roofline" / "kernels" / "gluon_w4a16.py"
spec = importlib.util.spec_from_file_location("gluon_w4a16", path)
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)


def compile_kernel(bm, bn, nw, pdl=0, stages=1, persist=0):
    sig = {"X": "*bf16", "W": "*i32", "S": "*bf16", "Z": "*bf16", "Out": "*bf16", "Partials": "*fp32",
           "Counters": "*i32", "M": "i32", "N": "i32", "K": "i32", "k_tiles_per_split": "i32", "SPLIT_K": "i32",
           "stride_xm": "i32", "stride_sg": "i32", "stride_om": "i32",
           "BLOCK_M": "constexpr", "BN": "constexpr", "NUM_WARPS": "constexpr", "STAGES": "constexpr", "XPRE": "constexpr", "PDL": "constexpr",
           "PERSIST": "constexpr"}
    names = list(sig)
    div = ["X", "W", "S", "Z", "Out", "Partials", "N", "K", "stride_xm", "stride_sg", "stride_om"]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div}
    consts = {"BLOCK_M": bm, "BN": bn, "NUM_WARPS": nw, "STAGES": stages, "XPRE": int(bm <= 16), "PDL": pdl, "PERSIST": persist}
    fn = mod._w4a16_mma_kernel
    src = GluonASTSource(fn, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw})


def resources(k):
    """Registers / spills from the cubin (cuobjdump --dump-resource-usage), '' if the tool is missing."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True, text=True).stdout
    m = re.search(r"REG:(\d+).*?STACK:(\d+)", out)
    return f"regs {m.group(1)} stack {m.group(2)}" if m else out.strip()[-200:]


def sass_mix(k):
    nvd = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin/nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    out = subprocess.run([nvd, "-c", f.name], capture_output=True, text=True).stdout.splitlines()
    labs = {m.group(1): i for i, ln in enumerate(out) for m in [re.match(r"\.L_x_(\d+):", ln.strip())] if m}
    best = None
    for i, ln in enumerate(out):
        m = re.search(r"BRA.*\.L_x_(\d+)", ln)
        if m and m.group(1) in labs and labs[m.group(1)] < i and (best is None or i - labs[m.group(1)] > best[0]):
            best = (i - labs[m.group(1)], labs[m.group(1)], i)
    ops = collections.Counter()
    for ln in out[best[1]:best[2] + 1] if best else []:
        m = re.search(r"/\*[0-9a-f]{4}\*/\s+(@!?P\d\s+)?([A-Z0-9_.]+)", ln)
        if m:
            ops[m.group(2).split(".")[0]] += 1
    return ops


for arg in sys.argv[1:] or ["16,128,4"]:
    parts = arg.split(",")
    bm, bn, nw = map(int, parts[:3])
    pdl = int(parts[3]) if len(parts) > 3 else 0
    stages = int(parts[4]) if len(parts) > 4 else 1
    persist = int(parts[5]) if len(parts) > 5 else 0
    k = compile_kernel(bm, bn, nw, pdl, stages, persist)
    ops = sass_mix(k)
    n = sum(ops.values())
    weights = 128 * bn // (32 * nw)  # per thread per k-tile
    ttg = k.asm["ttgir"]
    print(f"PDL={pdl} STAGES={stages} PERSIST={persist} BLOCK_M={bm} BN={bn} warps={nw}: smem {k.metadata.shared} {resources(k)} "
          f"local_alloc {ttg.count('local_alloc')} | loop SASS {n} = {n / weights:.2f} per weight "
          f"{dict(ops.most_common(12))}")
