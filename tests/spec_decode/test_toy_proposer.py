"""Adding a proposer is one class and one registry line (``roofline.spec_decode.proposer.PROPOSERS``). A toy
proposer drafts a fixed continuation, known right (the greedy reference) or known wrong (each reference token
+ 1): greedy output must be token-identical to decoding without speculation either way, and the acceptance
counters must count every right draft accepted and every wrong one rejected."""

from __future__ import annotations

import pytest

from roofline import LLM, SamplingParams
from roofline.spec_decode.proposer import PROPOSERS, Proposer

PROMPTS = ["The capital of France is", "def fibonacci(n):"]
MAX_TOKENS = 24
GAMMA = 3
COMMON = dict(max_model_len=256, dtype="float32", device="cpu", attention_backend="torch",
              max_num_batched_tokens=512, async_scheduling=False)


class FixedDraft(Proposer):
    """Drafts ``CONTINUATIONS[prompt][n:n + k]`` (+ ``OFFSET``, modulo the vocabulary) at output length n."""

    CONTINUATIONS: dict[tuple[int, ...], list[int]] = {}
    OFFSET = 0
    VOCAB = 1

    def propose(self, token_ids: list[int], k: int) -> list[int]:
        for prompt, cont in self.CONTINUATIONS.items():
            if tuple(token_ids[:len(prompt)]) == prompt:
                n = len(token_ids) - len(prompt)
                return [(t + self.OFFSET) % self.VOCAB for t in cont[n:n + k]]
        raise AssertionError(f"no continuation for a sequence of {len(token_ids)} tokens")


@pytest.fixture(scope="module")
def reference(default_llm):
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = default_llm.generate(PROMPTS, sp, use_tqdm=False)
    return {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in outs}


@pytest.fixture(scope="module")
def toy_llm(default_llm, reference):
    PROPOSERS["toy"] = FixedDraft  # the one registry line
    FixedDraft.CONTINUATIONS = reference
    FixedDraft.VOCAB = default_llm.engine.model_config.vocab_size
    try:
        llm = LLM(speculative_config={"method": "toy", "num_speculative_tokens": GAMMA, "adaptive": False},
                  **COMMON)
        yield llm
        llm.engine.executor.shutdown()
    finally:
        del PROPOSERS["toy"]


@pytest.mark.parametrize("offset", [0, 1], ids=["known-right", "known-wrong"])
def test_a_toy_proposer_is_verified_exactly(monkeypatch, toy_llm, reference, offset):
    monkeypatch.setattr(FixedDraft, "OFFSET", offset)
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    before = toy_llm.engine.spec_stats.copy()
    outs = toy_llm.generate(PROMPTS, sp, use_tqdm=False)
    assert {tuple(o.prompt_token_ids): list(o.outputs[0].token_ids) for o in outs} == reference
    st = toy_llm.engine.spec_stats.since(before)
    assert st.num_drafts > 0 and st.num_emitted_tokens == st.num_accepted_tokens + st.num_drafts
    if offset == 0:  # every draft is the target's argmax: all accepted, GAMMA + 1 tokens per pass
        assert st.num_accepted_tokens == st.num_draft_tokens > 0, st.as_dict()
        # Each request: one token from its prompt's step, then passes of GAMMA + 1 (23 = 5 x 4 + 3: the last
        # pass drafts 2, all max_tokens leaves room for).
        assert st.num_drafts == len(PROMPTS) * -(-(MAX_TOKENS - 1) // (GAMMA + 1)), st.as_dict()
    else:  # every draft is off by one: none accepted, one (corrected) token per pass; the last token has no
        # room for a draft (max_tokens), so it decodes plainly
        assert st.num_accepted_tokens == 0 and st.num_draft_tokens > 0, st.as_dict()
        assert st.num_drafts == len(PROMPTS) * (MAX_TOKENS - 2), st.as_dict()


def test_an_unregistered_method_names_the_registered_ones():
    from roofline.config import SpeculativeConfig

    with pytest.raises(ValueError, match=r"method must be one of ngram, draft_model, eagle, medusa(, toy)?, got "
                                         r"'lookahead'"):
        SpeculativeConfig(method="lookahead", num_speculative_tokens=2)
