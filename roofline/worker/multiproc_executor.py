"""Tensor and pipeline parallelism: one worker process per rank, driven by the engine's process (vLLM's ``mp``
backend).

The driver (the engine's process) holds no model. It starts ``tensor_parallel_size x pipeline_parallel_size``
processes with the ``spawn`` method; each joins a ``torch.distributed`` group (NCCL on GPUs, gloo on CPUs;
rendezvous on a free loopback port, or ``env://`` when ``MASTER_ADDR`` is set), takes its place in the layout
(``init_parallel_state``: rank r is tensor-parallel rank r % tp of pipeline stage r // tp) and builds a
``Worker``. Within a stage the layers hold 1/tp of each weight: qkv and gate_up column-parallel, o and down
row-parallel with an all-reduce, the embedding and LM head split by vocabulary (logits gathered). A stage holds
only its decoder layers, and passes (hidden, residual) to the next with send/recv (``Worker._pipeline_forward``).

Every step the driver sends the same ``StepInput`` (only what changed: new requests, new blocks and progress,
never whole histories) down one pipe per rank; every rank runs the step, their collectives keeping them in
lockstep. The last stage samples (its tensor-parallel ranks alike: the same gathered logits and the same seeds)
and broadcasts its ``StepOutput`` to every rank; rank 0's comes back.

Failures never hang the driver: a rank that raises sends its traceback, and a rank that dies is seen through
its process sentinel. Either way the executor raises ``ExecutorDeadError`` naming the rank, the exit code or
the error, stops the other ranks (which may be blocked inside a collective) and refuses further steps.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import socket
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection, wait
from typing import Any

from roofline.config import EngineConfig, ModelConfig
from roofline.models import loader
from roofline.step import StepInput, StepOutput
from roofline.worker.executor import Executor, ExecutorDeadError

logger = logging.getLogger(__name__)

POLL_S = 1.0  # how often a waiting driver checks that every rank is alive
STEP_TIMEOUT_BASE_S = 300.0  # the default step watchdog: this, plus STEP_TIMEOUT_PER_TOKEN_S per token
STEP_TIMEOUT_PER_TOKEN_S = 0.01  # (an 8192-token CPU prefill chunk of a 1B model takes ~20 s on 2 cores)


def step_timeout_for(num_tokens: int, configured: float | None) -> float:
    """Seconds a step of ``num_tokens`` scheduled tokens may take: ``configured`` (``--step-timeout``), else
    300 s + 10 ms per token, generous so that only a stuck rank (stopped, deadlocked) trips it."""
    return configured if configured is not None else STEP_TIMEOUT_BASE_S + STEP_TIMEOUT_PER_TOKEN_S * num_tokens


def _process_state(pid: int | None) -> str | None:
    """Linux /proc state letter of ``pid`` ("T": stopped, e.g. by SIGSTOP), None where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


DEATH_GRACE_S = 1.0  # after a rank's error, how long to look for a dead peer that caused it
_MAIN_GUARD_HINT = ("worker processes are spawned and import the main module: a script that creates "
                    "LLM(tensor_parallel_size=N) must do so under `if __name__ == \"__main__\":`")


@dataclass
class WorkerInfo:
    """What the engine and reports read from a worker, taken at start-up (one rank's figures; see ``_step_info``
    for the executor's summary of all ranks)."""

    dtype: Any
    device: Any
    weight_bytes: int
    weight_bytes_per_step: int
    kv_bytes_per_token: int
    num_blocks: int
    config: EngineConfig
    graphs: Any = None  # not None where rank 0 captured CUDA graphs (a marker, not the runner)


def _step_info(infos: list[WorkerInfo], config: EngineConfig) -> WorkerInfo:
    """Rank 0's figures, with the bytes a decode step reads (``weight_bytes_per_step``, ``kv_bytes_per_token``)
    counted for the memory system that serves them, which is what the decode floor divides by one device's
    bandwidth: on GPUs each rank reads its own memory, and the stages of a pipeline run one after another, so
    the bytes of tensor-parallel rank 0 of every stage; on a CPU every rank shares the host's memory, so every
    rank's bytes (the whole model's). ``weight_bytes`` (memory held) stays rank 0's."""
    pc = config.parallel_config
    tp = pc.tensor_parallel_size
    ranks = (range(0, len(infos), tp) if config.device.startswith("cuda") else range(len(infos)))
    return replace(infos[0], weight_bytes_per_step=sum(infos[r].weight_bytes_per_step for r in ranks),
                   kv_bytes_per_token=sum(infos[r].kv_bytes_per_token for r in ranks))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_parallel_state(config: EngineConfig, model_config: ModelConfig, rank: int) -> None:
    """Set this process's place in the layout (``parallel_state``) once ``torch.distributed`` is up: rank r is
    tensor-parallel rank r % tp of stage r // tp, which holds that stage's share of the layers. Every rank
    creates every stage's group, in the same order (``new_group`` is collective)."""
    import torch.distributed as dist

    from roofline.distributed.parallel_state import ParallelState, set_parallel_state, stage_layer_ranges

    pc = config.parallel_config
    tp, pp = pc.tensor_parallel_size, pc.pipeline_parallel_size
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)] if pp > 1 else [None]
    partition = list(pc.pipeline_layer_partition) if pc.pipeline_layer_partition else None
    ranges = stage_layer_ranges(model_config.num_hidden_layers, pp, partition)
    stage = rank // tp
    set_parallel_state(ParallelState(rank % tp, tp, stage, pp, groups[stage], ranges[stage] if pp > 1 else None,
                                     enable_expert_parallel=pc.enable_expert_parallel))


