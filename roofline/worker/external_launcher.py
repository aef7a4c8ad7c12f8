"""Multi-node (and single-node) runs under ``torchrun``: vLLM's ``external_launcher`` backend.

``torchrun`` starts every process, on every node, and sets ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR`` and ``MASTER_PORT``. Each process runs the same script, so the same engine on the same
requests, and holds one rank's worker in-process: it joins the ``env://`` group (NCCL on GPUs, gloo on CPUs),
takes its place in the layout (``init_parallel_state``: tensor parallelism inside a node, pipeline stages
across nodes when each node runs ``tensor_parallel_size`` processes) and builds its shard of the model.

The engines stay in lockstep because their inputs are identical and their scheduling is deterministic: the
KV pool (and, on CPU, the profiled step budget) is the minimum over ranks, agreed with one all-reduce, and
every rank takes the last stage's ``StepOutput`` (``PendingStep``'s broadcast under pipeline parallelism; the
same gathered logits and seeds under tensor parallelism). Offline use only (``LLM``): a server would receive
requests on one rank. See docs/distributed.md for the launch commands.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace

from roofline.config import EngineConfig, ModelConfig
from roofline.models import loader
from roofline.worker.executor import UniProcExecutor

logger = logging.getLogger(__name__)

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


class ExternalLauncherExecutor(UniProcExecutor):
    """This process's rank of a ``torchrun`` job (see the module docstring).

    Raises:
        RuntimeError: a torchrun variable is missing, or ``WORLD_SIZE`` is not ``tensor_parallel_size x
            pipeline_parallel_size`` (names both).
    """

    def __init__(self, config: EngineConfig, source: loader.ModelSource, model_config: ModelConfig):
        import torch
        import torch.distributed as dist

        from roofline.worker.multiproc_executor import init_parallel_state
        from roofline.worker.worker import Worker

        missing = [v for v in _TORCHRUN_VARS if v not in os.environ]
        if missing:
            raise RuntimeError(f"distributed_executor_backend 'external_launcher' runs under torchrun, which sets "
                               f"{', '.join(_TORCHRUN_VARS)}; missing: {', '.join(missing)}")
        pc = config.parallel_config
        rank, world, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
        if world != pc.world_size:
            raise RuntimeError(f"torchrun WORLD_SIZE {world} != tensor_parallel_size {pc.tensor_parallel_size} x "
                               f"pipeline_parallel_size {pc.pipeline_parallel_size} = {pc.world_size}")
        on_cuda = config.device.startswith("cuda")
        if on_cuda:
            torch.cuda.set_device(local)
            config = replace(config, device=f"cuda:{local}")
        if not dist.is_initialized():
            dist.init_process_group("nccl" if on_cuda else "gloo", init_method="env://", rank=rank,
                                    world_size=world)
        init_parallel_state(config, model_config, rank)
        self.rank = rank
        self.worker = Worker(config, source, model_config)
        self._num_blocks = self._agree_min(self.worker.num_blocks)
        logger.info("torchrun rank %d of %d (local rank %d): %d KV blocks (the minimum over ranks)", rank, world,
                    local, self._num_blocks)

    def _agree_min(self, value: int) -> int:
        """The minimum of ``value`` over every rank (one all-reduce), so every engine schedules alike."""
        import torch
        import torch.distributed as dist

        t = torch.tensor([value], dtype=torch.int64, device=self.worker.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
        return int(t.item())

    @property
    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def profile_budget(self) -> int:
        return self._agree_min(self.worker.profile_budget())

    def shutdown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
