"""Passkey retrieval: a five-digit key hidden at a given depth in repeated filler text, asked for at the end.

The prompt follows Mohtashami & Jaggi 2023 ("Landmark Attention", arXiv:2305.16300), as used by most
long-context evaluations: an instruction, the filler "The grass is green. The sky is blue. ..." repeated,
the line "The pass key is NNNNN. Remember it. NNNNN is the pass key." inserted at a sentence boundary,
more filler, and the question "What is the pass key?". Two forms:
- ``chat`` (the default): the text is the user turn of the model's chat template, and the assistant answers
  ("The pass key is 27611.");
- ``plain``: no template, and the question ends with "The pass key is" for the model to complete.
SmolLM2-135M-Instruct in fp32 passed 4 of 5 depths at 1k tokens with ``chat`` (all but 0.25) and 2 of 5
with ``plain`` (0 and 0.5; 1 of 5 at 2k), so ``chat`` is the default. Decoding is greedy; a
trial passes when the generated text contains the key.

Depth d in [0, 1] is the fraction of the filler (the haystack) before the key line, as in
needle-in-a-haystack tests: 0 puts the key right after the instruction, 1 right before the question. The
key line starts at the filler sentence boundary nearest ``d * num_filler_tokens`` (within half a sentence,
at most 4 tokens, of the target).
Pieces are tokenized separately and concatenated; each piece starts with its own space or newline (and the
template's parts end in a newline or a special token), so the ids are the ones the joined text tokenizes to.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

INSTRUCTION = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there.")
FILLER = (" The grass is green.", " The sky is blue.", " The sun is yellow.", " Here we go.",
          " There and back again.")
KEY_LINE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = {"chat": "\n\nWhat is the pass key?", "plain": "\n\nWhat is the pass key? The pass key is"}
PROMPT_FORMS = tuple(QUESTION)
DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
ANSWER_MAX_TOKENS = 16  # "The pass key is" + " " + 5 digits + "." and a little room


@dataclass(frozen=True)
class PasskeyPrompt:
    token_ids: list[int]
    key: str
    depth: float  # requested
    key_position: int  # token index where the key line starts
    filler_start: int  # token index of the first filler token
    num_filler_tokens: int

    @property
    def actual_depth(self) -> float:
        """Fraction of the filler tokens before the key line."""
        return (self.key_position - self.filler_start) / self.num_filler_tokens


def _ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def _template_parts(tokenizer: Any) -> tuple[list[int], list[int]]:
    """Token ids of the chat template before and after a single user turn's content (generation prompt on)."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the chat passkey prompt needs a chat template; this tokenizer has none (use plain)")
    marker = "\x00PASSKEY\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], add_generation_prompt=True,
                                         tokenize=False)
    before, after = text.split(marker)
    return _ids(tokenizer, before), _ids(tokenizer, after)


def build_passkey_prompt(tokenizer: Any, num_tokens: int, depth: float, key: str,
                         form: str = "chat") -> PasskeyPrompt:
    """A prompt of at most ``num_tokens`` tokens (the most filler sentences that fit) with ``key`` at ``depth``.

    Raises:
        ValueError: depth outside [0, 1], a key that is not 5 digits, an unknown form, no chat template for
            ``chat``, or num_tokens too small to hold the template, instruction, key line, question and one
            filler sentence.
    """
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth must be in [0, 1], got {depth}")
    if not (len(key) == 5 and key.isdigit()):
        raise ValueError(f"passkey must be 5 digits, got {key!r}")
    if form not in QUESTION:
        raise ValueError(f"passkey prompt form must be one of {', '.join(PROMPT_FORMS)}, got {form!r}")
    pre, post = _template_parts(tokenizer) if form == "chat" else ([], [])
    head = pre + _ids(tokenizer, INSTRUCTION)
    key_ids, tail = _ids(tokenizer, KEY_LINE.format(key=key)), _ids(tokenizer, QUESTION[form]) + post
    sentences = [_ids(tokenizer, s) for s in FILLER]
    budget = num_tokens - len(head) - len(key_ids) - len(tail)
    filler: list[list[int]] = []
    used = 0
    while used + len(sentences[len(filler) % len(sentences)]) <= budget:
        s = sentences[len(filler) % len(sentences)]
        filler.append(s)
        used += len(s)
    if not filler:
        raise ValueError(f"passkey length {num_tokens} is too short: the instruction, key line and question "
                         f"alone take {num_tokens - budget} tokens")
    target = depth * used
    # Boundary k: the key goes after k filler sentences; pick the k nearest the target.
    best_k, best_err, pos = 0, target, 0
    for k, s in enumerate(filler, start=1):
        pos += len(s)
        if abs(pos - target) < best_err:
            best_k, best_err = k, abs(pos - target)
    before = [t for s in filler[:best_k] for t in s]
    after = [t for s in filler[best_k:] for t in s]
    ids = head + before + key_ids + after + tail
    return PasskeyPrompt(ids, key, depth, len(head) + len(before), len(head), used)


def passkey_keys(num: int, seed: int = 0) -> list[str]:
    """``num`` five-digit keys from ``random.Random(seed)`` (10000..99999, so no leading zero)."""
    rng = random.Random(seed)
    return [str(rng.randint(10000, 99999)) for _ in range(num)]


def build_trials(tokenizer: Any, lengths: list[int], depths: list[float], seed: int = 0,
                 form: str = "chat") -> list[PasskeyPrompt]:
    """One prompt per (length, depth), each with its own key (the same keys for every configuration)."""
    keys = passkey_keys(len(lengths) * len(depths), seed)
    return [build_passkey_prompt(tokenizer, n, d, keys[i * len(depths) + j], form)
            for i, n in enumerate(lengths) for j, d in enumerate(depths)]


def run_passkey(llm: Any, trials: list[PasskeyPrompt]) -> list[dict[str, Any]]:
    """Greedy answers for every trial; returns one record per trial (length, depth, key, answer, passed).

    Trials run one at a time: a long prompt is prefill-bound, so batching them gains little, and one at a
    time a pool sized for one ``max_model_len`` sequence never preempts.
    """
    from roofline.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=ANSWER_MAX_TOKENS)
    records = []
    for t in trials:
        ro = llm.generate({"prompt_token_ids": t.token_ids}, params, use_tqdm=False)[0]
        if ro.error:
            raise ValueError(f"passkey prompt of {len(t.token_ids)} tokens was rejected: {ro.error}")
        answer = ro.outputs[0].text
        records.append({"length": len(t.token_ids), "depth": t.depth, "actual_depth": round(t.actual_depth, 4),
                        "key": t.key, "answer": answer, "passed": t.key in answer})
    return records
