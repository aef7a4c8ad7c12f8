"""Incremental detokenization, stop strings across token boundaries and streaming hold-back, with the
real tokenizer of the default model (SmolLM2, byte-level BPE: multibyte characters are split across
tokens, e.g. an emoji into 3 byte tokens).

Sequences are built by hand and fed one token per step, in the engine's order: append the token,
``decode_new``, ``find_stop_string`` on the new characters, finish, then ``emittable_text``.
"""

from __future__ import annotations

import pytest

from roofline.engine.detokenizer import Detokenizer, emittable_text, find_stop_string
from roofline.engine.sequence import Sequence, SequenceStatus
from roofline.models.loader import load_tokenizer, resolve_model
from roofline.sampling_params import SamplingParams

PROMPT = "Answer in one line:"


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model(None))


def encode(tok, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False).input_ids)


def start_seq(tok, params: SamplingParams | None = None, prompt: str = PROMPT) -> tuple[Sequence, Detokenizer]:
    seq = Sequence("r", encode(tok, prompt), params or SamplingParams(max_tokens=100), arrival_time=0.0)
    seq.status = SequenceStatus.RUNNING
    detok = Detokenizer(tok)
    detok.start(seq)
    return seq, detok


def feed(seq: Sequence, detok: Detokenizer, token: int) -> tuple[str, str | None, str]:
    """One engine step for ``seq``: returns (decoded delta, stop string found, streamed text)."""
    seq.append_token(token, 0.0)
    before = len(seq.output_text)
    delta = detok.decode_new(seq)
    stop = find_stop_string(seq, len(seq.output_text) - before)
    if stop is not None:
        seq.stop_reason = stop
        seq.status = SequenceStatus.FINISHED_STOPPED
    return delta, stop, emittable_text(seq)


@pytest.mark.parametrize(
    "text",
    [
        "Café naïve — 日本語のテキスト 🎉👍🏽 ok",
        "日本語の文章です。",  # starts with a byte token of a 3-byte character
        "🎉👍🏽🇫🇷 done",  # 4-byte characters, a skin-tone modifier and a flag (two regional indicators)
        "naïve façade — Ελληνικά, Ünïcödé",
    ],
)
def test_incremental_decode_of_multibyte_text_never_emits_a_partial_character(tok, text):
    ids = encode(tok, text)
    assert any(tok.decode([i]) == "\ufffd" for i in ids), "the text should split a character across tokens"
    seq, detok = start_seq(tok)
    deltas = []
    for t in ids:
        delta, stop, _ = feed(seq, detok, t)
        assert stop is None
        assert "\ufffd" not in delta, f"partial character emitted after token {t}: {delta!r}"
        deltas.append(delta)
    assert "".join(deltas) == seq.output_text == tok.decode(ids) == text
    assert "" in deltas  # some tokens were held back until their character completed


def test_emoji_bytes_are_held_back_until_complete(tok):
    ids = encode(tok, " 🎉")
    assert len(ids) == 3  # ' \xf0\x9f', '\x8e', '\x89' in some split
    seq, detok = start_seq(tok)
    assert [feed(seq, detok, t)[0] for t in ids] == ["", "", " 🎉"]


def test_leading_space_of_the_first_output_token_is_kept(tok):
    seq, detok = start_seq(tok, prompt="The capital of France is")
    deltas = [feed(seq, detok, t)[0] for t in encode(tok, " Paris. It is")]
    assert deltas == [" Paris", ".", " It", " is"]
    assert seq.output_text == " Paris. It is"


def test_special_tokens_are_skipped_or_kept(tok):
    eos = tok.eos_token_id
    seq, detok = start_seq(tok)
    for t in encode(tok, " Hi") + [eos]:
        feed(seq, detok, t)
    assert seq.output_text == " Hi"
    seq, detok = start_seq(tok, SamplingParams(max_tokens=10, skip_special_tokens=False))
    for t in encode(tok, " Hi") + [eos]:
        feed(seq, detok, t)
    assert seq.output_text == " Hi<|im_end|>"


def test_no_tokenizer_gives_no_text():
    seq = Sequence("r", [1, 2], SamplingParams(), arrival_time=0.0)
    detok = Detokenizer(None)
    detok.start(seq)
    seq.append_token(5, 0.0)
    assert detok.decode_new(seq) == "" and seq.output_text == ""


# --------------------------------------------------------------------------------------------------
# stop strings
# --------------------------------------------------------------------------------------------------

