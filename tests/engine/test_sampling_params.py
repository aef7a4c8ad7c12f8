"""SamplingParams validation: each bad value raises a ValueError naming the field, the value and the range."""

from __future__ import annotations

import re

import pytest

from roofline.sampling_params import SamplingParams, SamplingType

RP = "repetition_penalty must be in [0.01, 100] (1 disables; the bounds keep finite logits finite), got "


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
        (dict(top_k=-2), "top_k must be -1 or 0 (disabled), or >= 1, got -2"),
        (dict(min_p=-0.1), "min_p must be in [0, 1], got -0.1"),
        (dict(min_p=1.5), "min_p must be in [0, 1], got 1.5"),
        (dict(repetition_penalty=0.0), RP + "0.0"),
        (dict(repetition_penalty=-1.0), RP + "-1.0"),
        (dict(repetition_penalty=1e-38), RP + "1e-38"),
        (dict(repetition_penalty=100.5), RP + "100.5"),
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
        (dict(prompt_logprobs=21), "prompt_logprobs must be None or in [0, 20], got 21"),
        (dict(prompt_logprobs=-1), "prompt_logprobs must be None or in [0, 20], got -1"),
        (dict(prompt_logprobs=2.0), "prompt_logprobs must be an integer or None, got 2.0 of type float"),
        (dict(prompt_logprobs=True), "prompt_logprobs must be an integer or None, got True of type bool"),
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
        dict(top_k=1), dict(top_k=-1), dict(min_p=0.0), dict(min_p=1.0), dict(repetition_penalty=0.01),
        dict(presence_penalty=-2.0), dict(frequency_penalty=2.0), dict(logprobs=0), dict(logprobs=20),
        dict(prompt_logprobs=0), dict(prompt_logprobs=20), dict(prompt_logprobs=5, logprobs=2, max_tokens=1),
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


SEED_RANGE = "None or in [-2**63, 2**63 - n] = [-9223372036854775808, {hi}] for n={n} " \
             "(sample i is seeded with seed + i, a 64-bit torch seed)"
F32 = "3.4028234663852886e+38 (float32 max: the sampler's dtype)"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # The values a new-user pass sent to /v1/chat/completions that failed the whole engine step.
        (dict(seed=2**64), "seed must be " + SEED_RANGE.format(hi=2**63 - 1, n=1) + ", got 18446744073709551616"),
        (dict(seed=2**63), "seed must be " + SEED_RANGE.format(hi=2**63 - 1, n=1) + ", got 9223372036854775808"),
        (dict(seed=-(2**63) - 1),
         "seed must be " + SEED_RANGE.format(hi=2**63 - 1, n=1) + ", got -9223372036854775809"),
        (dict(seed=2**63 - 3, n=4),  # the last sample would get seed + 3 = 2**63
         "seed must be " + SEED_RANGE.format(hi=2**63 - 4, n=4) + ", got 9223372036854775805"),
        (dict(top_k=2**63), "top_k must be -1 or 0 (disabled), or in [1, 2**63 - 1], got 9223372036854775808"),
        (dict(top_k=-(2**63)), "top_k must be -1 or 0 (disabled), or >= 1, got -9223372036854775808"),
        # Floats: NaN / inf everywhere, and values that overflow the sampler's fp32 tensors.
        (dict(temperature=-float("inf")), "temperature must be finite and >= 0, got -inf"),
        (dict(temperature=1e39), f"temperature must be <= {F32}, got 1e+39"),
        (dict(temperature=2**1000), f"temperature must be <= {F32}, got an int of 1001 bits (about 10**301)"),
        (dict(top_p=float("inf")), "top_p must be in (0, 1], got inf"),
        (dict(min_p=float("nan")), "min_p must be in [0, 1], got nan"),
        (dict(min_p=float("inf")), "min_p must be in [0, 1], got inf"),
        (dict(repetition_penalty=float("nan")), RP + "nan"),
        (dict(repetition_penalty=float("inf")), RP + "inf"),
        (dict(repetition_penalty=1e300), RP + "1e+300"),
        (dict(presence_penalty=float("nan")), "presence_penalty must be in [-2, 2], got nan"),
        (dict(presence_penalty=-float("inf")), "presence_penalty must be in [-2, 2], got -inf"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty must be in [-2, 2], got nan"),
        (dict(frequency_penalty=float("inf")), "frequency_penalty must be in [-2, 2], got inf"),
        # Integers: int64 and documented caps.
        (dict(n=1025), "n must be in [1, 1024], got 1025"),
        (dict(n=2**64), "n must be in [1, 1024], got 18446744073709551616"),
        (dict(max_tokens=2**63), "max_tokens must be None or in [1, 2**63 - 1], got 9223372036854775808"),
        (dict(min_tokens=2**63, max_tokens=None), "min_tokens must be in [0, 2**63 - 1], got 9223372036854775808"),
        (dict(logprobs=2**63), "logprobs must be None or in [0, 20], got 9223372036854775808"),
        (dict(stop_token_ids=[1, 2**64]), "stop_token_ids must contain ints in [0, 2**63 - 1], got 18446744073709551616"),
        (dict(stop_token_ids=[10**5000]),
         "stop_token_ids must contain ints in [0, 2**63 - 1], got an int of 16610 bits (about 10**5000)"),
        # Types: bool is not an int, float is not an int, bool fields take only bools.
        (dict(seed=True), "seed must be an int or None, got True"),
        (dict(seed=1.0), "seed must be an int or None, got 1.0"),
        (dict(n=True), "n must be an integer, got True of type bool"),
        (dict(top_k=5.0), "top_k must be an integer, got 5.0 of type float"),
        (dict(min_tokens=1.0), "min_tokens must be an integer, got 1.0 of type float"),
        (dict(logprobs=False), "logprobs must be an integer or None, got False of type bool"),
        (dict(logprobs=2.0), "logprobs must be an integer or None, got 2.0 of type float"),
        (dict(max_tokens=True), "max_tokens must be an integer or None, got True of type bool"),
        (dict(temperature=False), "temperature must be a number, got False of type bool"),
        (dict(stop_token_ids=[True]), "stop_token_ids must contain non-negative ints, got True"),
        (dict(stop_token_ids=[2.0]), "stop_token_ids must contain non-negative ints, got 2.0"),
        (dict(ignore_eos=1), "ignore_eos must be a bool (True or False), got 1 of type int"),
        (dict(ignore_eos="false"), "ignore_eos must be a bool (True or False), got 'false' of type str"),
        (dict(include_stop_str_in_output=None),
         "include_stop_str_in_output must be a bool (True or False), got None of type NoneType"),
        (dict(skip_special_tokens=0.0), "skip_special_tokens must be a bool (True or False), got 0.0 of type float"),
    ],
)
def test_extremes_name_field_value_and_range(kwargs, message):
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(seed=2**63 - 1), dict(seed=-(2**63)), dict(seed=2**63 - 4, n=4), dict(seed=-1, n=1024),
        dict(top_k=2**63 - 1), dict(n=1024), dict(max_tokens=2**63 - 1),
        dict(min_tokens=2**63 - 1, max_tokens=None), dict(stop_token_ids=[2**63 - 1]),
        dict(temperature=3.4028234663852886e38), dict(temperature=10**38), dict(repetition_penalty=100),
        dict(temperature=1, top_p=1, min_p=0, repetition_penalty=2),  # ints are numbers
        dict(ignore_eos=True, include_stop_str_in_output=True, skip_special_tokens=False),
    ],
)
def test_extreme_edges_are_accepted(kwargs):
    SamplingParams(**kwargs)


