"""Compile every Gluon prefill variant for sm_90 without a GPU and print registers / shared memory / spills.

Run with the torch-free Triton 3.6 venv that matches the H200 machine (the kernels' module imports no torch):

    /work/tr36/bin/python bench/gluon_aot_check.py [--sass]

Exit status 1 if any variant fails to compile. Variants: head_dim 64/128 x bf16/fp16 x block_size
(PAGE) 16/32/64/128/256 x BLOCK_N 64/128 x stages 2/3 x plain / pipelined / ws / pingpong / ws2 / persistent, and ws /
pingpong / persistent with the tree mask (the set ``roofline.kernels.gluon_prefill`` may launch); ``--fp8``: the
FP8 kernels (E4M3 q/K/V, bf16 out) at head_dim 64/128 x PAGE 16..256 x BLOCK_N 64/128 x stages 2/3/4 ("fp8") or
2/3 ("fp8pp", two-term q). The "regs" column is ptxas's kernel-wide count (for ws: the
maxnreg cap; the partitions' setmaxnreg budgets apply at run time).
"""

from __future__ import annotations

import argparse
import importlib.util
import pathlib
import re
import subprocess
import sys
import tempfile
import traceback

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

ROOT = pathlib.Path(__file__).resolve().parents[1]
WS_MAXNREG = 168  # as roofline.kernels.gluon_prefill passes for the warp-specialized kernel


