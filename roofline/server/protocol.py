"""OpenAI API shapes (pydantic v2): requests, responses, stream chunks and errors.

Field names, defaults and nesting follow the OpenAI API reference (Completions, Chat Completions,
Models). vLLM-style extensions (``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``,
``ignore_eos``, ``stop_token_ids``...) are accepted beside the standard fields. Unknown fields are
ignored. Only types are checked here; value ranges are checked where the request becomes a
``SamplingParams`` (``serving.py``), so every range error names the field and its allowed range.
"""

from __future__ import annotations

import time
import typing
import uuid
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationInfo, field_validator, model_validator


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


# Fields that vLLM's or OpenAI's request protocol defines and this server does not implement, each with the
# values that mean "not used" (vLLM's or OpenAI's default). Any other value is answered with a 400 naming the
# field (unsupported_fields), so that a client is never served unconstrained text in silence. Fields that
# neither defines are ignored, as OpenAI does. Sources: vLLM entrypoints/openai/protocol.py (CompletionRequest,
# ChatCompletionRequest) and the OpenAI API reference (completions, chat completions).
_UNSUPPORTED_COMMON: dict[str, tuple[Any, ...]] = {
    # vLLM: structured output, the older guided_* fields and the newer structured_outputs.
    "guided_json": (None,), "guided_regex": (None,), "guided_choice": (None,), "guided_grammar": (None,),
    "guided_whitespace_pattern": (None,), "structural_tag": (None,), "structured_outputs": (None,),
    # vLLM: sampling and decoding extensions.
    "use_beam_search": (None, False), "length_penalty": (None, 1.0), "allowed_token_ids": (None,),
    "bad_words": (None, []), "truncate_prompt_tokens": (None,), "logits_processors": (None,),
    "spaces_between_special_tokens": (None, True), "return_tokens_as_token_ids": (None, False),
    "return_token_ids": (None, False), "priority": (None, 0), "cache_salt": (None,),
    "kv_transfer_params": (None,), "vllm_xargs": (None,), "mm_processor_kwargs": (None,),
    "logprobs_mode": (None,),
}
_UNSUPPORTED_COMPLETION: dict[str, tuple[Any, ...]] = {
    **_UNSUPPORTED_COMMON, "response_format": (None, {"type": "text"}), "prompt_embeds": (None,),
    "add_special_tokens": (None, True),
}
_UNSUPPORTED_CHAT: dict[str, tuple[Any, ...]] = {
    **_UNSUPPORTED_COMMON,
    # OpenAI chat fields.
    "audio": (None,), "functions": (None, []), "function_call": (None, "none"), "modalities": (None, ["text"]),
    "prediction": (None,), "reasoning_effort": (None,), "web_search_options": (None,), "verbosity": (None,),
    "tool_choice": (None, "none", "auto"), "parallel_tool_calls": (None, True, False), "store": (None, False),
    # vLLM chat extensions.
    "echo": (None, False), "continue_final_message": (None, False), "add_special_tokens": (None, False),
    "documents": (None,), "chat_template": (None,), "chat_template_kwargs": (None, {}), "prompt_logprobs": (None,),
}


def _same(value: Any, unused: Any) -> bool:
    """JSON equality: ``true`` is not ``1`` here (Python's ``True == 1`` is)."""
    return value == unused and isinstance(value, bool) == isinstance(unused, bool)


def unsupported_fields(req: BaseModel, table: dict[str, tuple[Any, ...]]) -> list[str]:
    """The request's fields from ``table`` (vLLM/OpenAI fields we do not implement) set to a used value."""
    extra = req.model_extra or {}
    return [name for name, unused in table.items()
            if name in extra and not any(_same(extra[name], u) for u in unused)]


def _has_lone_surrogate(value: Any) -> bool:
    """Whether a JSON string in ``value`` (nested lists and objects included) holds a lone UTF-16 surrogate, which
    JSON allows (``"\\ud800"``) but no tokenizer can encode."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, list):
        return any(_has_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(_has_lone_surrogate(v) for v in value.values())
    return False


class _SamplingFields(BaseModel):
    """Fields shared by both endpoints (OpenAI names, then vLLM-style extensions).

    Unknown fields are kept in ``model_extra``: the ones vLLM or OpenAI define are refused by
    ``unsupported_fields``; the rest are ignored.
    """

    model_config = ConfigDict(extra="allow")
    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = {}

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

    @field_validator("*", mode="before")
    @classmethod
    def _json_types_as_written(cls, value: Any, info: ValidationInfo) -> Any:
        """No lax coercion between JSON booleans and numbers or strings: ``"temperature": true`` or
        ``"logprobs": "yes"`` is a 400 naming the field, not 1.0 or True (pydantic's lax mode takes both)."""
        ann = cls.model_fields[info.field_name].annotation
        kinds = set(typing.get_args(ann)) or {ann}
        if isinstance(value, bool) and bool not in kinds and kinds & {int, float}:
            raise ValueError("must be a number, not a JSON boolean")
        if kinds <= {bool, type(None)} and bool in kinds and value is not None and not isinstance(value, bool):
            raise ValueError("must be true or false")
        if isinstance(value, str) and str not in kinds and kinds & {int, float}:
            raise ValueError("must be a number, not a JSON string")
        if _has_lone_surrogate(value):
            raise ValueError("contains a lone UTF-16 surrogate (\\ud800-\\udfff): not valid Unicode text")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> _SamplingFields:
        """``stream_options`` without ``"stream": true`` is refused, as vLLM does (OpenAI ignores nothing here)."""
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed with \"stream\": true")
        return self


# ---------------------------------------------------------------------------------------------- completions


class CompletionRequest(_SamplingFields):
    """POST /v1/completions. ``prompt``: a string, token ids, or a list of either (one choice set each).

    ``echo`` with ``logprobs`` returns logprobs for the prompt tokens too (the first null), and ``echo`` with
    ``max_tokens: 0`` returns the prompt alone (the scoring request of lm-eval-harness). ``prompt_logprobs``
    (vLLM extension) returns each choice's ``prompt_logprobs`` in vLLM's layout.
    """

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]  # strict: JSON true is not token id 1
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # extension (vLLM)
    best_of: int | None = None
    suffix: str | None = None

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = _UNSUPPORTED_COMPLETION


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

    UNSUPPORTED: ClassVar[dict[str, tuple[Any, ...]]] = _UNSUPPORTED_CHAT


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
