"""H200 sweep: where the quantized split-KV decode loses its bandwidth (issue 9 §4).

The committed kernel casts int8 / e4m3 codes to q's dtype (bf16) before the dots and reached only 0.46-0.58
of read bandwidth (int8 slower than bf16 at batch 8 x 32k). Hypothesis: the code -> bf16 conversion
(I2F / a non-native e4m3 -> bf16 path) is the bottleneck, not the bytes. Variants, each vs bf16 in this run:
  CONV 0: codes -> q dtype (bf16), dots in bf16 (committed);
  CONV 1: codes -> fp16 with triton's cast (e4m3 -> f16 is one packed cvt on sm_90), q -> fp16, dots in fp16;
  CONV 2: int8 -> fp16 by bit tricks in inline PTX (xor 0x80, prmt with 0x64 -> 1024 + 128 + x, sub.f16x2):
          4 codes per 3 ALU instructions, no I2F; q -> fp16, dots in fp16.
Usage (device): python3 bench/gpu_decode_quant_variants.py OUT_DIR
"""

from __future__ import annotations

import json
import math
import sys

import torch
import triton
import triton.language as tl
from triton.testing import do_bench

from roofline.kernels.decode_attention import _decode_reduce_kernel, choose_num_splits, ref_decode_attention

LOG2E = 1.4426950408889634


