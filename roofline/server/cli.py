"""``roofline serve [MODEL] --host 127.0.0.1 --port 8000``: the OpenAI-compatible server under uvicorn."""

from __future__ import annotations

import argparse
import os

from roofline.args import EngineArgs

DEFAULT_MAX_BODY_BYTES = 1 << 20  # 1 MiB: ~250k tokens of JSON token ids, far above any context we serve


def _port(value: str) -> int:
    """argparse type of ``--port``: an integer in [0, 65535]."""
    try:
        port = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer in [0, 65535], got {value!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be in [0, 65535], got {port}")
    return port


def _check_bindable(host: str, port: int) -> None:
    """Raise OSError naming the address when ``host``:``port`` cannot be bound (in use, no such address), before
    the model loads (minutes on a large one); uvicorn binds it again once the engine is up."""
    import socket

    for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[:1]:
        with socket.socket(family, kind, proto) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn does
            try:
                sock.bind(addr)
            except OSError as e:
                raise OSError(e.errno, f"cannot serve on {host}:{port}: {e.strerror}") from None


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, /metrics)",
        description="Serve a model over the OpenAI API. Binds to loopback unless --host says otherwise.")
    EngineArgs.add_cli_args(p, model_positional=True)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1, loopback only)")
    g.add_argument("--port", type=_port, default=8000, help="TCP port in [0, 65535] (default 8000)")
    g.add_argument("--api-key", default=os.environ.get("ROOFLINE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1/* (default: $ROOFLINE_API_KEY)")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use in 'model'; the first is reported (default: the model's name)")
    g.add_argument("--max-waiting-requests", type=int, default=None,
                   help="answer 503 with Retry-After once this many requests wait (default: unlimited)")
    g.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help=f"answer 413 to larger request bodies (default {DEFAULT_MAX_BODY_BYTES})")
    g.add_argument("--max-stop", type=int, default=4, help="most stop strings per request (default 4, as OpenAI)")
    g.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from roofline.server.app import ServerConfig, build_app

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("roofline").setLevel(args.log_level.upper())  # also where a handler was already set up
    config = ServerConfig(
        served_model_names=tuple(args.served_model_name) if args.served_model_name else None,
        api_key=args.api_key or None,
        max_waiting_requests=args.max_waiting_requests,
        max_body_bytes=args.max_request_body_bytes,
        max_stop=args.max_stop,
    )
    engine_args = EngineArgs.from_cli_args(args)
    try:
        _check_bindable(args.host, args.port)
    except OSError as e:
        import sys

        print(f"roofline serve: error: {e.strerror}", file=sys.stderr)
        return 3  # uvicorn's status for a failed bind
    app = build_app(engine_args, config=config)
    serving = app.state.serving
    print(f"roofline serve: model {serving.model_names[0]!r}, max_model_len {serving.max_model_len}, "
          f"on http://{args.host}:{args.port} (auth {'on' if config.api_key else 'off'})", flush=True)
    from roofline.commands import startup_lines

    engine = app.state.async_engine.engine
    # The CPU line and decode plan / quantization auto, and the KV pool, as `generate` prints them; at
    # --log-level info or debug the worker's and the engine's log records already show them.
    if not logging.getLogger("roofline").isEnabledFor(logging.INFO):
        if (startup := startup_lines(engine)):
            print(startup, flush=True)
        print(engine.kv_cache_summary, flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0
