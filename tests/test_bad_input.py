"""Request validation and sampling/stopping features end to end, on the real default model (``default_llm``,
max_model_len 1024).

Bad input raises a ValueError naming the value and the allowed range before anything is scheduled:
SamplingParams at construction; prompt checks in ``engine.add_request``, which ``generate`` turns into a
per-request ``.error`` while the valid requests in the same call complete.
"""

from __future__ import annotations

import math

import pytest
from test_parity import prefill_logits

from roofline import SamplingParams

GREEDY8 = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _assert_idle(llm) -> None:
    """Nothing queued or running, and every KV block free."""
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.num_unfinished_requests == 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ------------------------------------------------------------------------------ SamplingParams


@pytest.mark.parametrize(("kwargs", "needles"), [
    (dict(max_tokens=0), ["max_tokens", ">= 1", "0"]),
    (dict(max_tokens=-3), ["max_tokens", ">= 1", "-3"]),
    (dict(temperature=-0.5), ["temperature", ">= 0", "-0.5"]),
    (dict(temperature=float("nan")), ["temperature", ">= 0", "nan"]),
    (dict(top_p=0.0), ["top_p", "(0, 1]", "0.0"]),
    (dict(top_p=1.5), ["top_p", "(0, 1]", "1.5"]),
    (dict(top_p=-0.1), ["top_p", "(0, 1]", "-0.1"]),
    (dict(stop=5), ["stop", "string", "5", "int"]),
    (dict(stop=[1]), ["stop", "string", "1", "int"]),
    (dict(stop=["ok", None]), ["stop", "string", "None"]),
    (dict(n=0), ["n", ">= 1", "0"]),
    (dict(min_tokens=9, max_tokens=4), ["min_tokens", "max_tokens", "9", "4"]),
    (dict(logprobs=21), ["logprobs", "20", "21"]),
    # 0 and -1 both disable top_k (vLLM), and the error says so.
    (dict(top_k=-2), ["top_k must be -1 or 0 (disabled), or >= 1, got -2"]),
])
def test_sampling_params_rejected_with_range(kwargs, needles):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    msg = str(e.value)
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_sampling_params_edges_accepted():
    assert SamplingParams(top_p=1.0).top_p == 1.0
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(max_tokens=1).max_tokens == 1
    assert SamplingParams(stop="x").stop == ["x"]
    assert SamplingParams(top_k=0).top_k == SamplingParams(top_k=-1).top_k == -1  # both disabled, as vLLM
    assert SamplingParams(top_k=1).top_k == 1


# ------------------------------------------------------------------------------ prompts


def test_prompt_checks_in_add_request(default_llm):
    engine = default_llm.engine
    max_len = engine.config.scheduler_config.max_model_len
    assert max_len == 1024
    free = engine.block_manager.num_free_blocks
    cases = [
        ([7] * max_len, ["1024 tokens", "max_model_len is 1024", "at most 1023"]),
        ([7] * (max_len + 50), ["1074 tokens", "max_model_len is 1024"]),
        ([], ["empty", "at least 1 token"]),
        ("", ["empty", "at least 1 token"]),
        ([5, 49152], ["49152", "[0, 49152)"]),
        ([5, -1], ["-1", "[0, 49152)"]),
    ]
    for prompt, needles in cases:
        with pytest.raises(ValueError) as e:
            engine.add_request(None, prompt, GREEDY8)
        for needle in needles:
            assert needle in str(e.value), (needle, str(e.value))
    # Nothing was queued and no block was taken.
    assert engine.scheduler.num_waiting == 0 and engine.scheduler.num_running == 0
    assert engine.block_manager.num_free_blocks == free
    # The longest allowed prompt passes validation (not run: a 1023-token prefill is slow on CPU).
    engine.validate([7] * (max_len - 1), GREEDY8)


