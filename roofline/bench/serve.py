"""``roofline bench serve``: an online serving benchmark against any OpenAI-compatible server.

Shaped like vLLM's ``bench serve``. Requests stream (SSE) through aiohttp, arriving as a Poisson process at
``--request-rate`` (or all at once for ``inf``), at most ``--max-concurrency`` in flight.

Per request (client clock, ``time.perf_counter``):
    TTFT   time to first token: request sent -> first streamed chunk that carries text.
    ITL    inter-token latency, per streamed chunk: the gap between consecutive text chunks. Under
           speculative decoding (or any server that batches tokens into a chunk) one chunk carries
           several tokens, so ITL is NOT a per-token figure.
    TPOT   time per output token, per token: (E2E - TTFT) / (output tokens - 1), the decode time spread
           over the tokens after the first.
    E2E    end-to-end latency: request sent -> end of the stream.
Output tokens are the server's count (``stream_options.include_usage``); servers that send no usage are
counted with the local tokenizer. Prompt lengths come from the local tokenizer (``--tokenizer``,
default: the default model's). Goodput is the rate of requests that meet every SLO given
(``--slo-ttft-ms``, ``--slo-tpot-ms``).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import platform
import sys
from dataclasses import asdict
from typing import Any

# The requests (SSE client, arrival loop) are in serve_client; this module is the command and its figures.
from roofline.bench.serve_client import RequestResult, run_load

PERCENTILES = (50, 90, 99)


# ---------------------------------------------------------------------------------------------- CLI


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "serve", help="online serving benchmark against an OpenAI-compatible server (TTFT, ITL, TPOT, goodput)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (default %(default)s)")
    s.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="/v1/completions or /v1/chat/completions")
    s.add_argument("--model", default=None, help="model name to send (default: the first of /v1/models)")
    s.add_argument("--api-key", default=os.environ.get("ROOFLINE_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $ROOFLINE_API_KEY or $OPENAI_API_KEY)")
    s.add_argument("--tokenizer", default=None,
                   help="HF directory or .gguf for counting prompt tokens (default: the default model's)")
    d = p.add_argument_group("workload")
    d.add_argument("--dataset", choices=["sharegpt", "random", "humaneval"], default="sharegpt")
    d.add_argument("--num-prompts", type=int, default=100)
    d.add_argument("--seed", type=int, default=0, help="seeds dataset sampling and arrival times")
    d.add_argument("--sharegpt-output-len", type=int, default=None,
                   help="fixed output length instead of each ShareGPT completion's length")
    d.add_argument("--max-output-len", type=int, default=None,
                   help="clip every request's output length to this many tokens (keeps short ones)")
    d.add_argument("--random-input-len", type=int, default=1024)
    d.add_argument("--random-output-len", type=int, default=128)
    d.add_argument("--humaneval-output-len", type=int, default=256)
    d.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore_eos, fixed output lengths)")
    d.add_argument("--temperature", type=float, default=0.0)
    lo = p.add_argument_group("load")
    lo.add_argument("--request-rate", type=float, default=math.inf,
                    help="requests per second, Poisson arrivals; inf sends all at once (default)")
    lo.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    lo.add_argument("--request-timeout-s", type=float, default=3600.0)
    r = p.add_argument_group("report")
    r.add_argument("--slo-ttft-ms", type=float, default=None, help="goodput SLO on TTFT (ms)")
    r.add_argument("--slo-tpot-ms", type=float, default=None, help="goodput SLO on TPOT (ms)")
    r.add_argument("--save-result", default=None, metavar="FILE.json",
                   help="write config, versions, figures and per-request timings")
    r.add_argument("--plot", default=None, metavar="FILE.png", help="write latency CDFs (TTFT, TPOT, ITL, E2E)")
    r.add_argument("--metadata", nargs="*", default=[], metavar="KEY=VALUE",
                   help="labels stored in the JSON (e.g. device=cpu)")
    r.add_argument("--disable-tqdm", action="store_true")
    p.set_defaults(func=run_bench)


# ---------------------------------------------------------------------------------------------- figures


def _stats(values_s: list[float], name: str) -> dict[str, float]:
    """mean/median/std/pXX of ``values_s`` (seconds) in milliseconds, keyed ``<stat>_<name>_ms``."""
    import numpy as np

    keys = [f"mean_{name}_ms", f"median_{name}_ms", f"std_{name}_ms"] + [f"p{p}_{name}_ms" for p in PERCENTILES]
    if not values_s:
        return dict.fromkeys(keys)
    arr = np.asarray(values_s, dtype=float) * 1000.0
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def compute_metrics(results: list[RequestResult], duration_s: float, slo_ttft_ms: float | None = None,
                    slo_tpot_ms: float | None = None) -> dict[str, Any]:
    """Aggregate figures; throughputs are per second of benchmark duration, latencies in ms."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    total_chunks = sum(r.num_chunks for r in ok)
    m: dict[str, Any] = {
        "duration_s": duration_s,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
        "mean_tokens_per_chunk": total_out / total_chunks if total_chunks else 0.0,
    }
    good = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = 0
        for r in ok:
            tpot = r.tpot_s or 0.0
            if slo_ttft_ms is not None and r.ttft_s * 1000 > slo_ttft_ms:
                continue
            if slo_tpot_ms is not None and tpot * 1000 > slo_tpot_ms:
                continue
            good += 1
    m["num_good_requests"] = good
    m["request_goodput"] = good / duration_s if good is not None else None
    m.update(_stats([r.ttft_s for r in ok], "ttft"))
    m.update(_stats([r.tpot_s for r in ok if r.tpot_s is not None], "tpot"))
    m.update(_stats([x for r in ok for x in r.itl_s], "itl"))
    m.update(_stats([r.e2el_s for r in ok], "e2el"))
    return m


