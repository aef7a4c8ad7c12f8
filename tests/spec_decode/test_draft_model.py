"""A separate draft model (``"model": PATH``) and a quantized self (``"quantization": "int4"``), each with its own
KV cache in the target's blocks (``roofline.spec_decode.draft_model``), on the default model in fp32 on CPU.

The separate checkpoint is made here: the default model's first 12 layers (and its embedding, final norm and
LM head) written as a Hugging Face safetensors directory. It shares the vocabulary, and disagrees with the
30-layer target often enough that rejections (and so the draft's KV rewind) happen in every run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from roofline import LLM, SamplingParams

COMMON = dict(max_model_len=512, dtype="float32", device="cpu", attention_backend="torch",
              max_num_batched_tokens=1024)
PROMPTS = [
    "def add(a, b):\n    return a + b\n\n# The same function, with type hints:\ndef add(",
    "The capital of France is",
    "Count from one to twenty: one, two, three,",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
DRAFT_LAYERS = 12


def _ids(outs):
    return [list(o.outputs[0].token_ids) for o in outs]


@pytest.fixture(scope="module")
def plain():
    return LLM(**COMMON)


@pytest.fixture(scope="module")
def greedy_ref(plain):
    return _ids(plain.generate(PROMPTS, GREEDY, use_tqdm=False))


@pytest.fixture(scope="module")
def draft_dir(plain, tmp_path_factory) -> Path:
    """The default model's first 12 layers as an HF checkpoint (config.json + model.safetensors)."""
    from safetensors.torch import save_file

    from roofline.models.export import hf_state_dict

    mc = plain.engine.model_config
    cfg = dataclasses.replace(mc, num_hidden_layers=DRAFT_LAYERS, name="smollm2-12-layers")
    keep = {n: t for n, t in hf_state_dict(plain.engine.worker.model, mc).items()
            if not n.startswith("model.layers.") or int(n.split(".")[2]) < DRAFT_LAYERS}
    path = tmp_path_factory.mktemp("draft")
    (path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    save_file(keep, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


def _check_accounting(llm) -> float:
    st = llm.engine.spec_stats
    assert st.num_drafts > 0 and st.num_emitted_tokens == st.num_accepted_tokens + st.num_drafts
    assert 0 <= st.num_accepted_tokens <= st.num_draft_tokens
    return st.num_accepted_tokens / st.num_draft_tokens


def test_separate_draft_checkpoint_is_token_identical(draft_dir, plain, greedy_ref):
    cfg = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3, "adaptive": False}
    llm = LLM(speculative_config=cfg, **COMMON)
    worker = llm.engine.worker
    assert worker.draft is not None and worker.draft.model_config.num_hidden_layers == DRAFT_LAYERS
    # Its own KV, in the target's blocks: 12 of 30 layers' bytes per token more.
    assert worker.draft.kv_bytes_per_token * 30 == plain.engine.worker.kv_bytes_per_token * DRAFT_LAYERS
    assert _ids(llm.generate(PROMPTS, GREEDY, use_tqdm=False)) == greedy_ref
    alpha = _check_accounting(llm)
    assert 0.0 < alpha < 1.0, alpha  # rejections happened: the draft's KV was rewound and caught up
    # Again, now with prompts whose prefix is cached and with n = 2: same tokens, both completions.
    outs = llm.generate(PROMPTS[:1], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, n=2),
                        use_tqdm=False)
    assert [list(c.token_ids) for c in outs[0].outputs] == [greedy_ref[0][:8]] * 2


