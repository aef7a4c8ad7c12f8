"""Speculative decoding's configuration (:class:`SpeculativeConfig`, vLLM's ``--speculative-config`` JSON).

Frozen and validated once in ``__post_init__``; errors name the offending value and the allowed range.
``roofline.config`` re-exports everything here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

from roofline.model_config import ModelConfig


def _shown(v: object) -> str:
    """A config value as the user wrote it in JSON (true, not True), else its repr."""
    return json.dumps(v) if isinstance(v, bool) or v is None else repr(v)


SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "medusa")
LEARNED_HEAD_METHODS = ("eagle", "medusa")  # heads written by `roofline train-draft` (spec_decode/heads.py)
_SPEC_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "model",
              "quantization", "num_layers", "adaptive", "tree_topk", "tree_budget")
MAX_SPECULATIVE_TOKENS = 16
MAX_TREE_TOPK = 16
MAX_TREE_BUDGET = 64  # the prefill kernel's ancestor-mask limit (one int64 bitmask per query row)


def max_tree_nodes(method: str, topk: int, depth: int) -> int:
    """The most nodes a ``method`` tree of branching ``topk`` and depth ``depth`` can offer (capped at
    ``MAX_TREE_BUDGET``): Medusa's Cartesian product has sum_{d<=D} k^d; EAGLE's dynamic tree expands k nodes
    per depth below the last, so it has k + k^2 (D - 1) candidates (``roofline.spec_decode.tree``)."""
    if method == "medusa":
        total = sum(topk ** d for d in range(1, depth + 1))
    else:
        total = topk + topk * topk * (depth - 1)
    return min(total, MAX_TREE_BUDGET)
DRAFT_QUANTIZATIONS = ("int4", "int8", "fp8")  # load-time methods a draft (or a quantized self) may use


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (``--speculative-config``, vLLM's JSON shape).

    ``method``: ``ngram`` (prompt lookup: the tokens that followed the latest earlier occurrence of the last
    ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens) or ``draft_model``. ``num_speculative_tokens`` is
    gamma_max, the most drafts per request and step. ``adaptive`` (default True) lets the policy pick gamma in
    [0, gamma_max] each step (``roofline.spec_decode.policy``); False pins gamma_max.

    ``eagle`` (EAGLE-1: one decoder layer on the target's features) and ``medusa`` (Medusa-1: residual heads,
    ``num_speculative_tokens`` <= their count, their count when not given, as vLLM takes it from the draft
    config) read a head directory from ``model`` (``roofline train-draft``);
    without ``model``, the head shipped for the target (the default model's EAGLE head) is used.

    Trees (``eagle`` and ``medusa``; ``roofline.spec_decode.tree``): ``tree_topk`` k in [1, 16] drafts a token
    tree, ``num_speculative_tokens`` being its depth D, pruned to ``tree_budget`` nodes in [1, min(64, what a
    tree of k and D offers)] (default: that maximum). SGLang's ``speculative_eagle_topk`` is ``tree_topk`` and
    its ``speculative_num_draft_tokens`` is ``tree_budget + 1`` (it counts the root). A verify pass then scores
    1 + tree_budget rows per request; the adaptive policy turns the tree on or off as a whole.

    ``draft_model`` drafts with:
    - ``model``: a separate checkpoint (HF directory, GGUF file, or ``default``) with the target's vocabulary,
      optionally quantized at load (``quantization``);
    - or the target's own weights: ``num_layers`` k runs the target's first k decoder layers, its final norm
      and LM head (a layer-truncated self, which shares the target's KV cache for those layers), or
      ``quantization`` (``int4``, ``int8`` or ``fp8``) loads a quantized copy of the whole target.
    A separate draft or a quantized self keeps its own KV in the target's blocks (``roofline.spec_decode.draft_model``).
    """

    method: str
    num_speculative_tokens: int | None = None  # None: medusa only, the head's count (args.create_engine_config)
    prompt_lookup_min: int | None = None  # ngram only; default 2
    prompt_lookup_max: int | None = None  # ngram only; default 5
    model: str | None = None
    quantization: str | None = None
    num_layers: int | None = None
    adaptive: bool = True
    tree_topk: int | None = None  # eagle / medusa: draft a token tree with this branching (None: a chain)
    tree_budget: int | None = None  # the tree's nodes (default: as many as it can offer, at most 64)

    def __post_init__(self) -> None:
        _check_method(self.method)
        k = self.num_speculative_tokens
        if k is None and self.method != "medusa":
            raise ValueError(_NEEDS_K)
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS):
            raise ValueError(f"speculative_config num_speculative_tokens must be an integer in "
                             f"[1, {MAX_SPECULATIVE_TOKENS}], got {_shown(k)}")
        if self.adaptive is None:  # JSON null = the default, as for the other optional keys
            object.__setattr__(self, "adaptive", True)
        if not isinstance(self.adaptive, bool):
            raise ValueError(f"speculative_config adaptive must be true or false, got {_shown(self.adaptive)}")
        if self.method not in LEARNED_HEAD_METHODS:
            for name in ("tree_topk", "tree_budget"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config {name} applies to methods {' and '.join(LEARNED_HEAD_METHODS)}"
                                     f" (token trees), not {self.method!r}")
        if self.method == "ngram":
            if self.prompt_lookup_min is None:
                object.__setattr__(self, "prompt_lookup_min", 2)
            if self.prompt_lookup_max is None:
                object.__setattr__(self, "prompt_lookup_max", max(5, self.prompt_lookup_min))
            lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
            for name, v in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
                if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                    raise ValueError(f"speculative_config {name} must be an integer >= 1, got {_shown(v)}")
            if lo > hi:
                raise ValueError(f"speculative_config prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})")
            for name, methods in (("model", "'draft_model', 'eagle' and 'medusa'"), ("quantization", "'draft_model'"),
                                  ("num_layers", "'draft_model'")):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config {name} applies to method {methods}, not 'ngram'")
            return
        if self.method in LEARNED_HEAD_METHODS:
            for name in ("prompt_lookup_min", "prompt_lookup_max", "quantization", "num_layers"):
                if getattr(self, name) is not None:
                    raise ValueError(f"speculative_config {name} does not apply to method {self.method!r} (its keys: "
                                     f"method, num_speculative_tokens, model, adaptive, tree_topk, tree_budget)")
            if k is not None:  # a Medusa depth left to the head's count is checked once resolved
                self._check_tree()
            if self.model is not None:
                self._check_head_dir(self.method, self.model)
            return
        if self.method != "draft_model":
            return  # another registered proposer: its options are its own
        for name in ("prompt_lookup_min", "prompt_lookup_max"):
            if getattr(self, name) is not None:
                raise ValueError(f"speculative_config {name} applies to method 'ngram', not 'draft_model'")
        if self.model is not None and not (isinstance(self.model, str) and self.model):
            raise ValueError(f"speculative_config model must be a draft checkpoint path (a GGUF file or an HF "
                             f"directory; a preset name with load_format='dummy'), got {self.model!r}")
        if self.quantization is not None and self.quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(f"speculative_config quantization must be one of {', '.join(DRAFT_QUANTIZATIONS)} "
                             f"(quantized at load), got {self.quantization!r}")
        if self.num_layers is not None and (self.model is not None or self.quantization is not None):
            raise ValueError("speculative_config num_layers (a layer-truncated self) does not combine with "
                             "\"model\" or \"quantization\" (not built); use one of them")
        if self.model is not None or self.quantization is not None:
            return
        if self.num_layers is None:
            raise ValueError("speculative_config method 'draft_model' needs \"model\" (a draft checkpoint), "
                             "\"quantization\" (a quantized self, e.g. \"int4\") or \"num_layers\" (a "
                             "layer-truncated self); the target's own full weights would only repeat it")
        if isinstance(self.num_layers, bool) or not isinstance(self.num_layers, int) or self.num_layers < 1:
            raise ValueError(f"speculative_config num_layers must be an integer in [1, the target's layers - 1] "
                             f"(checked against the model when it loads), got {_shown(self.num_layers)}")

    def _check_tree(self) -> None:
        topk, budget = self.tree_topk, self.tree_budget
        if topk is None:
            if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)
                                       or not 1 <= budget <= MAX_TREE_BUDGET):
                raise ValueError(f"speculative_config tree_budget must be an integer in [1, {MAX_TREE_BUDGET}] (the "
                                 f"tree's nodes, with tree_topk), got {_shown(budget)}")
            if budget is not None:
                raise ValueError("speculative_config tree_budget needs tree_topk (the tree's branching, in "
                                 f"[1, {MAX_TREE_TOPK}])")
            return
        if isinstance(topk, bool) or not isinstance(topk, int) or not 1 <= topk <= MAX_TREE_TOPK:
            raise ValueError(f"speculative_config tree_topk must be an integer in [1, {MAX_TREE_TOPK}], "
                             f"got {_shown(topk)}")
        most = max_tree_nodes(self.method, topk, self.num_speculative_tokens)
        if budget is None:
            object.__setattr__(self, "tree_budget", most)
            return
        depth = self.num_speculative_tokens
        if isinstance(budget, bool) or not isinstance(budget, int) or not depth <= budget <= most:
            raise ValueError(f"speculative_config tree_budget must be an integer in [{depth}, {most}] (at least a node "
                             f"per depth, num_speculative_tokens {depth}; at most the nodes method {self.method!r} "
                             f"offers with tree_topk {topk} and depth {depth}, and {MAX_TREE_BUDGET} for the tree "
                             f"mask), got {_shown(budget)}")

    @staticmethod
    def _check_head_dir(method: str, model: Any) -> None:
        """Raises ValueError unless ``model`` is a directory holding a head's two files (before the target loads)."""
        head = f"{'an' if method[0] in 'aeiou' else 'a'} {method} head"  # an eagle, a medusa
        if not (isinstance(model, str) and model):
            raise ValueError(f"speculative_config model must be {head} directory (written by "
                             f"`roofline train-draft --method {method}`), got {model!r}")
        if not os.path.isdir(model):
            what = "is not a directory" if os.path.exists(model) else "does not exist"
            raise ValueError(f"speculative_config model {model!r} {what}: give {head} "
                             f"directory written by `roofline train-draft --method {method}`")
        need = ("config.json", "model.safetensors")  # roofline.spec_decode.heads' CONFIG_NAME, WEIGHTS_NAME
        if not all(os.path.isfile(os.path.join(model, f)) for f in need):
            raise ValueError(f"speculative_config model {model!r} is not a draft head directory (it needs "
                             f"{need[0]} and {need[1]}, as `roofline train-draft --method {method}` writes)")

    @property
    def is_tree(self) -> bool:
        return self.tree_topk is not None

    @classmethod
    def from_dict(cls, d: dict[str, Any] | str) -> SpeculativeConfig:
        """From vLLM's dict (or its JSON text). Raises ValueError naming an unknown key or a bad value."""
        given = d
        if isinstance(d, str):
            import json

            def no_repeats(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
                seen = [k for i, (k, _) in enumerate(pairs) if k in dict(pairs[:i])]
                if seen:  # json.loads would keep the last silently
                    raise ValueError(f"speculative_config gives key {seen[0]!r} more than once: {given!r}")
                return dict(pairs)

            try:
                d = json.loads(d, object_pairs_hook=no_repeats)
            except json.JSONDecodeError as e:
                raise ValueError(f"speculative_config is not valid JSON ({e.msg} at column {e.colno}): {d!r}") from e
        if not isinstance(d, dict):
            json_kind = {type(None): "null", bool: "a boolean", int: "a number", float: "a number", str: "a string",
                         list: "an array"}.get(type(d), type(d).__name__)
            shown = f"{given!r} ({json_kind})" if isinstance(given, str) else f"{given!r} of type {type(given).__name__}"
            raise ValueError(f'speculative_config must be a JSON object such as {{"method": "ngram", '
                             f'"num_speculative_tokens": 4}}, got {shown}')
        unknown = sorted(set(d) - set(_SPEC_KEYS))
        if unknown:
            raise ValueError(f"speculative_config has unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                             f"{', '.join(_SPEC_KEYS)}")
        if "method" not in d:
            raise ValueError("speculative_config needs 'method'")
        _check_method(d["method"])  # before the other keys: a wrong method is the first thing to say
        if "num_speculative_tokens" not in d and d["method"] != "medusa":  # Medusa: the head's count, as vLLM
            if d["method"] in LEARNED_HEAD_METHODS and d.get("model") is not None:
                cls._check_head_dir(d["method"], d["model"])  # a bad path first: it is the bigger mistake
            raise ValueError(_NEEDS_K)
        return cls(**d)


_NEEDS_K = ("speculative_config needs 'num_speculative_tokens' (gamma_max, the most drafts a request and step; an "
            f"integer in [1, {MAX_SPECULATIVE_TOKENS}]; for a tree, its depth; method 'medusa' defaults to its head "
            "count)")


def _check_method(method: Any) -> None:
    from roofline.spec_decode.proposer import PROPOSERS  # the registry of methods (one entry per proposer)

    if not isinstance(method, str) or method not in PROPOSERS:  # an object or array is unhashable: say so too
        raise ValueError(f"speculative_config method must be one of {', '.join(PROPOSERS)}, got {method!r}")


def check_draft_vocab(draft: ModelConfig, target: ModelConfig) -> None:
    """Raises ValueError naming both sizes when the draft's vocabulary is not the target's."""
    if draft.vocab_size != target.vocab_size:
        raise ValueError(f"speculative_config model {draft.name!r} has a vocabulary of {draft.vocab_size} tokens, "
                         f"the target {target.name!r} has {target.vocab_size}: a draft must share the target's "
                         f"vocabulary")
