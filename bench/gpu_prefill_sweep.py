"""H200 sweep for the prefill-attention lever (issue 9 §1): block size x kernel variant x tile config.

Compares, on the same paged bf16 inputs and in the same process:
  - torch SDPA (default backend, and each backend alone where it runs), K/V repeated to 32 heads;
  - roofline's ``paged_prefill_attention`` (the committed kernel, configs incl. the TMA path);
  - ``pp``: a variant that issues the next tile's QK^T before the current tile's softmax (FA3's intra-warpgroup
    overlap, written at the Triton level: the async wgmma of tile j+1 can run under the exp2 of tile j).
And decode attention at block sizes 16..256 (the cost of a bigger GPU default block size).
Usage (device): python3 bench/gpu_prefill_sweep.py OUT_DIR
"""

from __future__ import annotations

import json
import math
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.testing import do_bench
from triton.tools.tensor_descriptor import TensorDescriptor

from roofline.bench.attention import _dense_kv, measure_read_bandwidth_cuda
from roofline.kernels.decode_attention import paged_decode_attention
from roofline.kernels.prefill_attention import paged_prefill_attention

LOG2E = 1.4426950408889634


@triton.jit
def _row_of(bt_row, start_n, PAGE: tl.constexpr):
    page = tl.load(bt_row + start_n // PAGE)
    return page * PAGE + start_n % PAGE


@triton.jit
def _pp_kernel(
    Q, Out, BlockTables, QueryStartLoc, SeqLens, KDesc, VDesc, QDesc, scale_log2e,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_bt,
    GROUP: tl.constexpr, PAGE: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PIPE: tl.constexpr, Q_TMA: tl.constexpr = False,
):
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(QueryStartLoc + seq)
    q_len = tl.load(QueryStartLoc + seq + 1) - q_start
    m0 = (tl.num_programs(0) - 1 - tl.program_id(0)) * BLOCK_M
    if m0 >= q_len:
        return
    seq_len = tl.load(SeqLens + seq)
    ctx = seq_len - q_len
    offs_m = m0 + tl.arange(0, BLOCK_M)
    mmask = offs_m < q_len
    offs_d = tl.arange(0, HEAD_DIM)
    q_rows = (q_start + offs_m).to(tl.int64)
    if Q_TMA:  # the tile lands in shared memory and can feed the wgmma from there (no 64 q registers/thread)
        q = QDesc.load([q_start + m0, head * HEAD_DIM])
    else:
        q = tl.load(Q + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=mmask[:, None],
                    other=0.0)
    kv_col = (head // GROUP) * HEAD_DIM
    bt_row = BlockTables + seq.to(tl.int64) * stride_bt
    offs_m_pos = ctx + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    full_end = ((ctx + m0 + 1) // BLOCK_N) * BLOCK_N
    if PIPE:
        if full_end > 0:
            qk = tl.dot(q, KDesc.load([_row_of(bt_row, 0, PAGE), kv_col]).T)
            for start_n in range(0, full_end, BLOCK_N):
                row = _row_of(bt_row, start_n, PAGE)
                nxt = tl.minimum(start_n + BLOCK_N, full_end - BLOCK_N)  # last trip: a wasted, valid tile
                qk_next = tl.dot(q, KDesc.load([_row_of(bt_row, nxt, PAGE), kv_col]).T)
                m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2e)
                p = tl.exp2(qk * scale_log2e - m_new[:, None])
                alpha = tl.exp2(m_i - m_new)
                l_i = l_i * alpha + tl.sum(p, axis=1)
                acc = acc * alpha[:, None]
                v = VDesc.load([row, kv_col])
                acc = tl.dot(p.to(v.dtype), v, acc)
                m_i = m_new
                qk = qk_next
    else:
        for start_n in range(0, full_end, BLOCK_N):
            row = _row_of(bt_row, start_n, PAGE)
            qk = tl.dot(q, KDesc.load([row, kv_col]).T)
            m_new = tl.maximum(m_i, tl.max(qk, axis=1) * scale_log2e)
            p = tl.exp2(qk * scale_log2e - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None]
            v = VDesc.load([row, kv_col])
            acc = tl.dot(p.to(v.dtype), v, acc)
            m_i = m_new
    band_end = tl.minimum(seq_len, ctx + m0 + BLOCK_M)
    for start_n in range(full_end, band_end, BLOCK_N):
        row = _row_of(bt_row, start_n, PAGE)
        offs_n = start_n + tl.arange(0, BLOCK_N)
        nmask = offs_n < seq_len
        qk = tl.dot(q, KDesc.load([row, kv_col]).T)
        causal = (offs_n[None, :] <= offs_m_pos[:, None]) & nmask[None, :]
        qk = tl.where(causal, qk * scale_log2e, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, axis=1))
        p = tl.exp2(qk - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        v = VDesc.load([row, kv_col])
        v = tl.where(nmask[:, None], v, 0.0)
        acc = tl.dot(p.to(v.dtype), v, acc)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(Out + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :], out.to(Out.dtype.element_ty),
             mask=mmask[:, None])


def pp_prefill(q, kc, vc, meta, scale, out, cfg):
    block_size, hkv, d = kc.shape[1], kc.shape[2], kc.shape[3]
    num_slots = kc.shape[0] * block_size
    kd, vd = (TensorDescriptor(c, shape=[num_slots, hkv * d], strides=[c.stride(1), 1],
                               block_shape=[cfg["BLOCK_N"], d]) for c in (kc, vc))
    qdesc = TensorDescriptor(q, shape=[q.shape[0], q.shape[1] * d], strides=[q.stride(0), 1],
                             block_shape=[cfg["BLOCK_M"], d])
    num_seqs = meta.query_start_loc.shape[0] - 1
    grid = (triton.cdiv(meta.max_query_len, cfg["BLOCK_M"]), num_seqs, q.shape[1])
    _pp_kernel[grid](q, out, meta.block_tables, meta.query_start_loc, meta.seq_lens, kd, vd, qdesc, scale * LOG2E,
                     q.stride(0), q.stride(1), out.stride(0), out.stride(1), meta.block_tables.stride(0),
                     GROUP=q.shape[1] // hkv, PAGE=block_size, HEAD_DIM=d, BLOCK_M=cfg["BLOCK_M"],
                     BLOCK_N=cfg["BLOCK_N"], PIPE=cfg["PIPE"], Q_TMA=cfg.get("Q_TMA", False), num_warps=cfg["num_warps"],
                     num_stages=cfg["num_stages"])
    return out


def inputs(batch, seq, heads, kv_heads, d, block_size):
    from types import SimpleNamespace
    nb = math.ceil(seq / block_size)
    total = batch * nb
    tables = torch.randperm(total, device="cuda").to(torch.int32).view(batch, nb)
    kc = torch.randn(total, block_size, kv_heads, d, device="cuda", dtype=torch.bfloat16)
    vc = torch.randn_like(kc)
    q = torch.randn(batch * seq, heads, d, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(seq, device="cuda")
    slots = (tables.long()[:, pos // block_size] * block_size + pos % block_size).reshape(-1)
    meta = SimpleNamespace(slot_mapping=slots,
                           query_start_loc=torch.arange(batch + 1, device="cuda", dtype=torch.int32) * seq,
                           seq_lens=torch.full((batch,), seq, device="cuda", dtype=torch.int32),
                           block_tables=tables, max_query_len=seq)
    return q, kc, vc, meta


def main(out_dir: str) -> None:
    heads, kv_heads, d = 32, 8, 128
    scale = 1 / math.sqrt(d)
    res = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
               date=time.strftime("%Y-%m-%dT%H:%M:%S"), prefill=[], decode=[], sdpa_backends=[])
    lines = []

    def log(s):
        print(s, flush=True)
        lines.append(s)

    repo_cfgs = [dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3, USE_TMA=True),
                 dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3, USE_TMA=True),
                 dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3)]
    pp_cfgs = [dict(BLOCK_M=BM, BLOCK_N=BN, num_warps=w, num_stages=s, PIPE=pipe)
               for (BM, BN, w) in [(128, 64, 4), (128, 128, 8), (128, 64, 8), (64, 64, 4)]
               for s in (2, 3) for pipe in (True, False)]
    quick = len(sys.argv) > 2 and sys.argv[2] == "quick"
    if quick:  # second pass: q tile through TMA (kept in shared memory: ncu showed 255 registers and spills)
        repo_cfgs = [dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=2, USE_TMA=True)]
        pp_cfgs = [dict(BLOCK_M=BM, BLOCK_N=BN, num_warps=w, num_stages=s, PIPE=pipe, Q_TMA=True)
                   for (BM, BN, w, s, pipe) in [(128, 64, 4, 2, False), (128, 64, 4, 3, False), (128, 128, 8, 2, False),
                                                (128, 128, 8, 2, True), (128, 64, 4, 2, True), (128, 128, 4, 2, False),
                                                (256, 64, 8, 2, False)]]
    for seq in (4096, 8192, 16384):
        batch = 16384 // seq
        for block_size in ((64,) if quick else (16, 64, 128, 256)):
            q, kc, vc, meta = inputs(batch, seq, heads, kv_heads, d, block_size)
            flops = batch * 4 * seq * seq * heads * d / 2
            qd = q.view(batch, seq, heads, d).transpose(1, 2).contiguous()
            kr = _dense_kv(kc, meta, batch, seq).repeat_interleave(heads // kv_heads, 1)
            vr = _dense_kv(vc, meta, batch, seq).repeat_interleave(heads // kv_heads, 1)
            ref = F.scaled_dot_product_attention(qd, kr, vr, is_causal=True)
            t_sdpa = do_bench(lambda: F.scaled_dot_product_attention(qd, kr, vr, is_causal=True),
                              return_mode="median")
            if block_size == 64 and not quick:
                from torch.nn.attention import SDPBackend, sdpa_kernel
                for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
                    try:
                        with sdpa_kernel([be]):
                            t = do_bench(lambda: F.scaled_dot_product_attention(qd, kr, vr, is_causal=True),
                                         return_mode="median")
                        res["sdpa_backends"].append(dict(seq=seq, backend=str(be), ms=t, tflops=flops / t / 1e9))
                        log(f"  sdpa {be} S={seq}: {flops / t / 1e9:.0f} TFLOP/s")
                    except Exception as e:  # noqa: BLE001
                        log(f"  sdpa {be}: {type(e).__name__}")
            out = torch.empty_like(q)
            row = dict(seq=seq, batch=batch, block_size=block_size, flops=flops, sdpa_ms=t_sdpa,
                       sdpa_tflops=flops / t_sdpa / 1e9, variants=[])
            cands = [("repo", c) for c in repo_cfgs] + ([("pp", c) for c in pp_cfgs] if block_size >= 64 else [])
            for kind, cfg in cands:
                if kind == "pp" and block_size % cfg["BLOCK_N"]:
                    continue
                if kind == "repo":
                    fn = lambda cfg=cfg: paged_prefill_attention(q, kc, vc, meta, scale, out=out, config=cfg)  # noqa
                else:
                    fn = lambda cfg=cfg: pp_prefill(q, kc, vc, meta, scale, out, cfg)  # noqa
                try:
                    out.fill_(float("nan"))
                    fn()
                    err = float((out.view(batch, seq, heads, d).transpose(1, 2).float() - ref.float()).norm()
                                / ref.float().norm())
                    t = do_bench(fn, return_mode="median")
                    v = dict(kind=kind, config=cfg, ms=t, tflops=flops / t / 1e9, ratio=t_sdpa / t, rel_err=err)
                except Exception as e:  # noqa: BLE001
                    v = dict(kind=kind, config=cfg, error=f"{type(e).__name__}: {str(e)[:160]}")
                row["variants"].append(v)
            ok = [v for v in row["variants"] if "ms" in v and v["rel_err"] < 1e-2]
            best = min(ok, key=lambda v: v["ms"]) if ok else None
            row["best"] = best
            res["prefill"].append(row)
            log(f"S={seq:>5} bs={block_size:>3} sdpa {row['sdpa_tflops']:5.0f}  best "
                + (f"{best['tflops']:5.0f} TFLOP/s ratio {best['ratio']:.3f} {best['kind']} {best['config']}"
                   if best else "none"))
            for v in row["variants"]:
                log(f"     {v['kind']:4} {str(v['config']):90} " + (f"{v['tflops']:6.0f} {v['ratio']:.3f} err {v['rel_err']:.1e}"
                                                               if "ms" in v else v["error"]))
            q = kc = vc = meta = qd = kr = vr = ref = out = None  # free them before the next size
            torch.cuda.empty_cache()
    if quick:
        with open(f"{out_dir}/prefill-sweep-qtma.json", "w") as f:
            json.dump(res, f, indent=1)
        return
    bw = measure_read_bandwidth_cuda()
    res["bandwidth"] = bw
    for batch, ctx in ((8, 32768), (64, 4096), (1, 4096)):
        for block_size in (16, 64, 128, 256):
            nb = math.ceil(ctx / block_size)
            kc = torch.randn(batch * nb, block_size, kv_heads, d, device="cuda", dtype=torch.bfloat16)
            vc = torch.randn_like(kc)
            tables = torch.randperm(batch * nb, device="cuda").to(torch.int32).view(batch, nb)
            seq_lens = torch.full((batch,), ctx, device="cuda", dtype=torch.int32)
            q = torch.randn(batch, heads, d, device="cuda", dtype=torch.bfloat16)
            out = torch.empty_like(q)
            t = do_bench(lambda: paged_decode_attention(q, kc, vc, tables, seq_lens, scale, out=out),
                         return_mode="median")
            kv_bytes = 2 * ctx * kv_heads * d * 2 * batch
            frac = kv_bytes / (t * 1e-3) / bw["read_bytes_per_s"]
            res["decode"].append(dict(batch=batch, ctx=ctx, block_size=block_size, ms=t, frac_of_read=frac))
            log(f"decode B={batch:>3} ctx={ctx:>6} bs={block_size:>3}: {t * 1e3:7.1f} us  {frac:.3f} of read")
            kc = vc = None
            torch.cuda.empty_cache()
    with open(f"{out_dir}/prefill-sweep.json", "w") as f:
        json.dump(res, f, indent=1)
    with open(f"{out_dir}/prefill-sweep.txt", "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
