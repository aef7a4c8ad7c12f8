"""SamplingParams validation: each bad value raises a ValueError naming the field, the value and the range."""

from __future__ import annotations

import re

import pytest

from roofline.sampling_params import SamplingParams, SamplingType


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_tokens=0), "max_tokens must be >= 1, got 0"),
        (dict(max_tokens=-3), "max_tokens must be >= 1, got -3"),
        (dict(max_tokens=2.5), "max_tokens must be an integer or None, got 2.5 of type float"),
        (dict(temperature=-0.5), "temperature must be finite and >= 0, got -0.5"),
        (dict(temperature=float("nan")), "temperature must be finite and >= 0, got nan"),
        (dict(temperature=float("inf")), "temperature must be finite and >= 0, got inf"),
        (dict(top_p=0.0), "top_p must be in (0, 1], got 0.0"),
        (dict(top_p=1.01), "top_p must be in (0, 1], got 1.01"),
        (dict(top_p=-0.2), "top_p must be in (0, 1], got -0.2"),
        (dict(top_p=float("nan")), "top_p must be in (0, 1], got nan"),
        (dict(top_k=-2), "top_k must be -1 (disabled) or >= 1, got -2"),
        (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1"),
        (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5"),
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0, got 0.0"),
        (dict(repetition_penalty=-1.0), "repetition_penalty must be > 0, got -1.0"),
        (dict(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
        (dict(presence_penalty=-2.01), "presence_penalty must be in [-2, 2], got -2.01"),
        (dict(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2], got -3.0"),
        (dict(frequency_penalty=2.1), "frequency_penalty must be in [-2, 2], got 2.1"),
        (dict(n=0), "n must be >= 1, got 0"),
        (dict(n=-1), "n must be >= 1, got -1"),
        (dict(n=1.5), "n must be an integer, got 1.5 of type float"),
        (dict(min_tokens=-1), "min_tokens must be >= 0, got -1"),
        (dict(min_tokens=5, max_tokens=4), "min_tokens must be <= max_tokens (4), got 5"),
        (dict(logprobs=21), "logprobs must be None or in [0, 20], got 21"),
        (dict(logprobs=-1), "logprobs must be None or in [0, 20], got -1"),
        (dict(stop=[1]), "stop must contain only strings, got 1 of type int"),
        (dict(stop=["ok", None]), "stop must contain only strings, got None of type NoneType"),
        (dict(stop=5), "stop must be a string or a list of strings, got 5 of type int"),
        (dict(stop={"a": 1}), "stop must be a string or a list of strings, got {'a': 1} of type dict"),
        (dict(stop=[""]), "stop strings must be non-empty, got ''"),
        (dict(stop=""), "stop strings must be non-empty, got ''"),
        (dict(stop_token_ids=[3, -1]), "stop_token_ids must contain non-negative ints, got -1"),
        (dict(stop_token_ids=["2"]), "stop_token_ids must contain non-negative ints, got '2'"),
        (dict(stop_token_ids=7), "stop_token_ids must be a list of ints, got 7 of type int"),
        (dict(prompt_logprobs=1), "prompt_logprobs is not supported yet, got 1; use None"),
        (dict(seed="42"), "seed must be an int or None, got '42'"),
    ],
)
def test_bad_value_names_field_value_and_range(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_tokens=1), dict(max_tokens=None), dict(temperature=0.0), dict(top_p=1.0), dict(top_p=1e-6),
        dict(top_k=1), dict(top_k=-1), dict(min_p=0.0), dict(min_p=1.0), dict(repetition_penalty=1e-3),
        dict(presence_penalty=-2.0), dict(frequency_penalty=2.0), dict(logprobs=0), dict(logprobs=20),
        dict(min_tokens=4, max_tokens=4), dict(min_tokens=100, max_tokens=None), dict(seed=0),
        dict(stop_token_ids=(0, 5)),
    ],
)
def test_edge_values_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_normalization():
    assert SamplingParams().stop == [] and SamplingParams().stop_token_ids == []
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "bc")).stop == ["a", "bc"]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]
    assert SamplingParams(top_k=0).top_k == -1  # 0 also means disabled (vLLM)


def test_sampling_type():
    assert SamplingParams(temperature=0.0).sampling_type == SamplingType.GREEDY
    assert SamplingParams(temperature=1e-6).is_greedy
    assert SamplingParams(temperature=0.7).sampling_type == SamplingType.RANDOM
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED


def test_clone_is_deep():
    p = SamplingParams(stop=["x"], stop_token_ids=[1])
    q = p.clone()
    q.stop.append("y")
    q.stop_token_ids.append(2)
    q._all_stop_token_ids.add(9)
    assert p.stop == ["x"] and p.stop_token_ids == [1] and p._all_stop_token_ids == set()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(temperature=None), "temperature must be a number, got None of type NoneType"),
        (dict(top_p="0.9"), "top_p must be a number, got '0.9' of type str"),
        (dict(max_tokens="8"), "max_tokens must be an integer or None, got '8' of type str"),
        (dict(top_k=True), "top_k must be an integer, got True of type bool"),
    ],
)
def test_wrong_types_name_the_type(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        SamplingParams(**kwargs)
