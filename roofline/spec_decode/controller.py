"""The engine side of speculative decoding: whether a step drafts, gamma, the drafts of host proposers, and
what the policy learns from each step (acceptance per request, the draft cost, step timings).

The engine holds one ``SpecController`` when ``speculative_config`` is set, and asks it, per step:
``drafting_due`` (does this step draft, and so run synchronously), ``propose`` (fill the decoding sequences'
``spec_token_ids``), ``add_to_step`` (drafts into the ``StepInput``), then ``record`` with the step's output.
It owns the ``SpecPolicy`` and the ``SpecDecodeStats``. Its bound model is priced from the executor's measured
``DeviceProfile`` (``roofline.step``): the engine imports neither the hardware probe nor the worker.

Pure Python (no torch): it runs in the engine's process.
"""

from __future__ import annotations

import functools
import logging
import time
from typing import Any

from roofline.spec_decode.policy import SpecPolicy
from roofline.spec_decode.proposer import is_device_method, make_proposer
from roofline.spec_decode.stats import SpecDecodeStats
from roofline.step import DeviceProfile, StepInput, StepOutput

logger = logging.getLogger(__name__)


class SpecController:
    """See the module docstring.

    Args:
        spec_config: ``SpeculativeConfig``.
        model_config: the target's ``ModelConfig`` (parameter count, layer count).
        max_model_len: the scheduler's limit (a request drafts no further than it).
        profile: the executor's measured ``DeviceProfile``.
    """

    def __init__(self, spec_config: Any, model_config: Any, max_model_len: int, profile: DeviceProfile):
        from roofline import costmodel

        self.spec_config = spec = spec_config
        self.max_model_len = max_model_len
        self.on_device = is_device_method(spec)
        # A device proposer is built in the worker; the engine only needs the host ones.
        self.proposer = None if self.on_device else make_proposer(spec)
        self.stats = SpecDecodeStats()
        num_params, weight_bytes = model_config.num_params, profile.weight_bytes_per_step
        kv_per_token, bandwidth, peak = profile.kv_bytes_per_token, profile.read_bandwidth, profile.gemm_flops
        self.context = 512  # keys per sequence assumed by the verify ratio; updated from the batch

        self.is_tree = bool(getattr(spec, "tree_topk", None))

        @functools.lru_cache(maxsize=1024)
        def bound_ratio(batch: int, rows: int, context: int) -> float:
            return costmodel.verify_cost_ratio(num_params, weight_bytes, context * kv_per_token, batch, bandwidth,
                                               peak, rows)

        def verify_ratio(batch: int, gamma: int) -> float:
            # A tree's verify pass scores tree_budget drafts per request whatever depth the policy prices. The
            # context is rounded up to 16 keys so that the bound (~27 us of Python) is computed once per 16 steps,
            # not ~4 times a step: the policy runs every step, drafting or not.
            rows = spec.tree_budget if self.is_tree and gamma > 0 else gamma
            return bound_ratio(batch, rows, -(-self.context // 16) * 16)

        # The starting estimate of c (a draft step over a target step), until the engine has timed both.
        draft_cost = 0.0
        if spec.method == "draft_model" and spec.num_layers is not None:
            draft_cost = spec.num_layers / model_config.num_hidden_layers
        elif spec.method == "draft_model":  # a separate draft: its weight bytes over the target's (decode reads)
            draft_cost = (profile.draft_weight_bytes / weight_bytes if profile.draft_weight_bytes is not None
                          else 0.5)
        elif spec.method in ("eagle", "medusa"):  # a learned head: one layer (EAGLE) and the LM head per draft
            mc = model_config
            lm_head = mc.vocab_size * mc.hidden_size
            layer = max(num_params - lm_head * (1 if mc.tie_word_embeddings else 2), 0) / mc.num_hidden_layers
            draft_cost = ((layer if spec.method == "eagle" else mc.hidden_size ** 2) + lm_head) / num_params
        if spec.method in ("eagle", "medusa"):
            what = f"{spec.method} head {spec.model or '(bundled)'}"
        elif spec.method == "draft_model":
            what = f"draft model {spec.model or '(the target)'}" + (
                f", {spec.num_layers} layers" if spec.num_layers is not None else "") + (
                f", {spec.quantization}" if spec.quantization else "")
        else:
            what = spec.method
        shape = (f"tree depth {spec.num_speculative_tokens}, top-{spec.tree_topk}, {spec.tree_budget} nodes"
                 if self.is_tree else f"chain, gamma_max {spec.num_speculative_tokens}")
        # The start-up line's part (``LLMEngine.kv_cache_summary``, which `generate` and `serve` print).
        self.summary = f"speculative decoding: {what}; {shape}; {'adaptive' if spec.adaptive else 'fixed'} gamma"
        logger.info("%s; verify ratio from %.1f GB/s and %.2f TFLOP/s (%s, measured)", self.summary,
                    bandwidth / 1e9, peak / 1e12, profile.dtype)
        self.policy = SpecPolicy(spec.num_speculative_tokens, spec.adaptive, verify_ratio, draft_cost, tree=self.is_tree)
        self.refill: tuple[int, int] | None = None  # (batch, gamma) of a drafting step the next async step follows

    def gamma(self, num_drafts: int) -> int:
        """The chain length the policy prices for ``num_drafts`` drafts: a tree of N nodes as its depth bound
        (its acceptance is at most that deep), so the policy's gamma and alpha stay a chain's."""
        return min(num_drafts, self.spec_config.num_speculative_tokens) if self.is_tree else num_drafts

    # ------------------------------------------------------------------------------ before the step

    @staticmethod
    def may_speculate(seq: Any) -> bool:
        """Requests with penalties (which depend on every earlier token) or still below min_tokens (whose
        stop-token ban lifts mid-run) decode without drafts."""
        p = seq.sampling_params
        return (p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
                and seq.num_output_tokens >= p.min_tokens)

    def drafting_due(self, running: list[Any], num_waiting: int) -> bool:
        """Whether this step proposes drafts, and so runs synchronously (``SpecPolicy.drafting_due``). Seeded
        requests follow the policy like any other: their draws are keyed by position (``keyed_seed``), so their
        tokens do not depend on which steps drafted."""
        decoding, prefill = [], num_waiting > 0  # one pass over the batch (every step)
        for s in running:
            if s.is_prefill:
                prefill = True
            else:
                decoding.append(s.seq_id)
        return self.policy.drafting_due(decoding, prefill)

    def propose(self, running: list[Any], num_waiting: int) -> None:
        """Before scheduling: choose gamma for the decoding requests (the policy) and fill their drafts. Every
        decoding request counts in the policy's batch: one that may not speculate (penalties, below min_tokens,
        no room left) with a cap of 0, since it waits for the longer verify step too.

        A host proposer's drafts are real ids; a device proposer's are placeholders (zeros) whose count is what
        the scheduler and ``add_to_step`` use: the worker drafts them (``StepInput.num_draft_tokens``)."""
        spec, policy = self.spec_config, self.policy
        for seq in running:
            seq.spec_token_ids = []
        # See SpecPolicy.drafting_due: with the adaptive policy a step that carries prefill work does not draft.
        if policy.adaptive and (num_waiting > 0 or any(s.is_prefill for s in running)):
            return
        cands, caps, drafts = [], [], []
        for seq in running:
            if seq.num_uncomputed_tokens != 1:
                continue
            p = seq.sampling_params
            room = self.max_model_len - seq.num_tokens - 1
            if p.max_tokens is not None:
                room = min(room, p.max_tokens - seq.num_output_tokens - 1)
            k = min(spec.num_speculative_tokens, room) if self.may_speculate(seq) else 0
            if k > 0 and getattr(spec, "tree_topk", None):
                # A tree: tree_budget nodes in the KV slots (room to max_model_len), at most k deep (a tree of
                # fewer nodes than the depth is no deeper than its node count).
                slots = self.max_model_len - seq.num_tokens - 1
                k = min(spec.tree_budget, slots) if k == spec.num_speculative_tokens else min(k, slots)
            if k <= 0:
                d = []
            elif self.proposer is not None:
                d = self.proposer.propose(seq.token_ids, k)
            else:
                d = [0] * k
            cands.append(seq)
            caps.append(self.gamma(len(d)))
            drafts.append(d)
        if not cands or max(caps) == 0:
            if cands:  # nothing to draft (no n-gram match): not a policy decision, not counted as off
                policy.no_drafts([s.seq_id for s in cands])
            return
        self.context = max(1, sum(s.num_tokens for s in cands) // len(cands))
        gamma = policy.choose([s.seq_id for s in cands], caps)
        self.stats.gamma = gamma
        if gamma == 0:
            self.stats.num_steps_off += 1
        for seq, d in zip(cands, drafts, strict=True):
            seq.spec_token_ids = d if self.is_tree and gamma > 0 else d[:gamma]

    def skip(self, running: list[Any]) -> None:
        """A step run without drafts (async): clear any drafts a sequence kept from a drafting step that did
        not schedule it, since an async step must carry none; counts toward a probe while the policy is off."""
        decoding = False
        for seq in running:
            seq.spec_token_ids = []
            decoding = decoding or not seq.is_prefill
        if decoding and self.policy.skip():
            self.stats.num_steps_off += 1

    def add_to_step(self, step: StepInput, seq_id: int, drafts: list[int]) -> None:
        """A scheduled chunk's drafts into the step: real ids, or the count the worker's proposer drafts."""
        if self.on_device:
            step.num_draft_tokens[seq_id] = len(drafts)
        else:
            step.spec_token_ids[seq_id] = list(drafts)

    # ------------------------------------------------------------------------------ after the step

    def record(self, spec_seqs: dict[int, int], result: StepOutput) -> None:
        """Acceptance counters and the policy's estimates (alpha per request, the draft cost c)."""
        policy = self.policy
        self.stats.num_steps_on += 1
        spec_seqs = {sid: self.gamma(k) for sid, k in spec_seqs.items()}
        for sid, k in spec_seqs.items():
            a = result.num_accepted.get(sid, 0)
            self.stats.record(k, a)
            policy.record(sid, k, a)
        gamma = max(spec_seqs.values())
        verify_s = max(result.duration_s - result.draft_duration_s, 1e-9)
        self.stats.draft_seconds += result.draft_duration_s
        self.stats.verify_seconds += verify_s
        if result.draft_duration_s > 0:  # the n-gram proposer's host time is inside the step's wall time
            # Steady: the first pass read no more than a drafting step leaves behind (1 + the accepted drafts).
            steady = result.draft_catch_up_rows <= self.spec_config.num_speculative_tokens + 1
            policy.record_cost(result.draft_duration_s / gamma, len(result.seq_ids), verify_s, steady)

    def record_step(self, batch: int, spec_seqs: dict[int, int], wall_t0: float, result: StepOutput,
                    mode: str) -> None:
        """A steady-state decode-only step's whole wall time since ``wall_t0`` (the proposer's and the host's
        work, and the processing of its tokens: a verify pass emits several per request, each detokenized and
        checked for stops, on a host-bound model a large part of a step), the draft model's time excluded (it
        is c). A drafting step (``mode`` "draft") that drafted leaves ``refill`` for the async step after it."""
        gamma = self.gamma(max(spec_seqs.values(), default=0))
        self.policy.record_step(batch, gamma, time.perf_counter() - wall_t0 - result.draft_duration_s)
        if gamma > 0 and mode == "draft":
            self.refill = (batch, gamma)

    def record_refill(self, refill: tuple[int, int], seconds: float) -> None:
        """The first async step after a drafting step: its host work (scheduling, inputs, launch) hides behind
        no step in flight. A cost of the drafting step, charged to its verify timing."""
        self.policy.record_refill(*refill, seconds)

    def forget(self, seq_id: int) -> None:
        self.policy.forget(seq_id)
