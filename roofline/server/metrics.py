"""Prometheus metrics of the server (prometheus-client), named like vLLM's (``roofline:`` prefix).

Per request (observed by the API layer when a request ends; seconds, engine monotonic clock):
    roofline:time_to_first_token_seconds     histogram, arrival -> first token
    roofline:inter_token_latency_seconds     histogram, one observation per gap between tokens
    roofline:time_per_output_token_seconds   histogram, one per request: (last - first token) / (n - 1)
    roofline:e2e_request_latency_seconds     histogram, arrival -> finish
    roofline:request_queue_time_seconds      histogram, arrival -> first scheduled
    roofline:request_success_total           counter, label finished_reason = stop | length | abort
    roofline:prompt_tokens_total             counter, prompt tokens of requests that got a first token
    roofline:generation_tokens_total         counter, generated tokens (all n samples)
Engine state, read at scrape time from ``AsyncLLMEngine.state()``. The engine is not thread-safe, so the
scrape never reads it; a step can take seconds on a CPU, and what is known while it runs is split in two:
  live (moves during a step; kept by the event loop and the engine thread's queue bookkeeping):
    roofline:num_requests_waiting            gauge, requests not yet scheduled: the snapshot's waiting
                                             ones plus adds queued for the engine thread
    roofline:num_requests_unfinished         gauge, requests accepted and not yet ended (finished,
                                             failed or aborted): what clients are waiting on
    roofline:engine_step_elapsed_seconds     gauge, how long the running step has taken; 0 between steps
  as of the last snapshot (published just before each step and at its end):
    roofline:num_requests_running            gauge (requests, not sequences)
    roofline:kv_cache_usage_perc             gauge, fraction of KV blocks in use, in [0, 1]
    roofline:num_preemptions_total           counter
    roofline:prefix_cache_queries_total      counter, prompt tokens looked up in the prefix cache
    roofline:prefix_cache_hits_total         counter, prompt tokens found there (hit rate = hits / queries)
    roofline:prefix_cache_evictions_total    counter, KV blocks evicted from the prefix cache

With speculative decoding on (vLLM's names):

    roofline:spec_decode_num_drafts_total            counter, verify passes (speculating request x step)
    roofline:spec_decode_num_draft_tokens_total      counter, drafted tokens verified
    roofline:spec_decode_num_accepted_tokens_total   counter, drafted tokens accepted
    roofline:spec_decode_num_emitted_tokens_total    counter, tokens the verify passes produced
    roofline:spec_decode_num_accepted_tokens_per_pos_total  counter, label position (0-based draft index)
    roofline:spec_decode_draft_acceptance_rate       gauge, accepted / drafted since start, in [0, 1]
    roofline:spec_decode_mean_acceptance_length      gauge, emitted tokens per verify pass
    roofline:spec_decode_gamma                       gauge, the policy's latest gamma (0: off)

Each app gets its own ``CollectorRegistry`` so several apps (tests) can live in one process.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from roofline.outputs import RequestOutput
from roofline.server.async_engine import EngineState

# Bucket edges in seconds (vLLM's, so dashboards carry over).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                         10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                           120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _EngineCollector(Collector):
    """Gauges and the engine's counters (preemptions, prefix cache), read from ``AsyncLLMEngine.state()`` on every scrape."""

    def __init__(self, state: Callable[[], EngineState], model_name: str,
                 expert_counts: Callable[[], list[list[int]] | None] | None = None):
        self._state = state
        self._model_name = model_name
        self._expert_counts = expert_counts

    def collect(self) -> Iterator[Metric]:
        state = self._state()
        snap = state.snapshot
        labels = ["model_name"]
        values = [self._model_name]
        for name, doc, value in (
            ("roofline:num_requests_running", "Requests with a sequence being computed (as of the last "
             "engine snapshot).", snap.num_running_requests),
            ("roofline:num_requests_waiting", "Requests waiting to be scheduled, new or preempted (live).",
             state.num_waiting_requests),
            ("roofline:num_requests_unfinished", "Requests accepted and not yet finished or aborted (live).",
             state.num_unfinished_requests),
            ("roofline:kv_cache_usage_perc", "Fraction of KV-cache blocks in use, 1 = 100 percent (as of the "
             "last engine snapshot).", snap.kv_cache_usage),
            ("roofline:engine_step_elapsed_seconds", "Seconds the running engine step has taken so far; 0 "
             "between steps (live).", state.step_elapsed_s),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(value))
            yield g
        for name, doc, value in (
            ("roofline:num_preemptions", "Sequences preempted (KV blocks reclaimed).", snap.num_preemptions),
            ("roofline:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
             snap.prefix_cache_queries),
            ("roofline:prefix_cache_hits", "Prompt tokens found in the prefix cache (not computed again).",
             snap.prefix_cache_hits),
            ("roofline:prefix_cache_evictions", "KV blocks evicted from the prefix cache.",
             snap.prefix_cache_evictions),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(value))
            yield c
        yield from self._expert_metrics(labels, values)
        sd = snap.spec_decode
        if sd is None:
            return
        for name, doc, value in (
            ("roofline:spec_decode_num_drafts", "Speculative verify passes (a speculating request in a step).",
             sd.num_drafts),
            ("roofline:spec_decode_num_draft_tokens", "Drafted tokens verified by the target.", sd.num_draft_tokens),
            ("roofline:spec_decode_num_accepted_tokens", "Drafted tokens accepted.", sd.num_accepted_tokens),
            ("roofline:spec_decode_num_emitted_tokens", "Tokens produced by verify passes (accepted + 1 each).",
             sd.num_emitted_tokens),
        ):
            c = CounterMetricFamily(name, doc, labels=labels)
            c.add_metric(values, float(value))
            yield c
        c = CounterMetricFamily("roofline:spec_decode_num_accepted_tokens_per_pos",
                                "Accepted drafts by position in the draft (0-based).", labels=labels + ["position"])
        for j, n in enumerate(sd.accepted_per_position):
            c.add_metric(values + [str(j)], float(n))
        yield c
        for name, doc, value in (
            ("roofline:spec_decode_draft_acceptance_rate", "Accepted / drafted tokens since start, in [0, 1].",
             sd.acceptance_rate or 0.0),
            ("roofline:spec_decode_mean_acceptance_length", "Tokens emitted per verify pass since start.",
             sd.mean_acceptance_length or 0.0),
            ("roofline:spec_decode_gamma", "Drafts per request the policy chose for the latest step (0: off).",
             sd.gamma),
        ):
            g = GaugeMetricFamily(name, doc, labels=labels)
            g.add_metric(values, float(value))
            yield g


    def _expert_metrics(self, labels: list[str], values: list[str]) -> Iterator[Metric]:
        """MoE models: tokens routed to each expert, summed over the MoE layers, so that routing imbalance
        (and, with expert parallelism, the load of each rank's experts) is visible; and max / mean over experts."""
        counts = self._expert_counts() if self._expert_counts is not None else None
        if not counts:
            return
        per_expert = [sum(col) for col in zip(*counts, strict=True)]
        g = GaugeMetricFamily("roofline:moe_expert_tokens", "Tokens routed to each expert since start, summed "
                              "over the MoE layers (top-k routing: each token counts k times per layer).",
                              labels=labels + ["expert"])
        for e, n in enumerate(per_expert):
            g.add_metric(values + [str(e)], float(n))
        yield g
        mean = sum(per_expert) / len(per_expert)
        g = GaugeMetricFamily("roofline:moe_expert_load_imbalance", "Max over mean of the per-expert token counts "
                              "(1 = balanced; 0 before any token).", labels=labels)
        g.add_metric(values, max(per_expert) / mean if mean else 0.0)
        yield g