def test_bad_prompts_between_good_ones(default_llm):
    good = ["The capital of France is", "def fibonacci(n):"]
    alone = [default_llm.generate(p, GREEDY8, use_tqdm=False)[0].outputs[0].token_ids for p in good]
    prompts = ["", good[0], {"prompt_token_ids": [7] * 2000}, {"prompt_token_ids": []}, good[1],
               {"prompt_token_ids": [1, 10**6]}, {"text": "no prompt key"}]
    outs = default_llm.generate(prompts, GREEDY8, use_tqdm=False)
    assert len(outs) == len(prompts)
    errors = [o.error for o in outs]
    assert errors[1] is None and errors[4] is None
    assert "empty" in errors[0] and "empty" in errors[3]
    assert "2000 tokens" in errors[2] and "max_model_len is 1024" in errors[2]
    assert "1000000" in errors[5]
    assert "prompt_token_ids" in errors[6]
    for i in (0, 2, 3, 5, 6):
        assert outs[i].outputs == [] and outs[i].finished
    assert outs[1].outputs[0].token_ids == alone[0]
    assert outs[4].outputs[0].token_ids == alone[1]
    assert outs[1].outputs[0].text.startswith(" Paris.")
    assert outs[1].prompt == good[0] and outs[4].prompt == good[1]
    # Run statistics count the completed requests only.
    assert default_llm.last_run_stats.num_requests == 2
    assert default_llm.last_run_stats.num_output_tokens == 16
    _assert_idle(default_llm)


def test_a_too_long_text_prompt_reports_its_tokens(default_llm):
    """A text prompt refused as too long comes back with its token ids (the caller sees how long it was)."""
    text = "word " * 1500
    out = default_llm.generate([text, "The capital of France is"], GREEDY8, use_tqdm=False)
    n = len(default_llm.engine.tokenize(text))
    assert n >= 1024 and f"{n} tokens" in out[0].error and len(out[0].prompt_token_ids) == n
    assert out[0].prompt == text and out[0].outputs == [] and out[1].error is None


def test_a_rejected_prompt_is_logged_and_counted_by_the_progress_bar(default_llm, caplog, capsys):
    """The progress bar counts every prompt (a rejected one is done at once, named in its postfix), and each
    rejected prompt gets a warning naming its index and why: its output has no outputs to index."""
    import logging

    with caplog.at_level(logging.WARNING, logger="roofline.llm"):
        outs = default_llm.generate(["", "The capital of France is"], GREEDY8, use_tqdm=True)
    assert outs[0].error is not None and outs[1].error is None
    warned = [r.getMessage() for r in caplog.records if r.name == "roofline.llm"]
    assert len(warned) == 1 and warned[0].startswith("prompt 0 of 2 rejected") and "empty" in warned[0], warned
    bar = capsys.readouterr().err
    assert "2/2" in bar and "rejected=1" in bar, bar[-300:]


def test_prompt_of_wrong_type_is_a_per_request_error(default_llm):
    """Regression: a None prompt used to raise TypeError out of generate, leaving the valid requests
    queued before it in the engine (run, unseen, by the next call)."""
    outs = default_llm.generate(["The capital of France is", None, 42, {"text": "no prompt key"}],
                                SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert outs[0].error is None and outs[0].outputs[0].token_ids == [7042, 30]
    for o, name in zip(outs[1:3], ["NoneType", "int"], strict=True):
        assert "a prompt must be a string, a list of token ids, or a dict" in o.error and name in o.error
    assert outs[3].prompt_token_ids == []  # not the dict's keys
    _assert_idle(default_llm)


def test_call_of_wrong_shape_is_a_type_error_naming_the_argument(default_llm):
    """Whole-call mistakes (not one bad prompt) raise TypeError before anything is queued: a dict of sampling
    settings instead of SamplingParams (was an AttributeError from deep in the engine), a prompts argument that is
    not a prompt or a list (None, 5, bytes: bytes were split into one rejected request per byte), a chat given a
    string (was walked character by character)."""
    with pytest.raises(TypeError, match=r"sampling_params must be a SamplingParams .* got dict .*SamplingParams\(\*\*"):
        default_llm.generate("a", {"temperature": 0}, use_tqdm=False)
    with pytest.raises(TypeError, match="got str"):
        default_llm.generate(["a", "b"], [SamplingParams(), "greedy"], use_tqdm=False)
    for bad, name in ((None, "NoneType"), (5, "int"), (b"hello", "bytes")):
        with pytest.raises(TypeError, match=f"prompts must be .* got {name}"):
            default_llm.generate(bad, GREEDY8, use_tqdm=False)
    with pytest.raises(TypeError, match="messages must be a conversation .* got str"):
        default_llm.chat("hello", GREEDY8, use_tqdm=False)
    _assert_idle(default_llm)


def test_failure_mid_run_leaves_engine_clean(default_llm, monkeypatch):
    """An exception during the run (here from the model runner on the second step) propagates, and the
    call's requests are aborted: no request stays queued and no block stays taken."""
    executor = default_llm.engine.executor
    real_execute = executor.execute_model_async
    calls = []

    def failing_execute(step):
        calls.append(step)
        if len(calls) == 2:
            raise RuntimeError("injected failure")
        return real_execute(step)

    monkeypatch.setattr(executor, "execute_model_async", failing_execute)
    with pytest.raises(RuntimeError, match="injected failure"):
        default_llm.generate(["The capital of France is", "def fibonacci(n):"], GREEDY8, use_tqdm=False)
    assert len(calls) == 2
    _assert_idle(default_llm)
    monkeypatch.undo()
    out = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=2),
                               use_tqdm=False)[0]
    assert out.outputs[0].token_ids == [7042, 30]

