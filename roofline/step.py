"""What crosses the boundary between the engine (pure Python) and the worker (tensors), once per step, and
the ``Executor`` protocol the engine drives. This module sits below both ``roofline.engine`` and
``roofline.worker``: neither imports the other.

The messages are small and serializable (ids and counts, no tensors, no request histories), so a later executor
can send them to worker processes (tensor parallelism) or pipeline stages unchanged.

The worker keeps a persistent batch: it learns a request's prompt and parameters once (``NewRequest``),
and afterwards only what changed (``CachedRequest``: new blocks, progress). It appends the tokens it
samples to its own copy of each request's token ids, so the engine never resends them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

from roofline.sampling_params import SamplingParams


@dataclass
class Logprob:
    """One entry of a token's logprobs (vLLM's ``Logprob``): natural-log probability, rank (1 = the most
    likely token) and, once the engine detokenized it, the token's text."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


@dataclass
class NewRequest:
    """A sequence the worker has not seen (or sees again after a preemption freed it)."""

    seq_id: int
    token_ids: list[int]  # prompt + output so far (a resumed sequence recomputes its output tokens)
    num_prompt_tokens: int
    sampling_params: SamplingParams
    seed_offset: int  # sample index within the request: its draws are keyed by seed + seed_offset (keyed_seed)
    block_ids: list[int]
    num_computed_tokens: int


@dataclass
class CachedRequest:
    """A sequence the worker already holds: blocks appended since the last step, and its progress."""

    seq_id: int
    new_block_ids: list[int]
    num_computed_tokens: int
    # >= 0: the row's block table was cut to this many blocks before new_block_ids (a speculative step's
    # surplus blocks were freed after its rejected drafts); -1: unchanged.
    num_kept_blocks: int = -1


@dataclass
class StepInput:
    """One step for the worker. ``scheduled`` lists (seq_id, number of tokens to compute) in batch order
    (decodes first); ``finished_seq_ids`` are sequences to forget (finished or aborted), and
    ``preempted_seq_ids`` leave the batch until they come back as ``NewRequest``."""

    new_requests: list[NewRequest] = field(default_factory=list)
    cached_requests: list[CachedRequest] = field(default_factory=list)
    scheduled: list[tuple[int, int]] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)  # leave the batch, keep their generators
    # Speculative decoding: seq_id -> the drafts its chunk verifies (the chunk is 1 + len(drafts) tokens: the
    # last known token, then the drafts), real token ids proposed on the host (n-gram) ...
    spec_token_ids: dict[int, list[int]] = field(default_factory=dict)
    # ... or seq_id -> how many drafts the worker's own proposer (a draft model) makes for the chunk this step.
    num_draft_tokens: dict[int, int] = field(default_factory=dict)

    @property
    def num_batched_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class StepOutput:
    """What the worker sampled: for each sampling sequence, a list of tokens (one, or the accepted drafts and
    one more token when the step verifies drafts), and optionally their logprobs."""

    seq_ids: list[int] = field(default_factory=list)
    sampled_token_ids: list[list[int]] = field(default_factory=list)
    # Per sampling sequence, one {token id: Logprob} dict per sampled token (sampled + top-k), or None.
    logprobs: list[list[dict[int, Logprob]] | None] = field(default_factory=list)
    # Prompt logprobs scored this step, per sequence that asks (sampling or not): seq_id -> (index of the
    # first prompt token scored, one {token id: Logprob} dict per consecutive prompt token, actual + top-k).
    prompt_logprobs: dict[int, tuple[int, list[dict[int, Logprob]]]] = field(default_factory=dict)
    duration_s: float = 0.0
    # Speculative decoding: seq_id -> drafts accepted this step (its sampled tokens are those plus one), and
    # the seconds the worker's draft model took (0 for host proposers), and the most positions one request's
    # first draft pass caught up over (``DeviceProposer.catch_up_rows``: more than a drafting step leaves behind
    # after steps off; the policy then keeps that time out of its draft cost).
    num_accepted: dict[int, int] = field(default_factory=dict)
    draft_duration_s: float = 0.0
    draft_catch_up_rows: int = 0
    # Sequences whose step failed (for example a non-finite sampling distribution): str(seq_id) -> error message.
    # The engine finishes each one's request with that error (``RequestOutput.error``) and frees its blocks.
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class DeviceProfile:
    """What the speculative controller prices a step with, measured once by the executor on its device.

    ``read_bandwidth`` in bytes/s (a large streaming read), ``gemm_flops`` in FLOP/s (a large GEMM in
    ``dtype``, the cost model's name: "bf16", "fp16" or "fp32"), ``weight_bytes_per_step`` the weight bytes one
    decode step reads (``Worker.weight_bytes_per_step``), ``kv_bytes_per_token`` the KV-cache bytes per token
    and ``draft_weight_bytes`` a separate draft model's weight bytes (None without one, or unknown)."""

    read_bandwidth: float
    gemm_flops: float
    dtype: str
    weight_bytes_per_step: int
    kv_bytes_per_token: int
    draft_weight_bytes: int | None = None


class Executor(Protocol):
    """What the engine needs from whatever runs the model (``roofline.worker.executor`` has the
    implementations: in-process, one process per rank, one rank of a ``torchrun`` job)."""

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers)."""
        ...

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token on one worker (its layers and KV heads)."""
        ...

    def execute_model_async(self, step: StepInput) -> Any:
        """Launch one step; the handle's ``result()`` gives the ``StepOutput`` and its ``step_input`` is
        ``step``."""
        ...

    def profile_budget(self) -> int:
        """The per-step token budget measured on the workers."""
        ...

    def device_profile(self) -> DeviceProfile:
        """Bandwidth, GEMM rate and the model's bytes, measured once (the speculative controller's inputs)."""
        ...

    def shutdown(self) -> None:
        """Stop worker processes, if any."""
        ...
