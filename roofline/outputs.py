"""What the engine returns per request (vLLM-compatible names)."""

from __future__ import annotations

from dataclasses import dataclass, field

from roofline.engine.sequence import Logprob


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    text_delta: str = ""  # text added since the previous output of this request (streaming)
    num_new_tokens: int = 0  # tokens added since the previous output

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Monotonic timestamps (seconds) and derived latencies of one request."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)

    @property
    def ttft(self) -> float | None:
        """Time to first token (s): arrival -> first sampled token."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        """Time per output token (s) after the first: (last - first) / (n - 1)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled_time is None else self.first_scheduled_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    error: str | None = None  # set when the request was rejected (no outputs then)
    # With SamplingParams.prompt_logprobs: one entry per prompt token, the first None (nothing predicts it),
    # each {token id: Logprob} with the actual prompt token and the top-k (vLLM's layout). Complete once any
    # sample has a token; a token the worker did not compute (a prefix-cache hit) is None too.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
