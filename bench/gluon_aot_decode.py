"""Compile the Gluon decode kernel for sm_90 without a GPU (Triton 3.6 only, no torch) and count SASS
instructions per KV byte of one tile. Run: /work/tr36/bin/python bench/gluon_aot_decode.py"""
import importlib.util
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon._runtime import GluonASTSource

here = os.path.dirname(os.path.abspath(__file__))
spec = importlib.util.spec_from_file_location(
    "gdk", os.path.join(here, "..", "roofline", "kernels", "gluon_decode_kernels.py"))
gdk = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gdk)

SIG = {"Q": "*bf16", "KC": "*i8", "VC": "*i8", "KS": "*fp32", "VS": "*fp32", "BlockTables": "*i32",
       "SeqLens": "*i32", "MidO": "*fp32", "MidLse": "*fp32", "scale_log2e": "fp32"}
for name in ("stride_qt", "stride_qh", "stride_kb", "stride_kh", "stride_vb", "stride_vh", "stride_bt",
             "stride_mt", "stride_mh", "stride_msp", "stride_lt", "stride_lh"):
    SIG[name] = "i32"


def compile_one(quant, page, head_dim, block_n=64, group=4, num_warps=4, h_kv=8, prefetch=True):
    sig = dict(SIG)
    if quant == 2:
        sig["KC"] = sig["VC"] = "*fp8e4nv"
    consts = dict(STRIDE_KS=h_kv * head_dim, STRIDE_VS=h_kv * head_dim, S_SLOT=h_kv if quant == 1 else 0,
                  GROUP=group, PAGE=page, HEAD_DIM=head_dim, BLOCK_N=block_n,
                  SPLIT_ALIGN=page if page % block_n == 0 else block_n, NUM_SPLITS=8, QUANT=quant,
                  NUM_WARPS=num_warps, PREFETCH=prefetch)
    for c in consts:
        sig[c] = "constexpr"
    # As the JIT specializes them on the GPU: pointers and strides divisible by 16 (a contiguous cache with
    # D 64/128 and whole pages; the stride of a head in mid_o/mid_lse is splits x D / splits).
    names = list(sig)
    div = [a for a in names if sig[a].startswith("*")] + ["stride_qt", "stride_qh", "stride_kb", "stride_kh",
                                                          "stride_vb", "stride_vh", "stride_mt", "stride_mh"]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div}
    src = GluonASTSource(gdk._gluon_decode_kernel, sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})


def sass_of(k):
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True).stdout


def loop_count(sass):
    """Instructions of the longest backward-branch loop body (the key-tile loop), and of the whole kernel."""
    lines = [ln for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4,}\*/", ln)]
    best = (0, [])
    # nvdisasm -c prints labels as separate lines; find loop heads by label lines
    text = sass.splitlines()
    labels = {}
    idx = 0
    for ln in text:
        if re.match(r"^\.L_x_\d+:", ln.strip()):
            labels[ln.strip()[:-1]] = idx
        elif re.search(r"/\*[0-9a-f]{4,}\*/", ln):
            idx += 1
    idx = 0
    for ln in text:
        if re.search(r"/\*[0-9a-f]{4,}\*/", ln):
            mt = re.search(r"BRA[^;]*(\.L_x_\d+)", ln)
            if mt and labels.get(mt.group(1), 1 << 30) < idx:
                n = idx - labels[mt.group(1)] + 1
                if n > best[0]:
                    best = (n, [])
            idx += 1
    return best[0], len(lines)


def registers(k):
    """(registers a thread, spill-store bytes) from ptxas -v on the kernel's PTX (sm_90a)."""
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(k.asm["ptx"])
    err = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", f.name, "-o", os.devnull],
                         capture_output=True, text=True).stderr
    regs, spills = re.search(r"Used (\d+) registers", err), re.search(r"(\d+) bytes spill stores", err)
    return int(regs.group(1)) if regs else -1, int(spills.group(1)) if spills else -1


def report(quant, page, hd, block_n=64, group=4, num_warps=4, prefetch=True):
    k = compile_one(quant, page, hd, block_n=block_n, group=group, num_warps=num_warps, prefetch=prefetch)
    regs, spills = registers(k)
    sass = sass_of(k)
    body, total = loop_count(sass)
    kv_bytes = 2 * block_n * hd  # K and V codes of one tile of one kv head
    ops = {op: len(re.findall(r"\b" + op, sass)) for op in ("HMMA", "LDG", "LDS", "STS", "BAR", "PRMT", "F2FP",
                                                             "MUFU", "SHFL")}
    warp_instr = num_warps * body  # each warp issues the loop body once per tile
    print(f"{('int8', 'fp8')[quant - 1]:4s} page {page:3d} D {hd:3d} group {group} tile {block_n:3d}x{num_warps}w{'' if prefetch else ' no-prefetch'}: "
          f"{regs} regs, {spills} B spilled, shared {k.metadata.shared:5d} B, loop body {body:4d} instr/thread -> {warp_instr / kv_bytes:.3f} warp-instr "
          f"per KV byte; kernel {total}; {ops}", flush=True)


if __name__ == "__main__":
    # Every shape the dispatch sends (default tile 64 x 4 warps), then the tiles the bench can sweep (--configs).
    for quant in (1, 2):
        for page in (64, 16, 128):
            for hd in (128, 64):
                report(quant, page, hd)
        report(quant, 64, 128, group=8)
        report(quant, 16, 64, group=1)
        report(quant, 8, 128)
        report(quant, 64, 128, prefetch=False)
        for block_n, warps in ((16, 1), (32, 1), (64, 1), (32, 2), (64, 2), (128, 4), (128, 8)):
            report(quant, 64, 128, block_n=block_n, num_warps=warps)
            report(quant, 64, 128, block_n=block_n, num_warps=warps, prefetch=False)
    sys.exit(0)