def test_all_prompts_rejected(default_llm):
    outs = default_llm.generate(["", {"prompt_token_ids": []}], GREEDY8, use_tqdm=False)
    assert [o.finished for o in outs] == [True, True]
    assert all("empty" in o.error for o in outs)
    _assert_idle(default_llm)


def test_params_count_mismatch(default_llm):
    with pytest.raises(ValueError, match="2 SamplingParams for 3 prompts"):
        default_llm.generate(["a", "b", "c"], [GREEDY8, GREEDY8], use_tqdm=False)
    _assert_idle(default_llm)


# ------------------------------------------------------------------------------ sampling features


def test_n_samples(default_llm):
    out = default_llm.generate("Once upon a time",
                               SamplingParams(n=3, temperature=1.0, seed=11, max_tokens=8, ignore_eos=True),
                               use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 8 and c.finish_reason == "length" for c in out.outputs)
    # Independent streams (seed + index): not three copies of one sample.
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    _assert_idle(default_llm)


def test_n_greedy_samples_identical(default_llm):
    out = default_llm.generate("The capital of France is", SamplingParams(n=2, temperature=0, max_tokens=3),
                               use_tqdm=False)[0]
    assert [c.index for c in out.outputs] == [0, 1]
    assert [c.token_ids for c in out.outputs] == [[7042, 30, 198]] * 2


def test_seed_independent_of_batch(default_llm):
    prompt = "Once upon a time"
    seeded = SamplingParams(temperature=0.8, seed=1234, max_tokens=8, ignore_eos=True)
    alone = default_llm.generate(prompt, seeded, use_tqdm=False)[0].outputs[0].token_ids
    others = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]
    params = [SamplingParams(temperature=1.0, max_tokens=8, ignore_eos=True),  # unseeded: shared RNG
              GREEDY8, SamplingParams(temperature=0.8, seed=99, max_tokens=5, ignore_eos=True)]
    outs = default_llm.generate(others[:2] + [prompt] + others[2:], params[:2] + [seeded] + params[2:],
                                use_tqdm=False)
    assert outs[2].outputs[0].token_ids == alone
    again = default_llm.generate([prompt, prompt], [seeded, seeded], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in again] == [alone, alone]
    other_seed = default_llm.generate(prompt, SamplingParams(temperature=0.8, seed=4321, max_tokens=8,
                                                             ignore_eos=True), use_tqdm=False)
    assert other_seed[0].outputs[0].token_ids != alone
    _assert_idle(default_llm)


# ------------------------------------------------------------------------------ stopping


@pytest.fixture(scope="module")
def paris(default_llm):
    """Greedy continuation of "The capital of France is" (ids and text), run once."""
    out = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12,
                                                                         ignore_eos=True), use_tqdm=False)
    c = out[0].outputs[0]
    assert c.token_ids[:3] == [7042, 30, 198] and c.text.startswith(" Paris.\n")
    return c


