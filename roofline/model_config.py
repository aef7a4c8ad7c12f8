"""The model's configuration (:class:`ModelConfig`, from an HF ``config.json`` or a named preset).

Frozen and validated once in ``__post_init__``; errors name the offending value and the allowed range.
``roofline.config`` re-exports everything here.
"""

from __future__ import annotations

from dataclasses import dataclass
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
