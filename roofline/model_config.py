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
    # Mixture-of-experts members of the family: the MLP of (some) layers is a routed MoE block.
    "MixtralForCausalLM": "llama",
    "Qwen2MoeForCausalLM": "llama",
    "Qwen3MoeForCausalLM": "llama",
}

MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")


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
    # Mixture of experts (0 experts: a dense model). HF names: Mixtral's num_local_experts is num_experts here.
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k
    moe_intermediate_size: int = 0  # each routed expert's width (Mixtral: intermediate_size)
    norm_topk_prob: bool = True  # renormalize the top-k probabilities to sum to 1 (Mixtral: always)
    shared_expert_intermediate_size: int = 0  # Qwen2-MoE: an always-on expert with a sigmoid gate (0: none)
    decoder_sparse_step: int = 1  # layer i is MoE when (i + 1) % step == 0 and i not in mlp_only_layers
    mlp_only_layers: tuple[int, ...] = ()

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
        if self.num_experts < 0:
            raise ValueError(f"num_experts must be >= 0 (0: dense), got {self.num_experts}")
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise ValueError(f"num_experts_per_tok must be in [1, num_experts={self.num_experts}], got "
                                 f"{self.num_experts_per_tok}")
            if self.moe_intermediate_size == 0:
                object.__setattr__(self, "moe_intermediate_size", self.intermediate_size)
            _check_positive("moe_intermediate_size", self.moe_intermediate_size)
            _check_positive("decoder_sparse_step", self.decoder_sparse_step)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether decoder layer ``layer_id``'s MLP is the routed MoE block (HF's rule for Qwen-MoE)."""
        return (self.num_experts > 0 and layer_id not in self.mlp_only_layers
                and (layer_id + 1) % self.decoder_sparse_step == 0)

    @property
    def num_moe_layers(self) -> int:
        return sum(self.is_moe_layer(i) for i in range(self.num_hidden_layers))

    @property
    def expert_params(self) -> int:
        """Parameters of one routed expert (gate, up and down: 3 * hidden * moe_intermediate_size)."""
        return 3 * self.hidden_size * self.moe_intermediate_size if self.num_experts else 0

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
        h, layers = self.hidden_size, self.num_hidden_layers
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        if self.attention_bias:
            attn += self.q_size + 2 * self.kv_size
        if self.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 2 * h
        emb = self.vocab_size * h
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        mlp = sum(self._mlp_params(j) for j in range(layers))
        return layers * per_layer + mlp + emb + head + h

    def _mlp_params(self, layer_id: int) -> int:
        h = self.hidden_size
        if not self.is_moe_layer(layer_id):
            return 3 * h * self.intermediate_size
        shared = 3 * h * self.shared_expert_intermediate_size + h if self.shared_expert_intermediate_size else 0
        return self.num_experts * (self.expert_params + h) + shared  # experts + router (+ shared and its gate)

    @property
    def num_routed_expert_params(self) -> int:
        """Parameters in routed experts, all layers (the part a step reads only where tokens are routed)."""
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def num_active_params(self) -> int:
        """Parameters a single token reads: everything but the routed experts it is not sent to."""
        return self.num_params - self.num_moe_layers * (self.num_experts - self.num_experts_per_tok) * self.expert_params

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
        attention_bias = bool(cfg.get("attention_bias", cfg.get("qkv_bias", arch in ("Qwen2ForCausalLM",
                                                                                      "Qwen2MoeForCausalLM"))))
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        moe: dict[str, Any] = {}
        if arch in MOE_ARCHITECTURES:
            num_experts = cfg.get("num_experts", cfg.get("num_local_experts"))
            if not num_experts:
                raise ValueError(f"{arch} config has no num_experts (or num_local_experts) > 0, got {num_experts!r}")
            moe = dict(num_experts=int(num_experts), num_experts_per_tok=int(cfg.get("num_experts_per_tok", 2)),
                       decoder_sparse_step=int(cfg.get("decoder_sparse_step", 1)),
                       mlp_only_layers=tuple(cfg.get("mlp_only_layers") or ()))
            if arch == "MixtralForCausalLM":
                moe.update(moe_intermediate_size=cfg["intermediate_size"], norm_topk_prob=True)
            else:
                moe.update(moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                           norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                           shared_expert_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
                           if arch == "Qwen2MoeForCausalLM" else 0)
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
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            name=name,
            **moe,
        )

    def to_hf_config(self) -> dict[str, Any]:
        """The inverse of :meth:`from_hf_config` (used to save checkpoints and to build HF oracles)."""
        model_type = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "mistral",
                      "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3", "MixtralForCausalLM": "mixtral",
                      "Qwen2MoeForCausalLM": "qwen2_moe", "Qwen3MoeForCausalLM": "qwen3_moe"}[self.architecture]
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
        if self.architecture == "MixtralForCausalLM":
            cfg.update(num_local_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok)
        elif self.num_experts:
            cfg.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                       moe_intermediate_size=self.moe_intermediate_size, norm_topk_prob=self.norm_topk_prob,
                       decoder_sparse_step=self.decoder_sparse_step, mlp_only_layers=list(self.mlp_only_layers),
                       shared_expert_intermediate_size=self.shared_expert_intermediate_size,
                       qkv_bias=self.attention_bias)
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
    # Mixture of experts (mistralai/Mixtral-8x7B-v0.1, Qwen/Qwen3-30B-A3B config.json).
    "mixtral-8x7b": dict(architecture="MixtralForCausalLM", vocab_size=32000, hidden_size=4096,
                         intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, rms_norm_eps=1e-5, rope_theta=1000000.0,
                         max_position_embeddings=32768, bos_token_id=1, eos_token_ids=(2,), num_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=14336, norm_topk_prob=True),
    "qwen3-30b-a3b": dict(architecture="Qwen3MoeForCausalLM", vocab_size=151936, hidden_size=2048,
                          intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32,
                          num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0,
                          max_position_embeddings=40960, qk_norm=True, bos_token_id=None,
                          eos_token_ids=(151645,), num_experts=128, num_experts_per_tok=8,
                          moe_intermediate_size=768, norm_topk_prob=True),
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
