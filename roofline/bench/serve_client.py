"""The client side of ``roofline bench serve`` (:mod:`roofline.bench.serve`): one streamed request (SSE over
aiohttp) timed on the client clock, and the Poisson arrival loop that sends them all.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

# ---------------------------------------------------------------------------------------------- requests


@dataclass
class RequestResult:
    """Timings of one request (seconds, client clock) and its token counts."""

    prompt_len: int  # local tokenizer, raw prompt (no chat template)
    output_len: int  # tokens asked for (max_tokens)
    success: bool = False
    error: str = ""
    output_tokens: int = 0
    output_tokens_source: str = ""  # "usage" (server-reported) or "tokenizer" (counted locally)
    server_prompt_tokens: int | None = None  # usage.prompt_tokens (includes any chat template)
    start_s: float = 0.0  # send time, relative to the start of the run
    ttft_s: float = 0.0
    e2el_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)  # one per text chunk after the first
    num_chunks: int = 0  # streamed chunks that carried text
    generated_text: str = ""

    @property
    def tpot_s(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); None for single-token outputs."""
        if self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)


def build_payload(endpoint: str, model: str, prompt: str, output_len: int, ignore_eos: bool,
                  temperature: float) -> dict[str, Any]:
    payload: dict[str, Any] = {
        "model": model,
        "temperature": temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if endpoint == "chat":
        payload["messages"] = [{"role": "user", "content": prompt}]
        payload["max_completion_tokens"] = output_len
        payload["max_tokens"] = output_len  # servers that predate max_completion_tokens
    else:
        payload["prompt"] = prompt
        payload["max_tokens"] = output_len
    if ignore_eos:
        payload["ignore_eos"] = True  # vLLM / llama.cpp / roofline extension
    return payload


async def _sse_events(response: Any) -> Any:
    """Yield the ``data:`` payloads of a server-sent-event stream as they arrive."""
    buffer = b""
    async for chunk in response.content.iter_any():
        buffer += chunk
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.splitlines():
                if line.startswith(b"data:"):
                    yield line[5:].strip().decode("utf-8")
    if buffer.strip().startswith(b"data:"):
        yield buffer.strip()[5:].strip().decode("utf-8")


async def send_request(session: Any, url: str, endpoint: str, payload: dict[str, Any], headers: dict[str, str],
                       result: RequestResult, t0: float) -> RequestResult:
    """Stream one request and fill ``result``'s timings; errors are recorded, not raised."""
    start = time.perf_counter()
    result.start_s = start - t0
    last = start
    texts: list[str] = []
    try:
        async with session.post(url, json=payload, headers=headers) as response:
            if response.status != 200:
                body = await response.text()
                result.error = f"HTTP {response.status}: {body[:500]}"
                return result
            async for data in _sse_events(response):
                if data == "[DONE]":
                    break
                obj = json.loads(data)
                if "error" in obj:
                    result.error = f"in-stream error: {obj['error']}"
                    return result
                usage = obj.get("usage")
                if usage:
                    result.output_tokens = int(usage.get("completion_tokens") or 0)
                    result.server_prompt_tokens = usage.get("prompt_tokens")
                    result.output_tokens_source = "usage"
                text = ""
                for choice in obj.get("choices") or []:
                    if endpoint == "chat":
                        text += (choice.get("delta") or {}).get("content") or ""
                    else:
                        text += choice.get("text") or ""
                if not text:
                    continue
                now = time.perf_counter()
                if not texts:
                    result.ttft_s = now - start
                else:
                    result.itl_s.append(now - last)
                last = now
                texts.append(text)
        result.e2el_s = time.perf_counter() - start
        result.num_chunks = len(texts)
        result.generated_text = "".join(texts)
        result.success = bool(texts)
        if not texts:
            result.error = "the stream carried no text"
    except Exception as e:  # connection errors, timeouts, bad JSON
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_load(base_url: str, endpoint: str, model: str, requests: list[Any], request_rate: float,
                   max_concurrency: int | None, seed: int, ignore_eos: bool, temperature: float,
                   api_key: str | None = None, timeout_s: float = 3600.0,
                   progress: bool = True) -> tuple[list[RequestResult], float]:
    """Send every request (Poisson arrivals at ``request_rate`` req/s); returns results and duration (s)."""
    import aiohttp
    from tqdm.auto import tqdm

    url = base_url.rstrip("/") + ("/v1/chat/completions" if endpoint == "chat" else "/v1/completions")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    rng = random.Random(seed)
    semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), desc="requests", disable=not progress, dynamic_ncols=True)
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        t0 = time.perf_counter()

        async def one(req: Any) -> RequestResult:
            result = RequestResult(prompt_len=req.prompt_len, output_len=req.output_len)
            payload = build_payload(endpoint, model, req.prompt, req.output_len, ignore_eos, temperature)
            if semaphore is None:
                await send_request(session, url, endpoint, payload, headers, result, t0)
            else:
                async with semaphore:
                    await send_request(session, url, endpoint, payload, headers, result, t0)
            bar.update(1)
            return result

        tasks = []
        for i, req in enumerate(requests):
            tasks.append(asyncio.create_task(one(req)))
            if math.isfinite(request_rate) and i < len(requests) - 1:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = list(await asyncio.gather(*tasks))
        duration = time.perf_counter() - t0
    bar.close()
    return results, duration
