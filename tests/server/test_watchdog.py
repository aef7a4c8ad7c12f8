"""The step watchdog (issue 31): a stopped worker of a ``-tp 3`` CPU engine (the default model has 9 heads) is
noticed within ``--step-timeout``: /health turns 503 naming the rank, the in-flight request ends with an error."""

from __future__ import annotations

import os
import signal
import threading
import time

import httpx
import openai
import pytest

STEP_TIMEOUT_S = 3.0


@pytest.mark.slow
def test_a_stopped_worker_trips_the_step_watchdog():
    from roofline.args import EngineArgs
    from roofline.server.app import BackgroundServer, build_app
    from roofline.server.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        tensor_parallel_size=3, step_timeout=STEP_TIMEOUT_S, device="cpu", dtype="float32", max_model_len=256,
        num_kv_blocks=32, block_size=16, max_num_batched_tokens=256))
    procs = engine.engine.executor.procs
    engine.start()
    stopped = None
    try:
        with BackgroundServer(build_app(engine)) as srv:
            client = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60)
            result: dict = {}

            def live() -> None:
                try:
                    stream = client.completions.create(model=None,
                                                       prompt="Once upon a time", max_tokens=200, temperature=0,
                                                       stream=True, extra_body={"ignore_eos": True})
                    result["chunks"] = list(stream)
                except Exception as e:  # the in-band error event surfaces as an APIError
                    result["error"] = e

            thread = threading.Thread(target=live)
            thread.start()
            deadline = time.monotonic() + 60
            while engine.snapshot.num_running_requests == 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert httpx.get(srv.url + "/health").status_code == 200
            stopped = procs[1].pid
            os.kill(stopped, signal.SIGSTOP)
            t0 = time.monotonic()
            health = None
            while time.monotonic() - t0 < STEP_TIMEOUT_S + 10:
                health = httpx.get(srv.url + "/health")
                if health.status_code == 503:
                    break
                time.sleep(0.1)
            assert health is not None and health.status_code == 503, health.text if health else None
            assert "worker rank 1" in health.text and "stopped" in health.text and "step timeout" in health.text
            thread.join(30)
            assert not thread.is_alive()
            assert "error" in result, result  # the stream ended with an error, not a finish
            assert "stalled" in str(result["error"])
    finally:
        if stopped is not None:
            try:
                os.kill(stopped, signal.SIGCONT)
            except ProcessLookupError:
                pass
        engine.stop()
        engine.engine.executor.shutdown()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the engine thread's exit
def test_a_stalled_step_trips_the_one_process_watchdog(tmp_path):
    """One process (no worker to stop): a step that never returns is noticed within --step-timeout: /health
    turns 503 naming the device and the step, the in-flight request ends with an error, new ones get 503."""
    import asyncio
    import json

    from roofline.args import EngineArgs
    from roofline.sampling_params import SamplingParams
    from roofline.server.app import BackgroundServer, build_app
    from roofline.server.async_engine import AsyncLLMEngine, EngineDeadError

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 256}
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=str(tmp_path), load_format="dummy", device="cpu", dtype="float32", max_model_len=128,
        step_timeout=0.5))
    assert not engine.engine.executor.has_step_watchdog
    release = threading.Event()
    real_step = engine.engine.step

    def stuck_step():
        release.wait(30)  # a device that never answers (released at the end so the thread can exit)
        return real_step()

    engine.engine.step = stuck_step
    engine.start()
    try:
        with BackgroundServer(build_app(engine)) as srv:
            assert httpx.get(srv.url + "/health").status_code == 200

            async def one() -> BaseException | None:
                try:
                    async for _ in engine.generate("r0", [1, 2, 3], SamplingParams(max_tokens=4)):
                        pass
                except BaseException as e:  # noqa: BLE001 - the error is what we check
                    return e
                return None

            t0 = time.monotonic()
            err = asyncio.run(one())
            assert isinstance(err, EngineDeadError), err
            assert "step 1 stalled: the device (cpu)" in str(err) and "0.5 s" in str(err)
            assert time.monotonic() - t0 < 10
            health = httpx.get(srv.url + "/health")
            assert health.status_code == 503 and "the device (cpu)" in health.text
            late = httpx.post(srv.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2})
            assert late.status_code == 503, late.text
    finally:
        release.set()
        engine.stop()
