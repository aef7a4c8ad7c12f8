"""``POST /v1/completions``: prompt normalization, legacy logprobs, JSON and SSE responses.

Choices are indexed ``prompt_index * n + sample_index``. Every prompt of a list is validated before the
first is queued, so a bad prompt in a list queues nothing.
"""

from __future__ import annotations

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
_COMPLETION_NAMES = {"max_tokens": "max_tokens", "logprobs": "logprobs"}


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                        start_offset: int) -> P.CompletionLogprobs:
    """Legacy logprobs: per token its string, logprob, top-k (plus the sampled one) and character offset."""
    out = P.CompletionLogprobs()
    offset = start_offset
    for tid, pos in zip(token_ids, entries, strict=False):
        lp = pos[tid]
        token = token_str(lp, tid)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        top = {token_str(e, t): e.logprob for t, e in ranked(pos, k)}
        top.setdefault(token, lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


async def create_completion(serving: OpenAIServing, req: P.CompletionRequest, raw: Request) -> Response:
    """Answer one completions request: JSON, or SSE when ``stream``. Raises APIError on bad input."""
    arrival = time.monotonic()
    model = serving.check_model(req.model)
    serving.common_checks(req)
    if req.best_of is not None and req.best_of != req.n:
        raise bad_request(f"best_of must equal n ({req.n}) or be null, got {req.best_of}", param="best_of")
    if req.suffix:
        raise bad_request("suffix is not supported; send null", param="suffix")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_LOGPROBS}], got {req.logprobs}", param="logprobs")
    if req.echo and req.logprobs is not None:
        raise bad_request("echo with logprobs needs prompt logprobs, which this server does not compute; "
                          "send echo or logprobs, not both", param="echo")
    # Normalize prompt: a string, token ids, or a list of either.
    prompt = req.prompt
    items: list[str | list[int]]
    if isinstance(prompt, str):
        items = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [list(prompt)]  # type: ignore[arg-type]
    else:
        items = list(prompt)  # type: ignore[arg-type]
    if not items:
        raise bad_request("prompt must be a non-empty string, token-id list, or list of them; got []",
                          param="prompt")
    prompt_ids: list[list[int]] = []
    prompt_texts: list[str] = []
    for item in items:
        if isinstance(item, str):
            if item == "":
                raise bad_request("prompt is empty; it must contain at least 1 token", param="prompt")
            ids = serving.tokenize(item)
            text = item
        else:
            if not item:
                raise bad_request("prompt token-id list is empty; it must contain at least 1 token",
                                  param="prompt")
            bad = [t for t in item if not 0 <= t < serving.vocab_size]
            if bad:
                raise bad_request(f"prompt token id {bad[0]} is out of range [0, {serving.vocab_size})",
                                  param="prompt")
            ids = list(item)
            text = serving.decode(ids) if req.echo else ""
        prompt_ids.append(ids)
        prompt_texts.append(text)
    # Validate everything before the first add, so a bad prompt in a list queues nothing.
    params_list = [
        serving.sampling_params(req, serving.check_context(len(ids), req.max_tokens, "prompt", "max_tokens"),
                                req.logprobs, _COMPLETION_NAMES)
        for ids in prompt_ids
    ]
    request_id = P.random_id("cmpl")
    streams = await serving.add_all(request_id, prompt_ids, params_list, arrival)
    trackers = [serving.metrics.tracker() for _ in streams]
    n = req.n
    num_prompt_tokens = sum(len(ids) for ids in prompt_ids)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = P.now_s()

        async def events() -> AsyncIterator[str]:
            finished: set[int] = set()
            echoed: set[int] = set()
            offsets: dict[int, int] = {}
            finals: dict[int, RequestOutput] = {}
            try:
                async for i, out in serving.merged(raw, streams, trackers):
                    finals[i] = out
                    for c in out.outputs:
                        idx = i * n + c.index
                        text = c.text_delta
                        if req.echo and idx not in echoed:
                            echoed.add(idx)
                            text = prompt_texts[i] + text
                        new_ids, new_lps = new_logprobs(c)
                        finish = c.finish_reason if c.finished and idx not in finished else None
                        if not text and finish is None and not new_ids:
                            continue
                        if finish is not None:
                            finished.add(idx)
                        lps = None
                        if req.logprobs is not None:
                            lps = completion_logprobs(new_ids, new_lps, req.logprobs, offsets.get(idx, 0))
                            offsets[idx] = offsets.get(idx, 0) + sum(len(t) for t in lps.tokens)
                        chunk = P.CompletionStreamResponse(
                            id=request_id, created=created, model=model,
                            choices=[P.CompletionChoice(index=idx, text=text, logprobs=lps, finish_reason=finish,
                                                        stop_reason=c.stop_reason if finish else None)])
                        yield sse(chunk)
                if len(finals) < len(streams) or not all(o.finished for o in finals.values()):
                    return  # client disconnected: nothing more to send
                if include_usage:
                    completion_tokens = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
                    usage = P.UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                                        total_tokens=num_prompt_tokens + completion_tokens)
                    yield sse(P.CompletionStreamResponse(id=request_id, created=created, model=model,
                                                         choices=[], usage=usage))
                yield "data: [DONE]\n\n"
            except Exception as e:  # engine failure mid-stream: report it in-band, then end
                logger.exception("stream %s failed", request_id)
                yield sse(P.ErrorResponse(error=P.ErrorInfo(message=str(e), type="server_error")))
                yield "data: [DONE]\n\n"

        return streaming_response(serving, events(), streams, trackers)

    finals = await serving.collect(raw, streams, trackers)
    if finals is None:
        return Response(status_code=499)  # client closed the connection; nobody reads this
    choices = []
    completion_tokens = 0
    for i, ro in enumerate(finals):
        for c in ro.outputs:
            completion_tokens += len(c.token_ids)
            prefix = prompt_texts[i] if req.echo else ""
            lps = (completion_logprobs(c.token_ids, c.logprobs or [], req.logprobs, len(prefix))
                   if req.logprobs is not None else None)
            choices.append(P.CompletionChoice(index=i * n + c.index, text=prefix + c.text, logprobs=lps,
                                              finish_reason=c.finish_reason, stop_reason=c.stop_reason))
    choices.sort(key=lambda ch: ch.index)
    usage = P.UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                        total_tokens=num_prompt_tokens + completion_tokens)
    return JSONResponse(P.CompletionResponse(id=request_id, model=model, choices=choices, usage=usage).model_dump())