def test_accepted_seeds_are_valid_distinct_torch_seeds():
    """Every seed + i the engine will use is accepted by torch.Generator.manual_seed (which takes
    [-2**63, 2**64 - 1], negatives modulo 2**64), and distinct int64 seeds stay distinct torch seeds."""
    torch = pytest.importorskip("torch")
    g = torch.Generator()
    used = set()
    for kwargs in (dict(seed=2**63 - 4, n=4), dict(seed=-(2**63), n=4), dict(seed=-1), dict(seed=0, n=2)):
        p = SamplingParams(**kwargs)
        for i in range(p.n):
            g.manual_seed(p.seed + i)  # raises "Overflow when unpacking long long" outside the 64-bit range
            used.add(g.initial_seed())
    assert len(used) == 11  # -1 and -(2**63) map to 2**64 - 1 and 2**63, above every non-negative seed


@pytest.mark.parametrize(
    ("kwargs", "vocab_size", "message"),
    [
        (dict(top_k=2**63 - 1), 49152,
         "top_k must be -1 or 0 (disabled), or in [1, vocab_size] = [1, 49152] for this model, got 9223372036854775807"),
        (dict(top_k=17), 16, "top_k must be -1 or 0 (disabled), or in [1, vocab_size] = [1, 16] for this model, got 17"),
        (dict(stop_token_ids=[3, 16]), 16, "stop_token_ids entry 16 is out of range [0, 16)"),
        (dict(stop_token_ids=[2**63 - 1]), 49152, "stop_token_ids entry 9223372036854775807 is out of range [0, 49152)"),
        (dict(logprobs=20), 16, "logprobs must be None or in [0, 16] for this model (vocab_size 16), got 20"),
        (dict(prompt_logprobs=17), 16,
         "prompt_logprobs must be None or in [0, 16] for this model (vocab_size 16), got 17"),
    ],
)
def test_verify_for_model_rejects(kwargs, vocab_size, message):
    p = SamplingParams(**kwargs)  # fine without the model
    with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
        p.verify_for_model(vocab_size)


@pytest.mark.parametrize(
    ("kwargs", "vocab_size"),
    [
        (dict(top_k=16), 16), (dict(top_k=-1), 16), (dict(top_k=0), 16), (dict(stop_token_ids=[0, 15]), 16),
        (dict(logprobs=16), 16), (dict(logprobs=20), 49152), (dict(), 1), (dict(prompt_logprobs=16), 16),
    ],
)
def test_verify_for_model_accepts(kwargs, vocab_size):
    SamplingParams(**kwargs).verify_for_model(vocab_size)


@pytest.mark.parametrize("vocab_size", [0, -5, True, 16.0, None])
def test_verify_for_model_checks_vocab_size(vocab_size):
    with pytest.raises(ValueError, match="^" + re.escape(f"vocab_size must be an integer >= 1, got {vocab_size!r}")):
        SamplingParams().verify_for_model(vocab_size)


def test_verify_for_model_rechecks_fields_assigned_after_construction():
    p = SamplingParams()
    p.seed = 2**64
    with pytest.raises(ValueError, match=r"^seed must be None or in \[-2\*\*63, 2\*\*63 - n\]"):
        p.verify_for_model(256)
    p = SamplingParams(stop="x", top_k=0)
    p.verify_for_model(256)  # idempotent: normalized values pass again unchanged
    assert p.stop == ["x"] and p.top_k == -1