@triton.jit
def _i8_to_f16(x):
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, c;
        xor.b32 t, $2, 0x80808080;
        mov.b32 c, 0x64806480;
        prmt.b32 $0, t, 0x64646464, 0x4140;
        prmt.b32 $1, t, 0x64646464, 0x4342;
        sub.f16x2 $0, $0, c;
        sub.f16x2 $1, $1, c;
        }""",
        constraints="=r,=r,r",
        args=[x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def _split(Q, KC, VC, KS, VS, BlockTables, SeqLens, MidO, MidLse, scale_log2e,
           stride_qs, stride_qh, stride_kb, stride_ks, stride_kh, stride_s_slot, stride_bt,
           stride_ms, stride_mh, stride_msp, stride_ls, stride_lh,
           GROUP: tl.constexpr, BLOCK_H: tl.constexpr, PAGE: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr,
           NUM_SPLITS: tl.constexpr, QUANT: tl.constexpr, CONV: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(SeqLens + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    offs_g = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + offs_g
    gmask = offs_g < GROUP
    offs_d = tl.arange(0, D)
    q = tl.load(Q + seq.to(tl.int64) * stride_qs + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None], other=0.0)
    if CONV != 0:
        q = q.to(tl.float16)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D], tl.float32)
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    k_base = KC + kv_head * stride_kh
    v_base = VC + kv_head * stride_kh
    if QUANT == 2:
        scale_log2e = scale_log2e * tl.load(KS + kv_head)
    for n in range(start, end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        nmask = offs_n < end
        if BLOCK_N <= PAGE:
            page = tl.load(bt_row + n // PAGE).to(tl.int64)
        else:
            page = tl.load(bt_row + offs_n // PAGE, mask=nmask, other=0).to(tl.int64)
        row = page * stride_kb + (offs_n % PAGE) * stride_ks
        k = tl.load(k_base + row[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
        v = tl.load(v_base + row[:, None] + offs_d[None, :], mask=nmask[:, None], other=0.0)
        if QUANT != 0:
            if CONV == 0:
                k = k.to(q.dtype)
                v = v.to(q.dtype)
            elif CONV == 2 and QUANT == 1:
                k = _i8_to_f16(k)
                v = _i8_to_f16(v)
            else:
                k = k.to(tl.float16)
                v = v.to(tl.float16)
        qk = tl.dot(q, tl.trans(k)) * scale_log2e
        if QUANT == 1:
            s_row = (page * PAGE + offs_n % PAGE) * stride_s_slot + kv_head
            ks = tl.load(KS + s_row, mask=nmask, other=0.0)
            vs = tl.load(VS + s_row, mask=nmask, other=0.0)
            qk = qk * ks[None, :]
        qk = tl.where(nmask[None, :], qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(qk - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if QUANT == 1:
            p = p * vs[None, :]
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    safe_l = tl.where(l_i > 0, l_i, 1.0)
    o = acc / safe_l[:, None]
    if QUANT == 2:
        o = o * tl.load(VS + kv_head)
    lse = tl.where(l_i > 0, m_i + tl.log2(safe_l), float("-inf"))
    mid = MidO + seq.to(tl.int64) * stride_ms + heads[:, None] * stride_mh + split * stride_msp + offs_d[None, :]
    tl.store(mid, o, mask=gmask[:, None])
    tl.store(MidLse + seq.to(tl.int64) * stride_ls + heads * stride_lh + split, lse, mask=gmask)


def decode(q, kc, vc, ks, vs, tables, seq_lens, scale, quant, conv, block_n, num_warps, num_stages, out,
           split_mult=1, maxnreg=None):
    num_seqs, num_heads, d = q.shape
    block_size, hkv = kc.shape[1], kc.shape[2]
    splits = choose_num_splits(num_seqs, hkv, tables.shape[1] * block_size) * split_mult
    mid_o = torch.empty((num_seqs, num_heads, splits, d), dtype=torch.float32, device=q.device)
    mid_lse = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
    _split[(num_seqs, hkv, splits)](
        q, kc, vc, ks if ks is not None else q, vs if vs is not None else q, tables, seq_lens, mid_o, mid_lse,
        scale * LOG2E, q.stride(0), q.stride(1), kc.stride(0), kc.stride(1), kc.stride(2),
        hkv if quant == 1 else 0, tables.stride(0), mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=num_heads // hkv, BLOCK_H=16, PAGE=block_size, D=d, BLOCK_N=block_n, NUM_SPLITS=splits,
        QUANT=quant, CONV=conv, num_warps=num_warps, num_stages=num_stages,
        **({"maxnreg": maxnreg} if maxnreg else {}))
    _decode_reduce_kernel[(num_seqs, num_heads)](
        mid_o, mid_lse, out, mid_o.stride(0), mid_o.stride(1), mid_o.stride(2), mid_lse.stride(0),
        mid_lse.stride(1), out.stride(0), out.stride(1), NUM_SPLITS=splits,
        SPLITS_P2=triton.next_power_of_2(splits), HEAD_DIM=d, BLOCK_D=d, num_warps=4)
    return out


def main(out_dir):
    heads, hkv, d, block_size = 32, 8, 128, 64
    scale = 1 / math.sqrt(d)
    x = torch.randn(1 << 31, device="cuda", dtype=torch.bfloat16)
    read_bw = (x.numel() * 2) / (do_bench(lambda: x.sum(), return_mode="median") * 1e-3)
    x = None  # free the 4 GiB before the sweep (a del would leave the timed lambda an unbound name)
    rows = []
    for batch, ctx in ((8, 32768), (64, 4096)):
        nb = ctx // block_size
        tables = torch.randperm(batch * nb, device="cuda").to(torch.int32).view(batch, nb)
        seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
        q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
        kf = torch.randn(batch * nb, block_size, hkv, d, device="cuda", dtype=torch.bfloat16)
        vf = torch.randn_like(kf)
        # int8 per token per head
        ks8 = (kf.float().abs().amax(-1) / 127).clamp_min(1e-8)
        vs8 = (vf.float().abs().amax(-1) / 127).clamp_min(1e-8)
        k8 = torch.round(kf.float() / ks8[..., None]).clamp(-127, 127).to(torch.int8)
        v8 = torch.round(vf.float() / vs8[..., None]).clamp(-127, 127).to(torch.int8)
        # fp8 per head
        ksf = (kf.float().abs().amax((0, 1, 3)) * 2 / 448)
        vsf = (vf.float().abs().amax((0, 1, 3)) * 2 / 448)
        kfp = (kf.float() / ksf[None, None, :, None]).to(torch.float8_e4m3fn)
        vfp = (vf.float() / vsf[None, None, :, None]).to(torch.float8_e4m3fn)
        out = torch.empty_like(q)
        cases = [("bf16", kf, vf, None, None, 0)] + [("int8", k8, v8, ks8, vs8, 1), ("fp8", kfp, vfp, ksf, vsf, 2)]
        base_t = None
        for name, kc, vc, ks, vs, quant in cases:
            ref = ref_decode_attention(q[:2], kc, vc, tables[:2], seq_lens[:2], scale, k_scale=ks, v_scale=vs) \
                if batch * ctx <= 8 * 32768 else None
            convs = (0,) if quant == 0 else ((0, 2) if quant == 1 else (1,))
            grid = [(64, 4, 2, 1, None)] if quant == 0 else [
                (64, w, 2, sm, mr) for w in (4, 8) for sm in (1, 2, 4) for mr in (None, 96, 72)]
            for conv in convs:
                for block_n, warps, stages, split_mult, maxnreg in grid:
                    fn = lambda: decode(q, kc, vc, ks, vs, tables, seq_lens, scale, quant, conv, block_n,  # noqa
                                        warps, stages, out, split_mult, maxnreg)
                    try:
                        fn()
                        err = float((out[:2].float() - ref.float()).norm() / ref.float().norm()) if ref is not None \
                            else float("nan")
                        t = do_bench(fn, return_mode="median")
                    except Exception as e:  # noqa: BLE001
                        print(f"{name} conv{conv} {block_n}/{warps}/{stages}: {type(e).__name__} {str(e)[:200]}")
                        continue
                    nbytes = 2 * batch * ctx * hkv * d * kc.element_size() + (2 * batch * ctx * hkv * 4 if quant == 1
                                                                               else 0)
                    frac = nbytes / (t * 1e-3) / read_bw
                    if name == "bf16" and base_t is None:
                        base_t = t
                    row = dict(batch=batch, ctx=ctx, fmt=name, conv=conv, block_n=block_n, warps=warps,
                               stages=stages, split_mult=split_mult, maxnreg=maxnreg, us=t * 1e3, frac_of_read=frac, speedup_vs_bf16=base_t / t, rel_err=err)
                    rows.append(row)
                    print(f"B={batch:>2} ctx={ctx:>6} {name:5} conv{conv} {block_n:>3}/{warps}/{stages} x{split_mult} r{maxnreg}: "
                          f"{t * 1e3:7.1f} us {frac:.3f} of read  {base_t / t:.2f}x bf16  err {err:.1e}", flush=True)
        del kf, vf, k8, v8, kfp, vfp
        torch.cuda.empty_cache()
    json.dump(dict(read_bw=read_bw, rows=rows, device=torch.cuda.get_device_name(), triton=triton.__version__),
              open(f"{out_dir}/decode-quant-variants.json", "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
