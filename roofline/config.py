"""Frozen, validated configuration for the engine.

Every config is a frozen dataclass validated once in ``__post_init__``; errors name the offending
value and the allowed range. The CLI maps flags onto these in one place (``roofline.args``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

SUPPORTED_ARCHITECTURES: dict[str, str] = {
    # HF ``architectures[0]`` -> our model family. One decoder implementation covers all of them.
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "llama",
    "Qwen3ForCausalLM": "llama",
}


def _check_positive(name: str, value: int | float) -> None:
    if value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")


# --quantization: methods that quantize an unquantized model at load, then checkpoint formats (roofline.quant).
QUANTIZATION_METHODS = ("int8", "int4", "fp8", "smoothquant", "gptq", "awq", "compressed-tensors")

@dataclass(frozen=True)
class ModelConfig:
    """Architecture of a Llama-family decoder (Llama 2/3/3.1, Mistral, Qwen2/2.5, Qwen3, SmolLM2).

    Field names follow Hugging Face ``config.json`` so that a config is a name mapping, not a translation.
    """

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 32
    head_dim: int = 0  # 0 -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # Llama 3.1 style scaling: {"rope_type": "llama3", "factor", "low_freq_factor", "high_freq_factor",
    # "original_max_position_embeddings"}; None for plain RoPE.
    rope_scaling: tuple[tuple[str, Any], ...] | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k before RoPE
    bos_token_id: int | None = 1
    eos_token_ids: tuple[int, ...] = (2,)
    name: str = "custom"

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; supported: "
                f"{', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings"):
            _check_positive(name, getattr(self, name))
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim == 0:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) is not divisible by num_attention_heads "
                    f"({self.num_attention_heads}); set head_dim explicitly"
                )
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @property
    def rope_scaling_dict(self) -> dict[str, Any] | None:
        return dict(self.rope_scaling) if self.rope_scaling is not None else None

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    @property
    def num_params(self) -> int:
        """Parameter count (embeddings counted once when tied), the ``P`` of the bound model."""
        h, i, layers = self.hidden_size, self.intermediate_size, self.num_hidden_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        emb = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return layers * per_layer + emb + head + h

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "custom") -> ModelConfig:
        """Build from a Hugging Face ``config.json`` dict.

        Raises:
            ValueError: unsupported architecture (names it and lists the supported ones).
        """
        archs = cfg.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {arch!r}; supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        heads = cfg["num_attention_heads"]
        rope_scaling = cfg.get("rope_scaling")
        rope_theta = cfg.get("rope_theta")
        rp = cfg.get("rope_parameters")  # transformers >= 5 layout
        if isinstance(rp, dict):
            rope_theta = rp.get("rope_theta", rope_theta)
            if rp.get("rope_type", "default") != "default" and rope_scaling is None:
                rope_scaling = rp
        if rope_scaling is not None:
            rtype = rope_scaling.get("rope_type", rope_scaling.get("type"))
            if rtype in (None, "default"):
                rope_scaling = None
            elif rtype != "llama3":
                raise ValueError(f"unsupported rope_scaling type {rtype!r}; supported: 'llama3'")
        eos = cfg.get("eos_token_id", 2)
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        attention_bias = bool(cfg.get("attention_bias", arch == "Qwen2ForCausalLM"))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta if rope_theta is not None else 10000.0),
            rope_scaling=tuple(sorted(rope_scaling.items())) if rope_scaling else None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=attention_bias,
            qk_norm=arch == "Qwen3ForCausalLM",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The inverse of :meth:`from_hf_config` (used to save checkpoints and to build HF oracles)."""
        model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                      "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}[self.architecture]
        cfg: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "attention_bias": self.attention_bias,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "hidden_act": "silu",
        }
        if self.rope_scaling is not None:
            cfg["rope_scaling"] = dict(self.rope_scaling)
        return cfg