TEXT = "Hello world. STOP here"  # tokens: Hello | ' world' | . | ' ST' | OP | ' here'


@pytest.mark.parametrize(
    "include, want_text",
    [(False, "Hello world. "), (True, "Hello world. STOP")],
)
def test_stop_string_spanning_two_tokens(tok, include, want_text):
    ids = encode(tok, TEXT)
    assert [tok.decode([i]) for i in ids] == ["Hello", " world", ".", " ST", "OP", " here"]
    seq, detok = start_seq(tok, SamplingParams(max_tokens=100, stop=["STOP"], include_stop_str_in_output=include))
    stops = [feed(seq, detok, t)[1] for t in ids[:5]]
    assert stops == [None, None, None, None, "STOP"]  # found when its second half arrives
    assert seq.output_text == want_text
    assert seq.stop_reason == "STOP" and seq.finish_reason == "stop"


def test_stop_string_spanning_three_tokens(tok):
    ids = encode(tok, TEXT)
    seq, detok = start_seq(tok, SamplingParams(max_tokens=100, stop=["d. S"]))
    stops = [feed(seq, detok, t)[1] for t in ids[:4]]
    assert stops == [None, None, None, "d. S"]
    assert seq.output_text == "Hello worl"


def test_stop_string_after_a_multibyte_character(tok):
    ids = encode(tok, "Prix: 5€ fin")
    seq, detok = start_seq(tok, SamplingParams(max_tokens=100, stop=["€ f"]))
    found = [feed(seq, detok, t)[1] for t in ids]
    assert found.count("€ f") == 1
    assert seq.output_text == "Prix: 5"


def test_find_stop_string_earliest_match_wins_and_old_text_is_not_rechecked():
    seq = Sequence("r", [1], SamplingParams(stop=["END", "STOP"]), arrival_time=0.0)
    seq.output_text = "abc STOP xyz END"
    assert find_stop_string(seq, len(seq.output_text)) == "STOP"
    assert seq.output_text == "abc "
    # Only matches that end in the newest characters count: "STOP" lies in text checked before.
    seq.output_text = "xxSTOPyy"
    assert find_stop_string(seq, 2) is None  # "yy" is new, "STOP" was checked already
    assert find_stop_string(seq, 3) == "STOP"  # "Pyy" is new: the match ends inside it
    assert seq.output_text == "xx"
    seq.output_text = "no stop here"
    assert find_stop_string(seq, 0) is None


# --------------------------------------------------------------------------------------------------
# streaming hold-back
# --------------------------------------------------------------------------------------------------

def test_emittable_text_holds_back_longest_stop_minus_one_and_never_streams_the_stop(tok):
    ids = encode(tok, TEXT)
    seq, detok = start_seq(tok, SamplingParams(max_tokens=100, stop=["STOP", "XY"]))
    streamed = []
    for t in ids[:4]:
        _, stop, delta = feed(seq, detok, t)
        streamed.append(delta)
        # While running, the last len("STOP") - 1 = 3 characters stay back.
        assert "".join(streamed) == seq.output_text[:len(seq.output_text) - 3]
    assert streamed == ["He", "llo wo", "r", "ld."]
    assert seq.output_text == "Hello world. ST"
    _, stop, delta = feed(seq, detok, ids[4])
    assert stop == "STOP" and seq.is_finished
    assert delta == " "  # finished: everything left is released, and the stop was never streamed
    assert "".join(streamed) + delta == "Hello world. "
    assert emittable_text(seq) == ""


def test_emittable_text_without_stop_strings_streams_everything():
    seq = Sequence("r", [1], SamplingParams(), arrival_time=0.0)
    seq.status = SequenceStatus.RUNNING
    seq.output_text = "abc"
    assert emittable_text(seq) == "abc"
    assert emittable_text(seq) == ""
    seq.output_text += "de"
    assert emittable_text(seq) == "de"
    assert seq.num_emitted_chars == 5


def test_emittable_text_releases_the_held_back_tail_on_length_finish():
    seq = Sequence("r", [1], SamplingParams(stop=["####"]), arrival_time=0.0)
    seq.status = SequenceStatus.RUNNING
    seq.output_text = "a"
    assert emittable_text(seq) == ""  # 1 char <= 3 held back
    seq.output_text = "abcde"
    assert emittable_text(seq) == "ab"
    seq.status = SequenceStatus.FINISHED_LENGTH
    assert emittable_text(seq) == "cde"
