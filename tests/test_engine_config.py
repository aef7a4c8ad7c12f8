"""EngineArgs -> EngineConfig: every "auto" resolved once on this (CPU) machine, invalid combinations
refused with both values named, and the CPU step budget's profiling rule."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from roofline.args import EngineArgs
from roofline.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from roofline.worker import scoring as worker  # the budget rule moved to worker/scoring.py

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="checks how auto resolves without a GPU")

MODEL = ModelConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512)


def test_auto_resolves_on_cpu_with_profiled_budget():
    cfg = EngineArgs().create_engine_config(MODEL)
    assert cfg.device == "cpu"
    assert cfg.dtype == "float32"
    assert cfg.cache_config.kv_cache_dtype == "float32"
    assert cfg.attention_backend == "torch"
    assert cfg.use_triton_kernels is False
    assert cfg.enforce_eager is True and cfg.uses_cuda_graphs is False
    sched = cfg.scheduler_config
    assert sched.budget_from_profile is True
    assert sched.max_num_batched_tokens == 2048  # the placeholder the profile lowers
    assert sched.max_model_len == 512  # min(max_position_embeddings, 8192)
    # Nothing "auto" is left anywhere in the resolved config.
    values = [cfg.device, cfg.dtype, cfg.attention_backend, cfg.cache_config.kv_cache_dtype]
    assert "auto" not in values


def test_explicit_budget_is_kept_and_not_profiled():
    cfg = EngineArgs(max_num_batched_tokens=256).create_engine_config(MODEL)
    assert cfg.scheduler_config.max_num_batched_tokens == 256
    assert cfg.scheduler_config.budget_from_profile is False


def test_no_chunked_prefill_is_not_profiled_and_fits_a_whole_prompt():
    long_model = dataclasses.replace(MODEL, max_position_embeddings=4096)
    cfg = EngineArgs(enable_chunked_prefill=False, max_model_len=3000).create_engine_config(long_model)
    assert cfg.scheduler_config.budget_from_profile is False
    assert cfg.scheduler_config.max_num_batched_tokens == 3000  # max(2048, max_model_len)


@pytest.mark.parametrize("dtype, kv, want_kv", [("float16", "auto", "float16"), ("bfloat16", "auto", "bfloat16"),
                                                ("auto", "bfloat16", "bfloat16"), ("float16", "float32", "float32")])
def test_kv_cache_dtype_defaults_to_the_model_dtype(dtype, kv, want_kv):
    cfg = EngineArgs(dtype=dtype, kv_cache_dtype=kv).create_engine_config(MODEL)
    assert cfg.dtype == (dtype if dtype != "auto" else "float32")
    assert cfg.cache_config.kv_cache_dtype == want_kv


def test_explicit_cpu_device_and_torch_backend():
    cfg = EngineArgs(device="cpu", attention_backend="torch", disable_triton_kernels=True).create_engine_config(MODEL)
    assert (cfg.device, cfg.attention_backend, cfg.use_triton_kernels, cfg.enforce_eager) == ("cpu", "torch", False,
                                                                                             True)


def test_triton_backend_on_cpu_names_both():
    with pytest.raises(ValueError) as info:
        EngineArgs(attention_backend="triton").create_engine_config(MODEL)
    msg = str(info.value)
    assert "'triton'" in msg and "'cpu'" in msg, msg


@pytest.mark.parametrize("field, value", [("dtype", "float64"), ("kv_cache_dtype", "int4"),
                                          ("attention_backend", "flash")])
def test_bad_engine_args_name_the_value(field, value):
    with pytest.raises(ValueError) as info:
        EngineArgs(**{field: value}).create_engine_config(MODEL)
    msg = str(info.value)
    assert field in msg and repr(value) in msg, msg


@pytest.mark.parametrize("change", [
    dict(dtype="auto"),
    dict(device="auto"),
    dict(attention_backend="auto"),
    dict(cache_config=CacheConfig(kv_cache_dtype="auto")),
], ids=["dtype", "device", "backend", "kv-dtype"])
def test_engine_config_refuses_unresolved_auto(change):
    with pytest.raises(ValueError) as info:
        EngineConfig(model_config=MODEL, **change)
    assert "'auto'" in str(info.value) and "resolved" in str(info.value)


@pytest.mark.parametrize("change, words", [
    (dict(dtype="float64"), ["dtype", "'float64'"]),
    (dict(cache_config=CacheConfig(kv_cache_dtype="fp8")), ["kv_cache_dtype", "'fp8'", "fp8_e4m3, int8"]),
    (dict(device="tpu"), ["device", "'tpu'"]),
    (dict(attention_backend="triton"), ["'triton'", "'cpu'"]),
    (dict(use_triton_kernels=True), ["use_triton_kernels", "'cpu'"]),
    (dict(enforce_eager=False), ["enforce_eager", "'cpu'"]),
], ids=["dtype", "kv-dtype", "device", "triton-on-cpu", "kernels-on-cpu", "graphs-on-cpu"])
def test_engine_config_refuses_invalid_values_naming_them(change, words):
    with pytest.raises(ValueError) as info:
        EngineConfig(model_config=MODEL, **change)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_engine_config_defaults_are_resolved_cpu_values():
    cfg = EngineConfig(model_config=MODEL, scheduler_config=SchedulerConfig(max_model_len=512))
    assert (cfg.device, cfg.dtype, cfg.cache_config.kv_cache_dtype, cfg.attention_backend,
            cfg.use_triton_kernels, cfg.enforce_eager) == ("cpu", "float32", "float32", "torch", False, True)
    assert dataclasses.replace(cfg, dtype="bfloat16").dtype == "bfloat16"


# ---------------------------------------------------------------------------------------------- CPU budget


@pytest.fixture
def clean_budgets():
    saved = dict(worker._BUDGETS)
    worker._BUDGETS.clear()
    yield worker._BUDGETS
    worker._BUDGETS.clear()
    worker._BUDGETS.update(saved)


@pytest.mark.parametrize("per_token, want", [
    (2e-3, 192),      # 0.5 / 2e-3 = 250 -> 192 (rounded down to the grid of 2^k and 1.5 x 2^k)
    (1e-3, 384),      # 500 -> 384
    (3e-4, 1536),     # 1666.7 -> 1536
    (3.4e-4, 1024),   # 1470.6 -> 1024 (the main job's budgets of 1392-1488 all land here)
    (1e-5, 2048),     # 50000 -> clamped to 2048
    (1e-2, 64),       # 50 -> 48 -> clamped to 64
    (1.0, 64),        # slower than the target per token: still 64
])
def test_profiled_budget_rule(clean_budgets, per_token, want):
    assert worker.CPU_STEP_TARGET_S == 0.5
    calls = []

    def seconds_per_token():
        calls.append(1)
        return per_token

    got = worker._profiled_budget(("key", per_token), seconds_per_token, 256)
    assert got == want
    assert got in worker.BUDGET_GRID
    # Measured once per key: a second call reuses it without timing again.
    assert worker._profiled_budget(("key", per_token), lambda: 1.0, 256) == want
    assert len(calls) == 1
    assert clean_budgets == {("key", per_token): want}


def test_block_size_auto_is_16_on_the_torch_backend_and_explicit_values_are_kept():
    assert EngineArgs().create_engine_config(MODEL).cache_config.block_size == 16
    assert EngineArgs(block_size=32).create_engine_config(MODEL).cache_config.block_size == 32
    with pytest.raises(ValueError, match=r"block_size must be in \[1, 1024\], got 0"):
        EngineArgs(block_size=0).create_engine_config(MODEL)


def test_block_size_auto_is_64_with_the_triton_backend(monkeypatch):
    import roofline.args as args_mod

    monkeypatch.setattr(args_mod, "resolve_device", lambda device: "cuda")
    monkeypatch.setattr(args_mod, "_triton_importable", lambda: True)
    cfg = EngineArgs().create_engine_config(MODEL)
    assert (cfg.attention_backend, cfg.cache_config.block_size) == ("triton", 64)
    assert EngineArgs(attention_backend="torch").create_engine_config(MODEL).cache_config.block_size == 16
    assert EngineArgs(block_size=16).create_engine_config(MODEL).cache_config.block_size == 16


@pytest.mark.parametrize("tied", [False, True])
def test_decode_floor_counts_the_embedding_table_only_when_it_is_the_lm_head(tmp_path, tied):
    """A decode step reads its tokens' rows of an untied input embedding, not the table; a tied table is read
    whole as the LM head. Worker.weight_bytes_per_step (the floor's weight term) counts exactly that."""
    import json

    from roofline import LLM

    vocab, hidden = 256, 64
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, "hidden_size": hidden,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "max_position_embeddings": 512, "tie_word_embeddings": tied}
    (tmp_path / "config.json").write_text(json.dumps(config))
    w = LLM(str(tmp_path), load_format="dummy", device="cpu", attention_backend="torch", dtype="float32",
            max_model_len=64, num_kv_blocks=8).engine.worker
    table = vocab * hidden * 4
    assert w.weight_bytes_per_step == w.weight_bytes - (0 if tied else table)
    assert w.weight_bytes == sum(p.numel() * 4 for p in w.model.parameters())  # tied: one tensor, counted once