# Named shapes for benchmarks with dummy weights (from the models' published config.json files).
MODEL_PRESETS: dict[str, dict[str, Any]] = {
    "llama-3-8b": dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                       max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128001, 128009)),
    "llama-3-70b": dict(architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=8192,
                        intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                        num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=500000.0,
                        max_position_embeddings=8192, bos_token_id=128000, eos_token_ids=(128001, 128009)),
    "qwen3-8b": dict(architecture="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     max_position_embeddings=40960, qk_norm=True, bos_token_id=None,
                     eos_token_ids=(151645,)),
    "smollm2-135m": dict(architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                         max_position_embeddings=8192, tie_word_embeddings=True, bos_token_id=1,
                         eos_token_ids=(2,)),
}


def model_preset(name: str) -> ModelConfig:
    """A named benchmark shape. Raises ``ValueError`` listing the known names."""
    if name not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known: {', '.join(sorted(MODEL_PRESETS))}")
    return ModelConfig(name=name, **MODEL_PRESETS[name])


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


@dataclass(frozen=True)
class ParallelConfig:
    """Parallel layout: ``pipeline_parallel_size`` stages, each of ``tensor_parallel_size`` worker processes
    (one per GPU, or a CPU process with gloo). Within a stage every sharded layer holds 1/N of its weight
    (``roofline.layers.linear``); the stages hold consecutive decoder layers (even by default, or
    ``pipeline_layer_partition``: each stage's layer count) and pass (hidden, residual) with send/recv.

    Raises:
        ValueError: a size below 1, an unknown backend, or ``uni`` with more than one process (names the value).
    """

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # "mp": worker processes (any size; at size 1 it measures the executor's overhead); "uni": the worker in
    # the engine's process (size 1 only); "external_launcher": every process of a torchrun job runs the
    # engine and one rank's worker (multi-node; docs/distributed.md); None: "mp" above size 1, else "uni".
    distributed_executor_backend: str | None = None
    pipeline_layer_partition: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.distributed_executor_backend not in (None, "uni", "mp", "external_launcher"):
            raise ValueError(f"distributed_executor_backend must be 'uni', 'mp' or 'external_launcher', got "
                             f"{self.distributed_executor_backend!r}")
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(f"distributed_executor_backend 'uni' runs one worker; tensor_parallel_size "
                             f"{self.tensor_parallel_size} x pipeline_parallel_size {self.pipeline_parallel_size} "
                             f"needs 'mp' or 'external_launcher'")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def uses_worker_processes(self) -> bool:
        return self.distributed_executor_backend == "mp" or (
            self.world_size > 1 and self.distributed_executor_backend != "external_launcher")

    @staticmethod
    def _shard_problem(model: ModelConfig, tp: int) -> str | None:
        """Why ``tp`` ranks cannot shard ``model`` (None: they can). Attention heads and the MLP width are
        split evenly; KV heads are split, or replicated when ``tp`` exceeds them; the vocabulary is padded."""
        if model.num_attention_heads % tp:
            return f"does not divide the {model.num_attention_heads} attention heads"
        if model.intermediate_size % tp:
            return f"does not divide the MLP width {model.intermediate_size} (intermediate_size)"
        kv = model.num_key_value_heads
        if kv % tp and tp % kv:
            return f"and the {kv} KV heads must divide one another"
        return None

    def check_model(self, model: ModelConfig) -> None:
        """The layout must shard ``model`` (``_shard_problem``).

        Raises:
            ValueError: naming the size, the dimension it does not divide and the sizes that work.
        """
        from roofline.distributed.parallel_state import stage_layer_ranges

        stage_layer_ranges(model.num_hidden_layers, self.pipeline_parallel_size,
                           list(self.pipeline_layer_partition) if self.pipeline_layer_partition else None)
        tp = self.tensor_parallel_size
        problem = self._shard_problem(model, tp)
        if problem is not None:
            allowed = [d for d in range(1, model.num_attention_heads + 1) if self._shard_problem(model, d) is None]
            raise ValueError(f"tensor_parallel_size {tp} {problem} of {model.name}; allowed: "
                             + ", ".join(map(str, allowed)))


SPECULATIVE_METHODS = ("ngram", "draft_model")
_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
              "quantization", "num_layers", "adaptive")
