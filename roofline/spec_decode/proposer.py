"""Proposers: what drafts the tokens a verify pass checks, one class per method, found through one registry
keyed by ``SpeculativeConfig.method`` (vLLM v1's ``spec_decode/``: ``NgramProposer``, ``DraftModelProposer``).

A proposer runs in one of two places:

- on the host, in the engine's process (``on_device = False``): ``propose(token_ids, k)`` returns up to ``k``
  real token ids from the sequence so far; the engine sends them in ``StepInput.spec_token_ids`` and the
  verifier treats their ``q`` as one-hot (n-gram);
- on the worker's device (``on_device = True``): the engine sends only how many drafts a request may get
  (``StepInput.num_draft_tokens``) and the worker calls ``propose_draft_token_ids`` with the model at hand,
  which writes the drafts into the persistent batch and returns their ``q`` (the draft model, separate or a
  quantized copy of the target, or the target's first k layers).

The device proposers live in ``roofline.spec_decode.draft_proposers`` (they import torch) and are built
lazily by name, so this module and the engine stay free of torch. Adding a method is one new class and one
``PROPOSERS`` line.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from typing import Any

from roofline.spec_decode.ngram import ngram_propose


class Proposer(ABC):  # noqa: B024 - host proposers override propose, device ones DeviceProposer
    """One speculative method. ``on_device``: it runs in the worker (``propose_draft_token_ids``), else on
    the host (``propose``)."""

    on_device = False

    def __init__(self, spec_config: Any):
        self.spec_config = spec_config

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        """Up to ``k`` draft token ids (real ids in [0, vocab)) continuing ``token_ids`` (a host proposer)."""
        raise NotImplementedError(f"{type(self).__name__} drafts on the worker's device, not on the host")

    def draft_cost_prior(self, num_target_layers: int, target_weight_bytes: int,
                         draft_weight_bytes: int | None) -> float:
        """The policy's starting estimate of c, one draft step's time over one target step's, until it has
        timed both (0 for host proposers, whose time is inside the step's wall time)."""
        return 0.0


class DeviceProposer(Proposer):
    """A proposer that drafts with a model on the worker's device. ``propose_draft_token_ids(worker, rows,
    num_drafts)`` writes row ``rows[i]``'s ``num_drafts[i]`` drafts into ``worker.input_batch.token_ids`` after
    its known tokens and returns {row: q [k_r, vocab] fp32} (the draft distributions the verifier needs)."""

    on_device = True
    # The most positions one request's first draft pass read in the last ``propose_draft_token_ids``: a draft
    # with state of its own (a separate draft's KV, an EAGLE layer's) first catches up over every position the
    # target computed since it last drafted, 1 + the accepted drafts while drafting every step, a prompt or the
    # steps spent off otherwise. 0 where the draft keeps no such state (it shares the target's KV).
    catch_up_rows = 0

    @abstractmethod
    def load(self, worker: Any) -> None:
        """Build what the proposer needs next to the worker's target (before the KV pools are sized)."""

    @abstractmethod
    def propose_draft_token_ids(self, worker: Any, rows: Any, num_drafts: Any) -> dict[int, Any]:
        """See the class docstring."""


class NgramProposer(Proposer):
    """Prompt lookup (``roofline.spec_decode.ngram``): the tokens that followed the latest earlier occurrence
    of the sequence's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens."""

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        s = self.spec_config
        return ngram_propose(token_ids, k, s.prompt_lookup_min, s.prompt_lookup_max)


# method -> "module:class" (a device proposer's module imports torch only when it is built), or the class.
PROPOSERS: dict[str, Any] = {
    "ngram": NgramProposer,
    "draft_model": "roofline.spec_decode.draft_proposers:draft_model_proposer",
    "eagle": "roofline.spec_decode.eagle:EagleProposer",
    "medusa": "roofline.spec_decode.medusa:MedusaProposer",
}


def proposer_class(spec_config: Any) -> type[Proposer]:
    """The proposer class registered for ``spec_config.method`` (a ``"module:name"`` entry is imported here;
    a callable entry other than a class is given ``spec_config`` and returns the class).

    Raises:
        ValueError: no proposer is registered under that method (names the registered ones).
    """
    entry = PROPOSERS.get(spec_config.method)
    if entry is None:
        raise ValueError(f"speculative_config method {spec_config.method!r} has no proposer; registered: "
                         f"{', '.join(sorted(PROPOSERS))}")
    if isinstance(entry, str):
        module, name = entry.split(":")
        entry = getattr(importlib.import_module(module), name)
    if not isinstance(entry, type):
        entry = entry(spec_config)
    return entry


def is_device_method(spec_config: Any) -> bool:
    """Whether ``spec_config``'s proposer drafts on the worker (without importing a device proposer's module:
    a registered string entry is a device proposer)."""
    entry = PROPOSERS.get(spec_config.method)
    return isinstance(entry, str) or (isinstance(entry, type) and entry.on_device)


def check_draft_kv_share(spec_config: Any, draft_bytes_per_token: int, target_bytes_per_token: int,
                         pool_tokens: int, alone_tokens: int, sized_by_user: bool) -> None:
    """Refuse a draft whose own KV would halve the target's pool (issue 30: an int4 self-draft mirrors the
    target's KV, the H200 pool fell from 865,344 to 409,472 tokens, and the run lost 15% while the policy kept
    speculation off in 99.6% of steps: the pool, not the drafts, set the throughput).

    A draft whose KV per token is at least the target's leaves the target half the tokens or fewer. That cost
    is paid in every step, speculating or not, so it is refused unless the user sized the pool
    (``kv_cache_memory``, or ``num_blocks``, which skips sizing): then the split is theirs and is logged.

    Raises:
        ValueError: the draft's share is >= 1/2 of the split on an automatically sized pool; names both bytes
            per token, both pool sizes and the alternatives.
    """
    if sized_by_user or draft_bytes_per_token < target_bytes_per_token:
        return
    what = spec_config.method + (f", {spec_config.quantization} at load" if spec_config.quantization else "")
    raise ValueError(
        f"speculative_config ({what}): the draft's own KV ({draft_bytes_per_token} bytes per token, the target's "
        f"{target_bytes_per_token}) would cut the KV pool from {alone_tokens} to {pool_tokens} tokens "
        f"({100 * (1 - pool_tokens / max(alone_tokens, 1)):.0f}% fewer), a cost paid whether or not the policy "
        f"speculates: refused. Use a draft with less KV (\"num_layers\" shares the target's KV; \"eagle\" keeps "
        f"one layer's), or size the pool yourself (--kv-cache-memory) to accept the split")


def make_proposer(spec_config: Any) -> Proposer:
    """The proposer for ``spec_config`` (see ``proposer_class``)."""
    return proposer_class(spec_config)(spec_config)