def test_int4_self_draft_is_token_identical(greedy_ref):
    cfg = {"method": "draft_model", "quantization": "int4", "num_speculative_tokens": 2, "adaptive": False}
    # Its KV mirrors the target's: an automatically sized pool refuses it (``check_draft_kv_share``), naming why.
    with pytest.raises(ValueError, match=r"the draft's own KV \(46080 bytes per token, the target's 46080\) would "
                                         r"cut the KV pool from \d+ to \d+ tokens \(50% fewer\).*refused"):
        LLM(speculative_config=cfg, **COMMON)
    llm = LLM(speculative_config=cfg, kv_cache_memory="64MiB", **COMMON)  # a pool the user sized: the split is theirs
    draft = llm.engine.worker.draft
    # 4-bit codes (and, on CPU, a uint8 copy for prefill-sized GEMMs); the tied fp32 embedding stays
    assert draft is not None and draft.weight_bytes < llm.engine.worker.weight_bytes / 2
    rows = []  # each drafting step's catch-up (StepOutput.draft_catch_up_rows)
    record = llm.engine.spec.record
    llm.engine.spec.record = lambda spec_seqs, result: (rows.append(result.draft_catch_up_rows),
                                                        record(spec_seqs, result))[1]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    assert _ids(llm.generate(PROMPTS[1:2], sp, use_tqdm=False)) == [greedy_ref[1][:12]]
    _check_accounting(llm)
    # The first draft pass reads the whole prompt and the first sampled token; later ones 1 + the accepted
    # drafts, at most gamma + 1 = 3 (what the policy counts as steady).
    n = len(llm.tokenizer(PROMPTS[1]).input_ids)
    assert rows[0] == n + 1 and 1 <= max(rows[1:]) <= 3, (n, rows)


def test_draft_pool_is_sized_with_the_target_and_survives_preemption(draft_dir):
    """10 MiB for target + draft KV: (30 + 12) layers x 3 KV heads x 64 x 2 x 4 bytes = 64,512 B per token,
    so 10 blocks of 16; a plain engine gets 14 blocks from the same budget. Four requests do not fit at once:
    sequences are preempted and recomputed (the draft's KV with them), and greedy output is unchanged."""
    kw = {**COMMON, "max_model_len": 64, "kv_cache_memory": "10MiB"}
    cfg = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2, "adaptive": False}
    prompts = PROMPTS + ["Once upon a time"]
    sp = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)  # 4 x ~48 tokens > 160 slots
    plain = LLM(**kw)
    llm = LLM(speculative_config=cfg, **kw)
    assert (plain.engine.block_pool.num_blocks, llm.engine.block_pool.num_blocks) == (14, 10)
    assert _ids(llm.generate(prompts, sp, use_tqdm=False)) == _ids(plain.generate(prompts, sp, use_tqdm=False))
    assert llm.engine.scheduler.num_preemptions > 0
    _check_accounting(llm)