def load_kernels():
    path = ROOT / "roofline" / "kernels" / "gluon_prefill_kernels.py"
    spec = importlib.util.spec_from_file_location("gluon_prefill_kernels", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def desc_sig(dtype: str, block: list[int], layout) -> str:
    return f"tensordesc<{dtype}[{block[0]},{block[1]}],{layout!r}>"


def compile_variant(mod, dtype: str, head_dim: int, page: int, block_m: int, block_n: int, stages: int,
                    num_warps: int, pipeline: bool | str = False, tree: bool = False):
    gdt = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    page_rows = min(page, block_n)
    q_layout = gl.NVMMASharedLayout.get_default_for([block_m, head_dim], gdt)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gdt)
    sig = {
        "q_desc": desc_sig(dtype, [block_m, head_dim], q_layout),
        "k_desc": desc_sig(dtype, [page_rows, head_dim], kv_layout),
        "v_desc": desc_sig(dtype, [page_rows, head_dim], kv_layout),
        "Out": f"*{dtype}", "BlockTables": "*i32", "QueryStartLoc": "*i32", "SeqLens": "*i32",
        "scale_log2e": "fp32", "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32",
        "GROUP": "constexpr", "PAGE": "constexpr", "PAGE_ROWS": "constexpr", "HEAD_DIM": "constexpr",
        "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "NUM_STAGES": "constexpr", "num_warps": "constexpr",
    }
    constexprs = dict(GROUP=4, PAGE=page, PAGE_ROWS=page_rows, HEAD_DIM=head_dim, BLOCK_M=block_m,
                      BLOCK_N=block_n, NUM_STAGES=stages, num_warps=num_warps)
    if pipeline in ("ws", "pingpong", "ws2", "persistent"):  # the kernels with a tree mask
        extra = {"num_seqs": "i32", "num_heads": "i32", "num_m_blocks": "i32"} if pipeline == "persistent" else {}
        sig = {**{k: v for k, v in sig.items() if k != "GROUP" and v != "constexpr"}, "TreeMask": "*i64",
               "stride_tm": "i32", **extra, **{k: v for k, v in sig.items() if v == "constexpr"},
               "TREE": "constexpr", "TREE_ROWS": "constexpr"}
        constexprs.update(TREE=tree, TREE_ROWS=64)
    if pipeline in ("pingpong", "ws2", "persistent"):  # 4 + 4 + 1 warps: warpgroup 0 is the default partition
        if pipeline != "persistent":
            sig["PINGPONG"] = "constexpr"
            constexprs.update(PINGPONG=pipeline == "pingpong")
        constexprs.update(num_warps=4)
        num_warps = 4
    fn = {False: mod.gluon_prefill_kernel, True: mod.gluon_prefill_kernel_pipelined,
          "ws": mod.gluon_prefill_kernel_ws, "pingpong": mod.gluon_prefill_kernel_pingpong,
          "ws2": mod.gluon_prefill_kernel_pingpong, "persistent": mod.gluon_prefill_kernel_persistent}[pipeline]
    src = GluonASTSource(fn, sig, constexprs=constexprs)
    options = {"num_warps": num_warps}
    if pipeline in ("ws", "pingpong", "ws2", "persistent"):
        options["maxnreg"] = WS_MAXNREG
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def compile_fp8(mod, head_dim: int, page: int, block_n: int, stages: int, split: bool = True,
                variant: str = "fp8", num_vt: int = 2, chunk: int = 32):
    """``gluon_prefill_kernel_fp8`` (BLOCK_M 128, 8 warps) or, ``variant`` "fp8pp", ``gluon_prefill_kernel_fp8pp``
    (3 warpgroups, num_warps 4 + workers, ``WS_MAXNREG``) as ``roofline.kernels.gluon_prefill.launch_gluon_fp8``
    launches them."""
    page_rows = min(page, block_n)
    q_layout = gl.NVMMASharedLayout.get_default_for([128, head_dim], gl.float8e4nv)
    kv_layout = gl.NVMMASharedLayout.get_default_for([block_n, head_dim], gl.float8e4nv)
    sig = {"q_desc": desc_sig("fp8e4nv", [128, head_dim], q_layout),
           "qlo_desc": desc_sig("fp8e4nv", [128, head_dim], q_layout),
           "k_desc": desc_sig("fp8e4nv", [page_rows, head_dim], kv_layout),
           "v_desc": desc_sig("fp8e4nv", [page_rows, head_dim], kv_layout), "Out": "*bf16", "BlockTables": "*i32",
           "QueryStartLoc": "*i32", "SeqLens": "*i32", "QScale": "*fp32", "KScale": "*fp32", "VScale": "*fp32",
           "scale_log2e": "fp32", "stride_ot": "i32", "stride_oh": "i32", "stride_bt": "i32", "stride_qs": "i32",
           "GROUP": "constexpr", "PAGE": "constexpr", "PAGE_ROWS": "constexpr", "HEAD_DIM": "constexpr",
           "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "NUM_STAGES": "constexpr", "num_warps": "constexpr",
           "Q_SPLIT": "constexpr"}
    constexprs = dict(GROUP=4, PAGE=page, PAGE_ROWS=page_rows, HEAD_DIM=head_dim, BLOCK_M=128, BLOCK_N=block_n,
                      NUM_STAGES=stages, num_warps=8, Q_SPLIT=split)
    if variant == "fp8pp":
        sig.update(NUM_VT="constexpr", CHUNK="constexpr")
        constexprs.update(num_warps=4, NUM_VT=num_vt, CHUNK=chunk)
        src = GluonASTSource(mod.gluon_prefill_kernel_fp8pp, sig, constexprs=constexprs)
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": WS_MAXNREG})
    src = GluonASTSource(mod.gluon_prefill_kernel_fp8, sig, constexprs=constexprs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8})


