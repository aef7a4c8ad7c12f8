"""Tune the fused MoE kernel's tile configs on the device (issue 33): for each MoE shape, expert format and token
count M, time a small grid of ``MoeConfig``s (and the expert loop) and write the table the kernel loads
(``roofline/kernels/moe_configs/<device>.json``, the layout of ``roofline.kernels.fused_moe_config``).

    python bench/gpu_moe_tune.py --out $OUT/moe_tune.json --table $OUT/NVIDIA_H200.json
    (with --tokens 1,2,4,8 --merge roofline/kernels/moe_configs/NVIDIA_H200.json: only those cells re-tuned)

Timing: each candidate runs inside one CUDA graph of R calls (R routings drawn in advance, so consecutive calls
touch different experts and the weights come from DRAM, not from the 50 MB L2), median of rounds of
``hardware._time_rounds``, divided by R. Every candidate's output is checked against the expert loop in the
model dtype (max |diff| / max |ref| < 2e-2); a failing or uncompilable one is skipped and logged. Where the best
fused config is slower than the loop, the entry says ``"path": "loop"`` (the kernel then runs the loop outside
CUDA-graph capture). ``--budget-s`` bounds the whole run: cells left when it runs out are not written (the
kernel's heuristic covers them) and the log says which.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

import torch

from roofline.bench.moe import make_experts
from roofline.hardware import _time_rounds
from roofline.kernels.fused_moe import fused_moe, ref_fused_moe
from roofline.kernels.fused_moe_config import MoeConfig, default_config, table_key
from roofline.layers.moe import select_experts
from roofline.model_config import model_preset

TOKENS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096]
GEMV = [(4, 512, 4), (8, 512, 4), (16, 512, 4), (8, 256, 4), (16, 1024, 8), (8, 1024, 8)]  # block_n, block_k, warps
# The GEMV path's down kernel (down_block_n, down_block_k, down_num_warps), tried on the best gate_up tile.
DOWN = [(4, 256, 4), (4, 512, 4), (8, 256, 4), (8, 512, 4), (16, 256, 4), (16, 512, 8), (4, 1024, 4), (2, 1024, 4)]
# 1-byte codes (int8, fp8) move half the bytes per element: tiles twice as deep keep as many bytes in flight.
GEMV_CODED = [(8, 2048, 8), (4, 2048, 4), (16, 2048, 8)]
DOWN_CODED = [(4, 2048, 8), (8, 1024, 8), (2, 2048, 4), (8, 2048, 8)]
# The down kernel with every expert of a token in flight at once (down_slots = top_k, for top_k >= 4: Qwen3's 8
# experts of K = 768 are a chain of 24 dependent tiles one expert at a time, 3 at BLOCK_K 256). Tiles of
# slots x rows x depth <= 4096 elements at 4 warps, 8192 at 8 (down_block_n, down_block_k, down_num_warps).
DOWN_SLOTS = [(2, 256, 4), (4, 128, 4), (1, 512, 4), (4, 256, 8), (2, 512, 8), (8, 128, 8), (1, 256, 4),
              (2, 128, 4)]
DOWN_SLOTS_CODED = [(4, 256, 4), (2, 512, 4), (4, 512, 8), (8, 256, 8)]
# Programs per SM of the persistent gate_up kernel (MoeConfig.persistent), tried on the best down kernel.
PERSISTENT = [1, 2, 4]
GROUPED_SMALL = [(16, 64, 128, 1, 4, 4), (16, 128, 128, 1, 4, 3), (16, 64, 256, 1, 4, 3), (32, 64, 128, 1, 4, 4),
                 (32, 128, 64, 1, 4, 4), (16, 32, 256, 1, 4, 4)]
GROUPED_MID = [(32, 128, 64, 8, 4, 4), (64, 64, 64, 8, 4, 4), (64, 128, 64, 8, 4, 4), (64, 128, 128, 8, 4, 3),
               (64, 256, 64, 8, 8, 3), (128, 128, 64, 8, 8, 3)]
GROUPED_LARGE = [(64, 128, 64, 8, 4, 4), (128, 128, 64, 8, 8, 3), (128, 128, 64, 8, 8, 4), (128, 128, 64, 16, 8, 3),
                 (128, 256, 64, 8, 8, 2), (128, 64, 64, 8, 4, 4), (64, 256, 64, 8, 8, 3), (128, 128, 128, 8, 8, 2)]


def candidates(m: int, num_experts: int, top_k: int, inter: int, hidden: int, coded: bool) -> list[MoeConfig]:
    """<= 15 configs for M: the GEMV family at M <= 16 (deeper tiles for 1-byte codes), grouped tiles by the expected pairs per expert, and the
    heuristic's own choice (so the table never loses to the default)."""
    out: list[MoeConfig] = [default_config(m, num_experts, top_k, inter, hidden, coded, 132)]
    if m <= 16:
        out += [MoeConfig(path="gemv", block_n=bn, block_k=bk, num_warps=w, num_stages=1)
                for bn, bk, w in GEMV + (GEMV_CODED if coded else [])]
    per_expert = m * top_k / num_experts
    grid = GROUPED_SMALL if per_expert <= 24 else GROUPED_MID if per_expert <= 160 else GROUPED_LARGE
    if m <= 16:
        grid = grid[:5]
    out += [MoeConfig(block_m=bm, block_n=bn, block_k=bk, group_m=g, num_warps=w, num_stages=s)
            for bm, bn, bk, g, w, s in grid]
    seen, unique = set(), []
    for c in out:
        if c not in seen:
            seen.add(c)
            unique.append(c)
    return unique[:12]


