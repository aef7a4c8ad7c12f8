"""Per-request sampling parameters, validated on construction (vLLM-compatible names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

_GREEDY_EPS = 1e-5


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to sample one request.

    Attributes follow vLLM's ``SamplingParams``:
        n: number of independent samples for the prompt (>= 1).
        temperature: >= 0; 0 means greedy.
        top_p: in (0, 1]; 1 disables.
        top_k: -1 (or 0) disables, else >= 1.
        min_p: in [0, 1]; 0 disables.
        repetition_penalty: > 0 (1 disables); CTRL-style, divides positive logits of seen tokens.
        presence_penalty, frequency_penalty: in [-2, 2] (OpenAI semantics, over generated tokens).
        seed: per-request seed; the same seed gives the same tokens whatever else is in the batch.
        max_tokens: >= 1 new tokens (None: until the context limit).
        min_tokens: >= 0; EOS and stop token ids are suppressed before this many tokens.
        stop: stop strings; the stop string is not included in the output text.
        stop_token_ids: extra token ids that end the request.
        ignore_eos: keep generating past EOS.
        logprobs: None, or the number (>= 0) of top alternatives to return with each sampled token.
        prompt_logprobs: not supported yet (must be None).
        include_stop_str_in_output: keep the matched stop string in the text.
        skip_special_tokens: drop special tokens from the text.

    Raises:
        ValueError: any value outside its range; the message names the field, the value and the range.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Set by the engine, not the user: every EOS id of the model (a config may list several).
    _all_stop_token_ids: set[int] = field(default_factory=set, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            if not isinstance(self.stop, (list, tuple)):
                raise ValueError(
                    f"stop must be a string or a list of strings, got {self.stop!r} of type {type(self.stop).__name__}"
                )
            self.stop = list(self.stop)
        for s in self.stop:
            if not isinstance(s, str):
                raise ValueError(f"stop must contain only strings, got {s!r} of type {type(s).__name__}")
            if s == "":
                raise ValueError("stop strings must be non-empty, got ''")
        if self.stop_token_ids is None:
            self.stop_token_ids = []
        else:
            if not isinstance(self.stop_token_ids, (list, tuple)):
                raise ValueError(
                    f"stop_token_ids must be a list of ints, got {self.stop_token_ids!r} of type "
                    f"{type(self.stop_token_ids).__name__}"
                )
            self.stop_token_ids = list(self.stop_token_ids)
            for t in self.stop_token_ids:
                if not isinstance(t, int) or isinstance(t, bool) or t < 0:
                    raise ValueError(f"stop_token_ids must contain non-negative ints, got {t!r}")
        self._verify()

    def _verify(self) -> None:
        def bad(name: str, value: object, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {value!r}")

        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r} of type {type(value).__name__}")
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}")
        for name in ("max_tokens", "logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer or None, got {value!r} of type {type(value).__name__}")
        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, ">= 1")
        if not 0.0 <= self.temperature < float("inf"):  # also rejects NaN
            raise bad("temperature", self.temperature, "finite and >= 0")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise bad("top_k", self.top_k, "-1 (disabled) or >= 1")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not self.repetition_penalty > 0.0:
            raise bad("repetition_penalty", self.repetition_penalty, "> 0")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if self.max_tokens is not None and (not isinstance(self.max_tokens, int) or self.max_tokens < 1):
            raise bad("max_tokens", self.max_tokens, ">= 1")
        if self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, ">= 0")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise bad("logprobs", self.logprobs, "None or in [0, 20]")
        if self.prompt_logprobs is not None:
            raise ValueError(f"prompt_logprobs is not supported yet, got {self.prompt_logprobs!r}; use None")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "an int or None")

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < _GREEDY_EPS:
            return SamplingType.GREEDY
        return SamplingType.RANDOM_SEED if self.seed is not None else SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.sampling_type == SamplingType.GREEDY

    def clone(self) -> SamplingParams:
        import copy

        return copy.deepcopy(self)
