"""The OpenAI-compatible HTTP app (FastAPI): ``build_app(engine_args | engine, ...)`` and ``BackgroundServer``.

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

Requests flow: validate and tokenize in ``OpenAIServing`` (``serving.py``; a private copy of the tokenizer,
so the engine thread's is never shared) -> ``AsyncLLMEngine.add_request`` -> per-request stream -> JSON or
SSE (``serving_completion.py``, ``serving_chat.py``). A client that disconnects aborts its requests; the
engine thread frees their KV blocks at once.
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from roofline.args import EngineArgs
from roofline.engine.llm_engine import LLMEngine
from roofline.server import protocol as P
from roofline.server.async_engine import AsyncLLMEngine, EngineDeadError
from roofline.server.metrics import CONTENT_TYPE, ServerMetrics
from roofline.server.serving import APIError, OpenAIServing, ServerConfig, error_json
from roofline.server.serving_chat import create_chat_completion
from roofline.server.serving_completion import create_completion

logger = logging.getLogger(__name__)


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


# ---------------------------------------------------------------------------------------------- the app


_JSON_TYPE = {dict: "object", list: "array", str: "string", bool: "boolean", int: "number", float: "number"}


def _as_json(value: Any) -> str:
    """The value as the client wrote it (JSON: true, null, "x"), not as Python shows it (True, None, 'x')."""
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


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
    text = _as_json(value)
    shown = text if len(text) < 200 else f"{_JSON_TYPE.get(type(value), type(value).__name__)} of {len(text)} chars"
    if first.get("type") == "missing":
        return f"{'.'.join(loc) or 'body'}: field required", param
    if not loc and isinstance(value, (bytes, str)):  # a body that was not parsed as JSON: the content type
        return ("the request body must be a JSON object sent with 'Content-Type: application/json' (it was read "
                "as raw bytes; curl -d sends application/x-www-form-urlencoded unless told otherwise)"), None
    if not loc and first.get("type") == "value_error":  # a check across fields, which names its field first
        message = str(first.get("msg")).removeprefix("Value error, ")
        return message, message.split(":", 1)[0] if ":" in message else None
    if first.get("type") == "int_parsing_size":
        return f"{'.'.join(loc)}: {shown} is too large for an integer", param
    # A union field (prompt, stop, content) fails once per member type: name the accepted types once.
    same_field = [e for e in errors if [str(x) for x in e.get("loc", ()) if x != "body"][:1] == loc[:1]]
    if len(loc) >= 2 and len(same_field) > 1 and len(same_field) == len(errors):
        members = list(dict.fromkeys(str(e["loc"][2]) for e in same_field if len(e.get("loc", ())) > 2))
        if len(members) > 1:
            return f"{loc[0]}: got {shown}, expected one of: {', '.join(members)}", param
    message = f"{'.'.join(loc) or 'body'}: {str(first.get('msg')).removeprefix('Value error, ')}, got {shown}"
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return message, param


def _expert_counts(async_engine: AsyncLLMEngine) -> Callable[[], list[list[int]] | None] | None:
    """The MoE token-count reader for /metrics: the in-process worker's model (None for dense models or
    worker processes, whose counts stay in their own process)."""
    model = getattr(getattr(async_engine.engine, "worker", None), "model", None)
    if model is None or not getattr(async_engine.engine.model_config, "is_moe", False):
        return None
    from roofline.layers.moe import expert_token_counts

    return lambda: expert_token_counts(model)


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
    if isinstance(engine, EngineArgs) and engine.distributed_executor_backend == "external_launcher":
        raise ValueError("distributed_executor_backend 'external_launcher' is for offline runs under torchrun "
                         "(every rank runs the same requests); a server receives requests on one process: use 'mp'")
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
    # /v1/models lists the names the user gave (all of them, as vLLM), or else the one default name; the
    # default's other spelling (the config's name) is accepted in ``model`` as an alias, not listed.
    listed_names = config.served_model_names or model_names[:1]
    metrics = ServerMetrics(model_names[0], async_engine.state, _expert_counts(async_engine))
    serving = OpenAIServing(async_engine, config, metrics, model_names, tuple(listed_names))

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
        detail = str(exc.detail)
        if exc.status_code == 400 and detail == "There was an error parsing the body":
            detail = ("the request body could not be read as JSON (it must be UTF-8 text, nested no deeper than "
                      "Python's JSON parser allows, about 1,000 levels)")
        return error_json(exc.status_code, detail, headers=getattr(exc, "headers", None))

    @app.exception_handler(EngineDeadError)
    async def _engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return error_json(503, str(exc), type="server_error", code="engine_dead")

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
        cards = [P.ModelCard(id=name, max_model_len=serving.max_model_len) for name in listed_names]
        return JSONResponse(P.ModelList(data=cards).model_dump())

    @app.get("/v1/models/{model_id:path}", dependencies=auth)
    async def retrieve_model(model_id: str) -> JSONResponse:
        """OpenAI's retrieve-model: a listed id or an accepted alias gets its card (under the name asked for)."""
        if model_id not in model_names and model_id not in listed_names:
            return error_json(404, f"The model {json.dumps(model_id)} does not exist; this server serves: "
                              f"{', '.join(listed_names)}", param="model", code="model_not_found")
        return JSONResponse(P.ModelCard(id=model_id, max_model_len=serving.max_model_len).model_dump())

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
