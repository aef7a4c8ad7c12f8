"""The only place that builds device tensors: flat batch in, sampled token ids out.

Per step it lays the scheduled tokens end to end (``input_ids``, ``positions``), maps each to its cache
slot (``slot_mapping``), and builds the block tables and cumulative query lengths the attention backend
reads. Host data is assembled in Python lists and moved with one copy per tensor; the only device->host
transfer is the sampled ids (and logprobs when asked).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from roofline.config import EngineConfig, ModelConfig
from roofline.engine.cuda_graph import CUDAGraphDecoder
from roofline.engine.scheduler import SchedulerOutput
from roofline.engine.sequence import Logprob, Sequence
from roofline.layers.attention import AttentionMetadata, get_attention_backend
from roofline.layers.sampler import Sampler, SamplerOutput, SamplingMetadata
from roofline.models import loader
from roofline.models.registry import build_model

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
CPU_DEFAULT_KV_CACHE_BYTES = 2 << 30


def resolve_device(device: str) -> torch.device:
    """``auto`` -> cuda when available, else cpu.

    Raises:
        ValueError: an unparsable device, or a CUDA device on a machine without one.
    """
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}") from e
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {device!r} requested, but this torch build sees no CUDA GPU "
                         f"(torch {torch.__version__}); use --device cpu or auto")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device must be auto, cpu, cuda or cuda:N, got {device!r}")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]


@dataclass
class StepResult:
    sampled: dict[int, int]  # seq_id -> token id
    logprobs: dict[int, dict[int, Logprob]]  # seq_id -> {token id: Logprob} (sampled + top-k)
    duration_s: float


class ModelRunner:
    def __init__(self, config: EngineConfig, source: loader.ModelSource, model_config: ModelConfig):
        self.config = config
        self.model_config = model_config
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        backend_name = config.attention_backend
        if backend_name == "auto":
            backend_name = "triton" if self.device.type == "cuda" else "torch"
        self.backend_name = backend_name
        backend_cls = get_attention_backend(backend_name)
        mc = model_config
        backend = backend_cls(mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim)
        torch.manual_seed(config.seed)
        # Build directly on the device in the target dtype; RotaryEmbedding keeps its table in fp32
        # because it creates it with explicit dtypes.
        prev_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = build_model(mc, backend)
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
        self.block_size = config.cache_config.block_size
        self.num_blocks = self._num_kv_blocks()
        kv_shape = (self.num_blocks, self.block_size, mc.num_key_value_heads, mc.head_dim)
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        for attn in self.model.attention_layers():
            attn.k_cache = torch.zeros(kv_shape, dtype=self.kv_dtype, device=self.device)
            attn.v_cache = torch.zeros(kv_shape, dtype=self.kv_dtype, device=self.device)
            self.kv_caches.append((attn.k_cache, attn.v_cache))
        self.sampler = Sampler()
        self._generators: dict[int, torch.Generator] = {}
        self.graphs: CUDAGraphDecoder | None = None
        if self.device.type == "cuda" and not config.enforce_eager:
            sc = config.scheduler_config
            self.graphs = CUDAGraphDecoder(
                self.model, sc.max_num_seqs, -(-sc.max_model_len // self.block_size), self.device,
                mc.hidden_size, self.dtype,
            )
            self.graphs.capture()

    # ------------------------------------------------------------------------------ sizing

    @property
    def kv_dtype(self) -> torch.dtype:
        kv = self.config.cache_config.kv_cache_dtype
        return self.dtype if kv == "auto" else _DTYPES[kv]

    @property
    def kv_bytes_per_token(self) -> int:
        """2 (k and v) x layers x kv_heads x head_dim x bytes per element."""
        mc = self.model_config
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()
        return 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * elem

    @property
    def weight_bytes(self) -> int:
        seen: set[int] = set()
        total = 0
        for p in self.model.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                total += p.numel() * p.element_size()
        return total

    def _num_kv_blocks(self) -> int:
        cc = self.config.cache_config
        if cc.num_blocks is not None:
            return cc.num_blocks
        per_block = self.kv_bytes_per_token * self.block_size
        if cc.kv_cache_memory is not None:
            budget = cc.kv_cache_memory
        elif self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # Reserve room for activations: logits and the largest step's intermediates.
            sc = self.config.scheduler_config
            mc = self.model_config
            act = sc.max_num_batched_tokens * (mc.hidden_size * 8 + mc.intermediate_size * 6) * 4
            act += sc.max_num_seqs * mc.vocab_size * 4 * 4
            budget = int(total * cc.gpu_memory_utilization) - used - act
        else:
            budget = CPU_DEFAULT_KV_CACHE_BYTES
        num_blocks = budget // per_block
        if num_blocks < 1:
            raise ValueError(
                f"no room for the KV cache: budget {budget / 2**20:.1f} MiB < one block "
                f"({per_block / 2**20:.3f} MiB); raise --kv-cache-memory or --gpu-memory-utilization"
            )
        return int(num_blocks)

    # ------------------------------------------------------------------------------ inputs

    def prepare_inputs(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """Flat batch for this step. Returns input_ids [T], positions [T], metadata, and the flat
        index of the last token of every sampling sequence (``logits_indices``)."""
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start = [0]
        seq_lens: list[int] = []
        query_lens: list[int] = []
        logits_indices: list[int] = []
        bs = self.block_size
        for s in out.scheduled:
            seq = s.seq
            start, n = s.start_position, s.num_scheduled_tokens
            if n == 1 and start == seq.num_tokens - 1:
                tokens = [seq.last_token_id]  # decode: avoid copying the whole history
            else:
                tokens = seq.token_ids[start:start + n]
            input_ids.extend(tokens)
            pos = range(start, start + n)
            positions.extend(pos)
            table = seq.block_table
            slot_mapping.extend(table[p // bs] * bs + p % bs for p in pos)
            query_start.append(query_start[-1] + n)
            seq_lens.append(start + n)
            query_lens.append(n)
            if s.samples:
                logits_indices.append(query_start[-1] - 1)
        max_blocks = max(len(s.seq.block_table) for s in out.scheduled)
        tables = [s.seq.block_table + [0] * (max_blocks - len(s.seq.block_table)) for s in out.scheduled]
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=dev),
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor(tables, dtype=torch.int32, device=dev),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            seq_lens_cpu=seq_lens,
            query_lens_cpu=query_lens,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=dev)
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        return ids, pos_t, meta, logits_indices

    def _generator(self, seq: Sequence) -> torch.Generator | None:
        seed = seq.sampling_params.seed
        if seed is None:
            return None
        g = self._generators.get(seq.seq_id)
        if g is None:
            g = torch.Generator(device=self.device)
            g.manual_seed(seed + seq.index)
            self._generators[seq.seq_id] = g
        return g

    def release(self, seq: Sequence) -> None:
        """Forget per-sequence device state (its generator) once it finishes."""
        self._generators.pop(seq.seq_id, None)

    def prepare_sampling(self, seqs: list[Sequence]) -> SamplingMetadata:
        dev = self.device
        vocab = self.model_config.vocab_size
        params = [s.sampling_params for s in seqs]
        n = len(seqs)

        def col(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
            return torch.tensor(values, dtype=dtype, device=dev)

        temps = [p.temperature if not p.is_greedy else 0.0 for p in params]
        all_greedy = all(t == 0.0 for t in temps)
        top_ks = col([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64) \
            if any(p.top_k > 0 for p in params) else None
        top_ps = col([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None
        min_ps = col([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None
        need_rep = any(p.repetition_penalty != 1.0 for p in params)
        need_pres = any(p.presence_penalty != 0.0 for p in params)
        need_freq = any(p.frequency_penalty != 0.0 for p in params)
        prompt_mask = output_counts = None
        if need_rep or need_pres or need_freq:
            output_counts = torch.zeros(n, vocab, dtype=torch.float32, device=dev)
            for i, s in enumerate(seqs):
                if s.output_token_ids:
                    ids = torch.tensor(s.output_token_ids, dtype=torch.int64, device=dev)
                    output_counts[i].index_add_(0, ids, torch.ones(len(ids), device=dev))
            if need_rep:
                prompt_mask = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
                for i, s in enumerate(seqs):
                    prompt_mask[i, torch.tensor(s.prompt_token_ids, dtype=torch.int64, device=dev)] = True
        banned = None
        for i, s in enumerate(seqs):
            p = s.sampling_params
            if s.num_output_tokens < p.min_tokens:
                stop_ids = set(p.stop_token_ids or [])
                if not p.ignore_eos:
                    stop_ids |= p._all_stop_token_ids
                if stop_ids:
                    if banned is None:
                        banned = torch.zeros(n, vocab, dtype=torch.bool, device=dev)
                    banned[i, torch.tensor(sorted(stop_ids), dtype=torch.int64, device=dev)] = True
        logprob_counts = [p.logprobs for p in params if p.logprobs is not None]
        return SamplingMetadata(
            temperatures=col(temps),
            top_ks=top_ks,
            top_ps=top_ps,
            min_ps=min_ps,
            repetition_penalties=col([p.repetition_penalty for p in params]) if need_rep else None,
            presence_penalties=col([p.presence_penalty for p in params]) if need_pres else None,
            frequency_penalties=col([p.frequency_penalty for p in params]) if need_freq else None,
            prompt_mask=prompt_mask,
            output_counts=output_counts,
            banned_mask=banned,
            generators=[self._generator(s) for s in seqs],
            all_greedy=all_greedy,
            max_num_logprobs=max(logprob_counts) if logprob_counts else -1,
        )

    # ------------------------------------------------------------------------------ the step

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput) -> StepResult:
        t0 = time.perf_counter()
        input_ids, positions, meta, logits_indices = self.prepare_inputs(out)
        if (self.graphs is not None and meta.is_decode_only
                and self.graphs.can_run(len(out.scheduled), meta.block_tables.shape[1])):
            hidden = self.graphs.run(input_ids, positions, meta)
        else:
            hidden = self.model(input_ids, positions, meta)
        sampling_seqs = [s.seq for s in out.scheduled if s.samples]
        result = StepResult({}, {}, 0.0)
        if sampling_seqs:
            idx = torch.tensor(logits_indices, dtype=torch.int64, device=self.device)
            logits = self.model.compute_logits(hidden[idx])  # [N, V] fp32
            md = self.prepare_sampling(sampling_seqs)
            so = self.sampler(logits, md)
            result.sampled = dict(zip((s.seq_id for s in sampling_seqs), so.token_ids.tolist(), strict=True))
            if so.logprobs is not None:
                result.logprobs = self._collect_logprobs(sampling_seqs, so)
        elif self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        result.duration_s = time.perf_counter() - t0
        return result

    @staticmethod
    def _collect_logprobs(seqs: list[Sequence], so: SamplerOutput) -> dict[int, dict[int, Logprob]]:
        assert so.logprobs is not None and so.ranks is not None
        assert so.top_ids is not None and so.top_logprobs is not None
        chosen = so.logprobs.tolist()
        ranks = so.ranks.tolist()
        token_ids = so.token_ids.tolist()
        top_ids = so.top_ids.tolist()
        top_lps = so.top_logprobs.tolist()
        result = {}
        for i, seq in enumerate(seqs):
            k = seq.sampling_params.logprobs
            if k is None:
                continue
            entry = {token_ids[i]: Logprob(chosen[i], ranks[i])}
            for r, (tid, lp) in enumerate(zip(top_ids[i][:k], top_lps[i][:k], strict=True)):
                if tid not in entry:
                    entry[tid] = Logprob(lp, r + 1)
            result[seq.seq_id] = entry
        return result