def test_stop_string(default_llm, paris):
    c = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12, stop="."),
                             use_tqdm=False)[0].outputs[0]
    assert c.text == " Paris"
    assert (c.finish_reason, c.stop_reason) == ("stop", ".")
    assert c.token_ids == [7042, 30]  # generation ended at the token that completed the stop string


def test_stop_string_across_tokens(default_llm, paris):
    """"is." spans " Paris" and ".": the text ends before it; the earliest of several stops wins."""
    c = default_llm.generate("The capital of France is",
                             SamplingParams(temperature=0, max_tokens=12, stop=["\n", "is."]),
                             use_tqdm=False)[0].outputs[0]
    assert c.text == " Par"
    assert (c.finish_reason, c.stop_reason) == ("stop", "is.")
    c = default_llm.generate("The capital of France is",
                             SamplingParams(temperature=0, max_tokens=12, stop=["is.", "Paris"],
                                            include_stop_str_in_output=True), use_tqdm=False)[0].outputs[0]
    assert c.text == " Paris"
    assert c.stop_reason == "Paris"


def test_stop_string_later_in_text(default_llm, paris):
    """A stop string that first appears several tokens in: text is the greedy text up to it."""
    text = paris.text
    stop = text[9:12]  # three characters past " Paris.\n"
    assert stop and stop not in text[:9 + len(stop) - 1]
    c = default_llm.generate("The capital of France is",
                             SamplingParams(temperature=0, max_tokens=12, stop=[stop]),
                             use_tqdm=False)[0].outputs[0]
    assert c.text == text[:text.index(stop)]
    assert c.stop_reason == stop and c.finish_reason == "stop"
    assert c.token_ids == paris.token_ids[:len(c.token_ids)] and len(c.token_ids) < 12


def test_stop_token_id(default_llm, paris):
    c = default_llm.generate("The capital of France is",
                             SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[198]),
                             use_tqdm=False)[0].outputs[0]
    assert c.token_ids == [7042, 30, 198]
    assert (c.finish_reason, c.stop_reason) == ("stop", 198)


def test_max_tokens_length(default_llm, paris):
    c = default_llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=5),
                             use_tqdm=False)[0].outputs[0]
    assert c.token_ids == paris.token_ids[:5]
    assert c.finish_reason == "length" and c.stop_reason is None


@pytest.fixture(scope="module")
def france_chat(default_llm):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    out = default_llm.chat(msgs, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)[0]
    return msgs, out


def test_chat_uses_template(default_llm, france_chat):
    msgs, out = france_chat
    c = out.outputs[0]
    assert "Paris" in c.text
    assert c.finish_reason == "stop"  # the model ends its turn with an EOS id
    tok = default_llm.tokenizer
    expected = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    if not isinstance(expected, list):
        expected = expected["input_ids"]
    assert out.prompt_token_ids == list(expected)
    assert "<|im_start|>assistant" in tok.decode(out.prompt_token_ids)


def test_min_tokens_suppresses_eos(default_llm, france_chat):
    _, out = france_chat
    ids = out.outputs[0].token_ids
    eos = default_llm.engine.eos_token_ids
    assert ids[-1] in eos  # finished on EOS after len(ids) tokens
    n = len(ids)
    c = default_llm.chat(france_chat[0], SamplingParams(temperature=0, max_tokens=n + 6, min_tokens=n + 3),
                         use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) >= n + 3
    assert not eos & set(c.token_ids[:n + 3])
    assert c.token_ids[:n - 1] == ids[:n - 1]  # same greedy path until the suppressed EOS
    assert c.token_ids[n - 1] not in eos


# ------------------------------------------------------------------------------ logprobs


