"""``roofline bench throughput``: offline throughput on ShareGPT with the dataset's output lengths.

Each request generates exactly its ShareGPT completion length (``ignore_eos``), as in vLLM's
``benchmark_throughput``. Prompts come tokenized from the default model's tokenizer; with ``--dataset-file``
they come from a JSON file written by ``--export-dataset`` (for machines without the dataset package).
Reports output tok/s, total tok/s and requests/s; the JSON lands in ``bench/results/``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from roofline.config import QUANTIZATION_METHODS


def load_requests(args: argparse.Namespace) -> list[dict]:
    """[{"prompt_token_ids": [...], "output_len": n}], ``num_prompts`` of them."""
    if args.dataset_file:
        data = json.loads(Path(args.dataset_file).read_text())
        reqs = data["requests"]
    else:
        from roofline.bench.datasets import sample_sharegpt
        from roofline.models.loader import load_tokenizer, resolve_model

        tok = load_tokenizer(resolve_model(None))
        samples = sample_sharegpt(tok, args.num_prompts, seed=args.seed)
        reqs = [{"prompt_token_ids": tok(s.prompt).input_ids, "output_len": s.output_len} for s in samples]
    if len(reqs) < args.num_prompts:
        raise ValueError(f"dataset has {len(reqs)} requests, asked for --num-prompts {args.num_prompts}")
    return reqs[: args.num_prompts]


def run_throughput_bench(args: argparse.Namespace) -> int:
    from roofline.bench.common import write_result
    from roofline.sampling_params import SamplingParams

    reqs = load_requests(args)
    if args.export_dataset:
        Path(args.export_dataset).write_text(json.dumps({"tokenizer": "SmolLM2-135M-Instruct (GGUF)",
                                                         "dataset": "ShareGPT V3", "seed": args.seed,
                                                         "requests": reqs}))
        print(f"wrote {len(reqs)} tokenized requests to {args.export_dataset}")
        return 0
    from roofline.args import EngineArgs
    from roofline.config import model_preset
    from roofline.engine_factory import build_engine
    from roofline.llm import LLM
    from roofline.models.loader import ModelSource

    ea = EngineArgs(model=args.model, load_format=args.load_format, dtype=args.dtype, max_model_len=args.max_model_len,
                    max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                    gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager,
                    device=args.device, kv_cache_memory=args.kv_cache_memory,
                    async_scheduling=args.async_scheduling, kv_cache_dtype=args.kv_cache_dtype,
                    block_size=args.block_size, enable_prefix_caching=args.enable_prefix_caching,
                    quantization=args.quantization, quantization_group_size=args.quantization_group_size,
                    speculative_config=args.speculative_config)
    if args.load_format == "dummy":
        mc = model_preset(args.model)
        if mc.max_position_embeddings < args.max_model_len:
            mc = dataclasses.replace(mc, max_position_embeddings=args.max_model_len)
        llm = LLM.__new__(LLM)
        llm.engine_args = ea
        llm.engine = build_engine(ea.create_engine_config(mc), ModelSource("dummy", None, args.model), mc, tokenizer=None)
        llm.last_run_stats = None
    else:
        llm = LLM(**ea.to_dict())
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r["output_len"], ignore_eos=True) for r in reqs]
    if args.warmup:
        llm.generate(prompts[:8], [SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)] * min(8, len(prompts)),
                     use_tqdm=False)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    elapsed = time.perf_counter() - t0
    errors = [o.error for o in outs if o.error]
    if errors:
        raise ValueError(f"{len(errors)} requests were rejected, first: {errors[0]}")
    n_in = sum(len(r["prompt_token_ids"]) for r in reqs)
    n_out = sum(len(c.token_ids) for o in outs for c in o.outputs)
    expected = sum(r["output_len"] for r in reqs)
    stats = llm.last_run_stats
    result = dict(model=args.model, load_format=args.load_format, num_prompts=len(reqs),
                  prompt_tokens=n_in, output_tokens=n_out, expected_output_tokens=expected,
                  elapsed_s=elapsed, requests_per_s=len(reqs) / elapsed, output_tok_per_s=n_out / elapsed,
                  total_tok_per_s=(n_in + n_out) / elapsed, num_preemptions=stats.num_preemptions if stats else None,
                  mean_decode_step_ms=(stats.mean_decode_step_s or 0) * 1e3 if stats else None,
                  max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                  async_scheduling=llm.engine.config.async_scheduling,
                  cuda_graphs=llm.engine.worker.graphs is not None, num_kv_blocks=llm.engine.worker.num_blocks,
                  block_size=llm.engine.worker.block_size, kv_cache_dtype=llm.engine.config.cache_config.kv_cache_dtype,
                  kv_bytes_per_token=llm.engine.worker.kv_bytes_per_token,
                  pool_tokens=llm.engine.worker.num_blocks * llm.engine.worker.block_size,
                  enable_prefix_caching=args.enable_prefix_caching, quantization=args.quantization,
                  weight_bytes=llm.engine.worker.weight_bytes, speculative_config=args.speculative_config,
                  spec_decode=stats.spec_decode.as_dict() if stats and stats.spec_decode else None)
    print(f"weights {args.quantization or 'unquantized'}: {result['weight_bytes'] / 1e9:.2f} GB")
    print(f"KV {result['kv_cache_dtype']}: {result['kv_bytes_per_token']} B/token, pool {result['pool_tokens']} tokens")
    print(f"requests {len(reqs)}, prompt tokens {n_in}, output tokens {n_out} (expected {expected})")
    print(f"elapsed {elapsed:.2f} s: {result['requests_per_s']:.2f} req/s, "
          f"output {result['output_tok_per_s']:.1f} tok/s, total {result['total_tok_per_s']:.1f} tok/s, "
          f"preemptions {result['num_preemptions']}")
    if result["spec_decode"]:
        sd = result["spec_decode"]
        print(f"speculative: acceptance rate {sd['acceptance_rate']}, mean acceptance length "
              f"{sd['mean_acceptance_length']}, on in {sd['num_steps_on']} steps, off in {sd['num_steps_off']}")
    tag = f"-{args.quantization}" if args.quantization else ""
    tag += "-spec" if args.speculative_config else ""
    path = write_result(args.out_dir, f"throughput-{args.model}{tag}-seqs{args.max_num_seqs}", result)
    print(f"wrote {path}")
    return 0


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("throughput", help="offline ShareGPT throughput (dataset output lengths, ignore_eos)")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--load-format", default="dummy", choices=["auto", "safetensors", "gguf", "dummy"])
    p.add_argument("--num-prompts", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset-file", default=None, help="tokenized requests JSON (from --export-dataset)")
    p.add_argument("--export-dataset", default=None, help="write the tokenized requests to this file and exit")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    p.add_argument("--device", default="auto")
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--max-num-seqs", type=int, default=512)
    p.add_argument("--max-num-batched-tokens", type=int, default=8192)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--kv-cache-memory", default=None)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="overlap step N+1's scheduling with step N (default: on with a GPU)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto, bfloat16, float16, float32, int8, fp8_e4m3, fp8")
    p.add_argument("--block-size", type=int, default=None, help="KV block size (default: the engine's)")
    p.add_argument("--quantization", default=None, choices=list(QUANTIZATION_METHODS),
                   help="weight format (see `roofline generate --help`); dummy weights are quantized at load")
    p.add_argument("--quantization-group-size", type=int, default=128, choices=[32, 64, 128])
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="prefix caching (default on, as in the engine)")
    p.add_argument("--speculative-config", default=None,
                   help="speculative decoding JSON, as `roofline generate` (speculation needs --no-async-scheduling, "
                        "which it implies)")
    p.add_argument("--no-warmup", dest="warmup", action="store_false")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out-dir", default="bench/results")
    p.set_defaults(func=run_throughput_bench)
    return p
