"""Compile the warp-specialized W8A16 Gluon GEMM (``roofline/kernels/gluon_ws_gemm.py``) for sm_90 without a GPU
and print registers / spills per config: catches layout and type errors before a device call.

    /work/tr36/bin/python bench/gluon_aot_ws_gemm.py        (a torch-free Triton 3.6 venv, as the H200's)

Exit status 1 if any config fails to compile."""

from __future__ import annotations

import importlib.util
import pathlib
import sys
import traceback

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from gluon_aot_check import desc_sig, ptxas_usage  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONFIGS = [  # (BLOCK_M, BLOCK_N, BLOCK_K, STAGES, CVT_WARPS, ws): the sweep's (gpu_quant_sweep.WS_TILES) and the
    # tests'; ws 2: no loader warp (the converter issues the copies)
    (64, 128, 64, 4, 4, 1), (64, 256, 64, 4, 4, 1), (128, 128, 64, 4, 4, 1), (128, 64, 128, 3, 4, 1),
    (64, 128, 128, 3, 4, 1), (64, 64, 64, 2, 4, 1), (128, 256, 64, 3, 4, 2), (128, 128, 64, 4, 4, 2),
    (64, 256, 64, 4, 4, 2), (128, 256, 64, 2, 4, 2),
    # 8 converter warps; 256-row tiles (two warpgroups, two m64 wgmma each a K step). 128 x 256 with 8 converter
    # warps does not fit ptxas (the MMA's 128-register accumulator at 128 registers a thread).
    (128, 128, 64, 4, 8, 2), (128, 128, 64, 4, 8, 1), (256, 128, 64, 3, 4, 2), (256, 128, 64, 4, 4, 2),
]
INT4_CONFIGS = [(128, 128, 64, 4, 4, 1), (128, 128, 64, 4, 4, 2), (64, 128, 64, 4, 4, 1), (128, 256, 64, 3, 4, 2),
                (64, 256, 64, 4, 4, 2), (128, 128, 64, 4, 8, 2), (256, 128, 64, 4, 4, 2)]


def main() -> int:
    spec = importlib.util.spec_from_file_location("gluon_ws_gemm", ROOT / "roofline/kernels/gluon_ws_gemm.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    bad = 0
    int4 = [(c, 1, 1) for c in INT4_CONFIGS] + [(INT4_CONFIGS[0], 3, 1)] + [(c, 1, 2) for c in INT4_CONFIGS]
    for dtype, gdt in (("bf16", gl.bfloat16), ("fp16", gl.float16)):
        for (bm, bn, bk, stages, cw, ws), split, is4 in [(c, 1, 0) for c in CONFIGS] + [(CONFIGS[2], 4, 0)] + int4:
            nw = 4 if bm == 64 else 8  # ws_gemm.mma_warps
            x_layout = gl.NVMMASharedLayout.get_default_for([bm, bk], gdt)
            q_block = [bk // 8, bn] if is4 else [bn, bk]
            q_layout = gl.NVMMASharedLayout.get_default_for(q_block, gl.int32 if is4 else gl.int8)
            w_layout = gl.NVMMASharedLayout.get_default_for([bn, bk], gdt)
            sig = {"x_desc": desc_sig(dtype, [bm, bk], x_layout),
                   "q_desc": desc_sig("i32" if is4 else "i8", q_block, q_layout),
                   "S": f"*{dtype}" if is4 else "*fp32", "Out": f"*{dtype}", "P": "*fp32", "C": "*i32", "M": "i32",
                   "N": "i32", "K": "i32", "stride_om": "i32", "k_per_split": "i32",
                   "BLOCK_M": "constexpr", "BLOCK_N": "constexpr", "BLOCK_K": "constexpr", "STAGES": "constexpr",
                   "SPLIT_K": "constexpr", "CVT_WARPS": "constexpr", "CVT_REGS": "constexpr", "W_LAYOUT": "constexpr",
                   "num_warps": "constexpr", "LOADER": "constexpr", "Z": f"*{dtype}" if is4 else "*fp32",
                   "GROUP": "i32", "INT4": "constexpr"}
            cx = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, STAGES=stages, SPLIT_K=split, CVT_WARPS=cw, CVT_REGS=min(128, mod.ws_maxnreg(nw, cw, ws == 1)),
                      W_LAYOUT=w_layout, num_warps=nw, LOADER=ws == 1, INT4=is4)
            name = f"{('int8', 'int4', 'int4p')[is4]} {dtype} BM{bm} BN{bn} BK{bk} S{stages} cvt{cw} ws{ws} split{split}"
            try:
                k = triton.compile(GluonASTSource(mod.gluon_ws_gemm_kernel, sig, constexprs=cx),
                                   target=GPUTarget("cuda", 90, 32),
                                   options={"num_warps": nw, "maxnreg": mod.ws_maxnreg(nw, cw, ws == 1)})
                regs, spill = ptxas_usage(k.asm["ptx"])
                print(f"{name:<42} ok  regs {regs:>4} spill {spill:>5} smem {k.metadata.shared:>7} warps {k.metadata.num_warps}", flush=True)
            except Exception:  # noqa: BLE001 - report every config
                bad += 1
                print(f"{name:<42} FAILED\n{traceback.format_exc()[-3000:]}", flush=True)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