def test_logprobs_greedy_match_model(default_llm):
    prompt = "The capital of France is"
    ids = default_llm.tokenizer(prompt).input_ids
    c = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=5),
                             use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs) == len(c.token_ids) == 3
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert len(lp) == 5  # greedy token is the top one: 5 alternatives include it
        assert lp[tok].rank == 1
        ranks = sorted(e.rank for e in lp.values())
        assert ranks == [1, 2, 3, 4, 5]
        assert all(e.logprob <= 0 for e in lp.values())
    # First position against the model's own log-softmax at the last prompt token.
    ref = prefill_logits(default_llm, ids)[-1].log_softmax(-1)
    top_lp, top_ids = ref.topk(5)
    first = c.logprobs[0]
    assert set(first) == set(top_ids.tolist())
    for tid, value in zip(top_ids.tolist(), top_lp.tolist(), strict=True):
        assert abs(first[tid].logprob - value) < 1e-4
    assert first[7042].decoded_token == " Paris"
    assert math.isclose(c.cumulative_logprob, sum(lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs,
                                                                                  strict=True)), rel_tol=1e-6)


def test_logprobs_include_sampled_token(default_llm):
    """At a high temperature the sampled token is often outside the top 1: it is added with its rank."""
    c = default_llm.generate("Once upon a time", SamplingParams(temperature=2.0, seed=5, max_tokens=16,
                                                                ignore_eos=True, logprobs=1),
                             use_tqdm=False)[0].outputs[0]
    assert len(c.logprobs) == 16
    outside = 0
    for tok, lp in zip(c.token_ids, c.logprobs, strict=True):
        assert tok in lp
        best = [t for t, e in lp.items() if e.rank == 1]
        assert len(best) == 1
        if lp[tok].rank > 1:
            outside += 1
            assert len(lp) == 2
            assert lp[tok].logprob <= lp[best[0]].logprob
        else:
            assert len(lp) == 1
    assert outside > 0  # the case under test happened


def test_logprobs_off_by_default(default_llm):
    c = default_llm.generate("Hi", SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)[0].outputs[0]
    assert c.logprobs is None and c.cumulative_logprob is None



def test_mixed_list_is_two_prompts_not_one_token_list(default_llm):
    """[123, "text"] is two prompts (token ids would have to be all ints); the text one still completes."""
    outs = default_llm.generate([[123], "The capital of France is"],
                                SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert len(outs) == 2
    assert outs[1].error is None and outs[1].outputs[0].text == " Paris."
    outs = default_llm.generate([123, "The capital of France is"], SamplingParams(temperature=0, max_tokens=2),
                                use_tqdm=False)
    assert len(outs) == 2
    assert outs[1].outputs[0].text == " Paris."
    assert outs[0].error == ("a prompt must be a string, a list of token ids, or a dict with 'prompt' or "
                             "'prompt_token_ids'; got int")


def test_chat_message_without_content_is_a_clear_error(default_llm):
    with pytest.raises(ValueError, match=r"^message 0 must be a dict with string 'role' and 'content', got"):
        default_llm.chat([{"role": "user"}], SamplingParams(max_tokens=2), use_tqdm=False)


def test_cuda_device_without_gpu_is_a_clear_error():
    import torch

    from roofline.args import resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match=r"^device 'cuda' requested, but this torch build sees no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(ValueError, match=r"^device must be auto, cpu, cuda or cuda:N, got 'tpu'"):
        resolve_device("tpu")


# ------------------------------------------------------------------------------ non-finite distributions (issue 31)


def _md(n: int, temperature: float, seeds: list[int | None]):
    import torch

    from roofline.layers.sampler import SamplingMetadata

    gens = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    return SamplingMetadata(temperatures=torch.full((n,), temperature), top_ks=None, top_ps=None, min_ps=None,
                            repetition_penalties=None, presence_penalties=None, frequency_penalties=None,
                            prompt_mask=None, output_counts=None, banned_mask=None, generators=gens,
                            all_greedy=temperature == 0, max_num_logprobs=1)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("poison", [float("inf"), float("nan")])
def test_sampler_flags_only_the_non_finite_row(temperature, poison):
    import torch

    from roofline.layers.sampler import Sampler

    clean = torch.randn(3, 50, generator=torch.Generator().manual_seed(0)) * 3
    clean[:, 7] = -float("inf")  # a masked token is legal, not a non-finite distribution
    bad = clean.clone()
    bad[1, 11] = poison
    alone = Sampler()(clean, _md(3, temperature, [1, 2, 3]))
    mixed = Sampler()(bad, _md(3, temperature, [1, 2, 3]))
    assert alone.nonfinite.tolist() == [False, False, False]
    assert mixed.nonfinite.tolist() == [False, True, False]
    assert mixed.token_ids[[0, 2]].tolist() == alone.token_ids[[0, 2]].tolist()
    assert mixed.logprobs[[0, 2]].tolist() == alone.logprobs[[0, 2]].tolist()


def _poisoned(**kwargs) -> SamplingParams:
    """The issue's request: repetition_penalty=1e-38 makes logit / 1e-38 = +inf, then a NaN softmax row."""
    return SamplingParams(repetition_penalty=1e-38, **kwargs)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_non_finite_distribution_fails_only_its_request(default_llm, temperature, monkeypatch):
    # Validation now refuses 1e-38 (test_sampling_params.py); the guard behind it is tested with the old bound,
    # standing for any non-finite row validation cannot foresee (a model's own inf/NaN logits).
    monkeypatch.setattr("roofline.sampling_params.REPETITION_PENALTY_MIN", 0.0)
    prompt = "The capital of France is Paris. The capital of France is"
    clean = [SamplingParams(temperature=temperature, seed=5, max_tokens=8, ignore_eos=True, logprobs=1),
             SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)]
    alone = default_llm.generate([prompt, "Once upon a time"], clean, use_tqdm=False)
    poisoned = _poisoned(temperature=temperature, seed=3, max_tokens=16, logprobs=1)
    outs = default_llm.generate([prompt, prompt, "Once upon a time"], [poisoned, *clean], use_tqdm=False)
    assert outs[0].error is not None and "sampling distribution is not finite" in outs[0].error
    assert "repetition_penalty" in outs[0].error
    assert outs[0].outputs[0].finish_reason == "error" and outs[0].outputs[0].token_ids == []
    for got, want in zip(outs[1:], alone, strict=True):
        assert got.error is None
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    _assert_idle(default_llm)


