"""The worker's paths outside the step loop: scoring a sequence (``roofline eval``) and timing a prefill to
size the per-step token budget on CPUs (``profile_budget``). Both read the model and the KV cache through the
same attention backend as generation, and touch neither the persistent batch nor the sampler."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from roofline.attention.backend import paged_metadata, slot_mapping

logger = logging.getLogger(__name__)

CPU_STEP_TARGET_S = 0.5  # a CPU step's token budget aims below this (see profile_budget)


@torch.inference_mode()
def score(worker: Any, token_ids: list[int], block_ids: list[int], chunk_size: int | None = None,
          hidden_states: bool = False) -> torch.Tensor:
    """Next-token log-probabilities at every position of one sequence: the evaluation path.

    The sequence runs as a chunked prefill outside the step loop: chunks of ``chunk_size`` tokens (default:
    the step's token budget, ``max_num_batched_tokens``) store their K/V in ``block_ids`` and attend to
    the earlier chunks through the KV cache, so each score sees the cache's format exactly as generation
    does (a quantized cache is read back through attention, prefill included). Only the slots of
    ``block_ids`` are written; the persistent batch, the sampler and the step counter are untouched, so
    requests in flight are not disturbed as long as the caller owns ``block_ids`` (``LLM.score_logprobs``
    takes them from the engine's block allocator).

    Args:
        token_ids: [T] ids in [0, vocab_size), 1 <= T <= max_model_len.
        block_ids: >= ceil(T / block_size) KV block ids reserved for this call, each in [0, num_blocks).
        chunk_size: tokens per forward pass, >= 1.

    Returns:
        [T, vocab_size] fp32 log-probabilities on the worker's device. Row t is the distribution of token
        t+1 given tokens 0..t (the last row predicts past the sequence). With ``hidden_states``: the final
        (normed) hidden states [T, hidden_size] in the model dtype instead, the LM head's input (the features
        a learned drafter trains on, ``roofline.spec_decode.train``).

    Raises:
        ValueError: an empty or too long sequence, an id out of range, too few or out-of-range blocks,
            or chunk_size < 1.
    """
    n_tokens = len(token_ids)
    max_len = worker.config.scheduler_config.max_model_len
    if not 1 <= n_tokens <= max_len:
        raise ValueError(f"score needs 1 <= len(token_ids) <= max_model_len ({max_len}), got {n_tokens}")
    vocab = worker.model_config.vocab_size
    bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
    if bad:
        raise ValueError(f"token id {bad[0]!r} is out of range [0, {vocab})")
    bs = worker.block_size
    need = -(-n_tokens // bs)
    if len(block_ids) < need or any(not 0 <= b < worker.num_blocks for b in block_ids[:need]):
        raise ValueError(f"score of {n_tokens} tokens needs {need} block ids in [0, {worker.num_blocks}), "
                         f"got {list(block_ids[:need + 1])}")
    chunk = chunk_size if chunk_size is not None else worker.config.scheduler_config.max_num_batched_tokens
    if chunk < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk}")
    dev = worker.device
    table = np.asarray(block_ids[:need], dtype=np.int32)  # [need]
    pos = np.arange(n_tokens, dtype=np.int64)  # [T]
    slots = slot_mapping(table[None, :], np.zeros(n_tokens, dtype=np.int64), pos, bs)  # [T] flat cache slots
    ids, positions = torch.tensor(token_ids, dtype=torch.int64, device=dev), torch.from_numpy(pos).to(dev)
    width = worker.model_config.hidden_size if hidden_states else vocab
    out = torch.empty(n_tokens, width, dtype=worker.dtype if hidden_states else torch.float32, device=dev)
    for start in range(0, n_tokens, chunk):
        end = min(n_tokens, start + chunk)
        n = end - start
        meta = paged_metadata(slots[start:end], np.array([0, n]), np.array([end]), table[None, :], dev)
        hidden = worker.model(ids[start:end], positions[start:end], worker.backend.build_metadata(meta))
        if hidden_states:
            out[start:end] = hidden
            continue
        out[start:end] = torch.log_softmax(worker.model.compute_logits(hidden), dim=-1)  # [n, V] fp32
    return out


@torch.inference_mode()
def profile_budget(worker: Any, probe_tokens: int = 256) -> int:
    """The per-step token budget whose prefill stays under ``CPU_STEP_TARGET_S``.

    Rule: time one forward pass of a ``probe_tokens``-token prefill (after one warm-up), scale linearly
    to ``CPU_STEP_TARGET_S`` and round down to ``BUDGET_GRID`` (64 at least). Nothing is written to
    the KV cache (every slot is -1). Measured once per model shape, device and dtype in a process.
    """
    key = (worker.model_config, str(worker.device), worker.dtype, worker.config.attention_backend)
    return _profiled_budget(key, lambda: _time_prefill(worker, probe_tokens), probe_tokens)


def _time_prefill(worker: Any, n: int) -> float:
    n = min(n, worker.config.scheduler_config.max_model_len, worker.num_blocks * worker.block_size)
    nb = -(-n // worker.block_size)
    dev = worker.device
    meta = paged_metadata(np.full(n, -1, dtype=np.int64), np.array([0, n]), np.array([n]),
                          np.arange(nb, dtype=np.int32)[None, :], dev)
    ids = torch.zeros(n, dtype=torch.int64, device=dev)
    pos = torch.arange(n, dtype=torch.int64, device=dev)
    inter = worker.stage.probe_input(n)  # a later pipeline stage runs on zero activations
    times = []
    for _ in range(2):
        t0 = time.perf_counter()
        worker.model(ids, pos, worker.backend.build_metadata(meta), inter)
        times.append(time.perf_counter() - t0)
    return times[-1] / n


_BUDGETS: dict[object, int] = {}
# The budgets the profile picks from: powers of two and their 1.5x multiples, 64 to 2048. A coarse grid, so that
# the timing's run-to-run noise (the main job's budget came out 1392-1488 in one hour on a 16-multiple grid) rarely
# moves it: the prefill chunk boundaries, and with them a bf16 run's greedy tokens, repeat from run to run.
BUDGET_GRID = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)


def _profiled_budget(key: object, seconds_per_token: Callable[[], float], probe_tokens: int) -> int:
    if key not in _BUDGETS:
        per_token = seconds_per_token()
        budget = int(CPU_STEP_TARGET_S / max(per_token, 1e-9))
        _BUDGETS[key] = max([b for b in BUDGET_GRID if b <= budget], default=BUDGET_GRID[0])
        logger.info("measured prefill %.2f ms/token at %d tokens: per-step token budget %d (target %.1f s)",
                    per_token * 1e3, probe_tokens, _BUDGETS[key], CPU_STEP_TARGET_S)
    return _BUDGETS[key]
