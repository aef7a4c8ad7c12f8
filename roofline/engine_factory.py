"""Where an ``LLMEngine`` is built: the model is resolved, its executor (``roofline.worker``) started and handed
to the engine, which itself imports no worker code (``tests/test_layering.py``). ``LLM``, the server and the
benchmarks build engines here."""

from __future__ import annotations

from typing import Any

from roofline.config import EngineConfig, ModelConfig
from roofline.engine.llm_engine import LLMEngine
from roofline.models import loader
from roofline.worker.executor import Executor, UniProcExecutor


def build_executor(config: EngineConfig, source: loader.ModelSource, model_config: ModelConfig) -> Executor:
    """The executor ``config.parallel_config`` asks for: one rank of a ``torchrun`` job
    (``external_launcher``), one worker process per rank (tensor or pipeline size > 1, or ``mp``), else one
    worker in this process."""
    if config.parallel_config.distributed_executor_backend == "external_launcher":
        from roofline.worker.external_launcher import ExternalLauncherExecutor

        return ExternalLauncherExecutor(config, source, model_config)
    if config.parallel_config.uses_worker_processes:
        from roofline.worker.multiproc_executor import MultiprocExecutor

        return MultiprocExecutor(config, source, model_config)
    return UniProcExecutor(config, source, model_config)


def build_engine(config: EngineConfig, source: loader.ModelSource, model_config: ModelConfig,
                 tokenizer: Any = None) -> LLMEngine:
    """Start the executor ``config`` asks for on ``source`` and build the engine around it. A failure while
    the engine is built shuts the executor's worker processes down before it propagates."""
    executor = build_executor(config, source, model_config)
    try:
        return LLMEngine(config, executor, model_config, tokenizer)
    except BaseException:
        executor.shutdown()
        raise


def engine_from_model(model: str | None, config_factory: Any = None, load_format: str = "auto") -> LLMEngine:
    """Resolve ``model`` (a path, a Hugging Face id or a preset name), read its config and tokenizer, and build
    the engine. ``config_factory(model_config) -> EngineConfig`` lets callers (the CLI, ``LLM``) fill the rest.

    Raises:
        ValueError: from ``loader.resolve_model`` (an unknown model or load format) or the engine's checks.
    """
    source = loader.resolve_model(model, load_format)
    model_config = loader.load_config(source)
    config = config_factory(model_config) if config_factory else EngineConfig(model_config=model_config)
    return build_engine(config, source, model_config, loader.load_tokenizer(source))
