"""The worker: owns the model, the attention backend (and through it the KV pool), the sampler, the
persistent input batch and the CUDA graphs. ``execute_model_async(StepInput).result() -> StepOutput`` is one step.

Per step:
1. ``update_states``: forget finished/preempted sequences, add new ones, append new blocks.
2. ``prepare_inputs``: vectorized gathers over the persistent batch give input_ids, positions,
   slot_mapping, block tables and query_start_loc; they go to the device from pinned host buffers with
   non-blocking copies, and the backend builds its metadata once.
3. forward (a CUDA graph for decode-only steps that fit one, else eager), logits of the rows that sample,
   the sampler, and one device->host copy of the sampled ids: the step's only host sync. Requests with
   prompt logprobs also get logits at their prompt positions (``prompt_logprobs.py``), copied back alike.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from roofline.attention.backend import AttentionMetadata, get_attention_backend
from roofline.attention.kv_cache import KVCachePool, kv_bytes_per_token
from roofline.config import EngineConfig, ModelConfig
from roofline.distributed.parallel_state import divide, get_parallel_state, get_tp_size
from roofline.engine.sequence import Logprob
from roofline.engine.step import StepInput, StepOutput
from roofline.layers import dispatch
from roofline.layers.rotary import RotaryEmbedding
from roofline.layers.sampler import NONFINITE_MESSAGE, Sampler, SamplingMetadata
from roofline.models import loader
from roofline.models.registry import build_model
from roofline.quant import get_quant_config
from roofline.worker.cuda_graph import DEFAULT_LADDER, CUDAGraphRunner
from roofline.worker.draft_model import DraftModel
from roofline.worker.input_batch import InputBatch
from roofline.worker.prompt_logprobs import (
    PromptLogprobsPlan,
    collect_prompt_logprobs,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
)

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_DTYPES = {**_DTYPES, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
CPU_DEFAULT_KV_CACHE_BYTES = 2 << 30
CPU_STEP_TARGET_S = 0.5  # a CPU step's token budget aims below this (see Worker.profile_budget)


class Worker:
    def __init__(self, config: EngineConfig, source: loader.ModelSource, model_config: ModelConfig):
        self.config = config
        self.model_config = mc = model_config
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        self.kv_dtype = _KV_DTYPES[config.cache_config.kv_cache_dtype]
        self.block_size = config.cache_config.block_size
        dispatch.set_kernels_enabled(config.use_triton_kernels)
        tp = get_tp_size()
        self.pp = get_parallel_state()  # pipeline stage (the whole model at pipeline size 1)
        start, end = self.pp.layer_range or (0, mc.num_hidden_layers)
        self.num_layers = end - start  # this stage's decoder layers: its KV pool holds these
        num_heads = divide(mc.num_attention_heads, tp, "num_attention_heads")
        num_kv_heads = max(1, mc.num_key_value_heads // tp)
        rotary = RotaryEmbedding.from_config(mc, self.device)
        self.backend = get_attention_backend(config.attention_backend)(num_heads, num_kv_heads, mc.head_dim, rotary)
        torch.manual_seed(config.seed)
        self.quant_config = get_quant_config(config.quantization, loader.checkpoint_quantization_config(source),
                                             config.quantization_group_size)
        # Build directly on the device in the model dtype.
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = build_model(mc, self.backend, self.quant_config)
        finally:
            torch.set_default_dtype(prev_dtype)
        if source.format == "dummy":
            loader.init_dummy_weights(model, config.seed)
        elif source.format == "gguf":
            assert source.path is not None
            loader.load_weights(model, loader.iter_gguf(source.path, mc))
        else:
            assert source.path is not None
            loader.load_weights(model, loader.iter_safetensors(source.path))
        self.model = model.eval()
        self.kv_bytes_per_token = kv_bytes_per_token(self.num_layers, num_kv_heads, mc.head_dim, self.kv_dtype)
        # Speculative decoding with a separate draft model (another checkpoint, or an int4 copy of the target):
        # its own KV pool in the same blocks, sized with the target's.
        spec = config.speculative_config
        self.draft: DraftModel | None = None
        if spec is not None and spec.method == "draft_model" and spec.num_layers is None:
            self.draft = DraftModel(config, source, mc, config.scheduler_config.max_num_seqs, self.dtype,
                                    self.kv_dtype, self.device)
        self.num_blocks = self._num_kv_blocks()
        self.kv_pool = self.backend.allocate_kv_cache(self.num_layers, self.num_blocks, self.block_size,
                                                      self.kv_dtype, self.device)
        if self.draft is not None:
            self.draft.allocate_kv_cache(self.num_blocks, self.block_size)
        if self.kv_dtype == torch.float8_e4m3fn:  # static per-head scales, before any graph is captured
            self._calibrate_fp8_kv_scales()
        sc = config.scheduler_config
        self.max_blocks_per_seq = -(-sc.max_model_len // self.block_size)
        self.input_batch = InputBatch(sc.max_num_seqs, sc.max_model_len, self.max_blocks_per_seq, mc.vocab_size,
                                      self.device)
        self._pin = self.device.type == "cuda"
        self._staging: dict[tuple[str, int], torch.Tensor] = {}
        self._step_id = 0
        self._prev_sampled: torch.Tensor | None = None  # the last launched step's sampled ids (device)
        self.sampler = Sampler()
        self._generators: dict[int, torch.Generator] = {}
        # Speculative decoding: drafts per row this step (0: the row does not speculate), and the layer-truncated
        # self-draft (the target's first draft_num_layers layers, final norm and LM head), if that is the draft.
        self._num_spec = np.zeros(sc.max_num_seqs, dtype=np.int64)
        self.draft_num_layers = spec.num_layers if spec is not None and spec.method == "draft_model" else None
        self.graphs: CUDAGraphRunner | None = None
        self.draft_graphs: CUDAGraphRunner | None = None
        if config.uses_cuda_graphs:
            if self.backend.supports_cuda_graphs:
                # A verify step is 1 + k decode rows per request (see prepare_inputs): capture that many rows,
                # up to the ladder's top, so verify steps replay graphs too.
                rows = sc.max_num_seqs
                if spec is not None:
                    rows = max(rows, min(rows * (1 + spec.num_speculative_tokens), max(DEFAULT_LADDER)))
                self.graphs = CUDAGraphRunner(self.model, self.backend, rows, self.max_blocks_per_seq,
                                              self.device, mc.hidden_size, self.dtype)
                self.graphs.capture()
                if self.draft_num_layers is not None:
                    k = self.draft_num_layers
                    self.draft_graphs = CUDAGraphRunner(
                        lambda ids, pos, meta: self._forward_layers(ids, pos, meta, k), self.backend,
                        sc.max_num_seqs, self.max_blocks_per_seq, self.device, mc.hidden_size, self.dtype,
                        share_with=self.graphs, name=f"draft, {k} layers")
                    self.draft_graphs.capture()
                if self.draft is not None:  # a pass has a decode row per position to fill (DraftModel.decode)
                    self.draft.capture_graphs(rows, self.max_blocks_per_seq)
            else:
                logger.warning("the %s attention backend cannot be captured in CUDA graphs; running eager",
                               self.backend.name)

    def _calibrate_fp8_kv_scales(self) -> None:
        """One calibration forward sets the fp8 KV cache's per-(layer, KV head) scales (kv_calibration.py)."""
        from roofline.attention.kv_calibration import (
            CALIBRATION_NUM_TOKENS,
            calibrate_fp8_kv_scales,
            calibration_token_ids,
        )

        mc = self.model_config
        n = min(CALIBRATION_NUM_TOKENS, self.config.scheduler_config.max_model_len,
                self.backend.rotary.cos_sin_cache.shape[0])
        stats = calibrate_fp8_kv_scales(self.backend, self.model,
                                        calibration_token_ids(mc.vocab_size, mc.bos_token_id, n), self.device)
        logger.info("fp8_e4m3 KV cache: static per-(layer, KV head) scales calibrated on %d tokens: K %.3g..%.3g, "
                    "V %.3g..%.3g", n, stats["k_min"], stats["k_max"], stats["v_min"], stats["v_max"])
        if self.device.type == "cpu":
            logger.warning("fp8_e4m3 KV cache on CPU is the emulated path: torch float8_e4m3fn casts for the "
                           "store, dequantized to fp32 inside the torch attention backend (no fp8 arithmetic)")

    # ------------------------------------------------------------------------------ sizing

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters (each tied tensor once): what one forward pass reads."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())  # yields a tied tensor once

    @property
    def weight_bytes_per_step(self) -> int:
        """Bytes of weights one decode step reads: every parameter (tied tensors once) except an input embedding
        table that is not also the LM head, of which a step reads only its tokens' rows (Llama-3-8B: 1.05 GB of
        its 16.06 GB in bf16). This is the weight term of the decode floor."""
        from roofline.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

        heads = {id(p) for m in self.model.modules() if isinstance(m, ParallelLMHead) for p in m.parameters()}
        lookup_only = {id(p) for m in self.model.modules()
                       if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
                       for p in m.parameters() if id(p) not in heads}
        seen: set[int] = set()
        total = 0
        for p in self.model.parameters():
            if id(p) not in seen and id(p) not in lookup_only:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total

    def _num_kv_blocks(self) -> int:
        cc = self.config.cache_config
        if cc.num_blocks is not None:
            return cc.num_blocks
        per_token = self.kv_bytes_per_token + (self.draft.kv_bytes_per_token if self.draft is not None else 0)
        per_block = per_token * self.block_size
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        elif self.device.type == "cuda":
            # Hand cached blocks back first: quantizing at load frees the 16-bit weights into torch's caching
            # allocator, and mem_get_info would count them as used (the pool would not grow by the freed memory).
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # Reserve room for activations: logits and the largest step's intermediates.
            sc, mc = self.config.scheduler_config, self.model_config
            act = sc.max_num_batched_tokens * (mc.hidden_size * 8 + mc.intermediate_size * 6) * 4
            act += sc.max_num_seqs * mc.vocab_size * 4 * 4
            budget = int(total * cc.gpu_memory_utilization) - used - act
        else:
            budget = CPU_DEFAULT_KV_CACHE_BYTES
        num_blocks = KVCachePool.num_blocks_for(budget, per_token, self.block_size)
        if num_blocks < 1:
            raise ValueError(
                f"no room for the KV cache: budget {budget / 2**20:.1f} MiB < one block "
                f"({per_block / 2**20:.3f} MiB); raise --kv-cache-memory or --gpu-memory-utilization"
            )
        return int(num_blocks)

    @torch.inference_mode()
    def profile_budget(self, probe_tokens: int = 256) -> int:
        """The per-step token budget whose prefill stays under ``CPU_STEP_TARGET_S``.

        Rule: time one forward pass of a ``probe_tokens``-token prefill (after one warm-up), scale linearly
        to ``CPU_STEP_TARGET_S`` and round down to a multiple of 16, within [64, 2048]. Nothing is written to
        the KV cache (every slot is -1). Measured once per model shape, device and dtype in a process.
        """
        key = (self.model_config, str(self.device), self.dtype, self.config.attention_backend)
        return _profiled_budget(key, lambda: self._time_prefill(probe_tokens), probe_tokens)

    def _time_prefill(self, n: int) -> float:
        n = min(n, self.config.scheduler_config.max_model_len, self.num_blocks * self.block_size)
        nb = -(-n // self.block_size)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([n], dtype=torch.int32, device=dev),
            block_tables=torch.arange(nb, dtype=torch.int32, device=dev)[None, :],
            max_query_len=n, query_lens_cpu=[n], seq_lens_cpu=[n],
        )
        ids = torch.zeros(n, dtype=torch.int64, device=dev)
        pos = torch.arange(n, dtype=torch.int64, device=dev)
        # A later pipeline stage times its own layers on zero activations (nothing is sent or received).
        inter = None
        if not self.pp.is_first_stage:
            zeros = torch.zeros(n, self.model_config.hidden_size, dtype=self.dtype, device=dev)
            inter = (zeros, zeros.clone())
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            self.model(ids, pos, self.backend.build_metadata(meta), inter)
            times.append(time.perf_counter() - t0)
        return times[-1] / n

    # ------------------------------------------------------------------------------ scoring (roofline eval)

    @torch.inference_mode()
    def score(self, token_ids: list[int], block_ids: list[int], chunk_size: int | None = None) -> torch.Tensor:
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
            t+1 given tokens 0..t (the last row predicts past the sequence).

        Raises:
            ValueError: an empty or too long sequence, an id out of range, too few or out-of-range blocks,
                or chunk_size < 1.
        """
        n_tokens = len(token_ids)
        max_len = self.config.scheduler_config.max_model_len
        if not 1 <= n_tokens <= max_len:
            raise ValueError(f"score needs 1 <= len(token_ids) <= max_model_len ({max_len}), got {n_tokens}")
        vocab = self.model_config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, int) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]!r} is out of range [0, {vocab})")
        bs = self.block_size
        need = -(-n_tokens // bs)
        if len(block_ids) < need or any(not 0 <= b < self.num_blocks for b in block_ids[:need]):
            raise ValueError(f"score of {n_tokens} tokens needs {need} block ids in [0, {self.num_blocks}), "
                             f"got {list(block_ids[:need + 1])}")
        chunk = chunk_size if chunk_size is not None else self.config.scheduler_config.max_num_batched_tokens
        if chunk < 1:
            raise ValueError(f"chunk_size must be >= 1, got {chunk}")
        dev = self.device
        table = torch.tensor(list(block_ids[:need]), dtype=torch.int64)  # [need]
        positions = torch.arange(n_tokens, dtype=torch.int64)  # [T]
        slots = (table[positions // bs] * bs + positions % bs).to(dev)  # [T] flat cache slots
        ids, positions = torch.tensor(token_ids, dtype=torch.int64, device=dev), positions.to(dev)
        block_tables = table.to(torch.int32)[None, :].to(dev)  # [1, need]
        out = torch.empty(n_tokens, vocab, dtype=torch.float32, device=dev)
        for start in range(0, n_tokens, chunk):
            end = min(n_tokens, start + chunk)
            n = end - start
            meta = AttentionMetadata(
                slot_mapping=slots[start:end],
                query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=dev),
                seq_lens=torch.tensor([end], dtype=torch.int32, device=dev),
                block_tables=block_tables, max_query_len=n, query_lens_cpu=[n], seq_lens_cpu=[end],
            )
            hidden = self.model(ids[start:end], positions[start:end], self.backend.build_metadata(meta))
            out[start:end] = torch.log_softmax(self.model.compute_logits(hidden), dim=-1)  # [n, V] fp32
        return out

    # ------------------------------------------------------------------------------ the step

    def update_states(self, step: StepInput) -> None:
        batch = self.input_batch
        for sid in step.finished_seq_ids:
            batch.remove(sid)
            self._generators.pop(sid, None)
        for sid in step.preempted_seq_ids:
            batch.remove(sid)
        for req in step.new_requests:
            batch.add(req)
            if self.draft is not None:
                self.draft.reset(batch.row_of[req.seq_id])
            seed = req.sampling_params.seed
            if seed is not None and req.seq_id not in self._generators:
                g = torch.Generator(device=self.device)
                g.manual_seed(seed + req.seed_offset)
                self._generators[req.seq_id] = g
        for c in step.cached_requests:
            row = batch.row_of[c.seq_id]
            if c.num_kept_blocks >= 0:
                batch.num_blocks[row] = c.num_kept_blocks
            batch.append_blocks(row, c.new_block_ids)
            batch.num_computed_tokens[row] = c.num_computed_tokens

    def _to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        """Copy a host array to the device: through a pinned staging buffer and a non-blocking copy on CUDA.

        Staging buffers alternate between two sets by step parity: with at most one step in flight behind
        the one being prepared, the set written now was last read by a step that has finished.
        """
        t = torch.from_numpy(array)
        if not self._pin:
            return t
        key = (name, self._step_id % 2)
        buf = self._staging.get(key)
        if buf is None or buf.numel() < t.numel():
            buf = torch.empty(max(t.numel(), 1024), dtype=t.dtype, pin_memory=True)
            self._staging[key] = buf
        staged = buf[:t.numel()].view(t.shape)
        staged.copy_(t)
        return staged.to(self.device, non_blocking=True)

    def prepare_inputs(
        self, step: StepInput, tag: str = ""
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray, np.ndarray]:
        """The step's flat batch. Returns input_ids [T], positions [T], the backend's metadata, the batch
        rows of the sequences that sample this step (in batch order), and the flat index of each one's last
        token (``logits_indices``). ``tag`` prefixes the staging buffers' names (a pipeline's micro-batches
        are prepared in one step)."""
        batch = self.input_batch
        rows = np.fromiter((batch.row_of[sid] for sid, _ in step.scheduled), dtype=np.int64,
                           count=len(step.scheduled))
        counts = np.fromiter((n for _, n in step.scheduled), dtype=np.int64, count=len(step.scheduled))
        query_start = np.zeros(len(rows) + 1, dtype=np.int64)
        np.cumsum(counts, out=query_start[1:])
        total = int(query_start[-1])
        start = batch.num_computed_tokens[rows]  # [S] first position of each chunk
        token_rows = np.repeat(rows, counts)  # [T]
        positions = np.repeat(start - query_start[:-1], counts) + np.arange(total)  # [T]
        input_ids = batch.token_ids[token_rows, positions]
        bs = self.block_size
        slot_mapping = batch.block_table[token_rows, positions // bs].astype(np.int64) * bs + positions % bs
        seq_lens = start + counts
        max_blocks = int(batch.num_blocks[rows].max())
        num_spec = self._num_spec[rows]
        samples = seq_lens - num_spec == batch.num_tokens[rows]  # drafts sit past num_tokens
        if num_spec.any() and samples.all() and (counts == 1 + num_spec).all():
            # A verify step (every request decodes its last token + its drafts): one decode row per token,
            # row j of a request seeing start + j + 1 keys through the request's block table. The cache store
            # precedes attention, so this is the causal extend, with the decode kernel's fixed shapes (CUDA
            # graphs replay it). Query rows, sample rows and logits indices are unchanged.
            attn_rows, attn_starts, attn_lens = token_rows, np.arange(total + 1), positions + 1
        else:
            attn_rows, attn_starts, attn_lens = rows, query_start, seq_lens
        block_tables = batch.block_table[attn_rows, :max_blocks]
        attn_counts = np.diff(attn_starts)
        meta = AttentionMetadata(
            slot_mapping=self._to_device(tag + "slot_mapping", slot_mapping),
            query_start_loc=self._to_device(tag + "query_start_loc", attn_starts.astype(np.int32)),
            seq_lens=self._to_device(tag + "seq_lens", attn_lens.astype(np.int32)),
            block_tables=self._to_device(tag + "block_tables", np.ascontiguousarray(block_tables)),
            max_query_len=int(attn_counts.max()),
            query_lens_cpu=attn_counts.tolist(),
            seq_lens_cpu=attn_lens.tolist(),
        )
        ids = self._to_device(tag + "input_ids", input_ids)
        pos = self._to_device(tag + "positions", positions)
        # A sequence's newest token may still be on its way from the previous step (async scheduling): read
        # it on the device from that step's sampled ids.
        pending = samples & (batch.pending_src[rows] >= 0) & (batch.pending_step[rows] == self._step_id - 1)
        if pending.any():
            assert self._prev_sampled is not None
            dst = self._to_device(tag + "pending_dst", query_start[1:][pending] - 1)
            src = self._to_device(tag + "pending_src", batch.pending_src[rows][pending])
            ids[dst] = self._prev_sampled[src]
        return ids, pos, self.backend.build_metadata(meta), rows[samples], query_start[1:][samples] - 1

    def prepare_sampling(self, rows: np.ndarray, tag: str = "") -> SamplingMetadata:
        """Sampling inputs for logits rows ``i`` = sequence rows ``rows[i]`` (the row -> request index).

        ``tag`` prefixes the staging buffers' names: a second call in the same step (speculative decoding's
        verify and draft passes) must not overwrite pinned buffers whose non-blocking copies may be pending."""
        batch = self.input_batch
        temps = batch.temperature[rows]
        need_rep, need_pres, need_freq = batch.uses_penalties(rows)
        penalties = need_rep or need_pres or need_freq
        idx = self._to_device(tag + "sampling_rows", rows) if penalties else None

        def col(name: str, values: np.ndarray) -> torch.Tensor:
            return self._to_device(tag + name, np.ascontiguousarray(values))

        banned = None
        ban_rows: list[int] = []
        ban_ids: list[int] = []
        below = batch.min_tokens_rows.intersection(rows.tolist()) if batch.min_tokens_rows else ()
        for i, r in enumerate(rows.tolist() if below else ()):
            if r in below:  # below min_tokens: EOS and stop ids may not be sampled yet
                p = batch.params[r]
                assert p is not None
                stop_ids = set(p.stop_token_ids or []) | (set() if p.ignore_eos else p._all_stop_token_ids)
                ban_rows += [i] * len(stop_ids)
                ban_ids += sorted(stop_ids)
        if ban_rows:
            banned = torch.zeros(len(rows), self.model_config.vocab_size, dtype=torch.bool, device=self.device)
            banned[self._to_device(tag + "ban_rows", np.array(ban_rows, dtype=np.int64)),
                   self._to_device(tag + "ban_ids", np.array(ban_ids, dtype=np.int64))] = True
        return SamplingMetadata(
            temperatures=col("temperature", temps),
            top_ks=col("top_k", batch.top_k[rows]) if (batch.top_k[rows] < self.model_config.vocab_size).any() else None,
            top_ps=col("top_p", batch.top_p[rows]) if (batch.top_p[rows] < 1.0).any() else None,
            min_ps=col("min_p", batch.min_p[rows]) if (batch.min_p[rows] > 0).any() else None,
            repetition_penalties=col("rep", batch.repetition_penalty[rows]) if need_rep else None,
            presence_penalties=col("pres", batch.presence_penalty[rows]) if need_pres else None,
            frequency_penalties=col("freq", batch.frequency_penalty[rows]) if need_freq else None,
            prompt_mask=batch.prompt_mask[idx] if need_rep and batch.prompt_mask is not None else None,
            output_counts=batch.output_counts[idx] if penalties and batch.output_counts is not None else None,
            banned_mask=banned,
            generators=([self._generators.get(batch.seq_ids[r]) for r in rows.tolist()]  # type: ignore[arg-type]
                        if self._generators else [None] * len(rows)),
            all_greedy=bool((temps == 0.0).all()),
            max_num_logprobs=int(batch.num_logprobs[rows].max()),
        )

    @torch.inference_mode()
    def execute_model_async(self, step: StepInput) -> PendingStep:
        """Launch one step; the returned ``PendingStep.result()`` waits for its sampled ids.

        Nothing here waits for the device: inputs go up with non-blocking copies from pinned buffers, the
        sampled ids come back the same way, and a sampling sequence's next input token, not yet known on
        the host, is read on the device from this step's sampled ids (``pending_src``). So the engine can
        schedule and launch step N+1 before step N finishes.
        """
        t0 = time.perf_counter()
        self._step_id += 1
        self.update_states(step)
        draft_s = self._place_drafts(step) if step.spec_token_ids else 0.0
        if self.pp.pp_size > 1:
            hidden, sample_rows, logits_indices = self._pipeline_forward(step)
        else:
            input_ids, positions, meta, sample_rows, logits_indices = self.prepare_inputs(step)
            if (self.graphs is not None and meta.is_decode_only
                    and self.graphs.can_run(meta.num_seqs, meta.block_tables.shape[1])):
                hidden = self.graphs.run(input_ids, positions, meta)
            else:
                hidden = self.model(input_ids, positions, meta)
        prompt_plan = plan_prompt_logprobs(self.input_batch, step)  # None unless a scheduled request asks
        batch = self.input_batch
        for (sid, n) in step.scheduled:
            batch.num_computed_tokens[batch.row_of[sid]] += n
        pending = PendingStep(self, step, t0)
        pending.draft_duration_s = draft_s
        if hidden is None:  # an earlier pipeline stage: the last stage samples (PendingStep.result)
            pending.rows = sample_rows.tolist()
            pending.seq_ids = [batch.seq_ids[r] for r in pending.rows]  # type: ignore[misc]
            pending.positions = batch.num_tokens[sample_rows].tolist()
            batch.mark_sampled(sample_rows, None, None, self._step_id)
            return pending
        if step.spec_token_ids and len(sample_rows):
            ks = self._num_spec[sample_rows]
            spec = ks > 0
            self._verify(pending, hidden, sample_rows[spec], logits_indices[spec], ks[spec])
            sample_rows, logits_indices = sample_rows[~spec], logits_indices[~spec]
            self._num_spec[:] = 0
        if prompt_plan is not None:  # logits at the prompt positions of the requests that ask, and no others
            lps = compute_prompt_logprobs(prompt_plan, hidden, self.model.compute_logits, self._to_device)
            pending.prompt_plan = prompt_plan
            pending.prompt_host = {name: self._to_host(t) for name, t in lps.items()}
        if len(sample_rows):
            idx = self._to_device("logits_indices", logits_indices)
            logits = self.model.compute_logits(hidden[idx])  # [N, V] fp32
            so = self.sampler(logits, self.prepare_sampling(sample_rows))
            rows = sample_rows.tolist()
            pending.rows = rows
            pending.seq_ids = [batch.seq_ids[r] for r in rows]  # type: ignore[misc]
            pending.positions = batch.num_tokens[sample_rows].tolist()  # where each sampled token goes
            rows_device = self._to_device("sample_rows", sample_rows) if batch.output_counts is not None else None
            batch.mark_sampled(sample_rows, so.token_ids, rows_device, self._step_id)
            self._prev_sampled = so.token_ids
            # A row whose distribution was not finite travels as id -1, in the same copy as the ids.
            ids = so.token_ids if so.nonfinite is None else torch.where(so.nonfinite, -1, so.token_ids)
            pending.host = {"token_ids": self._to_host(ids)}
            if so.logprobs is not None:
                assert so.ranks is not None and so.top_ids is not None and so.top_logprobs is not None
                pending.host.update(logprobs=self._to_host(so.logprobs), ranks=self._to_host(so.ranks),
                                    top_ids=self._to_host(so.top_ids), top_logprobs=self._to_host(so.top_logprobs))
        if self.device.type == "cuda":
            pending.event = torch.cuda.Event()
            pending.event.record()
        return pending

    # ------------------------------------------------------------------------------ pipeline parallelism

    def _pipeline_forward(self, step: StepInput) -> tuple[torch.Tensor | None, np.ndarray, np.ndarray]:
        """This stage's share of the step, as up to ``pp_size`` micro-batches (consecutive requests, balanced
        by tokens). Each micro-batch receives the previous stage's (hidden, residual) [2, T_m, H], runs this
        stage's layers and sends its own on; the stages being separate processes, stage s works on
        micro-batch m while stage s + 1 works on m - 1, so a step keeps m / (m + p - 1) of the pipeline busy
        (GPipe; Huang et al. 2019). Sends are non-blocking and complete before the step returns.

        Returns the last stage's hidden states [T, H] for the whole step (None on other stages), the rows
        that sample and their flat logits indices (every stage computes them alike)."""
        import torch.distributed as dist

        ps, hidden_size = self.pp, self.model_config.hidden_size
        sends, hiddens, rows, indices, offset = [], [], [], [], 0
        for m, group in enumerate(micro_batches(step.scheduled, ps.pp_size)):
            sub = StepInput(scheduled=group)
            input_ids, positions, meta, sample_rows, logits_indices = self.prepare_inputs(sub, tag=f"mb{m}_")
            n = len(positions)
            inter = None
            if not ps.is_first_stage:
                buf = torch.empty(2, n, hidden_size, dtype=self.dtype, device=self.device)
                dist.recv(buf, src=ps.pp_prev_rank)
                inter = (buf[0], buf[1])
            out = self.model(input_ids if ps.is_first_stage else None, positions, meta, inter)
            if ps.is_last_stage:
                hiddens.append(out)
            else:
                packed = torch.stack(out)
                sends.append((dist.isend(packed, dst=ps.pp_next_rank), packed))
            rows.append(sample_rows)
            indices.append(logits_indices + offset)
            offset += n
        for work, _ in sends:
            work.wait()
        hidden = torch.cat(hiddens) if hiddens else None
        return hidden, np.concatenate(rows), np.concatenate(indices)

    # ------------------------------------------------------------------------------ speculative decoding

    def _place_drafts(self, step: StepInput) -> float:
        """Write each speculating row's drafts after its known tokens (``token_ids[row, num_tokens:]``), where
        ``prepare_inputs`` reads them as the chunk's inputs; ``-1`` drafts come from the draft model now.
        Returns the draft model's seconds (0 without one)."""
        batch = self.input_batch
        self._num_spec[:] = 0
        need_model = []
        for sid, drafts in step.spec_token_ids.items():
            row = batch.row_of[sid]
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n:n + len(drafts)] = drafts
            self._num_spec[row] = len(drafts)
            if drafts and drafts[0] < 0:
                need_model.append(row)
        self._draft_probs: dict[int, torch.Tensor] = {}
        if not need_model:
            return 0.0
        t0 = time.perf_counter()
        self._run_draft_model(np.array(need_model, dtype=np.int64))
        return time.perf_counter() - t0

    def _forward_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                        num_layers: int) -> torch.Tensor:
        """The target's first ``num_layers`` decoder layers, then its final norm: the self-draft's forward.
        Its attention layers write K/V into the target's own cache for those layers, at the drafted positions;
        the verify pass overwrites them."""
        m = self.model.model
        x, residual = m.embed_tokens(input_ids), None
        for layer in m.layers[:num_layers]:
            x, residual = layer(positions, x, residual, meta)
        x, _ = m.norm(x, residual)
        return x

    def _run_draft_model(self, rows: np.ndarray) -> None:
        """k_r sequential one-token passes of the draft per row ``r``: pass j reads the token at position
        ``num_tokens - 1 + j`` and samples draft j + 1 from q (the row's own sampling processing), which it
        writes into ``token_ids``. Keeps each row's q [k_r, V] for the rejection sampler. The draft is the
        layer-truncated self (the target's KV for its layers) or a separate ``DraftModel`` (its own KV, which
        each pass catches up through the position it reads)."""
        from roofline.layers.sampler import processed_probs

        batch, bs = self.input_batch, self.block_size
        ks = self._num_spec[rows]
        q = {int(r): [] for r in rows}
        for j in range(int(ks.max())):
            act = rows[ks > j]
            pos = batch.num_tokens[act] - 1 + j  # [A]
            if self.draft is not None:  # catches the draft's KV up through pos first
                logits = self.draft.decode(batch.token_ids, batch.block_table, act, pos, bs,
                                           self.config.scheduler_config.max_num_batched_tokens)
            else:
                logits = self.model.compute_logits(self._truncated_self_pass(act, pos))
            md = self.prepare_sampling(act, tag="draft_")
            probs = processed_probs(logits, md)  # [A, V]
            noise = torch.empty_like(probs).exponential_()
            for i, g in enumerate(md.generators):
                if g is not None:
                    noise[i].exponential_(generator=g)
            tok = torch.where(md.temperatures < 1e-5, probs.argmax(dim=-1), (probs / noise).argmax(dim=-1))
            batch.token_ids[act, pos + 1] = tok.cpu().numpy()
            for i, r in enumerate(act.tolist()):
                q[r].append(probs[i])
        self._draft_probs = {r: torch.stack(v) for r, v in q.items()}

    def _truncated_self_pass(self, act: np.ndarray, pos: np.ndarray) -> torch.Tensor:
        """One decode pass of the layer-truncated self for rows ``act`` at positions ``pos``: hidden [A, H]
        (a CUDA graph where one was captured)."""
        batch, bs, dev = self.input_batch, self.block_size, self.device
        assert self.draft_num_layers is not None
        slots = batch.block_table[act, pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens = pos + 1
        max_blocks = int(((seq_lens + bs - 1) // bs).max())
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.arange(len(act) + 1, dtype=torch.int32, device=dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(np.ascontiguousarray(batch.block_table[act, :max_blocks])).to(dev),
            max_query_len=1, query_lens_cpu=[1] * len(act), seq_lens_cpu=seq_lens.tolist(),
        )
        ids = torch.from_numpy(batch.token_ids[act, pos]).to(dev)
        positions = torch.from_numpy(pos).to(dev)
        meta = self.backend.build_metadata(meta)
        if self.draft_graphs is not None and self.draft_graphs.can_run(len(act), max_blocks):
            return self.draft_graphs.run(ids, positions, meta)
        return self._forward_layers(ids, positions, meta, self.draft_num_layers)

    def _verify(self, pending: PendingStep, hidden: torch.Tensor, rows: np.ndarray, last_indices: np.ndarray,
                ks: np.ndarray) -> None:
        """Score each speculating row's 1 + k positions and accept or reject its drafts
        (``roofline.spec_decode.rejection``); the emitted tokens come back to the host in ``result()``."""
        from roofline.layers.sampler import processed_probs, token_logprobs
        from roofline.spec_decode.rejection import rejection_sample

        batch, dev = self.input_batch, self.device
        s, kmax = len(rows), int(ks.max())
        counts = ks + 1
        offsets = np.repeat(np.cumsum(counts) - counts, counts)  # [F] start of each row's run
        j = np.arange(int(counts.sum())) - offsets  # [F] position within the run
        row_of_flat = np.repeat(np.arange(s), counts)  # [F]
        flat_idx = np.repeat(last_indices - ks, counts) + j
        logits = self.model.compute_logits(hidden[torch.from_numpy(flat_idx).to(dev)])  # [F, V] fp32
        md = self.prepare_sampling(np.repeat(rows, counts), tag="spec_")
        probs = processed_probs(logits, md)
        rof, jj = torch.from_numpy(row_of_flat).to(dev), torch.from_numpy(j).to(dev)
        target = torch.zeros(s, kmax + 1, probs.shape[1], device=dev)
        target[rof, jj] = probs
        cols = batch.num_tokens[rows][:, None] + np.arange(kmax)  # [S, K] the drafts' slots in token_ids
        drafts = np.where(np.arange(kmax) < ks[:, None],
                          batch.token_ids[rows[:, None], np.minimum(cols, batch.token_ids.shape[1] - 1)], 0)
        draft_probs = None
        if self._draft_probs:
            draft_probs = torch.zeros(s, kmax, probs.shape[1], device=dev)
            for i, r in enumerate(rows.tolist()):
                qr = self._draft_probs.get(r)
                if qr is not None:
                    draft_probs[i, :len(qr)] = qr
                else:  # a host-proposed row in the same step: one-hot q
                    k = int(ks[i])
                    draft_probs[i, torch.arange(k, device=dev), torch.from_numpy(drafts[i, :k]).to(dev)] = 1.0
        first = np.cumsum(counts) - counts  # flat index of each row's first position
        temps = md.temperatures[torch.from_numpy(first).to(dev)]
        gens = [md.generators[f] for f in first.tolist()]
        res = rejection_sample(target, torch.from_numpy(drafts).to(dev), torch.from_numpy(ks).to(dev),
                               draft_probs, temps < 1e-5, gens)
        pending.spec_rows = rows.tolist()
        pending.spec_seq_ids = [batch.seq_ids[r] for r in pending.spec_rows]  # type: ignore[misc]
        pending.spec_host = {"token_ids": self._to_host(res.token_ids), "num_accepted": self._to_host(res.num_accepted)}
        if int(batch.num_logprobs[rows].max()) >= 0:
            emitted = res.token_ids[rof, jj].clamp(min=0)  # [F] the token emitted at each position (or 0)
            so = token_logprobs(logits, emitted, int(batch.num_logprobs[rows].max()))
            pending.spec_host.update(logprobs=self._to_host(so.logprobs), ranks=self._to_host(so.ranks),
                                     top_ids=self._to_host(so.top_ids), top_logprobs=self._to_host(so.top_logprobs))
            pending.spec_counts = counts.tolist()

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A non-blocking device -> host copy into pinned memory (a plain reference on CPU)."""
        if not self._pin:
            return t
        out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        out.copy_(t, non_blocking=True)
        return out

    def _collect_logprobs(self, rows: list[int], host: dict[str, torch.Tensor]) -> list[list[dict[int, Logprob]] | None]:
        chosen, ranks, token_ids = host["logprobs"].tolist(), host["ranks"].tolist(), host["token_ids"].tolist()
        top_ids, top_lps = host["top_ids"].tolist(), host["top_logprobs"].tolist()
        result: list[list[dict[int, Logprob]] | None] = []
        for i, row in enumerate(rows):
            p = self.input_batch.params[row]
            k = p.logprobs if p is not None else None
            if k is None:
                result.append(None)
                continue
            entry = {token_ids[i]: Logprob(chosen[i], ranks[i])}
            for r, (tid, lp) in enumerate(zip(top_ids[i][:k], top_lps[i][:k], strict=True)):
                if tid not in entry:
                    entry[tid] = Logprob(lp, r + 1)
            result.append([entry])
        return result


class PendingStep:
    """A launched step. ``result()`` waits for its sampled ids (the one host sync of a step), writes them
    into the persistent batch, and returns the ``StepOutput``."""

    def __init__(self, worker: Worker, step_input: StepInput, t0: float):
        self.worker = worker
        self.step_input = step_input
        self.step_id = worker._step_id
        self.t0 = t0
        self.rows: list[int] = []
        self.seq_ids: list[int] = []
        self.positions: list[int] = []
        self.host: dict[str, torch.Tensor] = {}
        self.event: torch.cuda.Event | None = None
        self.prompt_plan: PromptLogprobsPlan | None = None
        self.prompt_host: dict[str, torch.Tensor] = {}
        self.draft_duration_s = 0.0
        self.spec_rows: list[int] = []
        self.spec_seq_ids: list[int] = []
        self.spec_host: dict[str, torch.Tensor] = {}
        self.spec_counts: list[int] = []

    def done(self) -> bool:
        """Whether the device has finished this step (``result()`` would not wait for it)."""
        return self.event is None or self.event.query()

    def result(self) -> StepOutput:
        if self.event is not None:
            self.event.synchronize()
        if self.worker.pp.pp_size > 1:
            return self._pipeline_result()
        return self._result()

    def _pipeline_result(self) -> StepOutput:
        """Pipeline parallelism: the last stage's output goes to every rank (a ``torch.distributed`` object
        broadcast), whose persistent batches take its sampled tokens, so stage 0 embeds them next step."""
        import torch.distributed as dist

        ps = self.worker.pp
        box = [self._result() if ps.is_last_stage else None]
        dist.broadcast_object_list(box, src=ps.last_stage_rank)
        out: StepOutput = box[0]  # type: ignore[assignment]
        if not ps.is_last_stage and self.rows:
            by_seq = dict(zip(out.seq_ids, out.sampled_token_ids, strict=True))
            sampled = [by_seq[sid][0] for sid in self.seq_ids]
            self.worker.input_batch.write_sampled(self.rows, self.seq_ids, self.positions, sampled, self.step_id)
        return out

    def _result(self) -> StepOutput:
        out = StepOutput()
        if self.rows:
            sampled = self.host["token_ids"].tolist()
            for i, t in enumerate(sampled):
                if t < 0:  # the sampler's non-finite flag: fail this request only
                    out.errors[str(self.seq_ids[i])] = NONFINITE_MESSAGE
                    sampled[i] = 0
            if out.errors:  # the logprobs read the ids too: the host copy without the -1s
                self.host["token_ids"] = torch.tensor(sampled, dtype=torch.int64)
            self.worker.input_batch.write_sampled(self.rows, self.seq_ids, self.positions, sampled, self.step_id)
            out.seq_ids = list(self.seq_ids)
            out.sampled_token_ids = [[t] for t in sampled]
            out.logprobs = (self.worker._collect_logprobs(self.rows, self.host) if "logprobs" in self.host
                            else [None] * len(self.rows))
        if self.spec_rows:
            self._collect_spec(out)
        if self.prompt_plan is not None:
            out.prompt_logprobs = collect_prompt_logprobs(self.prompt_plan, self.prompt_host)
        out.draft_duration_s = self.draft_duration_s
        out.duration_s = time.perf_counter() - self.t0
        return out


    def _collect_spec(self, out: StepOutput) -> None:
        """Speculating rows: their emitted tokens go into the batch (after the drafts' slots were used as
        inputs) and into the output, with the target's logprobs of each emitted token when asked."""
        batch = self.worker.input_batch
        tokens = self.spec_host["token_ids"].tolist()
        accepted = self.spec_host["num_accepted"].tolist()
        lp = {k: v.tolist() for k, v in self.spec_host.items() if k in ("logprobs", "ranks", "top_ids", "top_logprobs")}
        flat = 0
        for i, (row, sid) in enumerate(zip(self.spec_rows, self.spec_seq_ids, strict=True)):
            emitted = tokens[i][:accepted[i] + 1]
            if batch.seq_ids[row] == sid:
                n = int(batch.num_tokens[row])
                batch.token_ids[row, n:n + len(emitted)] = emitted
                batch.num_tokens[row] = n + len(emitted)
                if self.worker.draft is not None:  # the draft's KV holds up to the last accepted draft
                    self.worker.draft.rewind(row, n + accepted[i])
            out.seq_ids.append(sid)
            out.sampled_token_ids.append(emitted)
            out.num_accepted[sid] = accepted[i]
            p = batch.params[row]
            k = p.logprobs if p is not None and batch.seq_ids[row] == sid else None
            if not lp or k is None:
                out.logprobs.append(None)
            else:
                entries = []
                for t, tok in enumerate(emitted):
                    f = flat + t
                    entry = {tok: Logprob(lp["logprobs"][f], lp["ranks"][f])}
                    for rank, (tid, v) in enumerate(zip(lp["top_ids"][f][:k], lp["top_logprobs"][f][:k], strict=True)):
                        if tid not in entry:
                            entry[tid] = Logprob(v, rank + 1)
                    entries.append(entry)
                out.logprobs.append(entries)
            if self.spec_counts:
                flat += self.spec_counts[i]


def micro_batches(scheduled: list[tuple[int, int]], n: int) -> list[list[tuple[int, int]]]:
    """Split a step's ``(seq_id, num_tokens)`` list into at most ``n`` non-empty runs of consecutive
    requests, cutting where the running token count first reaches k / n of the total (k = 1 .. n - 1)."""
    n = max(1, min(n, len(scheduled)))
    total = sum(t for _, t in scheduled)
    groups: list[list[tuple[int, int]]] = [[]]
    seen = 0
    for i, item in enumerate(scheduled):
        left = len(scheduled) - i  # this request and the ones after it
        if groups[-1] and len(groups) < n and (seen * n >= len(groups) * total or left <= n - len(groups)):
            groups.append([])
        groups[-1].append(item)
        seen += item[1]
    return groups


_BUDGETS: dict[object, int] = {}


def _profiled_budget(key: object, seconds_per_token, probe_tokens: int) -> int:
    if key not in _BUDGETS:
        per_token = seconds_per_token()
        budget = int(CPU_STEP_TARGET_S / max(per_token, 1e-9)) // 16 * 16
        _BUDGETS[key] = max(64, min(2048, budget))
        logger.info("measured prefill %.2f ms/token at %d tokens: per-step token budget %d (target %.1f s)",
                    per_token * 1e3, probe_tokens, _BUDGETS[key], CPU_STEP_TARGET_S)
    return _BUDGETS[key]
