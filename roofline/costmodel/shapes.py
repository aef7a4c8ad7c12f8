"""Model shapes: what the bound needs from a model (P and the KV-cache geometry), and the worksheet fixture."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from roofline.costmodel.common import _check_non_negative, _check_positive
from roofline.costmodel.formats import kv_bytes_per_sequence, kv_dtype_bytes, kv_scale_bytes


@dataclass(frozen=True)
class ModelShape:
    """What the bound needs from a model: parameter count P and the KV-cache geometry.

    The parallel bound also needs ``num_attention_heads`` (TP must divide it; 0 derives
    ``hidden_size // head_dim``) and the vocabulary (``vocab_size``, ``tie_word_embeddings``) to place
    the embedding on the first pipeline stage and the LM head on the last. ``vocab_size`` 0 (unknown,
    as for the fixture) counts every parameter as a layer parameter.

    Raises:
        ValueError: a size is not positive, the KV heads do not divide the attention heads, or the
            embedding and LM head hold more than ``num_params``.
    """

    name: str
    num_params: float
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_attention_heads: int = 0
    vocab_size: int = 0
    tie_word_embeddings: bool = False
    intermediate_size: int = 0  # the MLP width (0: unknown, as for the fixture); the per-projection shapes need it

    def __post_init__(self) -> None:
        for field_name in ("num_params", "num_layers", "num_kv_heads", "head_dim", "hidden_size"):
            _check_positive(field_name, getattr(self, field_name))
        if self.num_attention_heads == 0:
            object.__setattr__(self, "num_attention_heads", max(1, self.hidden_size // self.head_dim))
        _check_positive("num_attention_heads", self.num_attention_heads)
        _check_non_negative("vocab_size", self.vocab_size)
        _check_non_negative("intermediate_size", self.intermediate_size)
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.layer_params <= 0:
            raise ValueError(f"the embedding and LM head ({self.embedding_params + self.lm_head_params:.4g} "
                             f"parameters) leave none of num_params ({self.num_params:.4g}) for the layers")

    @property
    def embedding_params(self) -> float:
        """``vocab_size x hidden_size``: the input embedding (0 when the vocabulary is unknown)."""
        return float(self.vocab_size * self.hidden_size)

    @property
    def lm_head_params(self) -> float:
        """The LM head's own parameters: ``vocab_size x hidden_size``, or 0 when tied to the embedding."""
        return 0.0 if self.tie_word_embeddings else self.embedding_params

    @property
    def layer_params(self) -> float:
        """Parameters of one decoder layer: ``(P - embedding - LM head) / layers``. The final norm's
        ``hidden_size`` weights are spread over the layers (under 1e-6 of P for Llama 3 8B)."""
        return (self.num_params - self.embedding_params - self.lm_head_params) / self.num_layers

    @classmethod
    def from_model_config(cls, cfg: Any) -> ModelShape:
        """From a :class:`roofline.config.ModelConfig` (P from ``ModelConfig.num_params``)."""
        return cls(name=cfg.name, num_params=float(cfg.num_params), num_layers=cfg.num_hidden_layers,
                   num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_size=cfg.hidden_size,
                   num_attention_heads=cfg.num_attention_heads, vocab_size=cfg.vocab_size,
                   tie_word_embeddings=bool(cfg.tie_word_embeddings),
                   intermediate_size=0 if getattr(cfg, "is_moe", False) else int(cfg.intermediate_size))

    def projection_shapes(self) -> dict[str, tuple[int, int]]:
        """``{"qkv", "o", "gate_up", "down"}`` -> ``(N, K)`` of each decoder layer's linear projections (a Llama
        layer; the weight is [N, K], a step multiplies [M, K] activations by it).

        Raises:
            ValueError: ``intermediate_size`` is 0 (unknown: the fixture, or a MoE model whose experts differ).
        """
        if self.intermediate_size <= 0:
            raise ValueError(f"model {self.name!r} has no intermediate_size (the fixture, or a MoE model): "
                             "its projection shapes are unknown")
        h, d = self.hidden_size, self.head_dim
        q, kv = self.num_attention_heads * d, self.num_kv_heads * d
        return {"qkv": (q + 2 * kv, h), "o": (h, q), "gate_up": (2 * self.intermediate_size, h),
                "down": (h, self.intermediate_size)}

    def kv_bytes_per_sequence(self, context_tokens: int, kv_dtype: str = "bf16") -> float:
        """KV bytes of one sequence of ``context_tokens`` in ``kv_dtype`` (scales included)."""
        return kv_bytes_per_sequence(self.num_layers, self.num_kv_heads, self.head_dim, context_tokens,
                                     kv_dtype_bytes(kv_dtype), kv_scale_bytes(kv_dtype))


# The published worksheet's fixture: a dense 70B model (Llama-2/3-70B-like KV geometry), BF16 KV,
# context 2048, batch 32; evaluated on the hypothetical 3.0 TB/s, 1,000 TFLOP/s device with
# alpha 0.8, gamma 4, c 0.1 and a 25 ms plain step.
DENSE_70B_FIXTURE = ModelShape(name="dense-70b-fixture-r1", num_params=70e9, num_layers=80, num_kv_heads=8,
                               head_dim=128, hidden_size=8192)
FIXTURE_SHAPES: dict[str, ModelShape] = {DENSE_70B_FIXTURE.name: DENSE_70B_FIXTURE}
WORKSHEET = {"batch": 32, "context": 2048, "kv_dtype": "bf16", "alpha": 0.8, "gamma": 4,
             "draft_cost": 0.1, "plain_step_s": 0.025, "hardware": "worksheet"}
