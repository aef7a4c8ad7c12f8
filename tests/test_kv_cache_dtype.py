"""``--kv-cache-dtype int8 | fp8_e4m3`` end to end on the real default model (CPU, torch backend).

- Greedy agreement with the fp32 cache (``default_llm``) on eight English prompts, 16 new tokens each,
  against thresholds measured here and set with margin (see AGREEMENT).
- int8 composes with chunked prefill and preemption: a 12-block pool (sized from bytes by the bound
  model's formula) and a 32-token step budget force both; every prompt's output equals its output alone.
- Pool size from the byte budget: the exact block count of kv_cache_bytes_per_token (scales included).
- fp8 on CPU says at start-up that it is the emulated path; its per-head scales are calibrated, with
  headroom for real text (measured: real prompts reach at most 1.6x the calibration amax; headroom 2).
- Bad values: an error listing the choices, from ``LLM()`` and from the CLI.
"""

from __future__ import annotations

import logging

import pytest
import torch

from roofline import LLM, SamplingParams
from roofline.attention.backend import FP8_CALIBRATION_HEADROOM
from roofline.costmodel import kv_cache_bytes_per_token
from roofline.kernels import cpu_paged_attention as cpa

PROMPTS = [
    "The capital of France is",
    "Write a haiku about the sea.",
    "def fibonacci(n):",
    "Explain photosynthesis in simple terms.",
    "List three prime numbers:",
    "Once upon a time, in a small village, there lived an old clockmaker who repaired every clock in town "
    "except the one in his own window, which had stopped at seven minutes past three many years ago.",
    "The quick brown fox",
    "Translate 'hello' into Spanish:",
]
NUM_NEW = 16
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True)
INT8_BYTES = kv_cache_bytes_per_token(30, 3, 64, "int8")  # 2 x 30 layers x 3 KV heads x (64 + 4 scale bytes)
INT8_BLOCKS = 12
# Measured (CPU, fp32 model, these prompts, 16 tokens): int8 common prefixes with the fp32 cache
# [16, 10, 16, 16, 16, 14, 16, 16] (6 of 8 identical, shortest 10); fp8 e4m3 [16, 0, 12, 16, 16, 3, 2, 11]
# (3 of 8 identical, 59% of tokens before the first divergence): e4m3 keeps 3 mantissa bits (relative error
# up to 2^-4 per element) and this 135M model flips near ties (prompt 2: fp32's top two first tokens are
# 0.21 nats apart; fp8 moves the logprobs by ~0.2, int8 by ~0.05). Thresholds with margin:
# int8: >= 5 of 8 identical and every prompt's first 6 tokens; fp8: >= 2 of 8 identical and >= 40% of tokens.
AGREEMENT = {"int8": (5, 6), "fp8_e4m3": (2, 0.4)}
PROBES = [5, 7]  # also run alone: the long prompt (chunked at 32 tokens) and the last admitted (preempted first)