def test_a_deleted_llm_is_collectable(tmp_path):
    """Nothing keeps an engine alive: ``del llm`` frees its worker (and so, on a GPU, its KV pool) by reference
    counting alone, with the cyclic collector off: no reference cycle among the engine, executor, worker and its
    pipeline stage (the stage holds a weak proxy of its worker)."""
    import gc
    import json
    import weakref

    from roofline import LLM

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "max_position_embeddings": 512}
    (tmp_path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(tmp_path), load_format="dummy", device="cpu", attention_backend="torch", dtype="float32",
              max_model_len=64, num_kv_blocks=8)
    llm.generate([[1, 2, 3]], use_tqdm=False)
    worker = weakref.ref(llm.engine.worker)
    engine = weakref.ref(llm.engine)
    gc.collect()
    gc.disable()
    try:
        del llm
        assert engine() is None and worker() is None
    finally:
        gc.enable()


# ------------------------------------------------------------------------------ fresh-user defects


@pytest.mark.parametrize("value, shown", [
    ("2", "'2' = 2 bytes (a number without a unit is bytes)"),  # meant 2GiB: refused, not a 2-byte pool
    (2, "2 = 2 bytes (a number without a unit is bytes)"),
    ("1", "'1' = 1 byte (a number without a unit is bytes)"),
    ("512KiB", "'512KiB' = 524288 bytes"),
    ("0", "'0' = 0 bytes (a number without a unit is bytes)"),
])
def test_kv_cache_memory_below_a_mib_names_the_value_the_unit_and_the_range(value, shown):
    from roofline.args import parse_kv_cache_memory

    forms = ("kv_cache_memory must be a size of at least 1MiB (bytes, or a unit: 4GiB, 512MiB) or a fraction of "
             "device memory in (0, 1]")
    with pytest.raises(ValueError) as e:
        parse_kv_cache_memory(value)
    assert str(e.value) == f"{forms}; got {shown}"
    with pytest.raises(ValueError, match=r"at least 1MiB"):  # the engine refuses it before any weight loads
        EngineArgs(kv_cache_memory=value).create_engine_config(MODEL)