def test_non_finite_distribution_fails_only_its_request_with_speculation_pinned_on(monkeypatch):
    """The same with n-gram speculation pinned on (gamma 4, not adaptive): the clean rows draft and verify
    (the copy-heavy prompt matches), the poisoned one (penalties: it decodes without drafts) fails alone."""
    from roofline.llm import LLM

    monkeypatch.setattr("roofline.sampling_params.REPETITION_PENALTY_MIN", 0.0)
    llm = LLM(max_model_len=512, dtype="float32", device="cpu", attention_backend="torch",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "adaptive": False})
    prompt = "The capital of France is Paris. The capital of France is"
    clean = [SamplingParams(temperature=0.8, seed=5, max_tokens=12, ignore_eos=True),
             SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)]
    alone = llm.generate([prompt, prompt + " Paris."], clean, use_tqdm=False)
    before = llm.engine.spec_stats.copy()
    outs = llm.generate([prompt, prompt, prompt + " Paris."], [_poisoned(temperature=0, max_tokens=8), *clean],
                        use_tqdm=False)
    assert llm.engine.spec_stats.since(before).num_drafts > 0  # speculation really ran beside the bad row
    assert outs[0].error is not None and "sampling distribution is not finite" in outs[0].error
    for got, want in zip(outs[1:], alone, strict=True):
        assert got.error is None
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
    _assert_idle(llm)
    llm.engine.executor.shutdown()


@pytest.mark.parametrize("env", ["ROOFLINE_PREFILL_KERNEL", "ROOFLINE_DECODE_KERNEL"])
def test_a_bad_kernel_environment_variable_is_refused_on_the_cpu_too(env, monkeypatch, tmp_path):
    import json

    from roofline.llm import LLM

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv(env, "fa3")
    with pytest.raises(ValueError, match=f"{env}='fa3'.*auto, triton, gluon"):
        LLM(str(tmp_path), load_format="dummy", device="cpu", max_model_len=64, num_kv_blocks=8)
    monkeypatch.setenv(env, " Triton")  # read as the kernel choosers read it: stripped, any case
    LLM(str(tmp_path), load_format="dummy", device="cpu", max_model_len=64, num_kv_blocks=8)
    from roofline.kernels.gluon_prefill import choose_prefill_kernel, paged_prefill_attention

    assert choose_prefill_kernel(" Triton") is paged_prefill_attention


