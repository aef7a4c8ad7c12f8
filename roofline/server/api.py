"""The OpenAI-compatible HTTP API (FastAPI): ``build_app(engine_args | engine, ...)``.

Endpoints: ``GET /health``, ``GET /metrics`` (Prometheus text), ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions``. ``/v1/*`` needs ``Authorization: Bearer KEY``
when an API key is set.

Errors use the OpenAI body ``{"error": {"message", "type", "param", "code"}}``:
    400  invalid_request_error  malformed JSON, wrong types (pydantic errors are mapped to 400, as vLLM
                                and OpenAI do, not FastAPI's 422), values out of range, prompt too long
                                (code ``context_length_exceeded``), too many stop strings
    401  invalid_request_error  missing or wrong API key (code ``invalid_api_key``)
    404  invalid_request_error  unknown model (code ``model_not_found``): OpenAI's and vLLM's status, so
                                the ``openai`` client raises ``NotFoundError`` as it does elsewhere
    413  invalid_request_error  body larger than ``max_body_bytes`` (code ``request_too_large``)
    503  server_error           more than ``max_waiting_requests`` waiting; ``Retry-After`` header
Every message names the field, the value and the allowed range.

Requests flow: validate and tokenize here (a private copy of the tokenizer, so the engine thread's is
never shared) -> ``AsyncLLMEngine.add_request`` -> per-request stream -> JSON or SSE. A client that
disconnects aborts its requests; the engine thread frees their KV blocks at once.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from roofline.engine.args import EngineArgs
from roofline.engine.llm_engine import LLMEngine
from roofline.engine.sequence import Logprob
from roofline.outputs import CompletionOutput, RequestOutput
from roofline.sampling_params import SamplingParams
from roofline.server import protocol as P
from roofline.server.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError, RequestStream
from roofline.server.metrics import CONTENT_TYPE, RequestTracker, ServerMetrics

logger = logging.getLogger(__name__)

MAX_LOGPROBS = 20  # the sampler's limit (SamplingParams.logprobs <= 20)
MAX_N = 128  # OpenAI's limit on n; the server also caps it at max_num_seqs


@dataclass(frozen=True)
class ServerConfig:
    """Serving limits and names (see ``roofline serve --help``).

    Attributes:
        served_model_names: names accepted in ``model``; the first is reported. None: the model's name.
        api_key: required bearer token for ``/v1/*``; None disables the check.
        max_waiting_requests: admission limit on waiting requests (503 above it); None: unlimited.
        max_body_bytes: largest request body in bytes (413 above it).
        max_stop: most stop strings per request (OpenAI allows 4).
        retry_after_s: the ``Retry-After`` value (seconds) sent with 503.
    """

    served_model_names: tuple[str, ...] | None = None
    api_key: str | None = None
    max_waiting_requests: int | None = None
    max_body_bytes: int = 1 << 20
    max_stop: int = 4
    retry_after_s: int = 1

    def __post_init__(self) -> None:
        if self.max_waiting_requests is not None and self.max_waiting_requests < 0:
            raise ValueError(f"max_waiting_requests must be >= 0 or None, got {self.max_waiting_requests}")
        if self.max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be >= 1, got {self.max_body_bytes}")
        if self.max_stop < 0:
            raise ValueError(f"max_stop must be >= 0, got {self.max_stop}")


class APIError(Exception):
    """An error answered with the OpenAI error body."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def error_json(status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    body = P.ErrorResponse(error=P.ErrorInfo(message=message, type=type, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


# ---------------------------------------------------------------------------------------------- body limit


class BodySizeLimitMiddleware:
    """Pure ASGI middleware: answer 413 to bodies over ``max_bytes``, else replay the buffered body.

    (``BaseHTTPMiddleware`` is avoided: it breaks disconnect detection of streaming responses.)
    """

    def __init__(self, app: Any, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await self._reject(scope, receive, send, int(length))
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._reject(scope, receive, send, size)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, scope: dict, receive: Any, send: Any, size: int) -> None:
        response = error_json(
            413, f"request body is {size} bytes or more, over the limit of {self.max_bytes} bytes "
                 f"(--max-request-body-bytes)", code="request_too_large")
        await response(scope, receive, send)


# ---------------------------------------------------------------------------------------------- serving


def _stop_list(stop: str | list[str] | None) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)


def _param_of(message: str, names: dict[str, str]) -> str | None:
    """The request field a SamplingParams error names (its first word), mapped to the API name."""
    first = message.split(" ", 1)[0]
    return names.get(first, first if first.isidentifier() else None)


class OpenAIServing:
    """Request handling shared by both endpoints. Lives on the event loop; never touches the engine."""

    def __init__(self, async_engine: AsyncLLMEngine, config: ServerConfig, metrics: ServerMetrics,
                 model_names: tuple[str, ...]):
        self.async_engine = async_engine
        self.config = config
        self.metrics = metrics
        self.model_names = model_names
        engine = async_engine.engine
        # A private tokenizer: HF fast tokenizers are not safe to share with the engine thread.
        self.tokenizer = copy.deepcopy(engine.tokenizer) if engine.tokenizer is not None else None
        self.max_model_len = engine.config.scheduler_config.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.max_n = min(MAX_N, engine.config.scheduler_config.max_num_seqs)

    # ------------------------------------------------------------------------------ validation

    def check_model(self, model: str | None) -> str:
        """The name to report; raises 404 for a model this server does not serve."""
        if model is None or model in self.model_names:
            return self.model_names[0]
        raise APIError(404, f"The model '{model}' does not exist; this server serves: "
                            f"{', '.join(self.model_names)}", param="model", code="model_not_found")

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer (dummy weights); send the prompt as token ids",
                              param="prompt")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                      max_tokens_param: str) -> int:
        """Check the prompt and ``max_tokens`` against ``max_model_len``; returns the max_tokens to use."""
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the {prompt_param} has "
                f"{num_prompt_tokens} tokens; it must be at most {limit - 1} tokens to leave room for one "
                f"generated token", param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            return limit - num_prompt_tokens
        if max_tokens < 1:
            raise bad_request(f"{max_tokens_param} must be >= 1, got {max_tokens}", param=max_tokens_param)
        if num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but {num_prompt_tokens + max_tokens} "
                f"were requested ({num_prompt_tokens} in the {prompt_param}, {max_tokens} for the "
                f"completion); {max_tokens_param} must be in [1, {limit - num_prompt_tokens}] for this "
                f"{prompt_param}", param=max_tokens_param, code="context_length_exceeded")
        return max_tokens

    def common_checks(self, req: P._SamplingFields) -> None:
        if not 1 <= req.n <= self.max_n:
            raise bad_request(f"n must be in [1, {self.max_n}], got {req.n}", param="n")
        stops = _stop_list(req.stop)
        if len(stops) > self.config.max_stop:
            raise bad_request(f"stop has {len(stops)} strings; at most {self.config.max_stop} are allowed",
                              param="stop")
        if any(s == "" for s in stops):
            raise bad_request("stop strings must be non-empty, got ''", param="stop")
        if req.logit_bias:
            raise bad_request("logit_bias is not supported; send null or {}", param="logit_bias")
        if req.stop_token_ids and any(not 0 <= t < self.vocab_size for t in req.stop_token_ids):
            bad = next(t for t in req.stop_token_ids if not 0 <= t < self.vocab_size)
            raise bad_request(f"stop_token_ids entry {bad} is out of range [0, {self.vocab_size})",
                              param="stop_token_ids")

    def sampling_params(self, req: P._SamplingFields, max_tokens: int, logprobs: int | None,
                        names: dict[str, str]) -> SamplingParams:
        """Build SamplingParams; a range error becomes a 400 naming the field and the allowed range."""
        try:
            return SamplingParams(
                n=req.n,
                temperature=1.0 if req.temperature is None else req.temperature,
                top_p=1.0 if req.top_p is None else req.top_p,
                top_k=-1 if req.top_k is None else req.top_k,
                min_p=0.0 if req.min_p is None else req.min_p,
                repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                presence_penalty=req.presence_penalty,
                frequency_penalty=req.frequency_penalty,
                seed=req.seed,
                max_tokens=max_tokens,
                min_tokens=req.min_tokens,
                stop=_stop_list(req.stop),
                stop_token_ids=req.stop_token_ids,
                ignore_eos=req.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=req.skip_special_tokens,
                include_stop_str_in_output=req.include_stop_str_in_output,
            )
        except ValueError as e:
            raise bad_request(str(e), param=_param_of(str(e), names)) from e

    async def add(self, request_id: str, token_ids: list[int], params: SamplingParams,
                  arrival: float) -> RequestStream:
        try:
            return await self.async_engine.add_request(request_id, token_ids, params, arrival_time=arrival,
                                                       max_waiting=self.config.max_waiting_requests)
        except EngineOverloadedError as e:
            raise APIError(503, str(e), type="server_error", code="server_overloaded",
                           headers={"Retry-After": str(self.config.retry_after_s)}) from e
        except EngineDeadError as e:
            raise APIError(503, str(e), type="server_error", code="engine_dead") from e
        except ValueError as e:
            raise bad_request(str(e), param="prompt") from e

    async def add_all(self, base_id: str, prompts: list[list[int]], params: list[SamplingParams],
                      arrival: float) -> list[RequestStream]:
        """Add one engine request per prompt; if any is refused, abort those already added."""
        streams: list[RequestStream] = []
        try:
            for i, ids in enumerate(prompts):
                rid = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.add(rid, ids, params[i], arrival))
        except BaseException:
            for s in streams:
                self.async_engine.abort(s.request_id, s)
            raise
        return streams

    # ------------------------------------------------------------------------------ running requests

    async def collect(self, raw: Request, streams: list[RequestStream],
                      trackers: list[RequestTracker]) -> list[RequestOutput] | None:
        """Wait for every stream's final output; None if the client disconnected (requests aborted)."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def drain(i: int) -> None:
            async for out in streams[i]:
                trackers[i].on_output(out)
                finals[i] = out

        watcher = asyncio.ensure_future(_wait_disconnect(raw))
        runner = asyncio.ensure_future(asyncio.gather(*(drain(i) for i in range(len(streams)))))
        try:
            await asyncio.wait({watcher, runner}, return_when=asyncio.FIRST_COMPLETED)
            if runner.done():
                runner.result()  # re-raise an engine failure
                return [f for f in finals if f is not None]
            return None  # disconnected
        finally:
            watcher.cancel()
            if not runner.done():
                runner.cancel()
            self._abort_unfinished(streams, trackers)

    def _abort_unfinished(self, streams: list[RequestStream], trackers: list[RequestTracker]) -> None:
        for s, t in zip(streams, trackers, strict=True):
            if not s.finished:
                self.async_engine.abort(s.request_id, s)
                t.on_abort()

    async def merged(self, raw: Request, streams: list[RequestStream],
                     trackers: list[RequestTracker]) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Outputs of several streams as they come, tagged with the prompt index.

        Ends early (after aborting everything unfinished) when the client disconnects or the consumer
        stops iterating.
        """
        merged_q: asyncio.Queue[Any] = asyncio.Queue()
        done_marker = object()

        async def pump(i: int) -> None:
            try:
                async for out in streams[i]:
                    await merged_q.put((i, out))
            except Exception as e:
                await merged_q.put(e)
            finally:
                await merged_q.put(done_marker)

        async def watch() -> None:
            await _wait_disconnect(raw)
            await merged_q.put(None)

        tasks = [asyncio.ensure_future(pump(i)) for i in range(len(streams))]
        tasks.append(asyncio.ensure_future(watch()))
        remaining = len(streams)
        try:
            while remaining:
                item = await merged_q.get()
                if item is None:
                    return  # client went away
                if item is done_marker:
                    remaining -= 1
                    continue
                if isinstance(item, Exception):
                    raise item
                i, out = item
                trackers[i].on_output(out)
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
            self._abort_unfinished(streams, trackers)


async def _wait_disconnect(raw: Request) -> None:
    """Return when the client disconnects (the body has been read, so only disconnects arrive)."""
    while True:
        message = await raw.receive()
        if message["type"] == "http.disconnect":
            return


def _sse(obj: Any) -> str:
    data = obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


def _token_str(lp: Logprob, token_id: int) -> str:
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def _ranked(entries: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely entries (rank 1 first)."""
    return sorted(entries.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob))[:k]


def completion_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int,
                        start_offset: int) -> P.CompletionLogprobs:
    """Legacy logprobs: per token its string, logprob, top-k (plus the sampled one) and character offset."""
    out = P.CompletionLogprobs()
    offset = start_offset
    for tid, pos in zip(token_ids, entries, strict=False):
        lp = pos[tid]
        token = _token_str(lp, tid)
        out.tokens.append(token)
        out.token_logprobs.append(lp.logprob)
        top = {_token_str(e, t): e.logprob for t, e in _ranked(pos, k)}
        top.setdefault(token, lp.logprob)
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(token)
    return out


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], k: int) -> P.ChatLogprobs:
    """Chat logprobs: per token ``{token, logprob, bytes, top_logprobs: [k entries]}``."""
    content = []
    for tid, pos in zip(token_ids, entries, strict=False):
        lp = pos[tid]
        token = _token_str(lp, tid)
        top = [P.TopLogprob(token=_token_str(e, t), logprob=e.logprob, bytes=list(_token_str(e, t).encode()))
               for t, e in _ranked(pos, k)]
        content.append(P.ChatLogprobEntry(token=token, logprob=lp.logprob, bytes=list(token.encode()),
                                          top_logprobs=top))
    return P.ChatLogprobs(content=content)


def _new_logprobs(c: CompletionOutput) -> tuple[list[int], list[dict[int, Logprob]]]:
    """Token ids and logprob entries added since the previous output of this completion."""
    if not c.num_new_tokens or c.logprobs is None:
        return [], []
    return c.token_ids[-c.num_new_tokens:], c.logprobs[-c.num_new_tokens:]


# ---------------------------------------------------------------------------------------------- endpoints


_COMPLETION_NAMES = {"max_tokens": "max_tokens", "logprobs": "logprobs"}
_CHAT_NAMES = {"max_tokens": "max_completion_tokens", "logprobs": "top_logprobs"}


async def create_completion(serving: OpenAIServing, req: P.CompletionRequest, raw: Request) -> Response:
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
                        new_ids, new_lps = _new_logprobs(c)
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
                        yield _sse(chunk)
                if len(finals) < len(streams) or not all(o.finished for o in finals.values()):
                    return  # client disconnected: nothing more to send
                if include_usage:
                    completion_tokens = sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
                    usage = P.UsageInfo(prompt_tokens=num_prompt_tokens, completion_tokens=completion_tokens,
                                        total_tokens=num_prompt_tokens + completion_tokens)
                    yield _sse(P.CompletionStreamResponse(id=request_id, created=created, model=model,
                                                          choices=[], usage=usage))
                yield "data: [DONE]\n\n"
            except Exception as e:  # engine failure mid-stream: report it in-band, then end
                logger.exception("stream %s failed", request_id)
                yield _sse(P.ErrorResponse(error=P.ErrorInfo(message=str(e), type="server_error")))
                yield "data: [DONE]\n\n"

        return _streaming_response(serving, events(), streams, trackers)

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


def _render_chat(serving: OpenAIServing, req: P.ChatCompletionRequest) -> list[int]:
    if not req.messages:
        raise bad_request("messages must contain at least 1 message, got []", param="messages")
    if serving.tokenizer is None:
        raise bad_request("chat needs a tokenizer with a chat template; this model has none", param="messages")
    conversation = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}].content has a part of type {part.type!r}; only 'text' "
                                      f"parts are supported", param=f"messages[{i}].content")
                texts.append(part.text)
            content = "\n".join(texts)
        role = "system" if m.role == "developer" else m.role
        conversation.append({"role": role, "content": content or ""})
    try:
        text = serving.tokenizer.apply_chat_template(conversation, add_generation_prompt=req.add_generation_prompt,
                                                     tokenize=False)
    except Exception as e:  # jinja errors (e.g. a role the template does not know)
        raise bad_request(f"messages could not be rendered with the model's chat template: {e}",
                          param="messages") from e
    return serving.tokenize(text, add_special_tokens=False)


async def create_chat_completion(serving: OpenAIServing, req: P.ChatCompletionRequest, raw: Request) -> Response:
    arrival = time.monotonic()
    model = serving.check_model(req.model)
    serving.common_checks(req)
    if req.tools:
        raise bad_request("tools are not supported; send null", param="tools")
    if req.response_format and req.response_format.get("type", "text") != "text":
        raise bad_request(f"response_format type {req.response_format.get('type')!r} is not supported; only "
                          f"'text'", param="response_format")
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
            return _sse(P.ChatCompletionStreamResponse(id=request_id, created=created, model=model,
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
                        new_ids, new_lps = _new_logprobs(c)
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
                yield _sse(P.ErrorResponse(error=P.ErrorInfo(message=str(e), type="server_error")))
                yield "data: [DONE]\n\n"

        return _streaming_response(serving, events(), streams, trackers)

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


class _SSEResponse(StreamingResponse):
    """A server-sent-event response that runs ``on_close`` however it ends.

    If the client disconnects before the body iterator first runs, the iterator's own ``finally`` never
    executes; this hook still aborts the requests, so they do not run on with nobody listening.
    """

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _streaming_response(serving: OpenAIServing, events: AsyncIterator[str], streams: list[RequestStream],
                        trackers: list[RequestTracker]) -> StreamingResponse:
    return _SSEResponse(events, lambda: serving._abort_unfinished(streams, trackers))


# ---------------------------------------------------------------------------------------------- the app


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    """(message, param) for a pydantic/JSON error: names the field, the problem and the value."""
    errors = exc.errors()
    if not errors:
        return "invalid request body", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        return f"malformed JSON body: {ctx.get('error', first.get('msg'))}", None
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    param = loc[0] if loc else None
    value = first.get("input")
    shown = repr(value) if len(repr(value)) < 200 else f"{type(value).__name__} of {len(repr(value))} chars"
    if first.get("type") == "missing":
        return f"{'.'.join(loc) or 'body'}: field required", param
    # A union field (prompt, stop, content) fails once per member type: name the accepted types once.
    same_field = [e for e in errors if [str(x) for x in e.get("loc", ()) if x != "body"][:1] == loc[:1]]
    if len(loc) >= 2 and len(same_field) > 1 and len(same_field) == len(errors):
        members = list(dict.fromkeys(str(e["loc"][2]) for e in same_field if len(e.get("loc", ())) > 2))
        if len(members) > 1:
            return f"{loc[0]}: got {shown}, expected one of: {', '.join(members)}", param
    message = f"{'.'.join(loc) or 'body'}: {first.get('msg')}, got {shown}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return message, param


def build_app(
    engine: EngineArgs | LLMEngine | AsyncLLMEngine,
    *,
    served_model_name: str | list[str] | None = None,
    api_key: str | None = None,
    max_waiting_requests: int | None = None,
    max_body_bytes: int = 1 << 20,
    max_stop: int = 4,
    config: ServerConfig | None = None,
) -> FastAPI:
    """Build the FastAPI app.

    Args:
        engine: ``EngineArgs`` (the model is loaded now), an ``LLMEngine``, or an ``AsyncLLMEngine`` that
            may be shared by several apps. The app starts the engine thread when it starts and stops it
            on shutdown only if it created the ``AsyncLLMEngine`` itself.
        served_model_name: name(s) accepted in ``model``; the first is reported (default: the model's).
        api_key: bearer token required on ``/v1/*``.
        max_waiting_requests: 503 + Retry-After once this many requests wait.
        max_body_bytes: larger bodies get 413.
        max_stop: most stop strings per request.
        config: a full ``ServerConfig`` instead of the keywords above.
    """
    owns_engine = not isinstance(engine, AsyncLLMEngine)
    if isinstance(engine, EngineArgs):
        async_engine = AsyncLLMEngine.from_engine_args(engine)
    elif isinstance(engine, LLMEngine):
        async_engine = AsyncLLMEngine(engine)
    else:
        async_engine = engine
    if config is None:
        names = [served_model_name] if isinstance(served_model_name, str) else served_model_name
        config = ServerConfig(served_model_names=tuple(names) if names else None, api_key=api_key,
                              max_waiting_requests=max_waiting_requests, max_body_bytes=max_body_bytes,
                              max_stop=max_stop)
    # Default names: what the user asked for (e.g. SmolLM2-135M-Instruct), then the config's name.
    model_names = config.served_model_names or tuple(
        dict.fromkeys([async_engine.model_name, async_engine.engine.model_config.name]))
    metrics = ServerMetrics(model_names[0], lambda: async_engine.snapshot)
    serving = OpenAIServing(async_engine, config, metrics, model_names)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        if owns_engine:
            async_engine.stop()

    app = FastAPI(title="roofline", lifespan=lifespan)
    app.state.async_engine = async_engine
    app.state.serving = serving
    app.state.metrics = metrics
    app.state.config = config
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=config.max_body_bytes)
    async_engine.start()  # also when the app is used without lifespan events

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_json(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _validation_message(exc)
        return error_json(400, message, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_json(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error")
        return error_json(500, f"internal server error: {exc!r}", type="server_error")

    async def check_api_key(request: Request) -> None:
        if config.api_key is None:
            return
        auth = request.headers.get("authorization", "")
        scheme, _, token = auth.partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip(), config.api_key):
            what = "missing" if not auth else "incorrect"
            raise APIError(401, f"API key {what}: send the header 'Authorization: Bearer <key>' with the "
                                f"server's --api-key", code="invalid_api_key")

    auth = [Depends(check_api_key)]

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running:
            return error_json(503, f"the engine thread is not running (error: {async_engine.error!r})",
                              type="server_error", code="engine_dead")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", dependencies=auth)
    async def list_models() -> JSONResponse:
        cards = [P.ModelCard(id=name, max_model_len=serving.max_model_len) for name in model_names]
        return JSONResponse(P.ModelList(data=cards).model_dump())

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: P.CompletionRequest, raw_request: Request) -> Response:
        return await create_completion(serving, request, raw_request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: P.ChatCompletionRequest, raw_request: Request) -> Response:
        return await create_chat_completion(serving, request, raw_request)

    return app


# ---------------------------------------------------------------------------------------------- in-process server


class BackgroundServer:
    """Run an app under uvicorn in a daemon thread (tests, notebooks). ``port=0`` picks a free port.

    Example::

        with BackgroundServer(build_app(EngineArgs(max_model_len=1024))) as server:
            openai.OpenAI(base_url=server.url + "/v1", api_key="x")...
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        self.config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on")
        self.server = uvicorn.Server(self.config)
        self.thread = threading.Thread(target=self.server.run, name="roofline-uvicorn", daemon=True)
        self.host = host
        self.port = port

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout_s: float = 60.0) -> BackgroundServer:
        """Start serving; returns once the socket listens. Raises RuntimeError after ``timeout_s`` seconds."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"uvicorn did not start on {self.host}:{self.port} within {timeout_s} s")
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout_s)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
