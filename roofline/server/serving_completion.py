"""``POST /v1/completions``: prompt normalization, legacy logprobs, JSON and SSE responses.

Choices are indexed ``prompt_index * n + sample_index``. Every prompt of a list is validated before the
first is queued, so a bad prompt in a list queues nothing.

``echo`` with ``logprobs: k`` asks the engine for prompt logprobs (k of them, or ``prompt_logprobs`` when
set, as vLLM) and returns one legacy entry per prompt token before the completion's, the first null (nothing
predicts it). ``echo`` with ``max_tokens: 0`` is the scoring request of lm-eval-harness: as in vLLM, the
engine runs the prompt with max_tokens=1 (that token comes from the last prefill position in the same step,
so no decode step runs) and the response drops it: the text is the prompt, ``completion_tokens`` is 0 and
``finish_reason`` is "length". Without ``echo``, ``max_tokens`` must be >= 1 (vLLM refuses 0 there too).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable

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
_COMPLETION_NAMES = {"max_tokens": "max_tokens", "logprobs": "logprobs", "prompt_logprobs": "prompt_logprobs"}


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]] | list[dict[int, Logprob] | None],
                        k: int, start_offset: int, decode: Callable[[int], str] | None = None,
                        out: P.CompletionLogprobs | None = None) -> P.CompletionLogprobs:
    """Legacy logprobs: per token its string, logprob, top-k (plus the sampled one) and character offset.

    An entry that is None (the first prompt token, which nothing predicts) gives a null logprob and null
    top_logprobs; its string comes from ``decode(token_id)``. ``out``: append to these lists (prompt, then
    completion) instead of new ones.
    """
    out = P.CompletionLogprobs() if out is None else out
    offset = start_offset
    for tid, pos in zip(token_ids, entries, strict=False):
        if pos is None:
            token = decode(tid) if decode is not None else f"token_id:{tid}"
            out.tokens.append(token)
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            out.text_offset.append(offset)
            offset += len(token)
            continue
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


def vllm_prompt_logprobs(entries: list[dict[int, Logprob] | None]) -> list[dict[int, P.PromptLogprob] | None]:
    """``RequestOutput.prompt_logprobs`` as the response's ``prompt_logprobs`` (vLLM's JSON layout)."""
    return [None if e is None else
            {t: P.PromptLogprob(logprob=lp.logprob, rank=lp.rank, decoded_token=lp.decoded_token)
             for t, lp in e.items()}
            for e in entries]


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
    if req.prompt_logprobs is not None and not 0 <= req.prompt_logprobs <= MAX_LOGPROBS:
        raise bad_request(f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got {req.prompt_logprobs}",
                          param="prompt_logprobs")
    if req.max_tokens == 0 and not req.echo:
        raise bad_request("max_tokens must be >= 1 (0 only with echo: the prompt alone), got 0", param="max_tokens")
    # vLLM's rule: echo with logprobs scores the prompt with prompt_logprobs if set, else logprobs.
    prompt_logprobs = req.prompt_logprobs
    if prompt_logprobs is None and req.echo and req.logprobs is not None:
        prompt_logprobs = req.logprobs
    echo_only = req.echo and req.max_tokens == 0  # the prompt alone: the engine's one token is dropped
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
        serving.sampling_params(
            req, max(1, serving.check_context(len(ids), req.max_tokens, "prompt", "max_tokens", allow_zero=req.echo)),
            req.logprobs, _COMPLETION_NAMES, prompt_logprobs)
        for ids in prompt_ids
    ]
    request_id = P.random_id("cmpl")
    streams = await serving.add_all(request_id, prompt_ids, params_list, arrival)
    trackers = [serving.metrics.tracker() for _ in streams]
    n = req.n
    num_prompt_tokens = sum(len(ids) for ids in prompt_ids)

    def decode_one(token_id: int) -> str:
        return serving.decode([token_id])

    def echoed_logprobs(i: int, ro: RequestOutput) -> P.CompletionLogprobs:
        """Legacy logprobs of prompt ``i``'s tokens (the first null), offsets from 0."""
        entries = ro.prompt_logprobs or [None] * len(prompt_ids[i])
        return completion_logprobs(prompt_ids[i], entries, req.logprobs or 0, 0, decode_one)

    def vllm_prompt(ro: RequestOutput) -> list[dict[int, P.PromptLogprob] | None] | None:
        return vllm_prompt_logprobs(ro.prompt_logprobs or []) if req.prompt_logprobs is not None else None

    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        created = P.now_s()

        async def events() -> AsyncIterator[str]:
            finished: set[int] = set()
            started: set[int] = set()  # choices whose first chunk (echo, prompt logprobs) went out
            offsets: dict[int, int] = {}
            finals: dict[int, RequestOutput] = {}
            try:
                async for i, out in serving.merged(raw, streams, trackers):
                    finals[i] = out
                    for c in out.outputs:
                        idx = i * n + c.index
                        text = "" if echo_only else c.text_delta
                        new_ids, new_lps = ([], []) if echo_only else new_logprobs(c)
                        lps = plps = None
                        if idx not in started:
                            started.add(idx)
                            if req.echo:
                                text = prompt_texts[i] + text
                                offsets[idx] = len(prompt_texts[i])
                                if req.logprobs is not None:
                                    lps = echoed_logprobs(i, out)
                            plps = vllm_prompt(out)
                        finish = None
                        if c.finished and idx not in finished:
                            finish = "length" if echo_only else c.finish_reason
                        if not text and finish is None and not new_ids and lps is None and plps is None:
                            continue
                        if finish is not None:
                            finished.add(idx)
                        if req.logprobs is not None:
                            lps = completion_logprobs(new_ids, new_lps, req.logprobs, offsets.get(idx, 0), out=lps)
                            new_tokens = lps.tokens[len(lps.tokens) - len(new_ids):]
                            offsets[idx] = offsets.get(idx, 0) + sum(len(t) for t in new_tokens)
                        chunk = P.CompletionStreamResponse(
                            id=request_id, created=created, model=model,
                            choices=[P.CompletionChoice(
                                index=idx, text=text, logprobs=lps, finish_reason=finish,
                                stop_reason=c.stop_reason if finish and not echo_only else None,
                                prompt_logprobs=plps)])
                        yield sse(chunk)
                if len(finals) < len(streams) or not all(o.finished for o in finals.values()):
                    return  # client disconnected: nothing more to send
                if include_usage:
                    completion_tokens = 0 if echo_only else sum(
                        len(c.token_ids) for o in finals.values() for c in o.outputs)
                    usage = P.UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                                        total_tokens=num_prompt_tokens + completion_tokens)
                    yield sse(P.CompletionStreamResponse(id=request_id, created=created, model=model,
                                                         choices=[], usage=usage))
                yield "data: [DONE]\n\n"
            except Exception as e:  # engine failure mid-stream: report it in-band, then end
                logger.exception("stream %s failed", request_id)
                kind = e.type if isinstance(e, APIError) else "server_error"  # a request error, or the engine's
                yield sse(P.ErrorResponse(error=P.ErrorInfo(message=str(e), type=kind)))
                yield "data: [DONE]\n\n"

        return streaming_response(serving, events(), streams, trackers)

    finals = await serving.collect(raw, streams, trackers)
    if finals is None:
        return Response(status_code=499)  # client closed the connection; nobody reads this
    choices = []
    completion_tokens = 0
    for i, ro in enumerate(finals):
        prompt_lps = vllm_prompt(ro)
        for c in ro.outputs:
            # echo with max_tokens 0: the one token the engine sampled is not part of the answer.
            token_ids, entries, text = ([], [], "") if echo_only else (c.token_ids, c.logprobs or [], c.text)
            completion_tokens += len(token_ids)
            prefix = prompt_texts[i] if req.echo else ""
            lps = None
            if req.logprobs is not None:
                lps = completion_logprobs(token_ids, entries, req.logprobs, len(prefix),
                                          out=echoed_logprobs(i, ro) if req.echo else None)
            finish, stop = ("length", None) if echo_only else (c.finish_reason, c.stop_reason)
            choices.append(P.CompletionChoice(index=i * n + c.index, text=prefix + text, logprobs=lps,
                                              finish_reason=finish, stop_reason=stop, prompt_logprobs=prompt_lps))
    choices.sort(key=lambda ch: ch.index)
    usage = P.UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                        total_tokens=num_prompt_tokens + completion_tokens)
    return JSONResponse(P.CompletionResponse(id=request_id, model=model, choices=choices, usage=usage).model_dump())
