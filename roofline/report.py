"""End-of-run summary: throughput, latency, and the mean decode step beside its bound.

The decode-step floor is the bound model's (``roofline.costmodel``): bytes a step must move (every weight
once, plus the KV cache read at the actual context lengths) over the read bandwidth measured in this
process (or read from a ``roofline probe`` file), against FLOPs over peak where a peak is known.
"""

from __future__ import annotations

from typing import Any


def decode_floor(llm: Any, hardware: str | None = None) -> dict[str, Any] | None:
    """The floor of the last run's mean decode step; None when the run had no decode-only step."""
    from roofline import costmodel
    from roofline import hardware as hw

    engine = llm.engine
    worker = engine.worker
    stats = llm.last_run_stats
    if stats is None or stats.mean_decode_step_s is None:
        return None
    mean_batch = stats.mean_decode_batch or 1.0
    mean_ctx = stats.mean_decode_kv_tokens or 0.0
    dtype = costmodel.canonical_dtype(worker.dtype)  # torch.bfloat16 -> "bf16", the name the floor line prints
    # The GEMMs' arithmetic: INT8 W8A8 (smoothquant; int8 on CPU, roofline.kernels.cpu_int8) runs integer products.
    qname = getattr(getattr(worker, "quant_config", None), "name", None)
    if qname == "smoothquant" or (qname == "int8" and str(worker.device) == "cpu"):
        dtype = "int8"
    if hardware:
        spec = hw.load_hardware(hardware)
        bandwidth = spec.memory_bandwidth
        try:
            peak = spec.peak(dtype)
        except ValueError:
            peak = None
        source = f"{spec.name} ({spec.source})"
    else:
        bandwidth = hw.measure_read_bandwidth(str(worker.device))
        peak = hw.measure_gemm_flops(str(worker.device), dtype)
        source = f"read bandwidth and {dtype} GEMM rate measured in-process on {worker.device}"
        if str(worker.device) == "cpu" and dtype == "fp16":
            # fp16 matmuls on a CPU without fp16 matrix units convert to fp32 and run on the fp32 units (torch's
            # fp16 GEMV does; its square GEMM is a slow software path, 2-3 GFLOP/s, which put the "floor" above
            # the measured step, issue 32): fp16 cannot compute faster than the better of the two rates.
            peak = max(peak, hw.measure_gemm_flops("cpu", "fp32"))
            source = "read bandwidth and the better of the fp16 and fp32 GEMM rates measured in-process on cpu"
    weight_bytes, params, moe = worker.weight_bytes_per_step, engine.model_config.num_params, None
    if getattr(engine.model_config, "is_moe", False):
        # MoE: the dense weights plus the experts a step of this batch touches, from the routing measured in
        # this run (tokens per expert, counted on the device; uniform routing where not counted).
        from roofline.costmodel.moe import moe_step_bytes, touched_experts_from_counts
        from roofline.layers.moe import expert_token_counts

        counts = expert_token_counts(worker.model) if getattr(worker, "model", None) is not None else None
        mc = engine.model_config
        touched = touched_experts_from_counts(counts, mc.num_experts_per_tok, mean_batch) if counts else None
        weight_bytes, params = moe_step_bytes(mc, weight_bytes, mean_batch, touched)
        moe = dict(touched_experts_per_layer=touched, touched_source="measured routing" if counts else
                   "uniform routing (not counted)")
    report = costmodel.decode_floor_report(
        weight_bytes=weight_bytes,
        kv_bytes_read=mean_ctx * worker.kv_bytes_per_token,
        flops=2.0 * params * mean_batch,
        bandwidth_bytes_per_s=bandwidth,
        peak_flops=peak,
        measured_step_s=stats.mean_decode_step_s,
        weights=getattr(engine.config, "quantization", None) or dtype,
    )
    report.update(bandwidth_bytes_per_s=bandwidth, peak_flops=peak, peak_dtype=dtype, bandwidth_source=source,
                  mean_batch=mean_batch, mean_context_tokens=mean_ctx / max(mean_batch, 1e-9))
    if moe is not None:
        report["moe"] = moe
    return report