@pytest.mark.parametrize("value", ["-1", "abc", "4 parsecs", -5, float("nan"), float("inf")])
def test_unparsable_kv_cache_memory_names_the_forms(value):
    from roofline.args import parse_kv_cache_memory

    with pytest.raises(ValueError, match=r"^kv_cache_memory must be a size of at least 1MiB .* or a fraction of "
                                         r"device memory in \(0, 1\], got "):
        parse_kv_cache_memory(value)


def test_an_unknown_kv_cache_memory_unit_is_named_with_the_units():
    from roofline.args import parse_kv_cache_memory

    with pytest.raises(ValueError, match=r"got '10TiB': unit 'TiB' is not one of B, KiB, MiB, GiB"):
        parse_kv_cache_memory("10TiB")


def test_kv_cache_memory_accepted_forms():
    from roofline.args import parse_kv_cache_memory

    assert parse_kv_cache_memory("4GiB") == (4 << 30, None)
    assert parse_kv_cache_memory("1MiB") == (1 << 20, None)
    assert parse_kv_cache_memory(str(1 << 20)) == (1 << 20, None)  # bytes without a unit, at the minimum
    assert parse_kv_cache_memory("0.5") == (None, 0.5)
    assert parse_kv_cache_memory("1.0") == (None, 1.0)
    assert parse_kv_cache_memory(0.25) == (None, 0.25)
    assert EngineArgs(kv_cache_memory="2MiB").create_engine_config(MODEL).cache_config.kv_cache_memory == 2 << 20


@pytest.mark.parametrize("value, shown", [
    ("null", "'null' (null)"), ("[1, 2]", "'[1, 2]' (an array)"), ('"ngram"', "'\"ngram\"' (a string)"),
    ("4", "'4' (a number)"), ([1], "[1] of type list"),
])
def test_speculative_config_that_is_not_an_object_says_so_and_shows_it(value, shown):
    with pytest.raises(ValueError) as e:
        EngineArgs(speculative_config=value)
    assert str(e.value) == ('speculative_config must be a JSON object such as {"method": "ngram", '
                            f'"num_speculative_tokens": 4}}, got {shown}')
    assert "NoneType" not in str(e.value)
