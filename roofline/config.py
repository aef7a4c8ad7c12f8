"""Frozen, validated configuration for the engine.

Every config is a frozen dataclass validated once in ``__post_init__``; errors name the offending
value and the allowed range. The CLI maps flags onto these in one place (``roofline.args``).

One concern per module, all re-exported here (``from roofline.config import X``): the model
(``roofline.model_config``), the parallel layout (``roofline.parallel_config``) and speculative decoding
(``roofline.spec_config``); the cache, the scheduler and the whole engine's config live here.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from roofline.model_config import (
    MODEL_PRESETS,
    SUPPORTED_ARCHITECTURES,
    ModelConfig,
    _check_positive,
    model_preset,
)
from roofline.parallel_config import ParallelConfig, stage_layer_ranges
from roofline.spec_config import (
    DRAFT_QUANTIZATIONS,
    MAX_SPECULATIVE_TOKENS,
    SPECULATIVE_METHODS,
    SpeculativeConfig,
    check_draft_vocab,
)

# --quantization: methods that quantize an unquantized model at load, then checkpoint formats (roofline.quant).
QUANTIZATION_METHODS = ("int8", "int4", "fp8", "smoothquant", "gptq", "awq", "compressed-tensors")


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache.

    ``num_blocks`` fixes the pool size; otherwise it is derived from ``kv_cache_memory`` (bytes) or,
    on a GPU, from ``gpu_memory_utilization`` of the device memory.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    gpu_memory_utilization: float = 0.9
    # A torch dtype name, or a quantized format: "int8" (per token and KV head scales) or "fp8_e4m3" (static
    # per-head scales); EngineArgs resolves "auto" to the model dtype and "fp8" to "fp8_e4m3".
    kv_cache_dtype: str = "float32"
    # Automatic prefix caching (RadixAttention): reuse the KV blocks of earlier requests' common prefixes.
    enable_prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size > 1024:
            raise ValueError(f"block_size must be in [1, 1024], got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 bytes, got {self.kv_cache_memory}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


SCHEDULE_POLICIES = ("fcfs", "lpm")


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous batching limits (names as in vLLM)."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # True when the user set no budget on a CPU: the engine measures the prefill cost per token once the
    # model is loaded and lowers max_num_batched_tokens so one step stays under about half a second.
    budget_from_profile: bool = False
    # Order of admission from the waiting queue: "fcfs", or "lpm" (longest cached prefix first, SGLang's name;
    # needs prefix caching). Under lpm a sequence passed over by later ones in ``lpm_starvation_rounds``
    # scheduling rounds is admitted ahead of all others.
    schedule_policy: str = "fcfs"
    lpm_starvation_rounds: int = 16

    def __post_init__(self) -> None:
        if self.schedule_policy not in SCHEDULE_POLICIES:
            raise ValueError(f"schedule_policy must be one of {', '.join(SCHEDULE_POLICIES)}, got "
                             f"{self.schedule_policy!r}")
        _check_positive("lpm_starvation_rounds", self.lpm_starvation_rounds)
        _check_positive("max_num_seqs", self.max_num_seqs)
        _check_positive("max_num_batched_tokens", self.max_num_batched_tokens)
        _check_positive("max_model_len", self.max_model_len)
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"without chunked prefill, max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}) so that any prompt fits in one step"
            )


DTYPES = ("float32", "float16", "bfloat16")
KV_CACHE_DTYPES = (*DTYPES, "fp8_e4m3", "int8")  # resolved values (vLLM's names; "fp8" is an alias)
ATTENTION_BACKENDS = ("torch", "triton")


@dataclass(frozen=True)
class EngineConfig:
    """The whole engine's configuration, every value resolved (``EngineArgs.create_engine_config``).

    ``device`` is ``cpu``, ``cuda`` or ``cuda:N``; ``dtype`` and ``cache_config.kv_cache_dtype`` are torch
    dtype names; ``attention_backend`` is a registered backend; ``use_triton_kernels`` says whether norms and
    activations run the fused Triton kernels; ``enforce_eager`` is True where CUDA graphs are off (always
    on CPU). Two values are measured once the model is loaded, as vLLM does: the KV pool's block count
    (from free memory) and, on CPU without an explicit ``--max-num-batched-tokens``, the step budget
    (``scheduler_config.budget_from_profile``).
    """

    model_config: ModelConfig
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    dtype: str = "float32"
    device: str = "cpu"
    seed: int = 0
    attention_backend: str = "torch"
    use_triton_kernels: bool = False
    enforce_eager: bool = True
    # Schedule and prepare step N+1 while step N runs (vLLM's async scheduling, SGLang's overlap scheduler).
    async_scheduling: bool = False
    # Weight format (roofline.quant): None, or a method quantized at load / the checkpoint format's name.
    quantization: str | None = None
    # What --quantization auto chose and why, with its measured quality (None: a format was named, or none).
    quantization_note: str | None = None
    quantization_group_size: int = 128
    speculative_config: SpeculativeConfig | None = None
    # Step watchdog (multiprocess executor): seconds a step may run; None = step_timeout_for(tokens).
    step_timeout: float | None = None

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)} once resolved; got {self.dtype!r}")
        if self.cache_config.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)} once resolved; got "
                             f"{self.cache_config.kv_cache_dtype!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)} once resolved; "
                             f"got {self.attention_backend!r}")
        on_cuda = self.device.startswith("cuda")
        if not on_cuda and self.device != "cpu":
            raise ValueError(f"device must be cpu, cuda or cuda:N once resolved; got {self.device!r}")
        if self.attention_backend == "triton" and not on_cuda:
            raise ValueError(f"attention_backend 'triton' needs a CUDA device, got device {self.device!r}; "
                             f"use attention_backend 'torch' on CPU")
        if self.use_triton_kernels and not on_cuda:
            raise ValueError(f"use_triton_kernels=True needs a CUDA device, got device {self.device!r}")
        if self.scheduler_config.schedule_policy == "lpm" and not self.cache_config.enable_prefix_caching:
            raise ValueError("schedule_policy 'lpm' (longest prefix match) needs prefix caching, but "
                             "enable_prefix_caching is False; use schedule_policy 'fcfs' or enable prefix caching")
        if not on_cuda and not self.enforce_eager:
            raise ValueError(f"CUDA graphs (enforce_eager=False) need a CUDA device, got device {self.device!r}")

    @property
    def uses_cuda_graphs(self) -> bool:
        return not self.enforce_eager


__all__ = [
    "ATTENTION_BACKENDS", "DRAFT_QUANTIZATIONS", "DTYPES", "KV_CACHE_DTYPES", "MAX_SPECULATIVE_TOKENS", "MODEL_PRESETS",
    "QUANTIZATION_METHODS", "SCHEDULE_POLICIES", "SPECULATIVE_METHODS", "SUPPORTED_ARCHITECTURES", "CacheConfig",
    "EngineConfig", "ModelConfig", "ParallelConfig", "SchedulerConfig", "SpeculativeConfig", "check_draft_vocab",
    "model_preset", "stage_layer_ranges",
]