def floor_inputs_line(rep: dict[str, Any]) -> str:
    """The summary's ``floor inputs:`` line of a :func:`decode_floor` report: the bandwidth and the GEMM rate, in
    TOP/s for integer arithmetic (int8 W8A8) and TFLOP/s otherwise."""
    from roofline.costmodel import rate_unit

    peak = (f", {rep['peak_flops'] / 1e12:.3f} {rate_unit(rep.get('peak_dtype', 'bf16'))}" if rep.get("peak_flops")
            else "")
    return (f"floor inputs:       {rep['bandwidth_bytes_per_s'] / 1e9:.1f} GB/s{peak} ({rep['bandwidth_source']}); "
            f"bound by {rep['bound_by']}")


def print_run_summary(llm: Any, floor: str = "probe", hardware: str | None = None) -> None:
    s = llm.last_run_stats
    if s is None:
        return
    print(f"requests:           {s.num_requests}")
    print(f"prompt tokens:      {s.num_prompt_tokens}")
    print(f"generated tokens:   {s.num_output_tokens}")
    print(f"wall time:          {s.wall_time_s:.2f} s")
    print(f"output throughput:  {s.output_tok_per_s:.1f} tok/s")
    if s.mean_ttft_s is not None:
        print(f"mean TTFT:          {s.mean_ttft_s * 1e3:.1f} ms")
    if s.mean_tpot_s is not None:
        print(f"mean TPOT:          {s.mean_tpot_s * 1e3:.1f} ms")
    print(f"preemptions:        {s.num_preemptions}")
    if (governor := getattr(getattr(llm.engine, "worker", None), "thread_governor", None)) is not None:
        print(f"CPU threads:        {governor.summary()}")
    if s.num_prefix_cache_queries is not None:
        rate = s.prefix_cache_hit_rate
        print(f"prefix cache:       {'n/a' if rate is None else f'{rate:.1%}'} hit rate "
              f"({s.num_prefix_cache_hits} of {s.num_prefix_cache_queries} prompt tokens cached)")
    else:
        print("prefix cache:       off")
    sd = s.spec_decode
    if sd is not None:
        rate, length = sd.acceptance_rate, sd.mean_acceptance_length
        per_pos = ", ".join(f"{a / d:.2f}" for a, d in zip(sd.accepted_per_position, sd.drafted_per_position,
                                                          strict=True) if d)
        print(f"speculative decode: acceptance rate {'n/a' if rate is None else f'{rate:.3f}'}, mean acceptance "
              f"length {'n/a' if length is None else f'{length:.2f}'} tokens per verify pass ({sd.num_drafts} "
              f"passes, {sd.num_accepted_tokens} of {sd.num_draft_tokens} draft positions accepted; per position "
              f"[{per_pos}]); on in {sd.num_steps_on} steps, off (gamma 0) in {sd.num_steps_off}")
    if floor == "none" and not hardware:
        return
    rep = llm.decode_floor(hardware)
    if rep is None:
        return
    print(floor_inputs_line(rep))
    if sd is not None and sd.num_steps_on:
        # The mean step below mixes plain steps with drafting ones (draft passes + one verify pass of 1 + gamma
        # rows per request), while its floor is one plain decode pass: say so beside it.
        length = sd.mean_acceptance_length
        print(f"speculative steps:  {sd.num_steps_on} of {sd.num_steps_on + sd.num_steps_off} decode steps drafted; "
              f"such a step is the draft passes plus one verify pass and yields "
              f"{'n/a' if length is None else f'{length:.2f}'} tokens per request, so the mean step below is not "
              f"one forward pass: its floor is a plain decode pass (1 token per request); compare TPOT")
    if rep.get("moe") is not None:
        t = rep["moe"]["touched_experts_per_layer"]
        print(f"MoE floor:          the dense weights + {'expected (uniform)' if t is None else f'{t:.2f}'} experts "
              f"per layer per decode step ({rep['moe']['touched_source']})")
    print(rep["text"])
