"""Speculative-decoding counters (vLLM's ``spec_decode`` metrics): cumulative, diffed by callers."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecDecodeStats:
    """``num_drafts``: verify passes (one per speculating request and step); ``num_draft_tokens``: draft
    positions verified, the chain's length per pass (a token tree counts its depth, the most it can accept,
    not its nodes); ``num_accepted_tokens``: drafts accepted; ``num_emitted_tokens``: tokens the passes
    produced (accepted + one bonus or correction each, before stop truncation); ``accepted_per_position[j]``:
    passes whose draft j + 1 was accepted; ``drafted_per_position[j]``: passes that drafted a token j + 1;
    ``gamma``: the policy's latest choice. ``num_steps_on`` + ``num_steps_off`` can be fewer than the decode
    steps: a step where no decoding request had a draft (no n-gram match) or room to speculate (one token left
    before ``max_tokens``, so every request's last decode step) counts as neither. ``draft_seconds`` and
    ``verify_seconds``: the worker's wall time of the speculating steps, split into the proposer's call (host
    wall time; a proposer that ends with its drafts on the host, as the EAGLE tree does, includes its device
    work) and the rest of the step (the target's verify pass, rejection sampling). The n-gram proposer runs in
    the scheduler before the step, so its time is in neither."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_emitted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    drafted_per_position: list[int] = field(default_factory=list)
    gamma: int = 0
    num_steps_on: int = 0  # engine steps in which at least one request speculated
    num_steps_off: int = 0  # steps with decoding requests that may speculate, where gamma was 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0

    def record(self, num_draft: int, num_accepted: int) -> None:
        if not 0 <= num_accepted <= num_draft:
            raise ValueError(f"accepted {num_accepted} of {num_draft} drafts")
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        self.num_emitted_tokens += num_accepted + 1
        while len(self.drafted_per_position) < num_draft:
            self.drafted_per_position.append(0)
            self.accepted_per_position.append(0)
        for j in range(num_draft):
            self.drafted_per_position[j] += 1
            if j < num_accepted:
                self.accepted_per_position[j] += 1

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted drafted tokens / drafted tokens, in [0, 1] (None before any draft)."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens emitted per verify pass (1 + accepted drafts), in [1, gamma_max + 1]."""
        return self.num_emitted_tokens / self.num_drafts if self.num_drafts else None

    def as_dict_raw(self) -> dict:
        """The counters alone (``SpecDecodeStats(**as_dict_raw())`` is a copy)."""
        return dict(num_drafts=self.num_drafts, num_draft_tokens=self.num_draft_tokens,
                    num_accepted_tokens=self.num_accepted_tokens, num_emitted_tokens=self.num_emitted_tokens,
                    accepted_per_position=list(self.accepted_per_position),
                    drafted_per_position=list(self.drafted_per_position), gamma=self.gamma,
                    num_steps_on=self.num_steps_on, num_steps_off=self.num_steps_off,
                    draft_seconds=self.draft_seconds, verify_seconds=self.verify_seconds)

    @property
    def draft_ms_per_step(self) -> float | None:
        """Mean proposer time of a speculating step, in ms (None before any)."""
        return 1e3 * self.draft_seconds / self.num_steps_on if self.num_steps_on else None

    @property
    def verify_ms_per_step(self) -> float | None:
        """Mean rest of a speculating step (the verify pass and its host work), in ms (None before any)."""
        return 1e3 * self.verify_seconds / self.num_steps_on if self.num_steps_on else None

    def as_dict(self) -> dict:
        """The counters and the derived rates."""
        return dict(self.as_dict_raw(), acceptance_rate=self.acceptance_rate,
                    mean_acceptance_length=self.mean_acceptance_length, draft_ms_per_step=self.draft_ms_per_step,
                    verify_ms_per_step=self.verify_ms_per_step)

    def copy(self) -> SpecDecodeStats:
        return SpecDecodeStats(**self.as_dict_raw())

    def since(self, before: SpecDecodeStats) -> SpecDecodeStats:
        """The counters accumulated after ``before`` (a ``copy()`` taken earlier)."""
        def sub(a: list[int], b: list[int]) -> list[int]:
            return [x - (b[i] if i < len(b) else 0) for i, x in enumerate(a)]
        return SpecDecodeStats(
            self.num_drafts - before.num_drafts, self.num_draft_tokens - before.num_draft_tokens,
            self.num_accepted_tokens - before.num_accepted_tokens, self.num_emitted_tokens - before.num_emitted_tokens,
            sub(self.accepted_per_position, before.accepted_per_position),
            sub(self.drafted_per_position, before.drafted_per_position), self.gamma,
            self.num_steps_on - before.num_steps_on, self.num_steps_off - before.num_steps_off,
            self.draft_seconds - before.draft_seconds, self.verify_seconds - before.verify_seconds)