class ServerMetrics:
    """All metrics of one app, in their own registry."""

    def __init__(self, model_name: str, state: Callable[[], EngineState],
                 expert_counts: Callable[[], list[list[int]] | None] | None = None):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r = self.registry
        self.ttft = Histogram("roofline:time_to_first_token_seconds",
                              "Time to first token (s): arrival to first generated token.", labels,
                              buckets=TTFT_BUCKETS, registry=r).labels(model_name)
        self.itl = Histogram("roofline:inter_token_latency_seconds",
                             "Inter-token latency (s): gap between consecutive tokens of a sequence.", labels,
                             buckets=TOKEN_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.tpot = Histogram("roofline:time_per_output_token_seconds",
                              "Time per output token (s) after the first, one observation per request.",
                              labels, buckets=TOKEN_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.e2e = Histogram("roofline:e2e_request_latency_seconds",
                             "End-to-end request latency (s): arrival to finish.", labels,
                             buckets=REQUEST_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.queue_time = Histogram("roofline:request_queue_time_seconds",
                                    "Queue time (s): arrival to first scheduled.", labels,
                                    buckets=REQUEST_LATENCY_BUCKETS, registry=r).labels(model_name)
        self.prompt_tokens = Counter("roofline:prompt_tokens", "Prompt tokens prefilled.", labels,
                                     registry=r).labels(model_name)
        self.generation_tokens = Counter("roofline:generation_tokens", "Tokens generated.", labels,
                                         registry=r).labels(model_name)
        success = Counter("roofline:request_success", "Requests finished, by finish reason.",
                          labels + ["finished_reason"], registry=r)
        self.request_success = {reason: success.labels(model_name, reason) for reason in FINISH_REASONS}
        r.register(_EngineCollector(state, model_name, expert_counts))

    def render(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)

    def tracker(self) -> RequestTracker:
        return RequestTracker(self)


class RequestTracker:
    """Feeds one request's outputs into the metrics: counters as tokens arrive, histograms at the end."""

    def __init__(self, metrics: ServerMetrics):
        self.metrics = metrics
        self.last: RequestOutput | None = None
        self._num_tokens = 0
        self._counted_prompt = False
        self._done = False

    def on_output(self, out: RequestOutput) -> None:
        m = self.metrics
        if not self._counted_prompt:
            m.prompt_tokens.inc(len(out.prompt_token_ids))
            self._counted_prompt = True
        num_tokens = sum(len(c.token_ids) for c in out.outputs)
        if num_tokens > self._num_tokens:
            m.generation_tokens.inc(num_tokens - self._num_tokens)
            self._num_tokens = num_tokens
        self.last = out
        if out.finished:
            self._finish(out)

    def on_abort(self) -> None:
        """The request ended early (client disconnect or cancel): count it as ``abort``."""
        if not self._done:
            self._done = True
            self.metrics.request_success["abort"].inc()

    def _finish(self, out: RequestOutput) -> None:
        if self._done:
            return
        self._done = True
        m = self.metrics
        reason = out.outputs[0].finish_reason if out.outputs else "abort"
        m.request_success[reason if reason in m.request_success else "abort"].inc()
        met = out.metrics
        if met is None:
            return
        if met.ttft is not None:
            m.ttft.observe(met.ttft)
        if met.queue_time is not None:
            m.queue_time.observe(met.queue_time)
        if met.finished_time is not None:
            m.e2e.observe(met.finished_time - met.arrival_time)
        times = met.token_times
        for a, b in zip(times, times[1:], strict=False):
            m.itl.observe(b - a)
        if met.tpot is not None:
            m.tpot.observe(met.tpot)
