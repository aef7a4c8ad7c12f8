"""Per-request sampling parameters, validated on construction (vLLM-compatible names and defaults)."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

_GREEDY_EPS = 1e-5

# Ranges of what the engine can represent (why each bound is what it is):
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1  # torch int64 tensors / 64-bit torch.Generator seeds
FLOAT32_MAX = 3.4028234663852886e38  # torch.finfo(torch.float32).max: the sampler's per-row parameters are fp32
REPETITION_PENALTY_MIN = 0.01  # repetition_penalty bounds: a logit scales by at most 100, so finite stays finite
REPETITION_PENALTY_MAX = 100.0
MAX_N = 1024  # samples per prompt; the engine also caps n at max_num_seqs (all samples run in one batch)
MAX_LOGPROBS = 20  # as OpenAI's top_logprobs; verify_for_model also caps it at vocab_size


def _show(value: object) -> str:
    """``repr(value)``, except that an int too long to read (or to convert: Python caps int -> str at 4300
    digits) is shown by its size."""
    if isinstance(value, int) and value.bit_length() > 128:
        bits = value.bit_length()
        return f"an int of {bits} bits (about {'-' if value < 0 else ''}10**{int(bits * 0.30103)})"
    return repr(value)


def _fits_float32(value: float) -> bool:
    """True when ``value`` (already known finite or an int) does not overflow to inf as an fp32 tensor entry."""
    try:
        return abs(float(value)) <= FLOAT32_MAX
    except OverflowError:  # an int beyond the float64 range
        return False


class SamplingType(IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass
class SamplingParams:
    """How to sample one request.

    Attributes follow vLLM's ``SamplingParams``. Every field is range-checked here against what the engine
    can represent (int64 tensors and seeds, fp32 sampler parameters), so one request's values can never fail
    a batch step that other requests share; ``verify_for_model`` adds the checks that need the vocabulary.
        n: number of independent samples for the prompt, in [1, MAX_N = 1024] (the engine also caps it at
            ``max_num_seqs``).
        temperature: finite, in [0, FLOAT32_MAX]; 0 means greedy.
        top_p: in (0, 1]; 1 disables.
        top_k: -1 (or 0) disables, else in [1, 2**63 - 1] (and <= vocab_size, ``verify_for_model``).
        min_p: in [0, 1]; 0 disables.
        repetition_penalty: in [0.01, 100] (1 disables); CTRL-style, divides positive logits of seen tokens and
            multiplies negative ones. The bounds keep finite logits finite (a logit scales by at most 100, so any
            logit under 3.4e36 in magnitude stays under float32 max); 1e-38 used to make the row +inf, then NaN.
        presence_penalty, frequency_penalty: in [-2, 2] (OpenAI semantics, over generated tokens).
        seed: per-request seed in [-2**63, 2**63 - n]; sample i is seeded with ``seed + i``, which must fit
            torch's 64-bit generator seed without two seeds aliasing. Each token's draw is keyed by that seed
            and the token's position (``roofline.layers.sampler.keyed_seed``), so the same seed gives the same
            tokens whatever else is in the batch, and with speculative decoding on or off.
        max_tokens: None (until the context limit) or in [1, 2**63 - 1] new tokens. 0 is refused, as in
            vLLM: a request for its prompt's logprobs alone uses max_tokens=1 (the token is sampled from the
            last prefill position in the same step, so no decode step runs); the server's ``echo`` with
            ``max_tokens: 0`` does exactly that and returns the prompt only.
        min_tokens: in [0, 2**63 - 1] and <= max_tokens; EOS and stop token ids are suppressed before this
            many tokens.
        stop: stop strings; the stop string is not included in the output text.
        stop_token_ids: extra token ids that end the request, each in [0, 2**63 - 1] (and < vocab_size,
            ``verify_for_model``).
        ignore_eos: bool; keep generating past EOS.
        logprobs: None, or the number in [0, 20] (as OpenAI's ``top_logprobs``; <= vocab_size,
            ``verify_for_model``) of top alternatives to return with each sampled token.
        prompt_logprobs: None, or the number in [0, 20] (<= vocab_size, ``verify_for_model``) of top
            alternatives to return for each prompt token, as vLLM: ``RequestOutput.prompt_logprobs`` holds one
            entry per prompt token, the first None (nothing predicts it), each a {token id: Logprob} dict with
            the actual prompt token (its rank may exceed k) and the k most likely tokens. Computed in fp32 from
            the raw logits, like ``logprobs``.
        include_stop_str_in_output: bool; keep the matched stop string in the text.
        skip_special_tokens: bool; drop special tokens from the text.

    Integer fields reject bool and float; float fields reject bool and str; bool fields take only True/False.

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
                if t > INT64_MAX:
                    raise ValueError(f"stop_token_ids must contain ints in [0, 2**63 - 1], got {_show(t)}")
        self._verify()

    def _verify(self) -> None:
        def bad(name: str, value: object, allowed: str) -> ValueError:
            return ValueError(f"{name} must be {allowed}, got {_show(value)}")

        # Types first: every later comparison may assume a real number / a real int (bool is not one).
        for name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"{name} must be a number, got {value!r} of type {type(value).__name__}")
        for name in ("n", "top_k", "min_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"{name} must be an integer, got {value!r} of type {type(value).__name__}")
        for name in ("max_tokens", "logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ValueError(f"{name} must be an integer or None, got {value!r} of type {type(value).__name__}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise bad("seed", self.seed, "an int or None")
        for name in ("ignore_eos", "include_stop_str_in_output", "skip_special_tokens"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise ValueError(f"{name} must be a bool (True or False), got {value!r} of type {type(value).__name__}")

        if not 1 <= self.n <= MAX_N:
            raise bad("n", self.n, ">= 1" if self.n < 1 else f"in [1, {MAX_N}]")
        if not 0.0 <= self.temperature < float("inf"):  # also rejects NaN
            raise bad("temperature", self.temperature, "finite and >= 0")
        if not _fits_float32(self.temperature):
            raise bad("temperature", self.temperature, f"<= {FLOAT32_MAX!r} (float32 max: the sampler's dtype)")
        if not 0.0 < self.top_p <= 1.0:
            raise bad("top_p", self.top_p, "in (0, 1]")
        if self.top_k == 0:
            self.top_k = -1
        if self.top_k < -1:
            raise bad("top_k", self.top_k, "-1 or 0 (disabled), or >= 1")
        if self.top_k > INT64_MAX:
            raise bad("top_k", self.top_k, "-1 or 0 (disabled), or in [1, 2**63 - 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise bad("min_p", self.min_p, "in [0, 1]")
        if not REPETITION_PENALTY_MIN <= self.repetition_penalty <= REPETITION_PENALTY_MAX:  # also rejects NaN
            raise bad("repetition_penalty", self.repetition_penalty,
                      f"in [{REPETITION_PENALTY_MIN}, {REPETITION_PENALTY_MAX:g}] (1 disables; the bounds keep "
                      f"finite logits finite)")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise bad("presence_penalty", self.presence_penalty, "in [-2, 2]")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise bad("frequency_penalty", self.frequency_penalty, "in [-2, 2]")
        if self.max_tokens is not None:
            if self.max_tokens < 1:
                raise bad("max_tokens", self.max_tokens, ">= 1")
            if self.max_tokens > INT64_MAX:
                raise bad("max_tokens", self.max_tokens, "None or in [1, 2**63 - 1]")
        if self.min_tokens < 0:
            raise bad("min_tokens", self.min_tokens, ">= 0")
        if self.min_tokens > INT64_MAX:
            raise bad("min_tokens", self.min_tokens, "in [0, 2**63 - 1]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise bad("min_tokens", self.min_tokens, f"<= max_tokens ({self.max_tokens})")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", self.logprobs, f"None or in [0, {MAX_LOGPROBS}]")
        if self.prompt_logprobs is not None and not 0 <= self.prompt_logprobs <= MAX_LOGPROBS:
            raise bad("prompt_logprobs", self.prompt_logprobs, f"None or in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not INT64_MIN <= self.seed <= INT64_MAX - (self.n - 1):
            # Sample i is seeded with seed + i (ModelRunner._generator); keep every one in int64.
            raise bad("seed", self.seed,
                      f"None or in [-2**63, 2**63 - n] = [{INT64_MIN}, {INT64_MAX - (self.n - 1)}] for n={self.n} "
                      f"(sample i is seeded with seed + i, a 64-bit torch seed)")

    def verify_for_model(self, vocab_size: int) -> None:
        """The checks that need the model: call once per request before it is scheduled.

        Args:
            vocab_size: the model's vocabulary size (rows of the LM head); token ids are in [0, vocab_size).

        Raises:
            ValueError: any construction check (re-run: fields may have been assigned since), ``top_k`` >
                vocab_size, a ``stop_token_ids`` entry outside [0, vocab_size), or
                ``logprobs`` or ``prompt_logprobs`` > vocab_size (the top-k of the log-softmax would fail for
                the whole batch); the message names the field, the value and the range for this model.
        """
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be an integer >= 1, got {vocab_size!r}")
        # The fields are plain attributes: re-run the construction checks (microseconds) in case the caller
        # assigned one since, e.g. ``params.seed = 2**64``, which would otherwise fail a shared batch step.
        self.__post_init__()
        if self.top_k > vocab_size:
            raise ValueError(f"top_k must be -1 or 0 (disabled), or in [1, vocab_size] = [1, {vocab_size}] for this "
                             f"model, got {_show(self.top_k)}")
        for t in self.stop_token_ids or []:
            if not 0 <= t < vocab_size:
                raise ValueError(f"stop_token_ids entry {t!r} is out of range [0, {vocab_size})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and value > vocab_size:
                raise ValueError(f"{name} must be None or in [0, {min(MAX_LOGPROBS, vocab_size)}] for this model "
                                 f"(vocab_size {vocab_size}), got {value!r}")

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
