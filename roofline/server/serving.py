"""What both OpenAI endpoints share: limits, errors, request validation, running requests, SSE.

``OpenAIServing`` lives on the event loop and never touches the ``LLMEngine``: it validates and tokenizes
(a private copy of the tokenizer, so the engine thread's is never shared), hands requests to
``AsyncLLMEngine.add_request``, and reads the per-request streams. A client that disconnects aborts its
requests; the engine thread frees their KV blocks at once. The endpoints themselves are in
``serving_completion.py`` and ``serving_chat.py``; the app, middleware and error handlers in ``app.py``.
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from roofline.engine.sequence import Logprob
from roofline.outputs import CompletionOutput, RequestOutput
from roofline.sampling_params import SamplingParams
from roofline.server import protocol as P
from roofline.server.async_engine import AsyncLLMEngine, EngineDeadError, EngineOverloadedError, RequestStream
from roofline.server.metrics import RequestTracker, ServerMetrics

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
                 model_names: tuple[str, ...], listed_names: tuple[str, ...] | None = None):
        self.async_engine = async_engine
        self.config = config
        self.metrics = metrics
        self.model_names = model_names  # accepted in ``model``: the listed names and the default's alias
        self.listed_names = listed_names or model_names  # what /v1/models lists and a 404 names
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
                            f"{', '.join(self.listed_names)}", param="model", code="model_not_found")

    def tokenize(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self.tokenizer is None:
            raise bad_request("this model has no tokenizer (dummy weights, or a GGUF file without a vocabulary); send the prompt as token ids",
                              param="prompt")
        return list(self.tokenizer(text, add_special_tokens=add_special_tokens).input_ids)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def check_context(self, num_prompt_tokens: int, max_tokens: int | None, prompt_param: str,
                      max_tokens_param: str, allow_zero: bool = False) -> int:
        """Check the prompt and ``max_tokens`` against ``max_model_len``; returns the max_tokens to use.

        ``allow_zero``: 0 is accepted (the completions endpoint's ``echo`` with ``max_tokens: 0``: the prompt
        alone), and returned as 0; the caller runs such a request with max_tokens=1 and drops the token.
        """
        limit = self.max_model_len
        if num_prompt_tokens >= limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but the {prompt_param} "
                f"{'have' if prompt_param.endswith('s') else 'has'} "
                f"{num_prompt_tokens} tokens; it must be at most {limit - 1} tokens to leave room for one "
                f"generated token", param=prompt_param, code="context_length_exceeded")
        if max_tokens is None:
            return limit - num_prompt_tokens
        if max_tokens == 0 and allow_zero:
            return 0
        if max_tokens < 1:
            allowed = ">= 0 (0 returns the prompt alone)" if allow_zero else ">= 1"
            raise bad_request(f"{max_tokens_param} must be {allowed}, got {max_tokens}", param=max_tokens_param)
        if num_prompt_tokens + max_tokens > limit:
            raise bad_request(
                f"This model's maximum context length is {limit} tokens, but {num_prompt_tokens + max_tokens} "
                f"were requested ({num_prompt_tokens} in the {prompt_param}, {max_tokens} for the "
                f"completion); {max_tokens_param} must be in [1, {limit - num_prompt_tokens}] for "
                f"{'these' if prompt_param.endswith('s') else 'this'} {prompt_param}", param=max_tokens_param, code="context_length_exceeded")
        return max_tokens

    def common_checks(self, req: P._SamplingFields) -> None:
        unsupported = P.unsupported_fields(req, req.UNSUPPORTED)
        if unsupported:
            name = unsupported[0]
            raise bad_request(f"{name} is not supported by this server (got {json.dumps(req.model_extra[name])}); "
                              f"send null or leave it out", param=name)
        ignored = sorted(set(req.model_extra or {}) - set(req.UNSUPPORTED))
        if ignored:  # neither OpenAI nor vLLM defines them: ignored, as both do, and said in the log as vLLM does
            logger.warning("The following fields were present in the request but ignored: %s", ", ".join(ignored))
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
                        names: dict[str, str], prompt_logprobs: int | None = None) -> SamplingParams:
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
                prompt_logprobs=prompt_logprobs,
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
        """Add one engine request per prompt, every add queued before any is awaited, so a list of N prompts joins
        the engine in one step (awaited one by one, each joined a step later: 100 one-token prompts took 5.5 s
        against 0.8 s as 100 requests); if any is refused, abort those accepted and raise the first refusal."""
        rids = [base_id if len(prompts) == 1 else f"{base_id}-{i}" for i in range(len(prompts))]
        results = await asyncio.gather(*(self.add(rid, ids, p, arrival) for rid, ids, p in zip(rids, prompts, params,
                                                                                               strict=True)),
                                       return_exceptions=True)
        refused = [r for r in results if isinstance(r, BaseException)]
        if refused:
            for r in results:
                if isinstance(r, RequestStream):
                    self.async_engine.abort(r.request_id, r)
            raise refused[0]
        return results

    # ------------------------------------------------------------------------------ running requests

    async def collect(self, raw: Request, streams: list[RequestStream],
                      trackers: list[RequestTracker]) -> list[RequestOutput] | None:
        """Wait for every stream's final output; None if the client disconnected (requests aborted)."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def drain(i: int) -> None:
            async for out in streams[i]:
                trackers[i].on_output(out)
                finals[i] = out
                if out.error is not None:  # the engine failed this request (e.g. a non-finite distribution)
                    raise bad_request(out.error)

        watcher = asyncio.ensure_future(_wait_disconnect(raw))
        runner = asyncio.ensure_future(asyncio.gather(*(drain(i) for i in range(len(streams)))))
        # After a disconnect the gather may end with its children's CancelledError as its exception; retrieving
        # it here keeps asyncio from logging "exception was never retrieved" at ERROR for a normal event.
        runner.add_done_callback(lambda f: f.cancelled() or f.exception())
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
                if out.error is not None:  # the engine failed this request: an in-band error event
                    raise bad_request(out.error)
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


# ---------------------------------------------------------------------------------------------- SSE, logprobs


def sse(obj: Any) -> str:
    """One server-sent event: ``data: <json>`` and a blank line."""
    data = obj.model_dump_json() if hasattr(obj, "model_dump_json") else json.dumps(obj)
    return f"data: {data}\n\n"


def token_str(lp: Logprob, token_id: int) -> str:
    """The token's text in logprobs (``token_id:N`` when it has none)."""
    return lp.decoded_token if lp.decoded_token is not None else f"token_id:{token_id}"


def ranked(entries: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The ``k`` most likely entries (rank 1 first)."""
    return sorted(entries.items(), key=lambda kv: (kv[1].rank, -kv[1].logprob))[:k]


def new_logprobs(c: CompletionOutput) -> tuple[list[int], list[dict[int, Logprob]]]:
    """Token ids and logprob entries added since the previous output of this completion."""
    if not c.num_new_tokens or c.logprobs is None:
        return [], []
    return c.token_ids[-c.num_new_tokens:], c.logprobs[-c.num_new_tokens:]


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


def streaming_response(serving: OpenAIServing, events: AsyncIterator[str], streams: list[RequestStream],
                       trackers: list[RequestTracker]) -> StreamingResponse:
    """The SSE response of ``events``; whatever way it ends, unfinished ``streams`` are aborted."""
    return _SSEResponse(events, lambda: serving._abort_unfinished(streams, trackers))

