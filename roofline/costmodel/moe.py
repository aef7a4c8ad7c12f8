"""The decode floor of a mixture-of-experts model: a step reads the dense weights (attention, norms, routers,
shared experts, embeddings' rows read, LM head), only the routed experts its tokens touch, and the KV.

With top-k routing over E experts, uniform and independent across B tokens, an expert is missed by one token
with probability (1 - k/E), so a layer touches in expectation

    E_touched(B) = E * (1 - (1 - k/E)^B)

distinct experts (issue 33; the same count vLLM's and SGLang's MoE cost notes use). At B = 1 that is k, and it
tends to E as B grows. Real routers are not uniform (skewed routing touches fewer), so the engine's run
summary uses the distinct experts its steps actually touched (``FusedMoE.expert_token_counts``).
Pure Python, as the rest of the bound model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from roofline.costmodel.common import _check_non_negative, _check_positive
from roofline.costmodel.formats import weight_bytes
from roofline.costmodel.links import ring_allreduce_time


def expected_touched_experts(num_experts: int, top_k: int, batch: float) -> float:
    """E * (1 - (1 - k/E)^B): distinct experts a batch of ``batch`` tokens touches per MoE layer, in expectation.

    Raises:
        ValueError: E < 1, k outside [1, E], or a negative batch (names the value).
    """
    _check_positive("num_experts", num_experts)
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
    _check_non_negative("batch", batch)
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** batch)


@dataclass(frozen=True)
class MoEShape:
    """The part of a model the MoE floor needs. ``dense_params``: every parameter a step reads whatever the
    routing (all but the routed experts and the embedding table's unread rows); ``expert_params``: one routed
    expert (3 x hidden x moe_intermediate_size); ``active_params``: what one token multiplies by (FLOPs)."""

    num_experts: int
    top_k: int
    num_moe_layers: int
    expert_params: float
    dense_params: float
    active_params: float

    @classmethod
    def from_model_config(cls, cfg: Any) -> MoEShape:
        """From a :class:`roofline.config.ModelConfig` with ``num_experts`` > 0.

        Raises:
            ValueError: a dense config (names it).
        """
        if not getattr(cfg, "num_experts", 0):
            raise ValueError(f"{cfg.name} is not a mixture-of-experts model (num_experts 0)")
        lookup = cfg.vocab_size * cfg.hidden_size if not cfg.tie_word_embeddings else 0  # rows read, not table
        return cls(cfg.num_experts, cfg.num_experts_per_tok, cfg.num_moe_layers, float(cfg.expert_params),
                   float(cfg.num_params - cfg.num_routed_expert_params - lookup), float(cfg.num_active_params))

    def step_weight_bytes(self, touched_per_layer: float, fmt: str = "bf16") -> float:
        """Weight bytes of a step touching ``touched_per_layer`` experts in each MoE layer."""
        return weight_bytes(self.dense_params + self.num_moe_layers * touched_per_layer * self.expert_params, fmt)


def moe_decode_floor(moe: MoEShape, batch: int, kv_bytes_per_seq: float, bandwidth: float, peak_flops: float,
                     fmt: str = "bf16", touched_per_layer: float | None = None) -> dict[str, float]:
    """The decode-step floor of ``batch`` sequences: max(bytes / bandwidth, 2 * active params * batch / peak).

    Args:
        touched_per_layer: distinct experts per MoE layer (None: the uniform-routing expectation).
    Returns:
        dict with touched_experts, weight_bytes, bytes (weights + KV), floor_s, floor_tok_per_s, bound_by.
    """
    _check_positive("batch", batch)
    touched = (expected_touched_experts(moe.num_experts, moe.top_k, batch) if touched_per_layer is None
               else touched_per_layer)
    wbytes = moe.step_weight_bytes(touched, fmt)
    total = wbytes + batch * kv_bytes_per_seq
    mem = total / bandwidth
    comp = 2.0 * moe.active_params * batch / peak_flops
    floor = max(mem, comp)
    return dict(batch=batch, touched_experts=touched, weight_bytes=wbytes, bytes=total, floor_s=floor,
                floor_tok_per_s=batch / floor, bound_by="memory" if mem >= comp else "compute")


def format_moe_table(moe: MoEShape, rows: list[dict[str, float]], fmt: str, hardware: str) -> str:
    """The ``roofline cost`` MoE section: one row per batch."""
    lines = [f"mixture of experts: {moe.num_experts} experts, top-{moe.top_k}, {moe.num_moe_layers} MoE layers, "
             f"{moe.expert_params / 1e6:.1f} M params per expert; {fmt} weights on {hardware}",
             "  touched = E (1 - (1 - k/E)^B) per layer (uniform routing); bytes = dense + touched experts + KV",
             f"  {'batch':>6} {'touched':>9} {'GB/step':>9} {'floor ms':>9} {'floor tok/s':>12} {'bound':>8}"]
    for r in rows:
        lines.append(f"  {r['batch']:>6} {r['touched_experts']:>9.2f} {r['bytes'] / 1e9:>9.3f} "
                     f"{r['floor_s'] * 1e3:>9.3f} {r['floor_tok_per_s']:>12.1f} {r['bound_by']:>8}")
    return "\n".join(lines)


def touched_experts_from_counts(counts: list[list[int]], top_k: int, batch: float) -> float:
    """Distinct experts a batch of ``batch`` tokens touches per layer, in expectation under the routing
    frequencies measured in a run: ``counts[l][e]`` tokens routed to expert e of MoE layer l. Token t picks e
    with probability q_e = counts[l][e] / tokens_l (tokens_l = sum(counts[l]) / k), so the layer touches
    sum_e 1 - (1 - q_e)^B (uniform q_e = k/E gives ``expected_touched_experts``). Mean over layers; 0 without
    counts."""
    per_layer = []
    for row in counts:
        tokens = sum(row) / top_k
        if tokens > 0:
            per_layer.append(sum(1.0 - (1.0 - min(1.0, c / tokens)) ** batch for c in row))
    return sum(per_layer) / len(per_layer) if per_layer else 0.0


def moe_step_bytes(model_config: Any, weight_bytes_per_step: float, batch: float,
                   touched_per_layer: float | None = None) -> tuple[float, float] | None:
    """For a measured run or ``bench decode`` on an MoE model: (weight bytes a decode step of ``batch`` tokens
    reads, parameters one token multiplies by), or None for a dense model. The engine's
    ``weight_bytes_per_step`` counts every expert; the routed experts' share of it (their parameters over the
    parameters it counts) is replaced by ``touched_per_layer`` experts per MoE layer (None: the uniform
    expectation E (1 - (1 - k/E)^B))."""
    if not getattr(model_config, "is_moe", False):
        return None
    moe = MoEShape.from_model_config(model_config)
    counted = moe.dense_params + moe.num_moe_layers * moe.num_experts * moe.expert_params
    per_param = weight_bytes_per_step / counted
    touched = (expected_touched_experts(moe.num_experts, moe.top_k, batch) if touched_per_layer is None
               else touched_per_layer)
    return per_param * (moe.dense_params + moe.num_moe_layers * touched * moe.expert_params), moe.active_params


def moe_ep_projection(moe: MoEShape, ep: int, batch: int, kv_bytes_per_seq: float, bandwidth: float,
                      peak_flops: float, num_layers: int, hidden_size: int, link_bandwidth: float,
                      link_latency_s: float, fmt: str = "bf16", act_bytes: int = 2) -> dict[str, float]:
    """A **projection** of one decode step on ``ep`` GPUs with expert parallelism (TP attention, E/ep experts
    per GPU), per GPU: the dense weights and the KV split ``ep`` ways, the expected touched experts of its own
    E/ep (touched / ep), compute over ``ep``, plus two ring all-reduces of [batch, hidden] per layer (attention
    and the MoE combine; ``costmodel.links``). Routing skew, which loads one GPU more than the mean, is not
    modelled (the /metrics gauge measures it).

    Returns:
        dict with ep, batch, touched_per_gpu, weight_bytes_per_gpu, comm_s, floor_s, floor_tok_per_s.
    """
    _check_positive("ep", ep)
    if moe.num_experts % ep:
        raise ValueError(f"expert parallel size {ep} does not divide the {moe.num_experts} experts; sizes that do: "
                         + ", ".join(str(d) for d in range(1, moe.num_experts + 1) if moe.num_experts % d == 0))
    touched = expected_touched_experts(moe.num_experts, moe.top_k, batch) / ep
    wbytes = weight_bytes(moe.dense_params / ep + moe.num_moe_layers * touched * moe.expert_params, fmt)
    mem = (wbytes + batch * kv_bytes_per_seq / ep) / bandwidth
    comp = 2.0 * moe.active_params * batch / ep / peak_flops
    comm = 2 * num_layers * ring_allreduce_time(batch * hidden_size * act_bytes, ep, link_bandwidth, link_latency_s)
    floor = max(mem, comp) + comm
    return dict(ep=ep, batch=batch, touched_per_gpu=touched, weight_bytes_per_gpu=wbytes, comm_s=comm,
                floor_s=floor, floor_tok_per_s=batch / floor)
