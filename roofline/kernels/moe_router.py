"""The MoE router in one launch (Triton): logits [T, E] -> softmax (fp32) -> top-k -> optional renormalization.

Routing as Hugging Face transformers computes it for Mixtral, Qwen2-MoE and Qwen3-MoE (``ref_select_experts``
is that torch code, kept as the CPU path and the test reference): ``softmax`` over all E experts in float32,
``torch.topk`` of the probabilities, then, where ``norm_topk_prob`` says so, the k weights divided by their sum
(Mixtral always renormalizes: the same as a softmax over the top-k logits). The torch path is five to seven
kernels on a GPU (softmax, topk's gather and sort, the sum, the division, casts); at batch 1 each is a few
microseconds of a decode step that is launch-bound, so the kernel does all of it in one program per token.

Ties: among equal probabilities the lowest expert index is taken first, and the k ids come out in descending
probability order. That is what ``torch.topk`` does on the CPU (the HF-identity tests run there; checked in
tests/moe/test_moe_router.py); the CUDA ``topk`` makes no promise about ties.

One program holds a token's whole logit row in registers (E up to a few thousand) and picks the k experts by k
rounds of (max, lowest index at the max), so the cost is O(k E) register work on a row that is read once.
"""

from __future__ import annotations

import torch

from roofline.kernels import pdl

try:  # triton is optional: the CPU path never imports this module's kernel.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where triton is absent
    triton = None


def _check_top_k(top_k: int, num_experts: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok must be in [1, num_experts={num_experts}], got {top_k}")


def ref_select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's top-k router in torch: router_logits [T, E] any float dtype -> (topk_weights [T, k] float32,
    topk_ids [T, k] int64), k in descending probability order.

    Raises:
        ValueError: top_k outside [1, E] (names both).
    """
    _check_top_k(top_k, router_logits.shape[-1])
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


if triton is not None:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    @triton.jit
    def _router_kernel(logits_ptr, weights_ptr, ids_ptr, num_experts, stride_l, top_k,
                       RENORMALIZE: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr = 0):
        if PDL:  # roofline.kernels.pdl: the logits are the previous kernel's output
            gdc_wait()
            gdc_launch_dependents()
        row = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, E_PAD)
        mask = offs < num_experts
        x = tl.load(logits_ptr + row * stride_l + offs, mask=mask, other=float("-inf")).to(tl.float32)
        p = tl.exp(x - tl.max(x, axis=0))
        probs = p / tl.sum(p, axis=0)  # [E_PAD], as torch.softmax: exp(x - max) / sum
        # Padding lanes never win: probabilities are >= 0 (an underflowed expert, 0, still beats a pad lane).
        vals = tl.where(mask, probs, -1.0)
        koffs = tl.arange(0, K_PAD)
        top_w = tl.zeros([K_PAD], dtype=tl.float32)
        top_i = tl.zeros([K_PAD], dtype=tl.int64)
        for j in range(top_k):
            best = tl.max(vals, axis=0)
            idx = tl.min(tl.where(vals == best, offs, E_PAD), axis=0)  # lowest index among the ties
            top_w = tl.where(koffs == j, best, top_w)
            top_i = tl.where(koffs == j, idx.to(tl.int64), top_i)
            vals = tl.where(offs == idx, -2.0, vals)
        if RENORMALIZE:
            top_w = top_w / tl.sum(tl.where(koffs < top_k, top_w, 0.0), axis=0)
        kmask = koffs < top_k
        tl.store(weights_ptr + row * top_k + koffs, top_w, mask=kmask)
        tl.store(ids_ptr + row * top_k + koffs, top_i, mask=kmask)


def select_experts(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The router in one Triton launch (see the module docstring); the same contract as ``ref_select_experts``.

    Args:
        router_logits: [T, E] fp32/fp16/bf16, unit stride along E.
        top_k: experts per token, in [1, E]. renormalize: divide the k weights by their sum (norm_topk_prob).

    Returns:
        (topk_weights [T, k] float32, topk_ids [T, k] int64): descending probability, ties to the lowest index.
        int64 ids are what torch.topk gives, what the expert-count ``scatter_add_`` needs, and what the fused
        MoE kernels read as is.

    Raises:
        ValueError: top_k outside [1, E]; logits that are not 2-D with unit stride along E (names the shape).
        RuntimeError: triton missing.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use ref_select_experts on this machine")
    if router_logits.dim() != 2 or router_logits.stride(-1) != 1:
        raise ValueError(f"router_logits must be [T, E] with unit stride along E, got shape "
                         f"{tuple(router_logits.shape)} strides {router_logits.stride()}")
    num_tokens, num_experts = router_logits.shape
    _check_top_k(top_k, num_experts)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=router_logits.device)
    if num_tokens:
        e_pad = triton.next_power_of_2(num_experts)
        _router_kernel[(num_tokens,)](router_logits, weights, ids, num_experts, router_logits.stride(0), top_k,
                                      RENORMALIZE=renormalize, E_PAD=e_pad, K_PAD=triton.next_power_of_2(top_k),
                                      num_warps=1 if e_pad <= 256 else 4, **pdl.launch_kwargs(router_logits.device))
    return weights, ids