def _graph(fn):
    """``fn`` (which runs every routing once) captured in one CUDA graph, after one warm-up call on a side stream."""
    from roofline.worker.cuda_graph import capture_graph

    return capture_graph(fn)[0]


def tune_cell(m: int, shape: tuple[int, int, int, int], w: dict, quant: str | None, dev: str
              ) -> tuple[dict | None, dict, str]:
    """Time the loop and every candidate at M tokens; returns (the table entry or None, the log row, a line)."""
    num_experts, top_k, hidden, inter = shape
    wargs = (w["w13"], w["w2"])
    scales = (w.get("w13_scale"), w.get("w2_scale"))
    reps = 8 if m <= 256 else 2
    gen = torch.Generator(device=dev).manual_seed(m)
    routes = []
    for _ in range(reps):
        x = torch.randn(m, hidden, device=dev, generator=gen).to(torch.bfloat16)
        tw, ids = select_experts(torch.randn(m, num_experts, device=dev, generator=gen), top_k, True)
        routes.append((x, tw, ids))
    x0, tw0, ids0 = routes[0]
    ref = ref_fused_moe(x0, *wargs, tw0, ids0, *scales).float()
    loop = statistics.median(_time_rounds(
        lambda: [ref_fused_moe(x, *wargs, tw, ids, *scales) for x, tw, ids in routes], dev, 3, 1)) / reps
    best: tuple[float, MoeConfig] | None = None
    rows = []

    def measure(cfg: MoeConfig) -> tuple[float | None, float | None]:
        try:
            out = fused_moe(x0, *wargs, tw0, ids0, *scales, config=cfg).float()
            err = ((out - ref).abs().max() / ref.abs().max()).item()
            if not err < 2e-2:
                raise ValueError(f"rel err {err:.2e} against the loop")
            g = _graph(lambda c=cfg: [fused_moe(x, *wargs, tw, ids, *scales, config=c) for x, tw, ids in routes])
            t = statistics.median(_time_rounds(g.replay, dev, 5 if m <= 1024 else 3, 1)) / reps
            del g
        except Exception as exc:  # noqa: BLE001 - a config that does not fit is skipped, logged
            rows.append(dict(config=cfg.to_dict(), error=f"{type(exc).__name__}: {str(exc)[:160]}"))
            return None, None
        rows.append(dict(config=cfg.to_dict(), us=t * 1e6, rel_err=err))
        return t, err

    for cfg in candidates(m, num_experts, top_k, inter, hidden, quant is not None):
        t, err = measure(cfg)
        if t is not None and (best is None or t < best[0]):
            best = (t, cfg)
    if best is not None and best[1].path == "gemv":  # phase 2: the down kernel's own tile
        for dn, dk, dw in DOWN + (DOWN_CODED if quant is not None else []):
            cfg = dataclasses.replace(best[1], down_block_n=dn, down_block_k=dk, down_num_warps=dw)
            if cfg.down_tile() == best[1].down_tile():
                continue
            t, err = measure(cfg)
            if t is not None and t < best[0]:
                best = (t, cfg)
        if top_k >= 4:  # phase 3: every expert's down tile in flight at once
            slots = 1 << (top_k - 1).bit_length()
            for dn, dk, dw in DOWN_SLOTS + (DOWN_SLOTS_CODED if quant is not None else []):
                cfg = dataclasses.replace(best[1], down_block_n=dn, down_block_k=dk, down_num_warps=dw,
                                          down_slots=slots)
                t, err = measure(cfg)
                if t is not None and t < best[0]:
                    best = (t, cfg)
        # phase 4: the gate_up kernel on a persistent grid (PERSISTENT programs per SM), every GEMV tile again
        # (a program now streams many items, so the best tile may differ), with phase 2/3's down kernel
        for per_sm in PERSISTENT:
            for bn, bk, w in GEMV + (GEMV_CODED if quant is not None else []):
                cfg = dataclasses.replace(best[1], block_n=bn, block_k=bk, num_warps=w, persistent=per_sm,
                                          down_block_n=best[1].down_tile()[0], down_block_k=best[1].down_tile()[1],
                                          down_num_warps=best[1].down_tile()[2])
                t, err = measure(cfg)
                if t is not None and t < best[0]:
                    best = (t, cfg)
        # phase 5: the down kernel on a persistent grid, on the best down tile and a few others
        slots = 1 << (top_k - 1).bit_length() if top_k >= 4 else 1
        tiles = [best[1].down_tile()] + (DOWN_SLOTS if top_k >= 4 else DOWN)[:4]
        for per_sm in PERSISTENT:
            for dn, dk, dw in tiles:
                cfg = dataclasses.replace(best[1], down_block_n=dn, down_block_k=dk, down_num_warps=dw,
                                          down_persistent=per_sm,
                                          down_slots=best[1].down_slots if (dn, dk, dw) == best[1].down_tile()
                                          else slots)
                t, err = measure(cfg)
                if t is not None and t < best[0]:
                    best = (t, cfg)
    log = dict(m=m, loop_us=loop * 1e6, rows=rows)
    if best is None:
        return None, log, "no config ran"
    t, cfg = best
    heuristic = default_config(m, num_experts, top_k, inter, hidden, quant is not None, 132).to_dict()
    default_us = next((r.get("us") for r in rows if r["config"] == heuristic), float("nan"))
    chosen = dict(cfg.to_dict(), us=round(t * 1e6, 2), loop_us=round(loop * 1e6, 2))
    if loop < t and m >= 128:  # decode sizes stay on the kernel (CUDA graphs); prefill may loop
        chosen = dict(dataclasses.asdict(MoeConfig(path="loop")), us=round(loop * 1e6, 2), fused_us=round(t * 1e6, 2),
                      fused_config=cfg.to_dict())
    line = (f"best {t * 1e6:9.1f} us ({cfg.path} {cfg.block_m}x{cfg.block_n}x{cfg.block_k} g{cfg.group_m} "
            f"w{cfg.num_warps} s{cfg.num_stages} down {cfg.down_tile()} slots {cfg.down_slots} persistent {cfg.persistent}/{cfg.down_persistent}), heuristic {default_us:9.1f} us, loop {loop * 1e6:9.1f} us "
            f"-> {chosen['path']}")
    return chosen, log, line


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="mixtral-8x7b,qwen3-30b-a3b")
    p.add_argument("--formats", default="bfloat16,int8,fp8")
    p.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    p.add_argument("--budget-s", type=float, default=220.0)
    p.add_argument("--out", default="moe_tune.json", help="every timing")
    p.add_argument("--table", default="NVIDIA_H200.json", help="the table the kernel loads")
    p.add_argument("--merge", default=None, help="start from this table and replace only the cells tuned now")
    args = p.parse_args()
    t_start = time.time()
    dev = "cuda"
    device_name = torch.cuda.get_device_name()
    tokens = [int(t) for t in args.tokens.split(",")]
    table: dict = {"_source": f"bench/gpu_moe_tune.py on the {device_name}, {time.strftime('%Y-%m-%d')}: per (E, "
                              f"N=I, K=H, dtype) and M the fastest correct config of <= 12 (CUDA-graph timing, "
                              f"routings rotated); path loop where the expert loop was faster"}
    if args.merge:
        kept = json.loads(Path(args.merge).read_text())
        table = {**kept, "_source": f"{kept.get('_source', '')}; cells M={args.tokens} re-tuned "
                                    f"{time.strftime('%Y-%m-%d')} (GEMV down kernel with the top-k sum, its own tile)"}
    log: list[dict] = []
    skipped: list[str] = []

    def write() -> None:  # after every cell: a crash later keeps what was measured
        Path(args.table).write_text(json.dumps(table, indent=1) + "\n")
        Path(args.out).write_text(json.dumps(dict(device=device_name, torch=torch.__version__, log=log,
                                                  skipped=skipped, seconds=time.time() - t_start), indent=1))

    for fmt in args.formats.split(","):  # formats outer: bf16 at both shapes first if the budget runs short
        for model in args.models.split(","):
            mc = model_preset(model)
            shape = (mc.num_experts, mc.num_experts_per_tok, mc.hidden_size, mc.moe_intermediate_size)
            quant = None if fmt in ("bfloat16", "float16") else fmt
            w = make_experts(shape[0], shape[2], shape[3], torch.bfloat16, dev, quant)
            key = table_key(shape[0], shape[3], shape[2], fmt)
            for m in tokens:
                if time.time() - t_start > args.budget_s:
                    skipped.append(f"{key} M={m}")
                    continue
                chosen, row, line = tune_cell(m, shape, w, quant, dev)
                log.append(dict(row, key=key))
                print(f"{key} M={m:>5}: {line}  [{time.time() - t_start:.0f} s]", flush=True)
                if chosen is not None:
                    table.setdefault(key, {})[str(m)] = chosen
                    write()
            del w
            torch.cuda.empty_cache()
    if skipped:
        print(f"budget {args.budget_s:.0f} s ran out; not tuned (heuristic there): {', '.join(skipped)}")
    write()
    print(f"wrote {args.table} and {args.out} in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