MAX_SPECULATIVE_TOKENS = 16
DRAFT_QUANTIZATIONS = ("int4", "int8", "fp8")  # load-time methods a draft (or a quantized self) may use


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config``, vLLM's JSON shape).

    ``method``: ``ngram`` (prompt lookup: the tokens that followed the latest earlier occurrence of the last
    ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens) or ``draft_model``. ``num_speculative_tokens`` is
    gamma_max, the most drafts per request and step. ``adaptive`` (default True) lets the policy pick gamma in
    [0, gamma_max] each step (``roofline.spec_decode.policy``); False pins gamma_max.

    ``draft_model`` drafts with:
    - ``model``: a separate checkpoint (HF directory, GGUF file, or ``default``) with the target's vocabulary,
      optionally quantized at load (``quantization``);
    - or the target's own weights: ``num_layers`` k runs the target's first k decoder layers, its final norm
      and LM head (a layer-truncated self, which shares the target's KV cache for those layers), or
      ``quantization`` (``int4``, ``int8`` or ``fp8``) loads a quantized copy of the whole target.
    A separate draft or a quantized self keeps its own KV in the target's blocks (``roofline.worker.draft_model``).
    """

    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int | None = None  # ngram only; default 2
    prompt_lookup_max: int | None = None  # ngram only; default 5
    model: str | None = None
    quantization: str | None = None
    num_layers: int | None = None
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config method must be one of {', '.join(SPECULATIVE_METHODS)}, "
                             f"got {self.method!r}")
        k = self.num_speculative_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}")
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got {self.adaptive!r}")
        if self.method == "ngram":
            if self.prompt_lookup_min is None:
                object.__setattr__(self, "prompt_lookup_min", 2)
            if self.prompt_lookup_max is None:
                object.__setattr__(self, "prompt_lookup_max", max(5, self.prompt_lookup_min))
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"speculative_config {name} must be an integer >= 1, got {v!r}")
            if lo > hi:
                raise ValueError(f"speculative_config prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            for name in ("model", "quantization", "num_layers"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config {name} applies to method 'draft_model', not 'ngram'")
            return
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config {name} applies to method 'ngram', not 'draft_model'")
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise ValueError(f"speculative_config model must be a draft checkpoint path (a GGUF file or an HF "
                             f"directory; a preset name with load_format='dummy'), got {self.model!r}")
        if self.quantization is not None and self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"speculative_config quantization must be one of {', '.join(DRAFT_QUANTIZATIONS)} "
                             f"(quantized at load), got {self.quantization!r}")
        if self.num_layers is not None and (self.model is not None or self.quantization is not None):
            raise ValueError("speculative_config num_layers (a layer-truncated self) does not combine with "
                             "\"model\" or \"quantization\" (not built); use one of them")
        if self.model is not None or self.quantization is not None:
            return
        if self.num_layers is None:
            raise ValueError("speculative_config method 'draft_model' needs \"model\" (a draft checkpoint), "
                             "\"quantization\" (a quantized self, e.g. \"int4\") or \"num_layers\" (a "
                             "layer-truncated self); the target's own full weights would only repeat it")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"speculative_config num_layers must be an integer >= 1, got {self.num_layers!r}")

    @classmethod
    def from_dict(cls, d: dict[str, Any] | str) -> SpeculativeConfig:
        """From vLLM's dict (or its JSON text). Raises ValueError naming an unknown key or a bad value."""
        if isinstance(d, str):
            import json

            try:
                d = json.loads(d)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e.msg} at column {e.colno}): {d!r}") from e
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(d).__name__}")
        unknown = sorted(set(d) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                             f"{', '.join(_SPEC_KEYS)}")
        for key in ("method", "num_speculative_tokens"):
            if key not in d:
                raise ValueError(f"speculative_config needs {key!r}")
        return cls(**d)


def check_draft_vocab(draft: ModelConfig, target: ModelConfig) -> None:
    """Raises ValueError naming both sizes when the draft's vocabulary is not the target's."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config model {draft.name!r} has a vocabulary of {draft.vocab_size} tokens, "
                         f"the target {target.name!r} has {target.vocab_size}: a draft must share the target's "
                         f"vocabulary")


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
