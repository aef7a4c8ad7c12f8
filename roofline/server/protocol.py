"""OpenAI API shapes (pydantic v2): requests, responses, stream chunks and errors.

Field names, defaults and nesting follow the OpenAI API reference (Completions, Chat Completions,
Models). vLLM-style extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``...) are accepted beside the standard fields. Unknown fields are
ignored. Only types are checked here; value ranges are checked where the request becomes a
``SamplingParams`` (``serving.py``), so every range error names the field and its allowed range.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


def random_id(prefix: str) -> str:
    """``prefix-<32 hex digits>`` (e.g. ``cmpl-...``, ``chatcmpl-...``)."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    """Unix time in whole seconds (the ``created`` field)."""
    return int(time.time())


# ---------------------------------------------------------------------------------------------- errors


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """``{"error": {"message", "type", "param", "code"}}``, the OpenAI error body."""

    error: ErrorInfo


# ---------------------------------------------------------------------------------------------- shared


class StreamOptions(BaseModel):
    include_usage: bool = False


class UsageInfo(BaseModel):
    """Token counts: prompt tokens once per prompt, completion tokens summed over all choices."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (OpenAI names, then vLLM-style extensions)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions (vLLM names).
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False


# ---------------------------------------------------------------------------------------------- completions


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, token ids, or a list of either (one choice set each).

    ``echo`` with ``logprobs`` returns logprobs for the prompt tokens too (the first null), and ``echo`` with
    ``max_tokens: 0`` returns the prompt alone (the scoring request of lm-eval-harness). ``prompt_logprobs``
    (vLLM extension) returns each choice's ``prompt_logprobs`` in vLLM's layout.
    """

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # extension (vLLM)
    best_of: int | None = None
    suffix: str | None = None


class CompletionLogprobs(BaseModel):
    """Legacy logprobs: parallel lists over the returned tokens; ``text_offset`` in characters."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token of a ``prompt_logprobs`` entry (vLLM's ``Logprob``): rank 1 is the most likely token."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def _is_none(value: Any) -> bool:
    return value is None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None  # extension: the stop string or token id that matched
    # Extension (vLLM), only when the request sets prompt_logprobs: one entry per prompt token, the first
    # null, each {token id: PromptLogprob} with the actual prompt token and the top prompt_logprobs.
    prompt_logprobs: list[dict[int, PromptLogprob] | None] | None = Field(default=None, exclude_if=_is_none)


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class CompletionStreamResponse(CompletionResponse):
    """A streamed completions chunk: OpenAI gives it the same shape as the whole response."""


# ---------------------------------------------------------------------------------------------- chat


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingFields):
    """POST /v1/chat/completions. ``max_completion_tokens`` wins over the deprecated ``max_tokens``."""

    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True  # extension


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None


class ChatCompletionChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionChoice]
    usage: UsageInfo


class DeltaMessage(BaseModel):
    """A stream delta; absent fields are left out (the last chunk's delta is ``{}``)."""

    role: Literal["assistant"] | None = Field(default=None, exclude_if=_is_none)
    content: str | None = Field(default=None, exclude_if=_is_none)


class ChatCompletionStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: Literal["stop", "length", "abort"] | None = None


class ChatCompletionStreamResponse(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = None


# ---------------------------------------------------------------------------------------------- models


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "roofline"
    max_model_len: int | None = None  # extension: context length in tokens


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
