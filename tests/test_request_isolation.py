"""One request's sampling parameters can never break another request.

A new-user pass sent ``{"seed": 18446744073709551616}`` (and ``top_k = 2**63``) to the OpenAI server: the
values went unchecked into ``torch.Generator.manual_seed`` / an int64 tensor, the whole engine step raised
"Overflow when unpacking long long", and every request in flight failed with it.

Property: drive SamplingParams fields to extreme values (huge and negative ints, NaN, inf, float32
overflow, wrong types) in bad requests, batched with a normal greedy request through the public API
(``LLM.generate``); first each field alone at every listed boundary (a deterministic sweep), then random
combinations of fields in up to four bad requests at once (hypothesis). Then
- each bad request is rejected at construction with a ValueError naming a field it set, or it gets a
  per-request ``error``, or it completes (``finish_reason`` "stop" or "length");
- the normal request completes with exactly the tokens it gets when run alone;
- the engine is idle afterwards, with every KV block free.

The engine is a tiny random-weight Llama (vocab 256, 2 layers, hidden 64) built once for the module, so the
whole file takes about 10 s on 2 CPU cores.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from roofline import LLM, SamplingParams

VOCAB = 256
MAX_MODEL_LEN = 64
MAX_NUM_SEQS = 8
NORMAL_PROMPT = [11, 42, 7, 99, 3, 250, 17, 64]
BAD_PROMPT = [5, 6, 7, 8, 9]
NORMAL = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)

# Values at and just past every boundary the engine has: int64, 2**64 (torch's seed limit), float32 max,
# float64 max, denormals, plus ordinary small values so that some bad requests do reach the engine.
EXTREME_INTS = [0, 1, -1, 2, 3, 8, 20, 21, 255, 256, 1024, 1025, 2**31 - 1, 2**31, 2**53 + 1,
                2**63 - 2, 2**63 - 1, 2**63, 2**64 - 1, 2**64, -(2**63), -(2**63) - 1, -(2**64), 10**30, 10**400]
EXTREME_FLOATS = [0.0, -0.0, 5e-324, 1e-45, 1e-38, 1e-5, 0.5, 1.0, 2.0, 2.0000001, -2.0, 1e38,
                  3.4028234663852886e38, 3.5e38, 1.7976931348623157e308, math.inf, -math.inf, math.nan]
WRONG_TYPES = [True, False, None, "1", 1.5, [1], {"a": 1}, b"1"]

ints = st.one_of(st.sampled_from(EXTREME_INTS), st.integers(-(2**70), 2**70))
floats = st.one_of(st.sampled_from(EXTREME_FLOATS), st.floats(allow_nan=True, allow_infinity=True),
                   st.sampled_from([0, 1, 2, -1, 10**400]))  # ints where a float is expected
wrong = st.sampled_from(WRONG_TYPES)

FIELDS = {
    "n": st.one_of(st.sampled_from([1, 2, MAX_NUM_SEQS, MAX_NUM_SEQS + 1]), ints, wrong),
    "temperature": st.one_of(floats, wrong),
    "top_p": st.one_of(floats, wrong),
    "top_k": st.one_of(ints, wrong),
    "min_p": st.one_of(floats, wrong),
    "repetition_penalty": st.one_of(floats, wrong),
    "presence_penalty": st.one_of(floats, wrong),
    "frequency_penalty": st.one_of(floats, wrong),
    "seed": st.one_of(ints, wrong),
    "max_tokens": st.one_of(ints, wrong),
    "min_tokens": st.one_of(ints, wrong),
    "stop": st.one_of(st.text(max_size=3), st.lists(st.one_of(st.text(max_size=3), wrong), max_size=3), wrong),
    "stop_token_ids": st.one_of(st.lists(st.one_of(ints, wrong), max_size=3), wrong),
    "ignore_eos": st.one_of(st.booleans(), wrong, ints),
    "logprobs": st.one_of(ints, wrong),
    "prompt_logprobs": st.one_of(ints, st.none()),
    "include_stop_str_in_output": st.one_of(st.booleans(), wrong),
    "skip_special_tokens": st.one_of(st.booleans(), wrong),
}
# One field at an extreme (reaches the engine more often) or several at once.
one_field = st.sampled_from(sorted(FIELDS)).flatmap(lambda name: FIELDS[name].map(lambda value: {name: value}))
bad_kwargs = st.one_of(one_field, st.fixed_dictionaries({}, optional=FIELDS).filter(bool))


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_llama")
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512}
    (path / "config.json").write_text(json.dumps(config))
    return LLM(str(path), load_format="dummy", device="cpu", attention_backend="torch", dtype="float32",
               max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, block_size=16)


@pytest.fixture(scope="module")
def normal_alone(tiny_llm):
    out = tiny_llm.generate({"prompt_token_ids": NORMAL_PROMPT}, NORMAL, use_tqdm=False)[0]
    assert out.error is None and len(out.outputs[0].token_ids) == 8
    return out.outputs[0].token_ids


def _assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def _run_beside_normal(llm: LLM, bad_kwargs_list: list[dict], normal_alone: list[int]) -> None:
    """Construct each bad request, run the accepted ones in one batch with the normal request, check all."""
    accepted: list[SamplingParams] = []
    for kwargs in bad_kwargs_list:
        try:
            accepted.append(SamplingParams(**kwargs))
        except ValueError as e:
            # Rejected at construction: the message names one of the fields this request set.
            message = str(e)
            assert any(message.startswith(name) for name in kwargs), (kwargs, message)
    prompts = [{"prompt_token_ids": BAD_PROMPT}] * len(accepted) + [{"prompt_token_ids": NORMAL_PROMPT}]
    outs = llm.generate(prompts, [*accepted, NORMAL], use_tqdm=False)  # must not raise: no step may fail

    normal = outs[-1]
    assert normal.error is None, (bad_kwargs_list, normal.error)
    assert normal.outputs[0].token_ids == normal_alone, bad_kwargs_list
    assert normal.outputs[0].finish_reason == "length"
    for params, out in zip(accepted, outs[:-1], strict=True):
        if out.error is None:  # accepted by the engine: it completed, every sample, with valid token ids
            assert out.finished and len(out.outputs) == params.n, params
            for c in out.outputs:
                assert c.finish_reason in ("stop", "length"), (params, c.finish_reason)
                assert all(0 <= t < VOCAB for t in c.token_ids), params
    _assert_idle(llm)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_each_field_at_each_boundary(tiny_llm, normal_alone, name):
    """Deterministic sweep: one field at every listed boundary value, the rest default, all in one batch."""
    if name in ("temperature", "top_p", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty"):
        values = EXTREME_FLOATS + [0, 1, 2, -1, 10**400] + WRONG_TYPES
    elif name in ("stop", "stop_token_ids"):
        values = [[v] for v in EXTREME_INTS + WRONG_TYPES] + WRONG_TYPES + ["", "x", ["", "x"]]
    else:
        values = EXTREME_INTS + EXTREME_FLOATS + WRONG_TYPES
    _run_beside_normal(tiny_llm, [{name: v} for v in values], normal_alone)


@settings(max_examples=50, deadline=None, database=None)
@given(bad_kwargs_list=st.lists(bad_kwargs, min_size=1, max_size=4))
@example(bad_kwargs_list=[{"seed": 2**64}, {"top_k": 2**63}])  # the values the new-user pass sent
def test_extreme_params_never_break_a_normal_request(tiny_llm, normal_alone, bad_kwargs_list):
    _run_beside_normal(tiny_llm, bad_kwargs_list, normal_alone)


@pytest.mark.parametrize("kwargs", [
    dict(seed=2**63 - 1, temperature=1.0),
    dict(seed=-(2**63), n=2, temperature=1.0),
    dict(top_k=2**63 - 1, temperature=1.0),  # > vocab: harmless in the sampler until the engine rejects it
    dict(temperature=3.4028234663852886e38),
    dict(repetition_penalty=0.01, temperature=1.0),  # the bounds: finite logits stay finite
    dict(repetition_penalty=100.0, temperature=1.0),
    dict(max_tokens=2**63 - 1, min_tokens=2**63 - 1, ignore_eos=True),
    dict(logprobs=20, temperature=1.0, min_p=1.0, top_p=5e-324),
])
def test_accepted_extremes_complete_beside_a_normal_request(tiny_llm, normal_alone, kwargs):
    """The largest / smallest values construction accepts, run in the same batch as the normal request."""
    bad = SamplingParams(**kwargs)
    outs = tiny_llm.generate([{"prompt_token_ids": BAD_PROMPT}, {"prompt_token_ids": NORMAL_PROMPT}],
                             [bad, NORMAL], use_tqdm=False)
    assert outs[1].error is None and outs[1].outputs[0].token_ids == normal_alone
    if outs[0].error is None:
        assert all(c.finish_reason in ("stop", "length") for c in outs[0].outputs)
    _assert_idle(tiny_llm)


@pytest.mark.parametrize(("kwargs", "needle"), [
    (dict(seed=2**64), "seed must be None or in [-2**63, 2**63 - n]"),
    (dict(top_k=2**63), "top_k must be -1 or 0 (disabled), or in [1, 2**63 - 1]"),
    (dict(temperature=math.nan), "temperature must be finite and >= 0, got nan"),
])
def test_reported_values_are_rejected_before_the_engine(tiny_llm, normal_alone, kwargs, needle):
    with pytest.raises(ValueError) as e:
        SamplingParams(**kwargs)
    assert needle in str(e.value)
    out = tiny_llm.generate({"prompt_token_ids": NORMAL_PROMPT}, NORMAL, use_tqdm=False)[0]
    assert out.error is None and out.outputs[0].token_ids == normal_alone
