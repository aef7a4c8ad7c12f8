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

``gate_select_experts`` also folds in the router's gate GEMV (``logits = x @ W_gate^T``, the launch before this
one, issue 33): programs over tiles of experts compute the logits, rounded to x's dtype as HF's
``router_logits = gate(x)`` is, and the last to finish for a token runs the same routing (``_route_row``, shared
by both kernels) on its row. ``roofline.layers.moe.FusedMoE.route`` picks it at decode sizes on a GPU.
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

    from roofline.kernels.quant_gemv import _row_stream

    @triton.jit
    def _route_row(x, offs, mask, weights_ptr, ids_ptr, row, top_k,
                   RENORMALIZE: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr):
        # x: one token's logits, fp32 [E_PAD], -inf on the pad lanes (offs >= E, mask False). Softmax, top-k (ties
        # to the lowest index), optional renormalization; stores row ``row`` of weights [T, k] and ids [T, k].
        # Shared by _router_kernel and _gate_router_kernel.
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
        _route_row(x, offs, mask, weights_ptr, ids_ptr, row, top_k, RENORMALIZE, E_PAD, K_PAD)

    @triton.jit
    def _gate_router_kernel(X, W, Logits, Counters, weights_ptr, ids_ptr, num_experts, K, stride_x, stride_w, top_k,
                            RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
                            EVEN_K: tl.constexpr, E_PAD: tl.constexpr, K_PAD: tl.constexpr, PDL: tl.constexpr = 0):
        # Grid (cdiv(E, BLOCK_E), T). Program (e, t): logits of experts [e BLOCK_E, (e + 1) BLOCK_E) for token t,
        # as quant_gemv's one-row [N, K] stream (register prefetch of the next K tile, fp32 products summed over K
        # once), rounded to x's dtype as the gate linear's output is, into the fp32 scratch Logits [T, E]. The
        # last program of token t to arrive (Counters[t], acq_rel, as splitk._splitk_epilogue) routes the whole
        # row and re-arms Counters[t] to 0 (CUDA-graph replays find it zeroed).
        pid_e = tl.program_id(0)
        row = tl.program_id(1).to(tl.int64)
        offs_e = pid_e * BLOCK_E + tl.arange(0, BLOCK_E)
        emask = offs_e < num_experts
        acc = _row_stream(W, X + row * stride_x, offs_e, emask, stride_w, K, 0, tl.cdiv(K, BLOCK_K), 0, BLOCK_E,
                          BLOCK_K, EVEN_K, PDL)  # quant_gemv's one-row [N, K] stream (dense)
        # The gate linear's output dtype is x's: round there, as router_logits = gate(x) does, then fp32.
        logits = tl.sum(acc, axis=1).to(X.dtype.element_ty).to(tl.float32)
        tl.store(Logits + row * num_experts + offs_e, logits, mask=emask)
        tl.debug_barrier()
        arrived = tl.atomic_add(Counters + row, 1, sem="acq_rel", scope="gpu")
        if arrived == tl.num_programs(0) - 1:
            offs = tl.arange(0, E_PAD)
            mask = offs < num_experts
            x = tl.load(Logits + row * num_experts + offs, mask=mask, other=float("-inf"), cache_modifier=".cg")
            _route_row(x, offs, mask, weights_ptr, ids_ptr, row, top_k, RENORMALIZE, E_PAD, K_PAD)
            tl.atomic_xchg(Counters + row, 0)


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


# The tile of the H200 dispatch table's dense GEMV at M = 1 (block_n 4, block_k 512, 4 warps; measured at
# N = K = 4096, not at a gate's shape: untuned here). Qwen3-30B-A3B (E = 128, H = 2048): 32 programs per token,
# as many as the unfused gate's GEMV launches.
GATE_BLOCK_E = 4  # experts (weight rows) per program
GATE_BLOCK_K = 512


def gate_select_experts(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int, renormalize: bool
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """The router's gate GEMV and the router in one Triton launch: ``select_experts(F.linear(x, gate_weight),
    top_k, renormalize)`` with the logits never leaving the kernel's fp32 scratch.

    As HF transformers' Qwen3-MoE / Mixtral routers (``router_logits = F.linear(x, gate.weight)`` in the model
    dtype, then ``softmax(router_logits, dtype=float32)``): each logit is an fp32 dot product rounded to x's
    dtype, then softmax in fp32, top-k with ties to the lowest index, optional renormalization. Against the
    two-launch path the ids agree wherever the rounded logits do; the fp32 sum's order differs from cuBLAS's or
    the GEMV's (quant_gemv splits K differently), so a logit on a rounding boundary can land one ulp apart.

    Grid (cdiv(E, GATE_BLOCK_E), T): each program streams GATE_BLOCK_E rows of the gate weight for one token; the
    last program of a token to finish (an arrival counter per token from the shared split-K counter buffer,
    ``splitk.arrival_counters``, re-armed by that program) runs the router on the token's whole logit row.
    Deterministic: every logit is one program's fixed-order sum, and the routing reads them all after the last
    arrival. Meant for decode (small T): every token's programs re-read the weight (from L2 after the first).

    Args:
        x: [T, H] fp32/fp16/bf16, unit stride along H.
        gate_weight: [E, H] in x's dtype on x's device, unit stride along H (the gate linear's ``weight``).
        top_k: experts per token, in [1, E]. renormalize: divide the k weights by their sum (norm_topk_prob).

    Returns:
        (topk_weights [T, k] float32, topk_ids [T, k] int64), as ``select_experts``.

    Raises:
        ValueError: top_k outside [1, E]; x or gate_weight not 2-D with unit stride along H, their H or dtype or
            device differing (names the shapes, dtypes and devices).
        RuntimeError: triton missing.
    """
    if triton is None:
        raise RuntimeError("triton is not installed; use ref_select_experts on this machine")
    if (x.dim() != 2 or gate_weight.dim() != 2 or x.shape[1] != gate_weight.shape[1] or x.stride(-1) != 1
            or gate_weight.stride(-1) != 1):
        raise ValueError(f"x must be [T, H] and gate_weight [E, H], both with unit stride along H; got shapes "
                         f"{tuple(x.shape)} and {tuple(gate_weight.shape)}, strides {x.stride()} and "
                         f"{gate_weight.stride()}")
    if x.dtype != gate_weight.dtype or x.device != gate_weight.device:
        raise ValueError(f"x and gate_weight must share dtype and device; got {x.dtype} on {x.device} and "
                         f"{gate_weight.dtype} on {gate_weight.device}")
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    _check_top_k(top_k, num_experts)
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=x.device)
    if num_tokens:
        from roofline.kernels.splitk import arrival_counters as _counters

        logits = torch.empty(num_tokens, num_experts, dtype=torch.float32, device=x.device)
        block_k = min(GATE_BLOCK_K, triton.next_power_of_2(max(hidden, 16)))
        grid = (triton.cdiv(num_experts, GATE_BLOCK_E), num_tokens)
        _gate_router_kernel[grid](
            x, gate_weight, logits, _counters(x.device, num_tokens), weights, ids, num_experts, hidden,
            x.stride(0), gate_weight.stride(0), top_k, RENORMALIZE=renormalize, BLOCK_E=GATE_BLOCK_E,
            BLOCK_K=block_k, EVEN_K=hidden > 0 and hidden % block_k == 0, E_PAD=triton.next_power_of_2(num_experts),
            K_PAD=triton.next_power_of_2(top_k), num_warps=4, **pdl.launch_kwargs(x.device))
    return weights, ids