def ptxas_usage(ptx: str) -> tuple[str, str]:
    """Registers and spill bytes from the bundled ptxas -v (the kernel is not loaded, so no n_regs)."""
    ptxas = pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = pathlib.Path(tmp) / "k.ptx"
        src.write_text(ptx)
        cmd = [str(ptxas), "-v", "--gpu-name", "sm_90a", str(src), "-o", str(src.with_suffix(".o"))]
        res = subprocess.run(cmd, capture_output=True, text=True)
    report = res.stdout + res.stderr
    regs = re.search(r"Used (\d+) registers", report)
    spill = re.search(r"(\d+) bytes spill stores", report)
    return (regs.group(1) if regs else "?"), (spill.group(1) if spill else "?")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sass", action="store_true", help="also count SASS instructions (needs nvdisasm)")
    ap.add_argument("--quick", action="store_true", help="only the default variants")
    ap.add_argument("--new", action="store_true", help="only round 2's variants (pingpong, ws2, tree masks)")
    ap.add_argument("--fp8", action="store_true", help="only the FP8 kernel")
    args = ap.parse_args()
    mod = load_kernels()
    if args.fp8:
        return check_fp8(mod)
    variants = []
    for dtype in ("bf16", "fp16"):
        for head_dim in (128, 64):
            for page in (16, 32, 64, 128, 256):
                for block_n in (128, 64):
                    for stages in (2, 3):
                        for pipeline in (False, True, "ws", "pingpong", "ws2", "persistent"):
                            variants.append((dtype, head_dim, page, 128, block_n, stages, 8, pipeline, False))
                        for pipeline in ("ws", "pingpong", "persistent"):
                            variants.append((dtype, head_dim, page, 128, block_n, stages, 8, pipeline, True))
    if args.quick:
        variants = [v for v in variants if v[0] == "bf16" and v[1] == 128 and v[2] in (16, 128)
                    and (v[4], v[5], v[7]) in ((128, 2, False), (64, 3, True), (128, 2, True), (64, 3, "ws"),
                                               (128, 2, "ws"), (128, 2, "pingpong"), (128, 2, "ws2"))]
    if args.new:
        variants = [v for v in variants if v[0] == "bf16" and v[2] in (16, 128) and v[5] == 2 + (v[4] == 64)
                    and (v[7] in ("pingpong", "ws2", "persistent") or v[8])]
    failed = 0
    print(f"{'dtype':5} {'D':>4} {'page':>4} {'BM':>4} {'BN':>4} {'st':>3} {'warps':>5} {'regs':>5} "
          f"{'spill':>5} {'smem':>7} kind     tree wgmma tma")
    for v in variants:
        try:
            k = compile_variant(mod, *v)
        except Exception as e:  # report and go on: every variant is checked
            failed += 1
            print(" ".join(map(str, v)), "FAILED:", type(e).__name__, str(e).splitlines()[0][:200])
            if failed == 1:
                traceback.print_exc()
            continue
        ptx = k.asm["ptx"]
        md = k.metadata
        regs, spills = ptxas_usage(ptx)
        print(f"{v[0]:5} {v[1]:>4} {v[2]:>4} {v[3]:>4} {v[4]:>4} {v[5]:>3} {v[6]:>5} {str(regs):>5} "
              f"{spills:>5} {md.shared:>7} {v[7]!s:8} {v[8]!s:5} {'wgmma' in ptx!s:5} "
              f"{'cp.async.bulk.tensor' in ptx}")
        if args.sass and "sass" in k.asm:
            sass = k.asm["sass"]
            print("   SASS lines", sass.count("\n"), "HGMMA", sass.count("HGMMA"), "UTMALDG",
                  sass.count("UTMALDG"))
    print(f"{len(variants) - failed}/{len(variants)} compiled")
    return 1 if failed else 0


def check_fp8(mod) -> int:
    failed = total = 0
    print(f"{'variant':7} {'D':>4} {'page':>4} {'BN':>4} {'st':>3} {'split':>5} {'regs':>5} {'spill':>5} "
          f"{'smem':>7} wgmma")
    for variant in ("fp8", "fp8pp"):
        for head_dim in (128, 64):
            for page in (16, 32, 64, 128, 256):
                for block_n in (64, 128):
                    for stages in (2, 3, 4):
                        for split in (True, False):
                            if variant == "fp8pp" and (stages == 4 or not split):
                                continue
                            total += 1
                            try:
                                k = compile_fp8(mod, head_dim, page, block_n, stages, split, variant)
                            except Exception as e:  # report and go on
                                failed += 1
                                print(variant, head_dim, page, block_n, stages, split, "FAILED:", type(e).__name__,
                                      str(e).splitlines()[0][:200])
                                continue
                            regs, spills = ptxas_usage(k.asm["ptx"])
                            print(f"{variant:7} {head_dim:>4} {page:>4} {block_n:>4} {stages:>3} {split!s:>5} "
                                  f"{regs:>5} {spills:>5} {k.metadata.shared:>7} "
                                  f"{k.asm['ptx'].count('wgmma.mma_async')}")
    print(f"{total - failed}/{total} compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
