"""Outputs: per request, what the engine reports (``RequestOutput``), and per sampled token, the stop checks
(stop token, stop string, length, in vLLM's order), detokenization and logprob entries."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from roofline.engine.detokenizer import Detokenizer, emittable_text, find_stop_string
from roofline.engine.sequence import Logprob, Sequence, SequenceStatus
from roofline.outputs import CompletionOutput, RequestMetrics, RequestOutput


@dataclass
class RequestState:
    """A request's sample streams and what its outputs report."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    seqs: list[Sequence]
    arrival_time: float
    stream: bool = True  # report every step (servers); False: only the final output (offline batches)
    # SamplingParams.prompt_logprobs: entry i scores prompt token i (entry 0 stays None); filled as chunks run.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class OutputProcessor:
    """Stop checks, detokenization and outputs, for an engine with ``tokenizer`` (None: no text) and
    ``max_model_len``."""

    def __init__(self, tokenizer: Any, max_model_len: int):
        self.tokenizer = tokenizer
        self.detokenizer = Detokenizer(tokenizer)
        self.max_model_len = max_model_len

    def check_stop_token(self, seq: Sequence, token: int) -> SequenceStatus | None:
        """EOS (any of the model's ids, unless ignore_eos) or a stop token id, once past min_tokens."""
        p = seq.sampling_params
        if seq.num_output_tokens >= p.min_tokens:
            if not p.ignore_eos and token in p._all_stop_token_ids:
                return SequenceStatus.FINISHED_STOPPED
            if token in (p.stop_token_ids or []):
                seq.stop_reason = token
                return SequenceStatus.FINISHED_STOPPED
        return None

    def check_length(self, seq: Sequence) -> SequenceStatus | None:
        p = seq.sampling_params
        if p.max_tokens is not None and seq.num_output_tokens >= p.max_tokens:
            return SequenceStatus.FINISHED_LENGTH
        if seq.num_tokens >= self.max_model_len:
            return SequenceStatus.FINISHED_LENGTH
        return None

    def add_logprob(self, seq: Sequence, token: int, lp: dict[int, Logprob]) -> None:
        if self.tokenizer is not None:
            for tid, entry in lp.items():
                entry.decoded_token = self.tokenizer.decode([tid])
        seq.output_logprobs.append(lp)
        seq.cumulative_logprob += lp[token].logprob

    def check_stops(self, seq: Sequence, token: int) -> SequenceStatus | None:
        """After ``token`` was appended: in vLLM's order, stop token, stop string, then the length limits."""
        status = self.check_stop_token(seq, token)
        before = len(seq.output_text)
        self.detokenizer.decode_new(seq)
        if status is None and seq.num_output_tokens >= seq.sampling_params.min_tokens:
            stop = find_stop_string(seq, len(seq.output_text) - before)
            if stop is not None:
                seq.stop_reason = stop
                status = SequenceStatus.FINISHED_STOPPED
        if status is None:
            status = self.check_length(seq)
        return status

    def add_prompt_logprobs(self, requests: dict[str, RequestState], seqs: dict[int, Sequence],
                            scored: dict[int, tuple[int, list[dict[int, Logprob]]]]) -> None:
        """Place a step's prompt-logprob entries at their token indices in their request's list.

        Every sample of a request scores the prompt it computes, and a resumed sequence scores it again: an
        index already filled keeps its first entry, so the list is complete once any sample has a token.
        ``seqs``: the step's scheduled sequences by id.
        """
        decoded: dict[int, str] = {}
        for sid, (first, entries) in scored.items():
            req = requests.get(seqs[sid].request_id)
            if req is None or req.prompt_logprobs is None:
                continue  # aborted meanwhile
            lps = req.prompt_logprobs
            if len(lps) < first:
                lps.extend([None] * (first - len(lps)))  # tokens this request's sequences did not compute
            for i, entry in enumerate(entries, start=first):
                if i < len(lps) and lps[i] is not None:
                    continue  # a repeat (another sample, or a resumed sequence)
                if self.tokenizer is not None:
                    for tid, lp in entry.items():
                        if tid not in decoded:
                            decoded[tid] = self.tokenizer.decode([tid])
                        lp.decoded_token = decoded[tid]
                if i < len(lps):
                    lps[i] = entry
                else:
                    lps.append(entry)

    def make_output(self, req: RequestState) -> RequestOutput:
        completions = []
        for seq in req.seqs:
            n_before = seq.num_reported_tokens
            completions.append(CompletionOutput(
                index=seq.index,
                text=seq.output_text,
                token_ids=list(seq.output_token_ids),
                cumulative_logprob=seq.cumulative_logprob if seq.sampling_params.logprobs is not None else None,
                logprobs=list(seq.output_logprobs) if seq.sampling_params.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
                text_delta=emittable_text(seq),
                num_new_tokens=seq.num_output_tokens - n_before,
            ))
            seq.num_reported_tokens = seq.num_output_tokens
        first = req.seqs[0]
        metrics = RequestMetrics(
            arrival_time=req.arrival_time,
            first_scheduled_time=first.first_scheduled_time,
            first_token_time=min((s.first_token_time for s in req.seqs if s.first_token_time), default=None),
            finished_time=max((s.finished_time or 0.0 for s in req.seqs), default=None),
            token_times=list(first.token_times),
        )
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             finished=all(s.is_finished for s in req.seqs), metrics=metrics,
                             prompt_logprobs=req.prompt_logprobs)
