"""AsyncLLMEngine: one background thread owns the (not thread-safe) LLMEngine; asyncio code talks to it.

Threads and what they touch:
    engine thread   the only caller of ``add_request``/``abort_request``/``step`` and the only reader of
                    the scheduler and block manager. It sleeps on the command queue while no request is
                    pending and steps while any is.
    event loop      submits commands (add, abort) through a thread-safe ``queue.Queue`` and reads
                    outputs from one ``asyncio.Queue`` per request, filled by the engine thread through
                    ``loop.call_soon_threadsafe``.

``snapshot`` is a frozen copy of the engine's counters, published by the engine thread twice per
iteration: after it applies the queued commands (just before a step) and after the step. The event loop and
metrics read only the snapshot, never the engine: the scheduler and block manager are not thread-safe, and
a step (seconds on a CPU) mutates them throughout. ``_lock`` guards the snapshot together with the count of
adds not yet seen by the engine, so admission control never counts a request twice or misses one.

What can be known while a step runs (``state()``, read by ``/metrics`` at scrape time) without touching the
engine: the adds the engine thread has not applied yet, the requests the event loop has handed over and not
yet seen end (added, minus finished, failed, rejected or aborted), and how long the current step has run.
Running requests, KV usage and preemptions are known only as of the last snapshot.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

from roofline.engine.llm_engine import LLMEngine
from roofline.outputs import RequestOutput
from roofline.sampling_params import SamplingParams
from roofline.worker.executor import ExecutorDeadError

logger = logging.getLogger(__name__)


class EngineOverloadedError(RuntimeError):
    """More requests are waiting than the admission limit allows (the API answers 503)."""

    def __init__(self, num_waiting: int, max_waiting: int):
        super().__init__(
            f"the server is overloaded: {num_waiting} requests are waiting and --max-waiting-requests is "
            f"{max_waiting}; retry later"
        )
        self.num_waiting = num_waiting
        self.max_waiting = max_waiting


class EngineDeadError(RuntimeError):
    """The engine thread is not running (stopped, or failed); requests cannot be served."""


@dataclass(frozen=True)
class EngineSnapshot:
    """Engine counters at the end of one engine-thread iteration.

    Requests are counted once each; sequences count the n samples of a request separately. A request
    is waiting while any of its sequences sits in the scheduler's waiting queue (never scheduled, or
    preempted).
    """

    num_running_requests: int = 0
    num_waiting_requests: int = 0
    num_running_seqs: int = 0
    num_waiting_seqs: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use, in [0, 1]
    num_preemptions: int = 0  # since the engine started
    num_unfinished_requests: int = 0
    num_steps: int = 0  # engine steps run by this AsyncLLMEngine
    # Prefix cache, since the engine started: prompt tokens looked up and found, blocks evicted.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_evictions: int = 0
    # Speculative decoding counters (None when it is off): a SpecDecodeStats copy.
    spec_decode: Any = None


@dataclass(frozen=True)
class EngineState:
    """What ``/metrics`` reads at scrape time: the last snapshot plus what is known live, during a step too.

    Attributes:
        snapshot: engine counters as of the last engine-thread publication (before or after a step).
        num_waiting_requests: live: adds queued for the engine thread plus the snapshot's waiting requests.
        num_unfinished_requests: live: requests accepted by ``add_request`` whose stream has not ended
            (finished, failed, rejected by the engine, or aborted), counted on the event-loop side.
        step_elapsed_s: live: seconds the engine step now running has taken so far; 0.0 between steps.
    """

    snapshot: EngineSnapshot
    num_waiting_requests: int
    num_unfinished_requests: int
    step_elapsed_s: float


_ABORTED = object()  # queue sentinel: the request was aborted from the event-loop side


class RequestStream:
    """Outputs of one request, in order. Iterate with ``async for``; ends after the finished output.

    ``put`` is called from the engine thread, everything else from the event loop. ``on_end`` runs once,
    on the event loop, when the request ends: its finished output or its error arrives there, or it is
    aborted from the event-loop side (whichever comes first), whether or not anyone iterates the stream.
    """

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 on_end: Callable[[], None] | None = None):
        self.request_id = request_id
        self._loop = loop
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._on_end = on_end
        self.finished = False
        self.aborted = False

    def put(self, item: RequestOutput | BaseException) -> None:
        """Thread-safe: hand an output (or the error that ended the request) to the event loop."""
        try:
            self._loop.call_soon_threadsafe(self._deliver, item)
        except RuntimeError:  # the event loop is closed (server shut down); nobody is listening
            pass

    def _deliver(self, item: RequestOutput | BaseException) -> None:  # on the event loop
        self._queue.put_nowait(item)
        if isinstance(item, BaseException) or item.finished:
            self._end()

    def _mark_aborted(self) -> None:
        self.aborted = True
        self._queue.put_nowait(_ABORTED)
        self._end()

    def _end(self) -> None:
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if item is _ABORTED:
                return
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.finished:
                self.finished = True
            yield item


class AsyncLLMEngine:
    """Asyncio front of an ``LLMEngine`` driven by one background thread.

    Example (inside a running event loop)::

        async_engine = AsyncLLMEngine(engine); async_engine.start()
        stream = await async_engine.add_request("r1", token_ids, SamplingParams(max_tokens=8))
        async for out in stream: print(out.outputs[0].text_delta, end="")
    """

    def __init__(self, engine: LLMEngine, model_name: str | None = None):
        self.engine = engine
        # What clients call the model (e.g. "SmolLM2-135M-Instruct"); the config's name otherwise.
        self.model_name = model_name or engine.model_config.name
        self._commands: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self._streams: dict[str, RequestStream] = {}  # engine thread only
        self._lock = threading.Lock()
        self._num_pending_adds = 0  # adds submitted but not yet applied by the engine thread
        # Requests accepted by add_request, and those whose stream has ended (event-loop side; under _lock,
        # because apps on several event loops may share this engine).
        self._num_added = 0
        self._num_ended = 0
        self._step_started_at: float | None = None  # monotonic start of the running step; engine thread writes
        self._snapshot = EngineSnapshot()
        self._thread: threading.Thread | None = None
        self._stopped = threading.Event()
        self._closed = False  # the engine thread has stopped taking commands (under _lock)
        self.error: BaseException | None = None
        self._num_steps = 0
        self._publish()

    @classmethod
    def from_engine_args(cls, engine_args: Any) -> AsyncLLMEngine:
        """Build the engine from ``EngineArgs`` (loads weights: seconds to minutes)."""
        from roofline.engine_factory import engine_from_model
        from roofline.models import loader

        engine = engine_from_model(engine_args.model, engine_args.create_engine_config,
                                   load_format=engine_args.load_format)
        return cls(engine, model_name=loader.resolve_model(engine_args.model, engine_args.load_format).name)

    # ------------------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the engine thread (idempotent)."""
        if self._thread is not None and self._thread.is_alive():
            return
        self._stopped.clear()
        with self._lock:
            self._closed = False
        self._thread = threading.Thread(target=self._run, name="roofline-engine", daemon=True)
        self._thread.start()
        executor = getattr(self.engine, "executor", None)
        if executor is not None and not getattr(executor, "has_step_watchdog", False):
            threading.Thread(target=self._watch, args=(self._thread,), name="roofline-watchdog", daemon=True).start()

    def _watch(self, engine_thread: threading.Thread) -> None:
        """The step watchdog of a one-process engine (worker processes have the executor's): a step that runs past
        ``--step-timeout`` (default ``step_timeout_for`` the step budget: 300 s + 10 ms per token) marks the engine
        dead with a reason that names the device and the step, and fails every in-flight request; /health then
        answers 503. The stuck step cannot be interrupted from Python, so the engine does not recover: restart it.
        If the step ever returns, the engine thread sees the error and stops."""
        from roofline.worker.multiproc_executor import step_timeout_for

        cfg = self.engine.config
        limit = step_timeout_for(cfg.scheduler_config.max_num_batched_tokens, cfg.step_timeout)
        poll = min(1.0, limit / 10)
        while engine_thread.is_alive() and self.error is None:
            started = self._step_started_at
            if started is not None and time.monotonic() - started > limit:
                step = self._num_steps + 1
                msg = (f"step {step} stalled: the device ({cfg.device}) did not finish it within {limit:g} s "
                       f"(step timeout, --step-timeout); the engine is stopped, restart it")
                logger.error(msg)
                self.error = EngineDeadError(msg)
                with self._lock:
                    self._closed = True
                for stream in list(self._streams.values()):  # put() is thread-safe; the engine thread is stuck
                    stream.put(EngineDeadError(msg))
                return
            time.sleep(poll)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask the engine thread to abort everything and exit; wait up to ``timeout_s`` seconds."""
        if self._thread is None:
            return
        self._commands.put(("stop",))
        self._thread.join(timeout_s)
        self._thread = None

    @property
    def is_running(self) -> bool:
        # Not running from the moment the thread records its error (it fails every request first, then exits:
        # /health must not answer 200 in between) or closes to new requests. No lock: callers may hold _lock,
        # and each field is one atomic read.
        return self._thread is not None and self._thread.is_alive() and self.error is None and not self._closed

    @property
    def snapshot(self) -> EngineSnapshot:
        with self._lock:
            return self._snapshot

    @property
    def num_waiting_requests(self) -> int:
        """Requests not yet scheduled: queued for the engine thread plus the scheduler's waiting ones."""
        with self._lock:
            return self._num_pending_adds + self._snapshot.num_waiting_requests

    def state(self) -> EngineState:
        """The last snapshot and the live counts, read together; never waits for a step to end.

        The engine thread takes ``_lock`` only to publish a snapshot, never across a step.
        """
        started = self._step_started_at  # one read: the engine thread may reset it meanwhile
        elapsed = 0.0 if started is None else max(0.0, time.monotonic() - started)
        with self._lock:
            return EngineState(
                snapshot=self._snapshot,
                num_waiting_requests=self._num_pending_adds + self._snapshot.num_waiting_requests,
                num_unfinished_requests=self._num_added - self._num_ended,
                step_elapsed_s=elapsed,
            )

    def _request_ended(self) -> None:
        with self._lock:
            self._num_ended += 1

    # ------------------------------------------------------------------------------ requests (event loop)

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          arrival_time: float | None = None, max_waiting: int | None = None) -> RequestStream:
        """Queue a request; returns its output stream once the engine has accepted it.

        Args:
            arrival_time: ``time.monotonic()`` seconds when the request arrived (TTFT counts from it).
            max_waiting: admission limit; None admits everything.
        Raises:
            EngineOverloadedError: ``max_waiting`` requests are already waiting (nothing is queued).
            ValueError: the engine rejected the request (too-long prompt, ...); nothing is queued.
            EngineDeadError: the engine thread is not running.
        """
        loop = asyncio.get_running_loop()
        stream = RequestStream(request_id, loop, on_end=self._request_ended)
        accepted: asyncio.Future[None] = loop.create_future()
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        with self._lock:  # the engine thread closes under this lock: an add is either applied or refused here
            if self._closed or not self.is_running:
                raise EngineDeadError(f"the engine thread is not running (error: {self.error!r})")
            num_waiting = self._num_pending_adds + self._snapshot.num_waiting_requests
            if max_waiting is not None and num_waiting >= max_waiting:
                raise EngineOverloadedError(num_waiting, max_waiting)
            self._num_pending_adds += 1
            self._num_added += 1
            self._commands.put(("add", request_id, prompt, params, arrival, stream, accepted, loop))
        try:
            await accepted
        except asyncio.CancelledError:
            self.abort(request_id, stream)  # the caller went away while the add was in flight
            raise
        except BaseException:  # the engine rejected the request: it never ran
            stream._end()
            raise
        return stream

    def abort(self, request_id: str, stream: RequestStream | None = None) -> None:
        """Abort a request (client disconnect or cancel); the engine thread frees its KV blocks.

        Safe to call more than once and after the request finished. ``stream``, if given, ends at once.
        """
        if stream is not None and not stream.finished and not stream.aborted:
            stream._mark_aborted()
        self._commands.put(("abort", request_id))

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs; closing the iterator early aborts the request."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request_id, stream)

    # ------------------------------------------------------------------------------ the engine thread

    def _run(self) -> None:
        try:
            while True:
                idle = not self.engine.has_unfinished_requests()
                commands = self._drain(block=idle)
                if not self._apply(commands):
                    break
                if self.engine.has_unfinished_requests():
                    self._step()
                self._publish()
        except BaseException as e:  # a dead worker or a bug: fail every request, keep the error for /health
            logger.exception("engine thread failed")
            self.error = e
            dead = EngineDeadError(f"the engine stopped: {e}")
            dead.__cause__ = e
            self._fail_all(dead)
            raise
        finally:
            # Refuse later adds, and those queued but never applied (they would wait forever).
            with self._lock:
                self._closed = True
            late = [c for c in self._drain(block=False) if c[0] == "add"]
            with self._lock:
                self._num_pending_adds -= len(late)
            for cmd in late:
                _resolve(cmd[7], cmd[6], EngineDeadError(f"the engine thread stopped (error: {self.error!r})"))
            self._fail_all(EngineDeadError("the engine thread stopped"))
            self._stopped.set()

    def _drain(self, block: bool) -> list[tuple[Any, ...]]:
        commands = []
        if block:
            commands.append(self._commands.get())
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[tuple[Any, ...]]) -> bool:
        """Apply add/abort/stop commands in order; False when asked to stop."""
        num_adds = 0
        keep_running = True
        for cmd in commands:
            kind = cmd[0]
            if kind == "add":
                num_adds += 1
                _, request_id, prompt, params, arrival, stream, accepted, loop = cmd
                try:
                    self.engine.add_request(request_id, prompt, params, arrival_time=arrival)
                except Exception as e:  # ValueError from validation, names the field and range
                    _resolve(loop, accepted, e)
                    continue
                self._streams[request_id] = stream
                _resolve(loop, accepted, None)
            elif kind == "abort":
                request_id = cmd[1]
                self.engine.abort_request(request_id)
                self._streams.pop(request_id, None)
            elif kind == "stop":
                for request_id in list(self._streams):
                    self.engine.abort_request(request_id)
                keep_running = False
        with self._lock:
            self._num_pending_adds -= num_adds
            self._snapshot = self._take_snapshot()
        return keep_running

    def _step(self) -> None:
        self._step_started_at = time.monotonic()
        try:
            outputs = self.engine.step()
            self._num_steps += 1
            if self.error is not None:  # the watchdog gave up on this step meanwhile: its requests have ended
                raise EngineDeadError(str(self.error))
        except (ExecutorDeadError, EngineDeadError):
            raise  # a dead worker process or a stalled step: the thread stops, /health and new requests answer 503
        except Exception as e:
            # The engine state is suspect after a failed step: end every request with the error.
            logger.exception("engine step failed; aborting all requests")
            for request_id, stream in list(self._streams.items()):
                self.engine.abort_request(request_id)
                stream.put(RuntimeError(f"engine step failed: {e!r}"))
            self._streams.clear()
            return
        finally:
            self._step_started_at = None
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted while the step ran
            stream.put(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail_all(self, error: BaseException) -> None:
        for stream in self._streams.values():
            stream.put(error)
        self._streams.clear()

    def _take_snapshot(self) -> EngineSnapshot:
        sched = self.engine.scheduler
        bm = self.engine.block_manager
        waiting = list(sched.waiting)
        running = list(sched.running)
        return EngineSnapshot(
            num_running_requests=len({s.request_id for s in running}),
            num_waiting_requests=len({s.request_id for s in waiting}),
            num_running_seqs=len(running),
            num_waiting_seqs=len(waiting),
            num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_blocks,
            kv_cache_usage=bm.usage,
            num_preemptions=sched.num_preemptions,
            num_unfinished_requests=self.engine.num_unfinished_requests,
            num_steps=self._num_steps,
            prefix_cache_queries=self.engine.stats.num_prefix_cache_queries,
            prefix_cache_hits=self.engine.stats.num_prefix_cache_hits,
            prefix_cache_evictions=self.engine.stats.num_prefix_cache_evictions,
            spec_decode=(self.engine.spec_stats.copy() if getattr(self.engine, "spec_config", None) is not None
                         else None),
        )

    def _publish(self) -> None:
        snap = self._take_snapshot()
        with self._lock:
            self._snapshot = snap


def _resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future[None], error: BaseException | None) -> None:
    """Complete ``fut`` on its loop from another thread (ignored if it was cancelled meanwhile)."""

    def done() -> None:
        if fut.done():
            return
        if error is None:
            fut.set_result(None)
        else:
            fut.set_exception(error)

    try:
        loop.call_soon_threadsafe(done)
    except RuntimeError:
        pass
