"""The worker: owns the model, the attention backend (and through it the KV pool), the sampler, the
persistent input batch, the CUDA graphs, its pipeline stage and, with speculative decoding, its proposer.
``execute_model_async(StepInput).result() -> StepOutput`` is one step.

Per step:
1. ``update_states``: forget finished/preempted sequences, add new ones, append new blocks.
2. a device proposer drafts (``roofline.spec_decode.draft_proposers``); host drafts are written in place.
3. the stage's forward (``pipeline.py``: the step's flat batch from ``inputs.py``, a CUDA graph for
   decode-only steps that fit one, else eager; or this pipeline stage's micro-batches).
4. the verifier for the rows that speculate (``roofline.spec_decode.verifier``), the prompt logprobs of the
   requests that ask (``prompt_logprobs.py``), the sampler for the others, and one device->host copy of
   the sampled ids: the step's only host sync, in ``PendingStep.result()``.
"""

from __future__ import annotations

import gc
import logging
import time
from typing import Any

import numpy as np
import torch

from roofline.attention.backend import get_attention_backend
from roofline.attention.kv_cache import KVCachePool, kv_bytes_per_token
from roofline.config import EngineConfig, ModelConfig
from roofline.distributed.parallel_state import divide, get_parallel_state, get_tp_size
from roofline.layers import dispatch
from roofline.layers.rotary import RotaryEmbedding
from roofline.layers.sampler import NONFINITE_MESSAGE, Sampler, SamplingMetadata
from roofline.models import loader
from roofline.quant import get_quant_config
from roofline.spec_decode.proposer import check_draft_kv_share, make_proposer
from roofline.spec_decode.verifier import Verified, verify
from roofline.step import Logprob, StepInput, StepOutput
from roofline.worker import scoring
from roofline.worker.cpu_plan import CpuDecodePlan
from roofline.worker.cuda_graph import DEFAULT_LADDER, CUDAGraphRunner
from roofline.worker.input_batch import InputBatch
from roofline.worker.inputs import InputPreparer
from roofline.worker.pipeline import make_stage
from roofline.worker.prompt_logprobs import (
    PromptLogprobsPlan,
    collect_prompt_logprobs,
    compute_prompt_logprobs,
    plan_prompt_logprobs,
)
from roofline.worker.sampling import logprob_entry

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_DTYPES = {**_DTYPES, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
CPU_DEFAULT_KV_CACHE_BYTES = 2 << 30
CPU_STEP_TARGET_S = scoring.CPU_STEP_TARGET_S


class Worker:
    def __init__(self, config: EngineConfig, source: loader.ModelSource, model_config: ModelConfig):
        self.config, self.source = config, source
        self.model_config = mc = model_config
        self.device = torch.device(config.device)
        self.dtype = _DTYPES[config.dtype]
        self.kv_dtype = _KV_DTYPES[config.cache_config.kv_cache_dtype]
        self.block_size = config.cache_config.block_size
        # The CPU start-up line (model, matrix extensions, dtype, threads and why): one process owning the
        # cores sizes torch's pool here; worker processes of a parallel run are sized by their executor.
        # The governor re-sizes the pool to the cores other processes leave free while the engine runs.
        self.cpu_summary: str | None = None
        self.thread_governor = None
        if self.device.type == "cpu" and config.parallel_config.world_size == 1:
            from roofline.cpu import apply_thread_policy

            self.cpu_summary, self.thread_governor = apply_thread_policy(config.dtype, config.quantization)
            if config.quantization_note is not None:
                self.cpu_summary += f"\nquantization auto: {config.quantization_note}"
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
        checkpoint_quant = loader.checkpoint_quantization_config(source)
        if config.quantization == "int4" and checkpoint_quant is None:  # at load: name the flag before loading
            from roofline.quant.int4 import check_int4_group_size

            check_int4_group_size(mc, config.quantization_group_size, tp)
        self.quant_config = get_quant_config(config.quantization, checkpoint_quant, config.quantization_group_size)
        self.model = loader.load_model(mc, source, self.backend, self.quant_config, self.dtype, self.device,
                                       config.seed)
        self.kv_bytes_per_token = kv_bytes_per_token(self.num_layers, num_kv_heads, mc.head_dim, self.kv_dtype)
        # Speculative decoding: a device proposer (a draft model keeps its own KV pool in the same blocks,
        # sized with the target's); a host proposer (n-gram) runs in the engine, and the worker only verifies.
        spec = config.speculative_config
        self.proposer: Any = None
        if spec is not None and (p := make_proposer(spec)).on_device:
            self.proposer = p
            p.load(self)
        self.num_blocks = self._num_kv_blocks()
        self.kv_pool = self.backend.allocate_kv_cache(self.num_layers, self.num_blocks, self.block_size,
                                                      self.kv_dtype, self.device)
        if self.proposer is not None:
            self.proposer.allocate_kv_cache(self.num_blocks, self.block_size)
        if self.kv_dtype == torch.float8_e4m3fn:  # static per-head scales, before any graph is captured
            self._calibrate_fp8_kv_scales()
        sc = config.scheduler_config
        self.max_blocks_per_seq = -(-sc.max_model_len // self.block_size)
        self.input_batch = InputBatch(sc.max_num_seqs, sc.max_model_len, self.max_blocks_per_seq, mc.vocab_size,
                                      self.device)
        self.inputs = InputPreparer(self.input_batch, self.device, self.block_size, mc.vocab_size,
                                    self.backend.build_metadata, self.backend.tree_as_decode_rows)
        self.sampler = Sampler()
        self.stage = make_stage(self)
        self._draft_probs: dict[int, torch.Tensor] = {}  # this step's device proposer's q per row
        self.graphs: CUDAGraphRunner | None = None
        if config.uses_cuda_graphs:
            if self.backend.supports_cuda_graphs:
                # A verify step is 1 + k decode rows per request (see InputPreparer.prepare_inputs; a tree's, 1 +
                # tree_budget, with the backend's tree_as_decode_rows): capture that many rows, up to the ladder's
                # top, so verify steps replay graphs too.
                rows = sc.max_num_seqs
                tree_rows = spec is not None and spec.is_tree and self.backend.tree_as_decode_rows
                if spec is not None:
                    per_request = 1 + (spec.tree_budget if tree_rows else spec.num_speculative_tokens)
                    rows = max(rows, min(rows * per_request, max(DEFAULT_LADDER)))
                self.graphs = CUDAGraphRunner(self.model, self.backend, rows, self.max_blocks_per_seq,
                                              self.device, mc.hidden_size, self.dtype, tree_rows=tree_rows)
                self.graphs.capture()
                if self.proposer is not None:
                    self.proposer.capture_graphs(self, rows)
            else:
                logger.warning("the %s attention backend cannot be captured in CUDA graphs; running eager",
                               self.backend.name)
        # The CPU's counterpart of the graphs: a decode step in one C++ call (None where it does not apply).
        self.cpu_plan: CpuDecodePlan | None = None
        if self.device.type == "cpu" and self.pp.pp_size == 1:
            self.cpu_plan, why = CpuDecodePlan.build(self.model, self.backend, self.dtype, self.device,
                                                     tp_size=get_tp_size())
            plan = (f"CPU decode plan: on ({self.cpu_plan.describe()})" if self.cpu_plan is not None
                    else f"CPU decode plan: off ({why})")
            if self.cpu_summary is not None:  # what `roofline generate` prints at start-up
                self.cpu_summary += "\n" + plan
            logger.info("%s", self.cpu_summary or plan)  # one record (`serve` shows it through the log)

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
                           "store, each block dequantized to fp32 by the C++ paged attention (torch SDPA without "
                           "a compiler); no fp8 arithmetic")

    # ------------------------------------------------------------------------------ sizing

    @property
    def weight_bytes(self) -> int:
        """Bytes of the model's parameters (each tied tensor once): what one forward pass reads."""
        return sum(p.numel() * p.element_size() for p in self.model.parameters())  # yields a tied tensor once

    @property
    def weight_bytes_per_step(self) -> int:
        """Bytes of weights one decode step reads: every parameter (tied tensors once) except an input embedding
        table that is not also the LM head, of which a step reads only its tokens' rows (Llama-3-8B: 1.05 GB of
        its 16.06 GB in bf16). This is the weight term of the decode floor. A head that multiplies by a quantized
        copy (``qweight``: INT8 on CPU) reads the copy, not its float ``weight``."""
        from roofline.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

        head_modules = [m for m in self.model.modules() if isinstance(m, ParallelLMHead)]
        unread = {id(m.weight) for m in head_modules if getattr(m, "qweight", None) is not None}
        heads = {id(p) for m in head_modules for p in m.parameters() if id(p) not in unread}
        lookup_only = unread | {id(p) for m in self.model.modules()
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
        per_token = self.kv_bytes_per_token + (self.proposer.kv_bytes_per_token if self.proposer is not None else 0)
        per_block = per_token * self.block_size
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        elif self.device.type == "cuda":
            # Hand cached blocks back first: quantizing at load frees the 16-bit weights into torch's caching
            # allocator, and mem_get_info would count them as used (the pool would not grow by the freed memory).
            # Collect first: an engine caught in a reference cycle outside ours (user code) would otherwise keep
            # its whole KV pool counted as used, and a second LLM(...) in one process would find no room.
            gc.collect()
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
        if self.proposer is not None and self.proposer.kv_bytes_per_token:
            # The pool split's cost, stated once: a draft KV pool shrinks the target's by its share per token.
            alone = KVCachePool.num_blocks_for(budget, self.kv_bytes_per_token, self.block_size)
            check_draft_kv_share(self.config.speculative_config, self.proposer.kv_bytes_per_token,
                                 self.kv_bytes_per_token, num_blocks * self.block_size, alone * self.block_size,
                                 sized_by_user=cc.kv_cache_memory is not None)
            logger.info("speculative decoding (%s): the draft's KV takes %d of %d bytes per token, so the pool "
                        "holds %d tokens instead of %d (%.0f%% fewer)", self.config.speculative_config.method,
                        self.proposer.kv_bytes_per_token, per_token, num_blocks * self.block_size,
                        alone * self.block_size, 100 * (1 - num_blocks / max(alone, 1)))
        if num_blocks < 1:
            raise ValueError(
                f"no room for the KV cache: budget {budget / 2**20:.1f} MiB < one block "
                f"({per_block / 2**20:.3f} MiB); raise --kv-cache-memory or --gpu-memory-utilization"
            )
        return int(num_blocks)

    @torch.inference_mode()
    def profile_budget(self, probe_tokens: int = 256) -> int:
        """The per-step token budget whose prefill stays under ``CPU_STEP_TARGET_S`` (``scoring.profile_budget``)."""
        return scoring.profile_budget(self, probe_tokens)

    def score(self, token_ids: list[int], block_ids: list[int], chunk_size: int | None = None,
              hidden_states: bool = False) -> torch.Tensor:
        """Next-token log-probabilities (or the final hidden states) at every position of one sequence
        (``scoring.score``: shapes, errors)."""
        return scoring.score(self, token_ids, block_ids, chunk_size, hidden_states)

    @property
    def draft(self) -> Any:
        """A separate draft model's ``DraftModel`` (None without one): for reports and tests."""
        return getattr(self.proposer, "draft", None)

    # ------------------------------------------------------------------------------ the step

    def update_states(self, step: StepInput) -> None:
        batch = self.input_batch
        for sid in step.finished_seq_ids:
            batch.remove(sid)
            self.inputs.generators.pop(sid, None)
            self.inputs.seeds.pop(sid, None)
        for sid in step.preempted_seq_ids:
            batch.remove(sid)
        for req in step.new_requests:
            batch.add(req)
            if self.proposer is not None:
                self.proposer.reset(batch.row_of[req.seq_id])
            seed = req.sampling_params.seed
            if seed is not None and req.seq_id not in self.inputs.generators:
                self.inputs.generators[req.seq_id] = torch.Generator(device=self.device)  # keyed per draw
                self.inputs.seeds[req.seq_id] = seed + req.seed_offset
        for c in step.cached_requests:
            row = batch.row_of[c.seq_id]
            if c.num_kept_blocks >= 0:
                batch.num_blocks[row] = c.num_kept_blocks
            batch.append_blocks(row, c.new_block_ids)
            batch.num_computed_tokens[row] = c.num_computed_tokens

    def prepare_inputs(self, step: StepInput, tag: str = "") -> tuple[Any, ...]:
        """The step's flat batch (``InputPreparer.prepare_inputs``)."""
        return self.inputs.prepare_inputs(step, tag)

    def prepare_sampling(self, rows: np.ndarray, tag: str = "", positions: np.ndarray | None = None) -> SamplingMetadata:
        """Sampling inputs for batch rows ``rows`` (``InputPreparer.prepare_sampling``)."""
        return self.inputs.prepare_sampling(rows, tag, positions)

    def to_host(self, t: torch.Tensor) -> torch.Tensor:
        return self.inputs.to_host(t)

    @torch.inference_mode()
    def execute_model_async(self, step: StepInput) -> PendingStep:
        """Launch one step; the returned ``PendingStep.result()`` waits for its sampled ids.

        Nothing here waits for the device: inputs go up with non-blocking copies from pinned buffers, the
        sampled ids come back the same way, and a sampling sequence's next input token, not yet known on
        the host, is read on the device from this step's sampled ids (``pending_src``). So the engine can
        schedule and launch step N+1 before step N finishes.
        """
        if self.thread_governor is not None and (n := self.thread_governor.tick()) is not None:
            logger.info("CPU threads -> %d (%.1f cores busy with other processes)", n,
                        self.thread_governor.last_other_busy)
        pending = PendingStep(self, step, time.perf_counter())
        self.update_states(step)
        if step.spec_token_ids or step.num_draft_tokens:
            pending.draft_duration_s = self._place_drafts(step)
            if pending.draft_duration_s > 0:
                pending.draft_catch_up_rows = self.proposer.catch_up_rows
        hidden, sample_rows, logits_indices = self.stage.forward(step)
        if self.proposer is not None and hidden is not None:
            self.proposer.observe(self, step, hidden)  # a learned drafter keeps the target's features
        prompt_plan = plan_prompt_logprobs(self.input_batch, step)  # None unless a scheduled request asks
        for (sid, n) in step.scheduled:
            self.input_batch.num_computed_tokens[self.input_batch.row_of[sid]] += n
        if hidden is None:  # an earlier pipeline stage: the last stage samples (PipelineStage.result)
            return pending.expect(sample_rows, None)
        if (step.spec_token_ids or step.num_draft_tokens) and len(sample_rows):  # a step with drafts
            ks = self.inputs.num_spec[sample_rows]
            spec = ks > 0
            pending.verified = verify(self, hidden, sample_rows[spec], logits_indices[spec], ks[spec],
                                      self._draft_probs)
            sample_rows, logits_indices = sample_rows[~spec], logits_indices[~spec]
            self.inputs.num_spec[:] = 0
        if prompt_plan is not None:  # logits at the prompt positions of the requests that ask, and no others
            lps = compute_prompt_logprobs(prompt_plan, hidden, self.model.compute_logits, self.inputs.to_device)
            pending.prompt_plan = prompt_plan
            pending.prompt_host = {name: self.to_host(t) for name, t in lps.items()}
        if len(sample_rows):
            logits = self.model.compute_logits(hidden[self.inputs.to_device("logits_indices", logits_indices)])
            # A seeded row's draw is keyed by the sampled token's sequence index: the row's computed tokens, this
            # step's included (above). Without seeded requests nothing is keyed.
            pos = self.input_batch.num_computed_tokens[sample_rows] if self.inputs.generators else None
            md = self.prepare_sampling(sample_rows, positions=pos)
            pending.expect(sample_rows, self.sampler(logits, md))
        if self.device.type == "cuda":
            pending.event = torch.cuda.Event()
            pending.event.record()
        return pending

    def _place_drafts(self, step: StepInput) -> float:
        """Write each speculating row's host drafts after its known tokens (``token_ids[row, num_tokens:]``),
        where ``prepare_inputs`` reads them as the chunk's inputs, and let the device proposer draft the rows
        of ``num_draft_tokens``. Returns the proposer's seconds (0 without drafting on the device)."""
        batch, num_spec = self.input_batch, self.inputs.num_spec
        for sid, drafts in step.spec_token_ids.items():
            row = batch.row_of[sid]
            n = int(batch.num_tokens[row])
            batch.token_ids[row, n:n + len(drafts)] = drafts
            num_spec[row] = len(drafts)
        self._draft_probs = {}
        rows = [batch.row_of[sid] for sid, k in step.num_draft_tokens.items() if k]
        if not rows:
            return 0.0
        t0 = time.perf_counter()
        rows_np = np.array(rows, dtype=np.int64)
        num_spec[rows_np] = [step.num_draft_tokens[batch.seq_ids[r]] for r in rows]  # type: ignore[index]
        self._draft_probs = self.proposer.propose_draft_token_ids(self, rows_np, num_spec[rows_np])
        return time.perf_counter() - t0

    def collect_logprobs(self, rows: list[int], host: dict[str, torch.Tensor]) -> list[list[dict[int, Logprob]] | None]:
        chosen, ranks, token_ids = host["logprobs"].tolist(), host["ranks"].tolist(), host["token_ids"].tolist()
        top_ids, top_lps = host["top_ids"].tolist(), host["top_logprobs"].tolist()
        result: list[list[dict[int, Logprob]] | None] = []
        for i, row in enumerate(rows):
            p = self.input_batch.params[row]
            k = p.logprobs if p is not None else None
            result.append(None if k is None else
                          [logprob_entry(token_ids[i], chosen[i], ranks[i], top_ids[i], top_lps[i], k)])
        return result


class PendingStep:
    """A launched step. ``result()`` waits for its sampled ids (the one host sync of a step), writes them
    into the persistent batch, and returns the ``StepOutput`` (through the worker's stage)."""

    def __init__(self, worker: Worker, step_input: StepInput, t0: float):
        worker.inputs.step_id += 1
        self.worker = worker
        self.step_input = step_input
        self.step_id = worker.inputs.step_id
        self.t0 = t0
        self.rows: list[int] = []
        self.seq_ids: list[int] = []
        self.positions: list[int] = []
        self.host: dict[str, torch.Tensor] = {}
        self.event: torch.cuda.Event | None = None
        self.prompt_plan: PromptLogprobsPlan | None = None
        self.prompt_host: dict[str, torch.Tensor] = {}
        self.draft_duration_s = 0.0
        self.draft_catch_up_rows = 0
        self.verified: Verified | None = None

    def expect(self, sample_rows: np.ndarray, so: Any) -> PendingStep:
        """The rows that sample this step, and the sampler's output for them (None on an earlier pipeline
        stage: the last stage's tokens arrive in ``result``). Marks them in the persistent batch."""
        w, batch = self.worker, self.worker.input_batch
        self.rows = sample_rows.tolist()
        self.seq_ids = [batch.seq_ids[r] for r in self.rows]  # type: ignore[misc]
        self.positions = batch.num_tokens[sample_rows].tolist()  # where each sampled token goes
        if so is None:
            batch.mark_sampled(sample_rows, None, None, self.step_id)
            return self
        rows_device = w.inputs.to_device("sample_rows", sample_rows) if batch.output_counts is not None else None
        batch.mark_sampled(sample_rows, so.token_ids, rows_device, self.step_id)
        w.inputs.prev_sampled = so.token_ids
        # A row whose distribution was not finite travels as id -1, in the same copy as the ids (no extra sync).
        ids = so.token_ids if so.nonfinite is None else torch.where(so.nonfinite, -1, so.token_ids)
        self.host = {"token_ids": w.to_host(ids)}
        if so.logprobs is not None:
            assert so.ranks is not None and so.top_ids is not None and so.top_logprobs is not None
            self.host.update(logprobs=w.to_host(so.logprobs), ranks=w.to_host(so.ranks),
                             top_ids=w.to_host(so.top_ids), top_logprobs=w.to_host(so.top_logprobs))
        return self

    def done(self) -> bool:
        """Whether the device has finished this step (``result()`` would not wait for it)."""
        return self.event is None or self.event.query()

    def result(self) -> StepOutput:
        if self.event is not None:
            self.event.synchronize()
        return self.worker.stage.result(self)

    def collect(self) -> StepOutput:
        """This process's output of the step (after the sync): sampled tokens into the batch and the output."""
        out = StepOutput()
        if self.rows:
            sampled = self.host["token_ids"].tolist()
            for i, t in enumerate(sampled):
                if t < 0:  # the sampler's non-finite flag: the engine fails this request only
                    out.errors[str(self.seq_ids[i])] = NONFINITE_MESSAGE
                    sampled[i] = 0
            if out.errors:  # the logprobs read the ids too: the host copy without the -1s
                self.host["token_ids"] = torch.tensor(sampled, dtype=torch.int64)
            self.worker.input_batch.write_sampled(self.rows, self.seq_ids, self.positions, sampled, self.step_id)
            out.seq_ids = list(self.seq_ids)
            out.sampled_token_ids = [[t] for t in sampled]
            out.logprobs = (self.worker.collect_logprobs(self.rows, self.host) if "logprobs" in self.host
                            else [None] * len(self.rows))
        if self.verified is not None:
            self.verified.collect(self.worker, out)
        if self.prompt_plan is not None:
            out.prompt_logprobs = collect_prompt_logprobs(self.prompt_plan, self.prompt_host)
        out.draft_duration_s = self.draft_duration_s
        out.draft_catch_up_rows = self.draft_catch_up_rows
        out.duration_s = time.perf_counter() - self.t0
        return out
