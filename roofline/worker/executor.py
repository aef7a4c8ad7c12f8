"""Executors drive workers. The engine talks only to an ``Executor``: a ``StepInput`` in, a ``StepOutput``
back. ``UniProcExecutor`` runs one worker in this process; ``MultiprocExecutor``
(``roofline.worker.multiproc_executor``) sends the same ``StepInput`` to one worker process per rank (tensor
and pipeline parallel); ``ExternalLauncherExecutor`` (``roofline.worker.external_launcher``) is one rank of a
``torchrun`` job, every process running the engine. None of them changes the scheduler.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from roofline.config import EngineConfig, ModelConfig
from roofline.models import loader
from roofline.step import DeviceProfile, StepInput, StepOutput


class ExecutorDeadError(RuntimeError):
    """A worker process died or failed; the executor cannot run further steps (the server then stops its
    engine thread and answers 503 ``engine_dead``)."""


class Executor(ABC):
    """The base of the executors; implements ``roofline.step.Executor``. ``worker`` is the in-process worker, or
    a rank's figures taken at start-up (``MultiprocExecutor``): dtype, device, weight and KV bytes."""

    worker: Any
    # True where the executor enforces --step-timeout itself (worker processes); the server's one-process
    # watchdog (``AsyncLLMEngine``) covers the others.
    has_step_watchdog = False

    @abstractmethod
    def execute_model_async(self, step: StepInput) -> Any:
        """Launch one step on every worker; the returned handle's ``result()`` gives the ``StepOutput``
        (sampled tokens, identical on every rank) and its ``step_input`` is ``step``."""

    def execute_model(self, step: StepInput) -> StepOutput:
        """Run one step and wait for it."""
        return self.execute_model_async(step).result()

    @property
    @abstractmethod
    def num_kv_blocks(self) -> int:
        """KV blocks every worker can hold (the minimum over workers)."""

    @abstractmethod
    def profile_budget(self) -> int:
        """Per-step token budget measured on the workers (see ``Worker.profile_budget``)."""

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes per token on one worker."""
        return int(self.worker.kv_bytes_per_token)

    def device_profile(self) -> DeviceProfile:
        """Read bandwidth and GEMM rate measured on the worker's device (in this process: the device is the
        same on every rank), with the model's bytes per step (``roofline.hardware``)."""
        from roofline import hardware as hw

        w = self.worker
        dtype = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}[str(w.dtype).removeprefix("torch.")]
        draft = getattr(w, "draft", None)
        return DeviceProfile(read_bandwidth=hw.measure_read_bandwidth(str(w.device)),
                             gemm_flops=hw.measure_gemm_flops(str(w.device), dtype), dtype=dtype,
                             weight_bytes_per_step=int(w.weight_bytes_per_step),
                             kv_bytes_per_token=int(w.kv_bytes_per_token),
                             draft_weight_bytes=int(draft.weight_bytes) if draft is not None else None)

    def shutdown(self) -> None:  # noqa: B027 - nothing to release in-process
        """Stop worker processes, if any."""


class UniProcExecutor(Executor):
    """One worker, in this process."""

    def __init__(self, config: EngineConfig, source: loader.ModelSource, model_config: ModelConfig):
        from roofline.worker.worker import Worker

        self.worker = Worker(config, source, model_config)

    def execute_model_async(self, step: StepInput) -> Any:
        return self.worker.execute_model_async(step)

    @property
    def num_kv_blocks(self) -> int:
        return self.worker.num_blocks

    def profile_budget(self) -> int:
        return self.worker.profile_budget()

