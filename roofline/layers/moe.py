"""Mixture-of-experts layers: the router (``select_experts``) and ``FusedMoE``, the routed experts of one
layer behind the weight-format seam (``roofline.quant.moe``), with expert parallelism.

Routing follows Hugging Face transformers exactly (Mixtral, Qwen2-MoE, Qwen3-MoE all compute it this way):
``softmax`` over all experts in float32, ``torch.topk`` of those probabilities (so ties break as HF's do),
then, where the config says so, the top-k renormalized to sum to 1. For Mixtral (always renormalized) this
equals a softmax over the top-k logits.

Parallel layouts (``roofline.distributed``; docs/distributed.md):
- tensor parallel (default at tp > 1): every rank holds every expert, each expert's width split like a dense
  MLP (gate/up column-parallel, down row-parallel); the partial outputs are all-reduced;
- expert parallel (``enable_expert_parallel``): rank r of the tp group holds experts [r E/n, (r+1) E/n) whole.
  Attention stays tensor-parallel, so every rank of the group already holds every token (the all-gather of
  the dispatch is free); each rank runs its local experts on the tokens routed to them, and one all-reduce
  sums the ranks' partial outputs (the combine).
"""

from __future__ import annotations

import torch
from torch import nn

from roofline.distributed.communication import tensor_parallel_all_reduce
from roofline.distributed.parallel_state import divide, get_parallel_state
from roofline.kernels.moe_router import ref_select_experts
from roofline.layers import dispatch
from roofline.layers.linear import ReplicatedLinear
from roofline.quant.base import QuantConfig, UnquantizedLinearMethod


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's top-k router: router_logits [T, E] -> (topk_weights [T, k] float32, topk_ids [T, k] int64).

    With kernels on and the logits on CUDA, one fused Triton launch (``roofline.kernels.moe_router``); else
    its torch twin ``ref_select_experts`` (the CPU path: HF's own code, token-identical). Ties go to the
    lowest expert index on both paths.

    Raises:
        ValueError: top_k outside [1, E] (names both).
    """
    if dispatch.kernels_for(router_logits) is not None and router_logits.dim() == 2:
        from roofline.kernels.moe_router import select_experts as fused_select_experts

        return fused_select_experts(router_logits.contiguous(), top_k, renormalize)
    return ref_select_experts(router_logits, top_k, renormalize)


# The gate GEMV and the router in one launch (``moe_router.gate_select_experts``) up to this many tokens: decode
# batches, where the gate linear's own launch is a measurable share of a launch-bound step (issue 33). Each
# token's programs re-read the [E, H] gate weight (L2 after the first token), so large batches keep cuBLAS +
# the router kernel. 16 is a choice, not a measurement: at Qwen3-30B-A3B's gate (128 x 2048 bf16, 512 KiB) 16
# tokens re-read 8 MiB from L2, about a microsecond on an H200, against the launch saved (1.5-2.5 us).
FUSED_GATE_MAX_TOKENS = 16


def fused_gate_applies(x: torch.Tensor, gate: nn.Module) -> bool:
    """Whether ``FusedMoE.route`` runs the gate and the router in one launch: Triton kernels on and ``x`` [T, H]
    on CUDA with unit stride along H, T <= ``FUSED_GATE_MAX_TOKENS``, and ``gate`` a replicated, unquantized,
    bias-free linear whose weight has x's dtype (what HF's routers and ours build: ``ReplicatedLinear``)."""
    return (x.dim() == 2 and x.shape[0] <= FUSED_GATE_MAX_TOKENS and x.stride(-1) == 1
            and dispatch.kernels_for(x) is not None and isinstance(gate, ReplicatedLinear)
            and isinstance(gate.quant_method, UnquantizedLinearMethod) and gate.bias is None
            and gate.weight.dtype == x.dtype and gate.weight.device == x.device)


# Whether FusedMoE layers count the tokens routed to each expert (the /metrics gauge, the run summary's
# measured routing): None = on where the layer is built on a CPU, off on a GPU, where the count's two small
# kernels per layer are a measurable share of a batch-1 decode step. Read when a layer is built (a CUDA graph
# captures what the layer did then).
_COUNT_EXPERT_TOKENS: bool | None = None


def set_expert_counting(enabled: bool | None) -> None:
    """Count tokens per expert in layers built from now on (True / False; None: on a CPU only)."""
    global _COUNT_EXPERT_TOKENS
    _COUNT_EXPERT_TOKENS = enabled


def expert_token_counts(model: nn.Module) -> list[list[int]] | None:
    """Tokens routed to each expert since the model was built, per MoE layer [layers][E] (one device -> host
    copy for all layers), or None when the model has no counting MoE layer."""
    layers = [m.expert_token_counts for m in model.modules() if isinstance(m, FusedMoE) and m.count_tokens]
    return torch.stack(layers).tolist() if layers else None


def expert_parallel_sizes(num_experts: int, limit: int) -> list[int]:
    """The expert-parallel sizes in [1, limit] that divide ``num_experts``."""
    return [n for n in range(1, limit + 1) if num_experts % n == 0]


class FusedMoE(nn.Module):
    """The routed experts of one MoE layer: forward(x [T, H], router_logits [T, E]) -> [T, H] (reduced across
    the tensor-parallel group). A model with its router's gate linear calls ``run_experts(x, *route(x, gate))``
    instead, so that the gate GEMV and the routing can be one launch at decode sizes (``route``).

    Args:
        num_experts: E, all experts of the layer. top_k: experts per token. renormalize: norm_topk_prob.
        intermediate_size: each expert's width I. prefix: the HF name of the experts module
            (``model.layers.0.mlp.experts``). checkpoint_names: HF names of an expert's gate, up and down
            projections (Mixtral ``w1, w3, w2``; Qwen ``gate_proj, up_proj, down_proj``).
        quant_config: the experts' weight format (None: 16-bit; ``roofline.quant.moe``).

    Raises:
        ValueError: an expert-parallel size that does not divide E (lists those that do), a tensor-parallel
            size that does not divide I, a format without an expert kernel (``get_moe_method``).
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool = True, quant_config: QuantConfig | None = None, prefix: str = "",
                 checkpoint_names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        from roofline.quant.moe import get_moe_method

        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")
        ps = get_parallel_state()
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.prefix = hidden_size, prefix
        self.group_size = ps.tp_size  # ranks whose partial outputs are summed
        self.use_ep = ps.enable_expert_parallel and ps.tp_size > 1
        self.ep_size, self.ep_rank = (ps.tp_size, ps.tp_rank) if self.use_ep else (1, 0)
        self.tp_size, self.tp_rank = (1, 0) if self.use_ep else (ps.tp_size, ps.tp_rank)
        if num_experts % self.ep_size:
            raise ValueError(f"expert parallel size {self.ep_size} (tensor_parallel_size with "
                             f"enable_expert_parallel) does not divide the {num_experts} experts; sizes that do: "
                             f"{', '.join(map(str, expert_parallel_sizes(num_experts, max(num_experts, 8))))}")
        self.num_local_experts = num_experts // self.ep_size
        self.expert_start = self.ep_rank * self.num_local_experts
        self.intermediate_size = intermediate_size
        self.intermediate_size_per_partition = divide(intermediate_size, self.tp_size,
                                                      f"{prefix or 'experts'} moe_intermediate_size")
        self.quant_method = get_moe_method(quant_config, prefix)
        self.quant_method.create_weights(self, self.num_local_experts, hidden_size,
                                         self.intermediate_size_per_partition,
                                         params_dtype or torch.get_default_dtype(), self.weight_loader)
        # Which checkpoint tensors fill each weight: (expert, 0 gate | 1 up | 2 down) -> HF name. The loader
        # checks that every one arrived and names the missing ones.
        gate, up, down = checkpoint_names
        local = range(self.expert_start, self.expert_start + self.num_local_experts)
        self.w13_weight.expected_shards = {(e, j): f"{prefix}.{e}.{name}.weight"
                                           for e in local for j, name in ((0, gate), (1, up))}
        self.w2_weight.expected_shards = {(e, 2): f"{prefix}.{e}.{down}.weight" for e in local}
        # Tokens routed to each expert (all E, counted by every rank) since the last reset: a device tensor,
        # updated without a host sync (the /metrics gauge and the run summary read it once).
        self.register_buffer("expert_token_counts", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        self.count_tokens = (_COUNT_EXPERT_TOKENS if _COUNT_EXPERT_TOKENS is not None
                             else self.expert_token_counts.device.type == "cpu")

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: tuple[int, int]) -> None:
        """Place checkpoint tensor ``loaded`` of expert ``shard_id[0]`` (global id), projection ``shard_id[1]``
        (0 gate [I, H], 1 up [I, H], 2 down [H, I]) into the stacked weight; another rank's expert is skipped.

        Raises:
            ValueError: an expert id outside [0, E) or a tensor of the wrong shape (names both shapes).
        """
        expert, proj = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert id {expert} is outside [0, {self.num_experts})")
        e = expert - self.expert_start
        if not 0 <= e < self.num_local_experts:
            return
        ip = self.intermediate_size_per_partition
        want = (self.intermediate_size, self.hidden_size) if proj < 2 else (self.hidden_size, self.intermediate_size)
        if tuple(loaded.shape) != want:
            raise ValueError(f"checkpoint has {tuple(loaded.shape)}, the model expects {want}")
        if proj < 2:
            param.data[e, proj * ip:(proj + 1) * ip].copy_(loaded.narrow(0, self.tp_rank * ip, ip))
        else:
            param.data[e].copy_(loaded.narrow(1, self.tp_rank * ip, ip))

    def route(self, x: torch.Tensor, gate: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        """Route x [T, H] through the router's ``gate`` linear [H -> E]: (topk_weights [T, k] float32,
        topk_ids [T, k] int64, global expert ids), ``select_experts(gate(x))``.

        Where ``fused_gate_applies`` (CUDA, kernels on, small T, a plain 16-bit replicated gate), one Triton
        launch (``roofline.kernels.moe_router.gate_select_experts``: the logits rounded to x's dtype as the gate's
        output is, so the same routing); else the gate linear then ``select_experts``.
        """
        if fused_gate_applies(x, gate):
            from roofline.kernels.moe_router import gate_select_experts

            return gate_select_experts(x, gate.weight, self.top_k, self.renormalize)
        return select_experts(gate(x), self.top_k, self.renormalize)

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        return self.run_experts(x, *select_experts(router_logits, self.top_k, self.renormalize))

    def run_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """x [T, H] through the experts ``route`` / ``select_experts`` picked (global ids [T, k], weights [T, k]
        float32) -> [T, H]: counts the tokens per expert (``count_tokens``), maps the ids to this rank's experts
        under expert parallelism, runs the weight format's kernel, and all-reduces across the group."""
        if self.count_tokens:
            ids = topk_ids.reshape(-1)
            self.expert_token_counts.scatter_add_(0, ids, torch.ones_like(ids))
        if self.use_ep:  # global -> local ids; another rank's experts -> -1
            local = topk_ids - self.expert_start
            topk_ids = torch.where((local >= 0) & (local < self.num_local_experts), local, -1)
        out = self.quant_method.apply(self, x, topk_weights, topk_ids)
        if self.group_size > 1:
            out = tensor_parallel_all_reduce(out)
        return out

    def extra_repr(self) -> str:
        return (f"experts={self.num_experts} (local {self.expert_start}..{self.expert_start + self.num_local_experts}"
                f"), top_k={self.top_k}, hidden={self.hidden_size}, inter={self.intermediate_size_per_partition}, "
                f"method={type(self.quant_method).__name__}")