def format_table(m: dict[str, Any], slo_ttft_ms: float | None = None, slo_tpot_ms: float | None = None) -> str:
    """The human-readable report (vLLM's layout)."""
    w = 50
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=w, c="=")]

    def row(label: str, value: Any, fmt: str = ".2f") -> None:
        text = "n/a" if value is None else (f"{value:{fmt}}" if isinstance(value, float) else str(value))
        lines.append(f"{label:<40}{text:>10}")

    row("Successful requests:", m["completed"])
    row("Failed requests:", m["failed"])
    row("Benchmark duration (s):", m["duration_s"])
    row("Total input tokens:", m["total_input_tokens"])
    row("Total generated tokens:", m["total_output_tokens"])
    row("Request throughput (req/s):", m["request_throughput"])
    row("Output token throughput (tok/s):", m["output_throughput"])
    row("Total token throughput (tok/s):", m["total_token_throughput"])
    if m.get("request_goodput") is not None:
        row("Request goodput (req/s):", m["request_goodput"])
        slo = [f"TTFT <= {slo_ttft_ms:g} ms" if slo_ttft_ms is not None else "",
               f"TPOT <= {slo_tpot_ms:g} ms" if slo_tpot_ms is not None else ""]
        lines.append(f"  (requests meeting {' and '.join(x for x in slo if x)})")
    sections = [
        ("ttft", "TTFT", "Time to First Token"),
        ("tpot", "TPOT", "Time per Output Token (per token, excl. 1st)"),
        ("itl", "ITL", "Inter-token Latency (per streamed chunk)"),
        ("e2el", "E2EL", "End-to-end Latency"),
    ]
    for key, short, title in sections:
        lines.append("{s:{c}^{n}}".format(s=title, n=w, c="-"))
        row(f"Mean {short} (ms):", m[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", m[f"median_{key}_ms"])
        for p in PERCENTILES[1:]:
            row(f"P{p} {short} (ms):", m[f"p{p}_{key}_ms"])
        if key == "itl":
            row("Mean tokens per chunk:", m["mean_tokens_per_chunk"])
    lines.append("=" * w)
    return "\n".join(lines)


def plot_cdfs(results: list[RequestResult], path: str, title: str = "") -> None:
    """Write a PNG with the empirical CDFs of TTFT, TPOT, ITL and E2E latency (ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in results if r.success]
    series = [
        ("TTFT (ms)", [r.ttft_s for r in ok]),
        ("TPOT, per token (ms)", [r.tpot_s for r in ok if r.tpot_s is not None]),
        ("ITL, per chunk (ms)", [x for r in ok for x in r.itl_s]),
        ("E2E latency (ms)", [r.e2el_s for r in ok]),
    ]
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (label, values) in zip(axes.flat, series, strict=True):
        if values:
            x = np.sort(np.asarray(values) * 1000.0)
            y = np.arange(1, len(x) + 1) / len(x)
            ax.step(x, y, where="post")
            for p in (50, 99):
                ax.axvline(float(np.percentile(x, p)), linestyle=":", color="gray")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of samples")
        ax.grid(alpha=0.3)
    fig.suptitle(title or "latency CDFs")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------------------------------------- the command


def _versions() -> dict[str, str | None]:
    from importlib import metadata

    out: dict[str, str | None] = {"python": platform.python_version(), "platform": platform.platform()}
    for pkg in ("roofline", "aiohttp", "numpy", "transformers"):
        try:
            out[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            out[pkg] = None
    from roofline.bench.common import git_sha

    out["commit"] = git_sha()  # ROOFLINE_GIT_SHA where the tree has no .git of its own (a device copy)
    return out


@functools.lru_cache(maxsize=4)
def load_tokenizer(name: str | None) -> Any:
    """The HF tokenizer of ``name`` (default: the default model's); cached, as loading takes seconds."""
    from roofline.models import loader

    source = loader.resolve_model(name)
    tokenizer = loader.load_tokenizer(source)
    if tokenizer is None:
        raise ValueError(f"no tokenizer found for {name!r}; pass --tokenizer DIR_OR_GGUF")
    return tokenizer


def sample_requests(args: argparse.Namespace, tokenizer: Any) -> list[Any]:
    """The workload: SampleRequest(prompt, prompt_len, output_len) per request."""
    from roofline.bench import datasets

    if args.num_prompts < 1:
        raise ValueError(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.dataset == "sharegpt":
        reqs = datasets.sample_sharegpt(tokenizer, args.num_prompts, seed=args.seed,
                                        fixed_output_len=args.sharegpt_output_len)
    elif args.dataset == "humaneval":
        reqs = datasets.sample_humaneval(tokenizer, args.num_prompts, output_len=args.humaneval_output_len,
                                         seed=args.seed)
    else:
        raw = datasets.sample_random(len(tokenizer), args.num_prompts, args.random_input_len,
                                     args.random_output_len, seed=args.seed, tokenizer=tokenizer)
        # Decoded random ids re-tokenize to about, not exactly, input_len tokens: count what is sent.
        reqs = [datasets.SampleRequest(r.prompt, len(tokenizer(r.prompt).input_ids), r.output_len) for r in raw]
    if args.max_output_len is not None:
        if args.max_output_len < 1:
            raise ValueError(f"--max-output-len must be >= 1, got {args.max_output_len}")
        reqs = [datasets.SampleRequest(r.prompt, r.prompt_len, min(r.output_len, args.max_output_len))
                for r in reqs]
    return reqs


def _server_models(base_url: str, api_key: str | None) -> list[str]:
    import urllib.request

    req = urllib.request.Request(base_url.rstrip("/") + "/v1/models",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return [m["id"] for m in json.loads(resp.read())["data"]]


def run_bench(args: argparse.Namespace) -> int:
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if args.max_concurrency is not None and args.max_concurrency < 1:
        raise ValueError(f"--max-concurrency must be >= 1, got {args.max_concurrency}")
    metadata = {}
    for item in args.metadata:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--metadata entries must be KEY=VALUE, got {item!r}")
        metadata[key] = value
    model = args.model or _server_models(args.base_url, args.api_key)[0]
    tokenizer = load_tokenizer(args.tokenizer)
    requests = sample_requests(args, tokenizer)
    print(f"bench serve: {len(requests)} {args.dataset} requests -> {args.base_url} ({args.endpoint}, model "
          f"{model!r}), rate {args.request_rate} req/s, max concurrency {args.max_concurrency or 'unlimited'}",
          flush=True)
    results, duration = asyncio.run(run_load(
        args.base_url, args.endpoint, model, requests, args.request_rate, args.max_concurrency, args.seed,
        args.ignore_eos, args.temperature, api_key=args.api_key, timeout_s=args.request_timeout_s,
        progress=not args.disable_tqdm))
    for r in results:
        if r.success and r.output_tokens_source != "usage":  # server sent no usage: count locally
            r.output_tokens = len(tokenizer(r.generated_text, add_special_tokens=False).input_ids)
            r.output_tokens_source = "tokenizer"
    metrics = compute_metrics(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    print(format_table(metrics, args.slo_ttft_ms, args.slo_tpot_ms))
    errors = [r.error for r in results if not r.success]
    if errors:
        print(f"{len(errors)} requests failed; first error: {errors[0]}", file=sys.stderr)
    if args.save_result:
        config = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v))
                  for k, v in vars(args).items() if k != "func" and k != "api_key"}
        config["model"] = model
        from roofline.bench.common import environment

        record = {
            "benchmark": "serve",
            **environment(),  # date, git commit, device and versions of the client machine
            "config": config,
            "metadata": metadata,
            "versions": _versions(),
            **metrics,
            "requests": [
                {k: v for k, v in asdict(r).items() if k != "generated_text"}
                | {"tpot_s": r.tpot_s}
                for r in results
            ],
        }
        os.makedirs(os.path.dirname(os.path.abspath(args.save_result)), exist_ok=True)
        with open(args.save_result, "w") as f:
            json.dump(record, f, indent=1)
        print(f"saved {args.save_result}")
    if args.plot:
        plot_cdfs(results, args.plot, title=f"{model} · {args.dataset} · {args.endpoint} · "
                                             f"rate {args.request_rate} req/s")
        print(f"saved {args.plot}")
    return 0 if metrics["completed"] else 1
