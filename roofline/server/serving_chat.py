"""``POST /v1/chat/completions``: chat-template rendering, chat logprobs, JSON and SSE responses.

Messages are rendered with the model's chat template (``developer`` is sent as ``system``; only text
content parts are accepted; a null or missing content, which OpenAI allows only beside tool calls, is a 400
naming the message). A stream starts with a ``{"role": "assistant", "content": ""}`` delta per choice, as
OpenAI sends it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from roofline.engine.sequence import Logprob
from roofline.outputs import RequestOutput
from roofline.server import protocol as P
from roofline.server.serving import (
    MAX_LOGPROBS,
    APIError,
    OpenAIServing,
    bad_request,
    new_logprobs,
    ranked,
    sse,
    streaming_response,
    token_str,
)

logger = logging.getLogger(__name__)

# SamplingParams field -> this endpoint's request field, for the param of a range error.
_CHAT_NAMES = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int) -> P.ChatLogprobs:
    """Chat logprobs: per token ``{token, logprob, bytes, top_logprobs: [k entries]}``."""
    content = []
    for tid, pos in zip(token_ids, entries, strict=False):
        lp = pos[tid]
        token = token_str(lp, tid)
        top = [P.TopLogprob(token=token_str(e, t), logprob=e.logprob, bytes=list(token_str(e, t).encode()))
               for t, e in ranked(pos, k)]
        content.append(P.ChatLogprobEntry(token=token, logprob=lp.logprob, bytes=list(token.encode()),
                                          top_logprobs=top))
    return P.ChatLogprobs(content=content)


def _render_chat(serving: OpenAIServing, req: P.ChatCompletionRequest) -> list[int]:
    """The prompt token ids of ``req.messages`` under the model's chat template."""
    if not req.messages:
        raise bad_request("messages must contain at least 1 message, got []", param="messages")
    if serving.tokenizer is None:
        raise bad_request("chat needs a tokenizer with a chat template; this model has none", param="messages")
    conversation = []
    for i, m in enumerate(req.messages):
        content = m.content
        if content is None:  # OpenAI allows it only in an assistant message with tool_calls, not supported here
            what = "has content null" if "content" in m.model_fields_set else "has no content"
            raise bad_request(f"messages[{i}] (role {m.role!r}) {what}; content must be a string or a list of "
                              f"text parts (null content is allowed only in an assistant message with tool_calls, "
                              f"which this server does not support)", param=f"messages[{i}].content")
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text":
                    raise bad_request(f"messages[{i}].content has a part of type {part.type!r}; only 'text' "
                                      f"parts are supported", param=f"messages[{i}].content")
                if part.text is None:
                    raise bad_request(f"messages[{i}].content has a 'text' part without its 'text' string",
                                      param=f"messages[{i}].content")
                texts.append(part.text)
            content = "\n".join(texts)
        role = "system" if m.role == "developer" else m.role
        conversation.append({"role": role, "content": content})
    try:
        text = serving.tokenizer.apply_chat_template(conversation, add_generation_prompt=req.add_generation_prompt,
                                                     tokenize=False)
    except Exception as e:  # jinja errors (e.g. a role the template does not know)
        raise bad_request(f"messages could not be rendered with the model's chat template: {e}",
                          param="messages") from e
    return serving.tokenize(text, add_special_tokens=False)


async def create_chat_completion(serving: OpenAIServing, req: P.ChatCompletionRequest, raw: Request) -> Response:
    """Answer one chat completions request: JSON, or SSE when ``stream``. Raises APIError on bad input."""
    arrival = time.monotonic()
    model = serving.check_model(req.model)
    serving.common_checks(req)
    if req.tools:
        raise bad_request("tools are not supported; send null", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request(f"response_format type {json.dumps(req.response_format.get('type'))} is not supported; "
                          f"only \"text\"", param="response_format")
    logprobs: int | None = None
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs needs logprobs=true", param="top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {req.top_logprobs}",
                              param="top_logprobs")
    if req.logprobs:
        logprobs = req.top_logprobs or 0
    ids = _render_chat(serving, req)
    if req.max_completion_tokens is not None and req.max_tokens is not None and req.max_tokens < 1:
        # max_completion_tokens wins, but a negative max_tokens beside it is still a mistake to name
        raise bad_request(f"max_tokens must be >= 1, got {req.max_tokens}", param="max_tokens")
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    max_tokens = serving.check_context(len(ids), requested, "messages", param)
    names = dict(_CHAT_NAMES, max_tokens=param)
    params = serving.sampling_params(req, max_tokens, logprobs, names)
    request_id = P.random_id("chatcmpl")
    streams = await serving.add_all(request_id, [ids], [params], arrival)
    trackers = [serving.metrics.tracker()]
    top_k = req.top_logprobs or 0
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = P.now_s()

        def chunk(choices: list[P.ChatCompletionStreamChoice], usage: P.UsageInfo | None = None) -> str:
            return sse(P.ChatCompletionStreamResponse(id=request_id, created=created, model=model,
                                                      choices=choices, usage=usage))

        async def events() -> AsyncIterator[str]:
            finished: set[int] = set()
            final: RequestOutput | None = None
            try:
                for j in range(req.n):  # the role comes first, with empty content (as OpenAI sends it)
                    yield chunk([P.ChatCompletionStreamChoice(
                        index=j, delta=P.DeltaMessage(role="assistant", content=""))])
                async for _, out in serving.merged(raw, streams, trackers):
                    final = out
                    for c in out.outputs:
                        new_ids, new_lps = new_logprobs(c)
                        finish = c.finish_reason if c.finished and c.index not in finished else None
                        if not c.text_delta and finish is None and not new_ids:
                            continue
                        if finish is not None:
                            finished.add(c.index)
                        lps = chat_logprobs(new_ids, new_lps, top_k) if req.logprobs else None
                        yield chunk([P.ChatCompletionStreamChoice(
                            index=c.index, delta=P.DeltaMessage(content=c.text_delta or None), logprobs=lps,
                            finish_reason=finish)])
                if final is None or not final.finished:
                    return  # client disconnected
                if include_usage:
                    completion_tokens = sum(len(c.token_ids) for c in final.outputs)
                    yield chunk([], P.UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                                                total_tokens=len(ids) + completion_tokens))
                yield "data: [DONE]\n\n"
            except Exception as e:
                logger.exception("stream %s failed", request_id)
                kind = e.type if isinstance(e, APIError) else "server_error"  # a request error, or the engine's
                yield sse(P.ErrorResponse(error=P.ErrorInfo(message=str(e), type=kind)))
                yield "data: [DONE]\n\n"

        return streaming_response(serving, events(), streams, trackers)

    finals = await serving.collect(raw, streams, trackers)
    if finals is None:
        return Response(status_code=499)
    ro = finals[0]
    choices = [
        P.ChatCompletionChoice(
            index=c.index, message=P.ChatResponseMessage(content=c.text),
            logprobs=chat_logprobs(c.token_ids, c.logprobs or [], top_k) if req.logprobs else None,
            finish_reason=c.finish_reason, stop_reason=c.stop_reason)
        for c in sorted(ro.outputs, key=lambda c: c.index)
    ]
    completion_tokens = sum(len(c.token_ids) for c in ro.outputs)
    usage = P.UsageInfo(prompt_tokens=len(ids), completion_tokens=completion_tokens,
                        total_tokens=len(ids) + completion_tokens)
    return JSONResponse(P.ChatCompletionResponse(id=request_id, model=model, choices=choices,
                                                 usage=usage).model_dump())