def test_draft_preset_with_dummy_weights_and_a_missing_draft_path():
    """With ``load_format="dummy"`` a preset name is a draft too (random weights at its shape, another seed than
    the target's): greedy tokens equal the plain dummy engine's. A draft path that does not exist is refused
    when the arguments are built (``EngineArgs``, before any model loads), naming the draft's key and the path."""
    kw = {**COMMON, "model": "smollm2-135m", "load_format": "dummy"}
    prompt = [{"prompt_token_ids": list(range(100, 130))}]
    sp = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    cfg = {"method": "draft_model", "model": "smollm2-135m", "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(speculative_config=cfg, kv_cache_memory="64MiB", **kw)  # a same-size draft: the user sizes the pool
    assert llm.engine.worker.draft is not None and llm.engine.worker.draft.source.format == "dummy"
    assert _ids(llm.generate(prompt, sp, use_tqdm=False)) == _ids(LLM(**kw).generate(prompt, sp, use_tqdm=False))
    _check_accounting(llm)
    from roofline.args import EngineArgs

    missing = {"method": "draft_model", "model": "/nonexistent/draft", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config model: model path '/nonexistent/draft' does not exist"):
        EngineArgs(speculative_config=missing)  # the arguments alone: nothing is loaded yet
    with pytest.raises(ValueError, match=r"speculative_config model: model path '/nonexistent/draft' does not exist"):
        LLM(speculative_config=missing, **COMMON)


def test_startup_errors(tmp_path: Path, draft_dir):
    cfg = json.loads((draft_dir / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 32000}))
    with pytest.raises(ValueError, match=r"has a vocabulary of 32000 tokens, the target .* has 49152"):
        LLM(speculative_config={"method": "draft_model", "model": str(tmp_path), "num_speculative_tokens": 2},
            **COMMON)
    with pytest.raises(ValueError, match=r"num_layers .* does not combine with \"model\" or \"quantization\""):
        LLM(speculative_config={"method": "draft_model", "quantization": "int4", "num_layers": 4,
                                "num_speculative_tokens": 2}, **COMMON)
    with pytest.raises(ValueError, match=r"quantization must be one of int4, int8, fp8 .*got 'int3'"):
        LLM(speculative_config={"method": "draft_model", "quantization": "int3", "num_speculative_tokens": 2},
            **COMMON)
    with pytest.raises(ValueError, match=r"needs \"model\" .*, \"quantization\" .* or \"num_layers\""):
        LLM(speculative_config={"method": "draft_model", "num_speculative_tokens": 2}, **COMMON)


def test_draft_pass_fills_short_spans_as_decode_rows(draft_dir):
    """``DraftModel.decode`` against the packed-prefill catch-up it replaces for short spans, on two rows
    of real text (fp32): the logits at each row's last token agree within 1e-4 (relative to their largest
    magnitude) whichever way the draft KV below was filled: all by prefill then one decode row; a prefill to
    1 and to 6 positions short, the rest (2 and 7 positions) as decode rows in the same pass; and from nothing
    (spans 17 and 25 > CATCH_UP_SPAN: prefill). ``computed`` ends past the last token each time."""
    import numpy as np
    import torch

    from roofline.spec_decode.draft_model import CATCH_UP_SPAN

    cfg = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2, "adaptive": False}
    llm = LLM(speculative_config=cfg, **COMMON)
    draft, bs = llm.engine.worker.draft, llm.engine.worker.block_size
    ids = [llm.tokenizer(p).input_ids for p in ("The quick brown fox jumps over the lazy dog, and then " * 3,
                                                PROMPTS[0] + "a: int, b: int) -> int:\n    return a + b")]
    rows, last = np.array([0, 1]), np.array([16, 24])
    assert all(len(t) > n for t, n in zip(ids, last, strict=True)) and last.min() + 1 > CATCH_UP_SPAN
    token_ids = np.zeros((2, 64), dtype=np.int64)
    for r, t in enumerate(ids):
        token_ids[r, :len(t)] = t
    per_row = 64 // bs + 1
    block_table = np.arange(2 * per_row, dtype=np.int32).reshape(2, per_row)  # the pool is idle: any blocks

    def logits(prefill_to: np.ndarray) -> torch.Tensor:
        draft.computed[rows] = 0
        if prefill_to.any():
            draft.catch_up(token_ids, block_table, rows, prefill_to, bs, 1024)
        assert (draft.computed[rows] == prefill_to).all()
        out = draft.decode(token_ids, block_table, rows, last, bs, 1024)
        assert (draft.computed[rows] == last + 1).all()
        return out

    ref = logits(last)  # everything below the last token by prefill; the last token one decode row
    for prefill_to in (last - 1, last - 6, np.zeros(2, dtype=np.int64)):
        got = logits(prefill_to)
        assert got.shape == ref.shape == (2, llm.engine.model_config.vocab_size)
        err = ((got - ref).abs().amax(dim=-1) / ref.abs().amax(dim=-1)).max().item()
        assert err < 1e-4, (prefill_to, err)
        assert torch.equal(got.argmax(dim=-1), ref.argmax(dim=-1))


def test_draft_kv_share_rule():
    """``check_draft_kv_share``: refused from a draft KV per token equal to the target's (the pool halves) on an
    automatically sized pool; allowed below it, or on a pool the user sized."""
    from types import SimpleNamespace

    from roofline.spec_decode.proposer import check_draft_kv_share

    spec = SimpleNamespace(method="draft_model", quantization="int4")
    check_draft_kv_share(spec, 46079, 46080, 23297, 46592, sized_by_user=False)  # just under half: allowed
    check_draft_kv_share(spec, 46080, 46080, 23296, 46592, sized_by_user=True)  # the user's split
    with pytest.raises(ValueError, match=r"\(draft_model, int4 at load\).*from 46592 to 23296 tokens \(50% fewer\)"):
        check_draft_kv_share(spec, 46080, 46080, 23296, 46592, sized_by_user=False)