@pytest.mark.parametrize("kwargs, needle", [
    ({"max_model_len": "2048"}, "max_model_len must be an integer or None, got '2048' (str)"),
    ({"max_num_seqs": "4"}, "max_num_seqs must be an integer, got '4' (str)"),
    ({"block_size": 16.5}, "block_size must be an integer or None, got 16.5 (float)"),
    ({"seed": "x"}, "seed must be an integer, got 'x' (str)"),
    ({"tensor_parallel_size": True}, "tensor_parallel_size must be an integer, got True (bool)"),
    ({"enforce_eager": "yes"}, "enforce_eager must be True or False, got 'yes' (str)"),
    ({"model": 123}, "model must be a path or a model name (str) or None, got 123 (int)"),
])
def test_engine_args_of_the_wrong_type_name_the_field(kwargs, needle):
    """A wrong type fails at construction naming the field, value and type (it was a raw comparison TypeError,
    "'<' not supported between instances of 'str' and 'int'", from inside the engine's set-up)."""
    from roofline.args import EngineArgs

    with pytest.raises(TypeError) as e:
        EngineArgs(**kwargs)
    assert needle in str(e.value)


def test_an_empty_model_name_is_refused():
    from roofline.args import EngineArgs

    with pytest.raises(ValueError, match=r"^model must be a path or a model name, got an empty string \(leave it "
                                         r"out for the default model\)$"):
        EngineArgs(model=" ")


def test_bool_token_ids_are_refused_per_request(default_llm):
    """True is not token id 1: a prompt holding a bool is rejected with the range (it generated before)."""
    outs = default_llm.generate([{"prompt_token_ids": [True, 2, 3]}, "The capital of France is"],
                                SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert outs[0].error is not None and "prompt token id True is a bool, not an integer token id in [0, 49152)" \
        in outs[0].error
    assert outs[1].error is None and outs[1].outputs[0].token_ids == [7042, 30]
    _assert_idle(default_llm)


def test_chat_role_empty_conversation_and_lone_surrogates_are_clear_errors(default_llm):
    """What the server refuses with a 400, the API refuses too (a fresh user found an unknown role rendered into
    the template and an empty conversation returning [] silently); text that is not valid Unicode (a lone
    surrogate, as Python makes of non-UTF-8 bytes) is one prompt's error, not a tokenizer TypeError for the batch."""
    from typing import get_args

    from roofline.llm import CHAT_ROLES
    from roofline.server.protocol import ChatMessage

    assert set(get_args(ChatMessage.model_fields["role"].annotation)) == set(CHAT_ROLES)
    sp = SamplingParams(temperature=0, max_tokens=2)
    with pytest.raises(ValueError, match=r"^message 0: role must be one of 'system', 'developer', 'user', "
                                         r"'assistant', 'tool', got 'wizard'$"):
        default_llm.chat([{"role": "wizard", "content": "hi"}], sp, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^messages must contain at least 1 message, got an empty conversation$"):
        default_llm.chat([], sp, use_tqdm=False)
    with pytest.raises(ValueError, match=r"^message 1 content contains a lone UTF-16 surrogate '\\udcff' at "
                                         r"character 4 \(non-UTF-8 bytes\?\): not valid Unicode text$"):
        default_llm.chat([{"role": "system", "content": "x"}, {"role": "user", "content": "bad \udcff"}], sp,
                         use_tqdm=False)
    outs = default_llm.generate(["hi \udcff there", "The capital of France is"], sp, use_tqdm=False)
    assert outs[0].error == ("prompt contains a lone UTF-16 surrogate '\\udcff' at character 3 (non-UTF-8 "
                             "bytes?): not valid Unicode text")
    assert outs[1].error is None and outs[1].outputs[0].text == " Paris."