def _worker_main(rank: int, world: int, init_method: str, config: EngineConfig, source: loader.ModelSource,
                 model_config: ModelConfig, conn: Connection) -> None:
    """A rank's process: join the group, build the worker, then serve ``(method, args)`` calls until told to
    stop. Replies ``("ok", value)`` (rank 0's value; None from the others) or ``("error", traceback)``."""
    import torch
    import torch.distributed as dist

    try:
        on_cuda = config.device.startswith("cuda")
        if on_cuda:
            torch.cuda.set_device(rank)
            config = replace(config, device=f"cuda:{rank}")
        else:
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        dist.init_process_group("nccl" if on_cuda else "gloo", init_method=init_method, rank=rank,
                                world_size=world)
        init_parallel_state(config, model_config, rank)
        from roofline.worker.worker import Worker

        worker = Worker(config, source, model_config)
        conn.send(("ok", WorkerInfo(worker.dtype, worker.device, worker.weight_bytes, worker.weight_bytes_per_step,
                                    worker.kv_bytes_per_token, worker.num_blocks, config,
                                    True if worker.graphs is not None else None)))

        def reply(value: Any) -> None:
            conn.send(("ok", value if rank == 0 else None))

        # With async scheduling the driver sends step N+1 before it waits for step N. A step in flight is
        # answered as soon as the device finishes it, unless the next step arrives first: that one is launched
        # before the answer, so the device never waits for this process's input preparation (the in-process
        # engine's overlap, kept across the pipe). Not with pipeline stages, whose results are collectives.
        overlap = worker.pp.pp_size == 1
        inflight = None
        while True:
            if inflight is not None:
                while not conn.poll(0) and not inflight.done():
                    pass  # spin: a blocking wait could not watch the pipe and the device together
                if not conn.poll(0):
                    reply(inflight.result())
                    inflight = None
                    continue
            method, args = conn.recv()
            if method == "execute_model" and overlap:
                try:
                    launched = worker.execute_model_async(*args)
                finally:  # answers stay in order, even when this launch raised
                    if inflight is not None:
                        reply(inflight.result())
                inflight = launched
                continue
            if inflight is not None:
                reply(inflight.result())
                inflight = None
            if method == "shutdown":
                break
            if method == "execute_model":
                out = worker.execute_model_async(*args).result()
            else:
                out = getattr(worker, method)(*args)
            reply(out)
    except (EOFError, KeyboardInterrupt):  # the driver went away
        pass
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except (BrokenPipeError, EOFError, OSError):
            pass
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - a peer may be gone
                pass


class _Pending:
    """A step sent to every rank; ``result()`` waits for every rank's reply."""

    def __init__(self, executor: MultiprocExecutor, step: StepInput, number: int, timeout_s: float):
        self.executor = executor
        self.step_input = step
        self.number, self.timeout_s = number, timeout_s
        self.deadline = time.monotonic() + timeout_s  # the watchdog's

    def result(self) -> StepOutput:
        ex = self.executor
        ex._deadline, ex._step_count, ex._step_timeout_s = self.deadline, self.number, self.timeout_s
        return ex._collect()


