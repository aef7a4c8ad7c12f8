"""Incremental detokenization and stop-string matching.

Text is decoded from a sliding window of token ids (as Hugging Face TGI and vLLM do): decode
``ids[prefix_offset:]`` and ``ids[prefix_offset:read_offset]`` and emit the difference. A window whose
text ends in U+FFFD is an incomplete UTF-8 sequence (a multi-byte character split across tokens), so
nothing is emitted until the next token completes it. The prefix window also keeps tokenizers that add
a leading space (SentencePiece) from losing it at the boundary.

Stop strings may span token boundaries: the search covers the new text plus the last
``len(stop) - 1`` characters before it. While a request runs, the last ``max(len(stop)) - 1``
characters are held back from streaming, because they might be the start of a stop string.
"""

from __future__ import annotations

from typing import Any

from roofline.engine.sequence import Sequence

_INITIAL_WINDOW = 5  # prompt tokens kept as decoding context


class Detokenizer:
    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer

    def start(self, seq: Sequence) -> None:
        n = seq.num_prompt_tokens
        seq.prefix_offset = max(0, n - _INITIAL_WINDOW)
        seq.read_offset = n

    def decode_new(self, seq: Sequence) -> str:
        """Append the text of newly sampled tokens to ``seq.output_text``; returns the added text."""
        if self.tokenizer is None:
            return ""
        ids = seq.token_ids
        skip = seq.sampling_params.skip_special_tokens
        prefix_text = self.tokenizer.decode(ids[seq.prefix_offset:seq.read_offset], skip_special_tokens=skip)
        new_text = self.tokenizer.decode(ids[seq.prefix_offset:], skip_special_tokens=skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""  # incomplete character (or a special token that decodes to nothing)
        delta = new_text[len(prefix_text):]
        seq.prefix_offset = seq.read_offset
        seq.read_offset = len(ids)
        seq.output_text += delta
        return delta


def find_stop_string(seq: Sequence, num_new_chars: int) -> str | None:
    """If a stop string now appears, truncate ``seq.output_text`` at it and return it.

    Only matches that end inside the newest ``num_new_chars`` characters are new; earlier text was
    already checked. The stop string itself is removed unless ``include_stop_str_in_output``.
    """
    stops = seq.sampling_params.stop
    if not stops or num_new_chars == 0:
        return None
    text = seq.output_text
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - num_new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    end = idx + len(stop) if seq.sampling_params.include_stop_str_in_output else idx
    seq.output_text = text[:end]
    return stop


def emittable_text(seq: Sequence) -> str:
    """Text not yet streamed that is safe to stream now; advances ``seq.num_emitted_chars``."""
    text = seq.output_text
    limit = len(text)
    if not seq.is_finished and seq.sampling_params.stop:
        limit -= max(len(s) for s in seq.sampling_params.stop) - 1
    if limit <= seq.num_emitted_chars:
        return ""
    delta = text[seq.num_emitted_chars:limit]
    seq.num_emitted_chars = limit
    return delta
