"""``roofline bench decode``: decode-step time at named shapes with dummy weights, beside its floor.

For each (batch, context) the runner executes real engine decode steps (scheduler -> worker -> update,
CUDA graphs where enabled) on sequences whose first ``context - 1`` tokens are already in the paged cache
(their values do not change the speed). The floor of a step is the bound model's:

    floor = max((weight_bytes + KV bytes read) / read_bandwidth, 2 * params * batch / peak_flops)

with the read bandwidth and the bf16 GEMM rate measured in the same process (Pope et al. 2022;
``roofline.costmodel.decode_floor_report``). The table prints tok/s, ms per step, floor and the achieved
fraction of the floor (floor / measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import random
import statistics
import time
from typing import Any


def build_engine(args: argparse.Namespace, max_batch: int, max_context: int, kv_cache_dtype: str = "auto",
                 quantization: str | None = None, executor: str | None = None):
    from roofline.args import EngineArgs
    from roofline.config import model_preset
    from roofline.engine_factory import build_engine
    from roofline.models.loader import ModelSource

    mc = model_preset(args.model)
    max_len = max_context + args.steps + args.warmup + 16
    if mc.max_position_embeddings < max_len:
        # Benchmark shape only: positions beyond the preset's trained length cost the same.
        mc = dataclasses.replace(mc, max_position_embeddings=max_len)
    ea = EngineArgs(model=args.model, load_format="dummy", dtype=args.dtype, max_model_len=max_len,
                    max_num_seqs=max_batch, max_num_batched_tokens=max(2048, max_batch),
                    gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                    kv_cache_memory=args.kv_cache_memory, attention_backend=args.attention_backend,
                    device=args.device, kv_cache_dtype=kv_cache_dtype, block_size=args.block_size,
                    quantization=quantization, quantization_group_size=args.quantization_group_size,
                    tensor_parallel_size=getattr(args, "tensor_parallel_size", 1),
                    distributed_executor_backend=executor,
                    async_scheduling=getattr(args, "async_scheduling", None))
    return build_engine(ea.create_engine_config(mc), ModelSource("dummy", None, args.model), mc, tokenizer=None)


def time_decode(engine: Any, batch: int, context: int, steps: int, warmup: int, seed: int = 0,
                spec_tokens: int = 0, self_draft: bool = False, draft_times: list[float] | None = None) -> list[float]:
    """Per-step wall times (s) of ``steps`` decode steps for ``batch`` sequences at ``context`` tokens.

    With ``spec_tokens`` k > 0 every step is a verify step of k random drafts per sequence (1 + k positions
    each; the engine needs a ``speculative_config``), drafted by the engine's self-draft model when
    ``self_draft`` (its seconds per step go to ``draft_times``)."""
    from roofline.engine.sequence import Sequence, SequenceStatus
    from roofline.sampling_params import SamplingParams

    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    sched, bm = engine.scheduler, engine.block_manager
    params = SamplingParams(temperature=0.0, max_tokens=steps + warmup + 3, ignore_eos=True)
    seqs = []
    for i in range(batch):
        seq = Sequence(f"bench-{i}", [rng.randrange(vocab) for _ in range(context)], params)
        bm.allocate(seq, context - 1)
        seq.num_computed_tokens = context - 1  # prefix "already computed": its KV values do not affect speed
        seq.status = SequenceStatus.RUNNING
        sched.running.append(seq)
        seqs.append(seq)
    times = []
    try:
        if engine.config.async_scheduling and not spec_tokens:
            return _time_async_decode(engine, seqs, steps, warmup)
        for i in range(warmup + steps):
            for seq in seqs:
                seq.spec_token_ids = ([-1] * spec_tokens if self_draft
                                      else [rng.randrange(vocab) for _ in range(spec_tokens)])
            out = sched.schedule()
            assert len(out.scheduled) == batch and all(
                s.num_scheduled_tokens == 1 + spec_tokens for s in out.scheduled), "benchmark batch did not fit"
            t0 = time.perf_counter()
            result = engine.executor.execute_model(engine._step_input(out))  # ends with the ids' sync
            elapsed = time.perf_counter() - t0
            sched.update(out, dict(zip(result.seq_ids, result.sampled_token_ids, strict=True)))
            if i >= warmup:
                times.append(elapsed)
                if draft_times is not None:
                    draft_times.append(result.draft_duration_s)
    finally:
        for seq in seqs:
            sched.finish(seq, SequenceStatus.FINISHED_ABORTED)
            engine._release(seq)
    return times


def _time_async_decode(engine: Any, seqs: list, steps: int, warmup: int) -> list[float]:
    """``time_decode`` as the engine runs with async scheduling: step N+1 is scheduled and launched before
    step N's sampled ids are waited for, so a step's time is the period between consecutive results (the
    host's scheduling and input preparation hide behind the device's work, as in ``LLMEngine.step``). The
    caller releases the sequences."""
    sched = engine.scheduler
    batch = len(seqs)
    times: list[float] = []
    inflight = None
    t_prev = None
    try:
        for i in range(warmup + steps + 1):
            out = sched.schedule()
            assert len(out.scheduled) == batch and all(
                s.num_scheduled_tokens == 1 for s in out.scheduled), "benchmark batch did not fit"
            pending = engine.executor.execute_model_async(engine._step_input(out))
            if inflight is not None:
                result = inflight[1].result()
                sched.update(inflight[0], dict(zip(result.seq_ids, result.sampled_token_ids, strict=True)))
            now = time.perf_counter()
            if t_prev is not None and i > warmup:
                times.append(now - t_prev)
            t_prev, inflight = now, (out, pending)
    finally:
        if inflight is not None:  # the step in flight ends before its sequences are released
            inflight[1].result()
    return times


def run_decode_bench(args: argparse.Namespace) -> int:
    """Decode steps at each (batch, context) for each weight format x KV-cache format, in one process,
    against the bound (each configuration's own weight and KV bytes over the bandwidth measured here).

    With several ``--quantization`` or ``--kv-cache-dtype`` values, each pair gets its own engine (the previous
    one is freed first) and the table ends with each one's tok/s over the first one's at the same point.
    """
    import gc

    from roofline.args import resolve_device
    from roofline.bench.common import parse_sizes, write_result
    from roofline.hardware import measure_gemm_flops, measure_read_bandwidth

    batches = parse_sizes(args.batch_sizes)
    contexts = parse_sizes(args.contexts)
    quants = [None if q in ("none", "") else q for q in args.quantization.split(",")]
    executors = [None if e in ("", "auto") else e for e in args.executor.split(",")]
    if args.steps < 1 or args.warmup < 0:
        raise ValueError(f"--steps must be >= 1 and --warmup >= 0, got {args.steps} and {args.warmup}")
    pdls = [p for p in str(getattr(args, "pdl", "") or "").split(",") if p != ""]
    if any(p not in ("0", "1", "2") for p in pdls):
        raise ValueError(f"--pdl {','.join(pdls)!r}: expected modes 0, 1 or 2")
    pdls = [int(p) for p in pdls] or [None]
    int4ks = [k for k in str(getattr(args, "int4_kernel", "") or "").split(",") if k] or [None]
    if any(k not in (None, "mma", "triton") for k in int4ks):
        raise ValueError(f"--int4-kernel {','.join(map(str, int4ks))!r}: expected mma or triton")
    reduces = [r for r in str(getattr(args, "attention_reduce", "") or "").split(",") if r] or [None]
    bad = [r for r in reduces if r not in (None, "fused", "kernel")]
    if bad:
        raise ValueError(f"--attention-reduce {bad[0]!r}: expected fused or kernel")
    gpu_only = [f"--{flag} {','.join(map(str, values))}" for flag, values in
                (("pdl", pdls), ("int4-kernel", int4ks), ("attention-reduce", reduces)) if values != [None]]
    if gpu_only and resolve_device(getattr(args, "device", "auto")) == "cpu":
        raise ValueError(f"{', '.join(gpu_only)}: GPU kernel knobs (Triton / Gluon kernels on CUDA); this run is on "
                         "the CPU, where they would change nothing")
    configs = [(q, kv, ex, pdl, i4, red) for ex in executors for q in quants for pdl in pdls
               for i4 in (int4ks if q == "int4" else [None]) for kv in args.kv_cache_dtype.split(",") if kv
               for red in reduces]
    formats = [_label(q, kv, len(quants) > 1) + (f"@{ex}" if len(executors) > 1 else "")
               + (f"+pdl{pdl}" if len(pdls) > 1 else "") + (f"+{i4}" if i4 and len(int4ks) > 1 else "")
               + (f"+{red}" if len(reduces) > 1 else "")
               for q, kv, ex, pdl, i4, red in configs]
    rows, meta, bandwidth, peak = [], {}, None, None
    for (quant, kv, ex, pdl, i4, red), fmt in zip(configs, formats, strict=True):
        if red is not None:  # the decode attention's split reduction (roofline.kernels.decode_attention)
            from roofline.kernels import decode_attention

            decode_attention.FUSED_REDUCE = red == "fused"
        if pdl is not None:  # the GEMM kernels' programmatic-dependent-launch mode, before the graphs are captured
            from roofline.kernels import pdl as pdl_mod

            pdl_mod.MODE = pdl
        if i4 is not None:  # which INT4 decode GEMM the layers prepare for (at load, so before the graphs)
            from roofline.kernels import w4a16_mma

            w4a16_mma.ENABLED = i4 == "mma"
        engine = build_engine(args, max(batches), max(contexts), kv_cache_dtype=kv, quantization=quant, executor=ex)
        worker = engine.worker
        device = str(worker.device)
        if bandwidth is None:
            bandwidth = measure_read_bandwidth(device)
            peak = measure_gemm_flops(device, n=8192 if device.startswith("cuda") else 1024, rounds=10)
            print(f"measured in this process: read {bandwidth / 1e12:.3f} TB/s, dense GEMM {peak / 1e12:.1f} TFLOP/s")
        rows += _decode_points(args, engine, fmt, batches, contexts, bandwidth, peak, quant or "none", kv)
        meta[fmt] = dict(kv_bytes_per_token=worker.kv_bytes_per_token, weight_bytes=worker.weight_bytes,
                         weight_bytes_per_step=worker.weight_bytes_per_step,
                         quantization=quant, kv_cache_dtype=kv,
                         pool_tokens=engine.block_manager.num_blocks * engine.block_manager.block_size)
        info = dict(model=args.model, dtype=str(worker.dtype), weight_bytes=worker.weight_bytes,
                    cuda_graphs=worker.graphs is not None, attention_backend=worker.config.attention_backend,
                    block_size=engine.block_manager.block_size)
        engine.executor.shutdown()  # worker processes hand their memory back
        del engine, worker
        gc.collect()
        _empty_device_cache()
    if len(formats) > 1:
        base = {(r["batch"], r["context"]): r["tok_per_s"] for r in rows if r["config"] == formats[0]}
        print(f"tok/s vs {formats[0]} at the same point:")
        for r in rows:
            if (r["batch"], r["context"]) in base:
                r["speedup_vs_first"] = r["tok_per_s"] / base[(r["batch"], r["context"])]
                print(f"  {r['config']:>9} batch {r['batch']:>4} context {r['context']:>6}: "
                      f"{r['speedup_vs_first']:.3f}x")
    path = write_result(args.out_dir, f"decode-{args.model}", dict(
        **info, kv_bytes_per_token=meta[formats[0]]["kv_bytes_per_token"], kv_formats=meta, read_bandwidth_bytes_per_s=bandwidth, peak_flops=peak,
        steps=args.steps, warmup=args.warmup, rows=rows,
    ))
    print(f"wrote {path}")
    return 0


def _label(quant: str | None, kv: str, with_quant: bool) -> str:
    """A configuration's name in the table: the KV format, prefixed by the weight format when several run."""
    return f"{quant or 'unquantized'}/{kv}" if with_quant else kv


def _empty_device_cache() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _decode_points(args, engine, fmt, batches, contexts, bandwidth, peak, quantization: str = "none",
                   kv_cache_dtype: str = "auto") -> list[dict]:
    """Rows carry ``quantization`` (the weight format, "none" when unquantized) and ``kv_cache_dtype`` (the
    KV-cache flag's value) as separate fields, and ``config``: the configuration's label in the table."""
    from roofline import costmodel
    from roofline.bench.moe import moe_step_bytes

    worker = engine.worker
    capacity = engine.block_manager.num_blocks * engine.block_manager.block_size
    print(f"model {args.model} (dummy weights, {worker.dtype}), {worker.weight_bytes / 1e9:.2f} GB of weights "
          f"({worker.weight_bytes_per_step / 1e9:.2f} GB read per step), "
          f"quantization {quantization}, kv_cache_dtype {kv_cache_dtype} ({worker.kv_bytes_per_token} B/token), pool {capacity} tokens, "
          f"CUDA graphs {'on' if worker.graphs is not None else 'off'}, "
          f"async scheduling {'on' if engine.config.async_scheduling else 'off'}")
    header = f"{'batch':>6} {'context':>8} {'ms/step':>9} {'tok/s':>10} {'floor ms':>9} {'floor tok/s':>12} {'of floor':>9}"
    print(header)
    rows = []
    for context in contexts:
        for batch in batches:
            need = batch * (context + args.steps + args.warmup + engine.block_manager.block_size)
            if need > capacity:
                print(f"{batch:>6} {context:>8}   skipped: needs {need} KV tokens, pool holds {capacity}")
                continue
            times = time_decode(engine, batch, context, args.steps, args.warmup)
            step = statistics.median(times)
            mean_ctx = context + args.warmup + args.steps / 2
            # MoE: the dense weights plus the experts this batch is expected to touch (roofline.bench.moe).
            moe = moe_step_bytes(engine.model_config, worker.weight_bytes_per_step, batch)
            weight_bytes, params = moe or (worker.weight_bytes_per_step, engine.model_config.num_params)
            rep = costmodel.decode_floor_report(
                weight_bytes=weight_bytes,
                kv_bytes_read=batch * mean_ctx * worker.kv_bytes_per_token,
                flops=2.0 * params * batch,
                bandwidth_bytes_per_s=bandwidth, peak_flops=peak, measured_step_s=step,
            )
            row = dict(config=fmt, quantization=quantization, kv_cache_dtype=kv_cache_dtype, batch=batch, context=context, step_ms=step * 1e3, tok_per_s=batch / step,
                       weight_bytes_read=weight_bytes, floor_ms=rep["floor_s"] * 1e3, floor_tok_per_s=batch / rep["floor_s"],
                       fraction_of_floor=rep["fraction_of_floor"], bound_by=rep["bound_by"],
                       async_scheduling=engine.config.async_scheduling,
                       step_ms_p10=sorted(times)[len(times) // 10] * 1e3,
                       step_ms_p90=sorted(times)[(len(times) * 9) // 10] * 1e3)
            rows.append(row)
            print(f"{batch:>6} {context:>8} {row['step_ms']:>9.3f} {row['tok_per_s']:>10.1f} {row['floor_ms']:>9.3f} "
                  f"{row['floor_tok_per_s']:>12.1f} {row['fraction_of_floor']:>9.3f}", flush=True)
    return rows


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("decode", help="decode step time vs its floor, dummy weights at a named shape")
    p.add_argument("--model", default="llama-3-8b", help="preset shape (llama-3-8b, qwen3-8b, llama-3-70b, ...)")
    p.add_argument("--batch-sizes", default="1,8,32,64,128,256")
    p.add_argument("--contexts", default="128,1k,4k,32k")
    p.add_argument("--steps", type=int, default=32, help="timed decode steps per point")
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--kv-cache-dtype", default="auto",
                   help="KV-cache format, or a comma-separated list run one after another in this process "
                        "(auto, bfloat16, float16, float32, int8, fp8_e4m3, fp8); the first is the baseline")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default: the engine's)")
    p.add_argument("--quantization", default="none",
                   help="weight format, or a comma-separated list (none, int8, int4, fp8, smoothquant), each "
                        "quantized at load from the dummy weights; the first is the baseline")
    p.add_argument("--quantization-group-size", type=int, default=128, choices=[32, 64, 128])
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--executor", default="auto",
                   help="comma-separated distributed executor backends to compare in one run: uni (in-process "
                        "worker), mp (worker processes; at TP 1 this measures the executor's overhead), auto")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="time steps as the engine runs them with async scheduling (step N+1 launched before "
                        "step N's ids are read; the period between results) or one step at a time "
                        "(default: the engine's, on with a CUDA device)")
    p.add_argument("--pdl", default="",
                   help="comma list of programmatic-dependent-launch modes for our decode kernels (0 off; GEMMs: 1 "
                        "release the next kernel after the wait, 2 after the K loop; sm_90+), each measured in turn "
                        "(roofline.kernels.pdl)")
    p.add_argument("--int4-kernel", default="",
                   help="comma list of INT4 decode GEMMs to measure in turn for --quantization int4: mma (the "
                        "Gluon tensor-core kernel, the default where it applies) or triton (roofline.kernels."
                        "w4a16_mma)")
    p.add_argument("--attention-reduce", default="",
                   help="comma list of decode-attention split reductions to measure in turn: fused (the split "
                        "kernel's last program merges the splits, one launch; the default) or kernel (a second "
                        "reduction kernel) (roofline.kernels.decode_attention.FUSED_REDUCE)")
    p.add_argument("--out-dir", default="bench/results")
    p.set_defaults(func=run_decode_bench)
    return p