def _tokens(llm: LLM, prompts: list[str]) -> list[list[int]]:
    outs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert [o.error for o in outs] == [None] * len(prompts)
    return [o.outputs[0].token_ids for o in outs]


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def _load(**kwargs) -> tuple[LLM, list[str]]:
    logger = logging.getLogger("roofline.worker.worker")
    handler, level = _Records(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        llm = LLM(max_model_len=kwargs.pop("max_model_len", 1024), dtype="float32", device="cpu",
                  attention_backend="torch", **kwargs)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    return llm, handler.messages


@pytest.fixture(scope="module")
def fp32_tokens(default_llm) -> list[list[int]]:
    return _tokens(default_llm, PROMPTS)


@pytest.fixture(scope="module")
def int8_llm() -> LLM:
    # 12 blocks from bytes (plus change that does not buy a 13th), a 32-token budget: the long prompt is
    # chunked, and eight sequences of 2 blocks each do not fit 12 blocks as they grow (preemption).
    llm, _ = _load(kv_cache_dtype="int8", kv_cache_memory=INT8_BLOCKS * 16 * INT8_BYTES + 1000, max_model_len=192,
                   max_num_batched_tokens=32)
    return llm


@pytest.fixture(scope="module")
def fp8_llm() -> tuple[LLM, list[str]]:
    return _load(kv_cache_dtype="fp8", max_num_batched_tokens=2048)  # "fp8" is vLLM's alias of fp8_e4m3


def test_int8_composes_with_chunked_prefill_and_preemption_and_agrees_with_fp32(int8_llm, fp32_tokens):
    engine = int8_llm.engine
    assert (engine.config.cache_config.kv_cache_dtype, engine.worker.kv_bytes_per_token) == ("int8", 12240)
    assert engine.executor.num_kv_blocks == INT8_BLOCKS
    batched = _tokens(int8_llm, PROMPTS)
    assert int8_llm.last_run_stats.num_preemptions > 0
    alone = [_tokens(int8_llm, [PROMPTS[i]])[0] for i in PROBES]
    prefixes = [_common_prefix(a, b) for a, b in zip(fp32_tokens, batched, strict=True)]
    print("int8 common prefixes with fp32:", prefixes)
    assert sum(p == NUM_NEW for p in prefixes) >= AGREEMENT["int8"][0], prefixes
    assert min(prefixes) >= AGREEMENT["int8"][1], prefixes
    same = [batched[i] for i in PROBES] == alone  # per-token quantization: outputs ignore batch and schedule
    if not same and cpa.unavailable_reason() is not None:
        # Without the C++ kernel (no compiler) a quantized cache runs on torch SDPA, which on AVX2-only CPUs (AMD
        # EPYC Zen 3, torch 2.13, 2026-12-07) is neither batch- nor schedule-invariant: its 4-D decode call gives a
        # row other bits depending on which thread takes it, and a preempted sequence recomputes its tokens through
        # the 3-D prefill call (~1e-7 apart, enough to move an int8 code). With the kernel every row of a quantized
        # cache, prefill chunks' too, is one item over its own keys (TorchAttentionBackend.build_metadata); the
        # 32-token step budget keeps the linears on the fp32 linear's M-invariant rows (MKL past 32 rows is not).
        pytest.xfail("torch SDPA (no C++ kernel) is not batch- or schedule-invariant for int8-cache rows")
    assert same


def test_fp8_agrees_with_fp32_and_logs_the_emulated_path(fp8_llm, fp32_tokens, default_llm):
    llm, messages = fp8_llm
    engine = llm.engine
    assert engine.config.cache_config.kv_cache_dtype == "fp8_e4m3"
    assert engine.worker.kv_pool.dtype == torch.float8_e4m3fn
    assert any("emulated path" in m for m in messages), messages
    assert any("scales calibrated on 512 tokens" in m for m in messages), messages
    # Pool from the 2 GiB CPU default: 11,520 bytes/token (no per-token scales), 4x the fp32 pool's tokens
    # (2x a 16-bit pool's).
    assert engine.worker.kv_bytes_per_token == 11520 == kv_cache_bytes_per_token(30, 3, 64, "bf16") // 2
    assert engine.executor.num_kv_blocks == (2 << 30) // (11520 * 16) == 11650
    assert default_llm.engine.executor.num_kv_blocks == (2 << 30) // (46080 * 16) == 2912
    assert "186400 tokens (11650 blocks of 16, fp8_e4m3, 11520 bytes/token" in engine.kv_cache_summary
    tokens = _tokens(llm, PROMPTS)
    prefixes = [_common_prefix(a, b) for a, b in zip(fp32_tokens, tokens, strict=True)]
    print("fp8 common prefixes with fp32:", prefixes)
    assert sum(p == NUM_NEW for p in prefixes) >= AGREEMENT["fp8_e4m3"][0], prefixes
    assert sum(prefixes) >= AGREEMENT["fp8_e4m3"][1] * len(PROMPTS) * NUM_NEW, prefixes


def test_fp8_calibration_headroom_covers_real_text(fp8_llm):
    """Per (layer, KV head), the amax of K and V over real prompts stays under headroom x calibration amax,
    so nothing saturates on them (measured max ratio ~1.6 against headroom 2)."""
    from roofline.attention.kv_calibration import calibrate_fp8_kv_scales

    llm, _ = fp8_llm
    worker = llm.engine.worker
    caches = worker.kv_pool.caches
    calibrated = [(c.k_scale.clone(), c.v_scale.clone()) for c in caches]
    worst = 0.0
    try:
        for p in PROMPTS:
            ids = torch.tensor(llm.tokenizer(p)["input_ids"])
            calibrate_fp8_kv_scales(worker.backend, worker.model, ids, worker.device)
            for c, (ks, vs) in zip(caches, calibrated, strict=True):
                worst = max(worst, float((c.k_scale / ks).max()), float((c.v_scale / vs).max()))
    finally:
        for c, (ks, vs) in zip(caches, calibrated, strict=True):
            c.k_scale.copy_(ks)
            c.v_scale.copy_(vs)
    print(f"real-text amax / calibration amax: {worst:.3f}")
    assert 1.0 < worst < FP8_CALIBRATION_HEADROOM  # random-token calibration alone would saturate real text


def test_unknown_kv_cache_dtype_lists_the_choices(capsys):
    with pytest.raises(ValueError, match=r"kv_cache_dtype must be one of auto, float32, float16, bfloat16, fp8, "
                                         r"fp8_e4m3, int8; got 'int4'"):
        LLM(kv_cache_dtype="int4", device="cpu")
    from roofline.cli import build_parser

    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(["generate", "--kv-cache-dtype", "int4"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-cache-dtype: invalid choice: 'int4'" in err and "'fp8_e4m3', 'int8'" in err, err
    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"])
    assert args.kv_cache_dtype == "fp8"


def test_serve_prints_the_kv_pool_at_start_up(monkeypatch, capsys):
    from types import SimpleNamespace

    import uvicorn

    from roofline.cli import build_parser
    from roofline.server import app as app_module
    from roofline.server.cli import run_serve

    summary = "KV cache: 175440 tokens (10965 blocks of 16, int8, 12240 bytes/token, 2.00 GiB)"
    engine = SimpleNamespace(kv_cache_summary=summary, config=SimpleNamespace(quantization_note=None))
    fake_app = SimpleNamespace(state=SimpleNamespace(serving=SimpleNamespace(model_names=["m"], max_model_len=64),
                                                     async_engine=SimpleNamespace(engine=engine)))
    seen = {}
    monkeypatch.setattr(app_module, "build_app", lambda engine_args, config: seen.update(args=engine_args) or fake_app)
    monkeypatch.setattr(uvicorn, "run", lambda *a, **k: None)
    import logging

    try:  # below --log-level info the pool line is printed (at info the engine's log record shows it)
        assert run_serve(build_parser().parse_args(["serve", "--kv-cache-dtype", "int8", "--log-level", "warning"])) == 0
    finally:
        logging.getLogger("roofline").setLevel(logging.NOTSET)
    assert summary in capsys.readouterr().out.splitlines()
    assert seen["args"].kv_cache_dtype == "int8"


@pytest.mark.parametrize("which", ["int8", "fp8"])
def test_quantized_cache_composes_with_the_prefix_cache(which, int8_llm, fp8_llm):
    """Blocks matched from the prefix cache hold the same codes and scales as recomputed ones: a second run of
    prompts sharing a long head (hits) gives the tokens of a run that computes every prompt token
    (``prompt_logprobs`` skips the match) and of the first run."""
    llm = int8_llm if which == "int8" else fp8_llm[0]
    shared = "You are a careful assistant. Answer briefly, precisely and politely. " * 3
    prompts = [shared + q for q in ("What is two plus two?", "Name a primary color.", "Say hello in French.")]
    first = _tokens(llm, prompts)
    hits_before = llm.engine.stats.num_prefix_cache_hits
    again = _tokens(llm, prompts)
    assert llm.engine.stats.num_prefix_cache_hits - hits_before >= 3 * 32  # every prompt matched whole blocks
    full = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0),
                        use_tqdm=False)
    assert again == [o.outputs[0].token_ids for o in full] == first