class MultiprocExecutor(Executor):
    """``tensor_parallel_size`` worker processes (see the module docstring).

    Raises:
        ExecutorDeadError: a rank failed or died during start-up (names it, with its error or exit code).
    """

    has_step_watchdog = True  # the driver waits for each rank at most step_timeout_for(...) seconds

    def __init__(self, config: EngineConfig, source: loader.ModelSource, model_config: ModelConfig):
        world = config.parallel_config.world_size
        if os.environ.get("MASTER_ADDR"):
            init_method = "env://"
        else:
            init_method = f"tcp://127.0.0.1:{_free_port()}"
        ctx = mp.get_context("spawn")
        self.world = world
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.dead: str | None = None
        self.step_timeout = config.step_timeout
        self._deadline: float | None = None  # the running step's watchdog deadline (time.monotonic)
        self._step_count = 0
        self._steps_sent = 0
        self._step_timeout_s = 0.0
        for rank in range(world):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_worker_main, name=f"roofline-tp{rank}",
                            args=(rank, world, init_method, config, source, model_config, child), daemon=True)
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)
        try:
            infos = [self._recv(r) for r in range(world)]
        except ExecutorDeadError as e:
            raise ExecutorDeadError(f"{e}\n(while starting; {_MAIN_GUARD_HINT})") from None
        self.rank_infos: list[WorkerInfo] = infos
        self.worker: WorkerInfo = _step_info(infos, config)
        self._num_blocks = min(i.num_blocks for i in infos)
        pc = config.parallel_config
        logger.info("%d worker processes (tensor parallel %d x pipeline parallel %d, %s), %d KV blocks per rank",
                    world, pc.tensor_parallel_size, pc.pipeline_parallel_size,
                    "nccl" if config.device.startswith("cuda") else "gloo", self._num_blocks)

    # ------------------------------------------------------------------------------ messaging

    def _fail(self, message: str) -> ExecutorDeadError:
        self.dead = message
        logger.error("%s", message)
        self.shutdown()
        return ExecutorDeadError(message)

    def _recv(self, rank: int) -> Any:
        """Rank ``rank``'s next reply, watching every rank's process meanwhile (a dead one raises)."""
        conn = self.conns[rank]
        while True:
            ready = wait([conn] + [p.sentinel for p in self.procs], timeout=POLL_S)
            if conn in ready:
                try:
                    status, value = conn.recv()
                except (EOFError, OSError):
                    status, value = "died", None
                if status == "ok":
                    return value
                if status == "error":
                    # A peer's death makes the others' collectives fail ("connection closed"): name the dead
                    # rank as the cause when there is one.
                    wait([p.sentinel for p in self.procs], timeout=DEATH_GRACE_S)
                    dead = self._dead_rank()
                    if dead is not None:
                        raise self._fail(f"{dead}; rank {rank} then failed:\n{value}")
                    raise self._fail(f"worker rank {rank} failed:\n{value}")
            dead = self._dead_rank()
            if dead is not None:
                raise self._fail(dead)
            if self._deadline is not None and time.monotonic() > self._deadline:
                raise self._fail(self._stalled(rank))

    def _stalled(self, rank: int) -> str:
        """The watchdog's message: the step, its timeout and the rank(s) that stalled it."""
        stopped = [r for r, p in enumerate(self.procs) if _process_state(p.pid) == "T"]
        for r in stopped:  # SIGTERM waits for a stopped process to continue; SIGKILL does not
            self.procs[r].kill()
        who = (", ".join(f"worker rank {r} (pid {self.procs[r].pid}) is stopped" for r in stopped) if stopped
               else f"worker rank {rank} (pid {self.procs[rank].pid}) did not answer")
        return (f"step {self._step_count} stalled: {who}; no reply within the step timeout of "
                f"{self._step_timeout_s:g} s (--step-timeout); the workers were stopped, restart the engine")

    def _dead_rank(self) -> str | None:
        for r, p in enumerate(self.procs):
            if not p.is_alive():
                return f"worker rank {r} (pid {p.pid}) died with exit code {p.exitcode}"
        return None

    def _send_all(self, method: str, *args: Any) -> None:
        if self.dead is not None:
            raise ExecutorDeadError(f"the executor is dead: {self.dead}")
        for rank, conn in enumerate(self.conns):
            try:
                conn.send((method, args))
            except (BrokenPipeError, OSError):
                p = self.procs[rank]
                p.join(timeout=1.0)
                raise self._fail(f"worker rank {rank} (pid {p.pid}) died with exit code "
                                 f"{p.exitcode}") from None

    def _collect(self) -> Any:
        try:
            values = [self._recv(r) for r in range(self.world)]
        finally:
            self._deadline = None
        return values[0]

    def _call(self, method: str, *args: Any) -> Any:
        self._send_all(method, *args)
        return self._collect()

    # ------------------------------------------------------------------------------ Executor

    def execute_model_async(self, step: StepInput) -> Any:
        self._send_all("execute_model", step)
        self._steps_sent += 1
        return _Pending(self, step, self._steps_sent,
                        step_timeout_for(sum(n for _, n in step.scheduled), self.step_timeout))

    @property
    def num_kv_blocks(self) -> int:
        return self._num_blocks

    def profile_budget(self) -> int:
        return self._call("profile_budget")

    def shutdown(self) -> None:
        for conn in self.conns:
            try:
                conn.send(("shutdown", ()))
            except (BrokenPipeError, OSError):
                pass
        for p in self.procs:
            p.join(timeout=2.0)
            if p.is_alive():  # blocked in a collective with a dead peer
                p.kill()
                p.join(timeout=2.0)
        for conn in self.conns:
            conn.close()
        self.conns = []
        self.procs = []

    def __del__(self) -> None:
        if getattr(self, "procs", None):
            self.shutdown()
