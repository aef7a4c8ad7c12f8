"""Exact speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", algorithm 1; Chen et al. 2023, "Accelerating Large Language Model Decoding with Speculative
Sampling", algorithm 2), vectorized over requests on the device: no per-token host loop.

For each request with drafts ``x_1..x_k`` drawn from ``q`` and the target's distributions ``p_1..p_{k+1}``
at the ``k + 1`` verified positions (both after the same temperature / top-k / top-p / min-p processing):

- draft ``x_j`` is accepted with probability ``min(1, p_j(x_j) / q_j(x_j))``, in order, until the first
  rejection;
- at the first rejected position ``j`` the emitted token is drawn from ``norm(max(0, p_j - q_j))``;
- if all ``k`` are accepted, a bonus token is drawn from ``p_{k+1}``.

The emitted tokens are then distributed exactly as ``k + 1`` (or fewer) tokens sampled from the target alone
(Leviathan et al. 2023, appendix A.1). A deterministic proposer (n-gram) has one-hot ``q``: acceptance is
``p_j(x_j)`` and the residual is ``p_j`` with ``x_j`` removed. Greedy rows accept while the draft equals the
target's argmax and emit the argmax at the first mismatch, which is token-identical to greedy decoding.

Randomness: ``u_j ~ U[0, 1)`` for the acceptance tests and an exponential race (``argmax(r / E)``,
``E ~ Exp(1)``, which draws index i with probability ``r_i / sum r``) for the emitted token. A row with a
``torch.Generator`` (a seeded request) draws both from it, so its result depends only on its own inputs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class RejectionOutput:
    """``token_ids`` [R, K + 1] int64: row i's emitted tokens in its first ``num_emitted[i]`` columns, -1
    after; ``num_accepted`` [R] int64 (accepted drafts, in [0, num_draft]); ``num_emitted`` = accepted + 1."""

    token_ids: torch.Tensor
    num_accepted: torch.Tensor
    num_emitted: torch.Tensor


def rejection_sample(
    target_probs: torch.Tensor,
    draft_token_ids: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
    is_greedy: torch.Tensor | None = None,
    generators: list[torch.Generator | None] | None = None,
    matched: torch.Tensor | None = None,
    match_ids: torch.Tensor | None = None,
) -> RejectionOutput:
    """Verify padded drafts against the target and emit each row's tokens.

    Args:
        target_probs: [R, K + 1, V] fp32, the target's processed next-token distributions at the verified
            positions (row i's positions ``0..num_draft[i]`` are used). For greedy rows only the argmax is used.
        draft_token_ids: [R, K] int64; row i's first ``num_draft[i]`` are its drafts (the rest is ignored).
        num_draft: [R] int64 in [0, K].
        draft_probs: [R, K, V] fp32 ``q`` of each draft position, or None for one-hot ``q`` (a deterministic
            proposer). Must put mass > 0 on each draft token it proposed.
        is_greedy: [R] bool (None: no row is greedy).
        generators: per row, a generator for its random draws or None for the default one.
        matched: [R] bool rows verified by matching instead (None: none): a draft is accepted while it equals
            ``match_ids`` [R, K + 1] int64 at its position, and the token emitted is ``match_ids`` at the first
            position that differs (or after the last draft). A seeded row's keyed samples
            (``verifier.keyed_samples``); greedy rows are the case ``match_ids`` = the argmax.

    Returns:
        ``RejectionOutput``.

    Raises:
        ValueError: shapes that do not agree, or ``num_draft`` outside [0, K] (checked for CPU tensors only, so
            a GPU caller pays no host sync).
    """
    r, k1, v = target_probs.shape
    k = k1 - 1
    dev = target_probs.device
    if tuple(draft_token_ids.shape) != (r, k) or tuple(num_draft.shape) != (r,):
        raise ValueError(f"drafts {tuple(draft_token_ids.shape)} and num_draft {tuple(num_draft.shape)} must be "
                         f"[{r}, {k}] and [{r}] for target_probs {tuple(target_probs.shape)}")
    if draft_probs is not None and tuple(draft_probs.shape) != (r, k, v):
        raise ValueError(f"draft_probs is {tuple(draft_probs.shape)}, expected {(r, k, v)}")
    # Checked where it costs no device sync (a CPU tensor); the worker passes counts it built itself.
    if r and num_draft.device.type == "cpu" and (int(num_draft.min()) < 0 or int(num_draft.max()) > k):
        raise ValueError(f"num_draft must be in [0, {k}], got {num_draft.tolist()}")
    rows = torch.arange(r, device=dev)
    cols = torch.arange(k, device=dev)
    valid = cols[None, :] < num_draft[:, None]  # [R, K]
    drafts = torch.where(valid, draft_token_ids, 0)
    argmax = target_probs.argmax(dim=-1)  # [R, K + 1]

    # Random draws: u [R, K] for the tests, then E [R, V] for the emitted token, per row's generator.
    gens = generators if generators is not None else [None] * r
    u = torch.empty(r, k, device=dev)
    noise = torch.empty(r, v, device=dev)
    shared = [i for i, g in enumerate(gens) if g is None]
    if shared:
        u.uniform_()
        noise.exponential_()
    seeded = [(i, g) for i, g in enumerate(gens) if g is not None]
    counts = num_draft.tolist() if seeded else []
    for i, g in seeded:
        # Exactly num_draft[i] uniforms, then V exponentials: a seeded row's draws do not depend on the
        # other rows' draft counts (the padding).
        u[i, :counts[i]].uniform_(generator=g)
        noise[i].exponential_(generator=g)

    p_draft = target_probs[:, :k].gather(-1, drafts[..., None])[..., 0]  # [R, K]
    q_draft = (draft_probs.gather(-1, drafts[..., None])[..., 0] if draft_probs is not None
               else torch.ones_like(p_draft))
    accept = u * q_draft < p_draft  # u < p / q without dividing (q > 0 where it drafted)
    if is_greedy is not None:
        accept = torch.where(is_greedy[:, None], drafts == argmax[:, :k], accept)
    if matched is not None:
        accept = torch.where(matched[:, None], drafts == match_ids[:, :k], accept)
    accept &= valid
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)  # [R] leading run of accepts

    # The emitted token at position a = num_accepted: residual max(0, p - q) after a rejection, p after all.
    p_a = target_probs[rows, num_accepted]  # [R, V]
    rejected = num_accepted < num_draft
    a_draft = num_accepted.clamp(max=max(k - 1, 0))
    if k == 0:
        residual = p_a
    else:
        if draft_probs is not None:
            q_a = draft_probs[rows, a_draft]
        else:
            q_a = torch.zeros_like(p_a).scatter_(1, drafts[rows, a_draft][:, None], 1.0)
        residual = torch.where(rejected[:, None], (p_a - q_a).clamp(min=0.0), p_a)
        # p == q on the whole support (possible only where acceptance was certain) leaves nothing: keep p.
        empty = residual.sum(dim=-1, keepdim=True) <= 0
        residual = torch.where(empty, p_a, residual)
    final = (residual / noise).argmax(dim=-1)
    if is_greedy is not None:
        final = torch.where(is_greedy, argmax[rows, num_accepted], final)
    if matched is not None:
        final = torch.where(matched, match_ids[rows, num_accepted], final)

    out = torch.full((r, k1), -1, dtype=torch.int64, device=dev)
    out[:, :k] = torch.where(cols[None, :] < num_accepted[:, None], drafts, -1)
    out[rows, num_accepted] = final
    return RejectionOutput(out, num_accepted, num_accepted + 1)
