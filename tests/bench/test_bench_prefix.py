"""`roofline bench prefix` on the CPU at tiny sizes: the ShareGPT multi-turn loader, the token-prefix property
the prefix cache relies on, and one end-to-end run of every workload with the cache on and off, its JSON
checked against counts derived from the prompts (speed itself is not asserted: benchmarks are not timed tests)."""

from __future__ import annotations

import json
import shlex

import pytest

from roofline.bench.datasets import (
    load_sharegpt_multiturn,
    sample_sharegpt_fewshot,
    sample_sharegpt_multiturn,
)
from roofline.bench.prefix_inputs import prompt_tokenizer
from roofline.bench.prefix_workloads import latency_summary_ms, percentile, prefix_caching_available
from roofline.cli import build_parser, main


@pytest.fixture(scope="module")
def tokenizer():
    return prompt_tokenizer()  # cached: the end-to-end run below reuses it


def test_multiturn_loader_keeps_alternating_conversations_of_three_turns_or_more():
    convs = load_sharegpt_multiturn(3)
    assert len(convs) > 1000
    for conv in convs:
        assert len(conv) >= 6 and len(conv) % 2 == 0
        assert [role for role, _ in conv] == ["user", "assistant"] * (len(conv) // 2)
        assert all(isinstance(text, str) and text.strip() for _, text in conv)
    # A longer minimum keeps a subset of the same conversations, in the same (file) order.
    longer = load_sharegpt_multiturn(5)
    assert 0 < len(longer) < len(convs)
    assert all(len(c) >= 10 for c in longer)
    assert longer[0] == next(c for c in convs if len(c) >= 10)
    with pytest.raises(ValueError, match="min_turns must be >= 1, got 0"):
        load_sharegpt_multiturn(0)


def test_turn_prompt_starts_with_previous_prompt_and_its_reply(tokenizer):
    convs = sample_sharegpt_multiturn(tokenizer, 24, num_turns=3, seed=1, max_output_len=32, max_prompt_len=1500)
    assert len(convs) == 24
    for turns in convs:
        assert len(turns) == 3
        for prev, turn in zip(turns, turns[1:], strict=False):
            prefix = list(prev.prompt_token_ids) + tokenizer(prev.reply, add_special_tokens=False).input_ids
            assert len(turn.prompt_token_ids) > len(prefix)
            assert list(turn.prompt_token_ids[:len(prefix)]) == prefix
        for turn in turns:
            assert 1 <= turn.output_len <= 32 and len(turn.prompt_token_ids) <= 1500
    # Same seed, same prompts (both cache settings replay the same requests); another seed, others.
    again = sample_sharegpt_multiturn(tokenizer, 24, num_turns=3, seed=1, max_output_len=32, max_prompt_len=1500)
    assert again == convs
    other = sample_sharegpt_multiturn(tokenizer, 24, num_turns=3, seed=2, max_output_len=32, max_prompt_len=1500)
    assert other != convs
    with pytest.raises(ValueError, match="only .* conversations have 3 turns with prompts of at most 40 tokens"):
        sample_sharegpt_multiturn(tokenizer, 4, num_turns=3, max_prompt_len=40)


def test_fewshot_prompts_share_the_prefix_ids(tokenizer):
    fs = sample_sharegpt_fewshot(tokenizer, 12, num_shots=5, prefix_len=1000, max_output_len=40, seed=0)
    n = len(fs.prefix_token_ids)
    assert 0.75 * 1000 <= n <= 1.25 * 1000 + 1  # five shots of 200 +-25% tokens (+ a BOS if the model has one)
    assert len(fs.prompts) == len(fs.output_lens) == 12
    assert len(set(fs.prompts)) == 12
    for p, out_len in zip(fs.prompts, fs.output_lens, strict=True):
        assert p[:n] == fs.prefix_token_ids and len(p) > n
        assert 4 <= out_len <= 40
    assert tokenizer.decode(list(fs.prefix_token_ids)).count("Question: ") == 5


def test_percentiles_interpolate_like_numpy():
    xs = [4.0, 1.0, 3.0, 2.0]
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 4.0
    assert percentile(xs, 50) == 2.5
    assert abs(percentile(xs, 90) - 3.7) < 1e-12
    summary = latency_summary_ms([0.001, 0.003])
    assert summary["count"] == 2
    assert summary["mean_ms"] == pytest.approx(2.0) and summary["p50_ms"] == pytest.approx(2.0)
    assert summary["p90_ms"] == pytest.approx(2.8)
    assert latency_summary_ms([])["mean_ms"] is None


_TINY = ["--num-conversations", "2", "--concurrency", "2", "--num-turns", "3", "--max-prompt-len", "200",
         "--num-questions", "3", "--fewshot-prefix-len", "160", "--n", "3", "--sc-prompt-len", "40",
         "--max-tokens", "2", "--max-model-len", "512", "--kv-cache-memory", "128MiB",
         "--max-num-batched-tokens", "256", "--seed", "0", "--no-warmup"]


@pytest.mark.skipif(not prefix_caching_available(), reason="the prefix cache is not built into this checkout")
def test_bench_prefix_all_workloads_cache_on_vs_off(tmp_path, tokenizer):
    out = tmp_path / "prefix.json"
    rc = main(["bench", "prefix", "--workload", "all", *_TINY, "--output-json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    for key in ("git_commit", "date", "torch", "device", "command", "block_size", "num_kv_blocks"):
        assert result[key], key
    assert result["device"] == "cpu"
    assert result["command"].startswith("roofline bench prefix --workload all")
    again = build_parser().parse_args(shlex.split(result["command"])[1:])  # the command reproduces the run
    assert (again.num_conversations, again.n, again.kv_cache_memory, again.warmup) == (2, 3, "128MiB", False)
    assert again.max_num_batched_tokens == 256 and again.output_json == str(out)
    bs = result["block_size"]
    assert bs == 16  # the torch backend on CPU
    w = result["workloads"]
    assert set(w) == {"multiturn", "fewshot", "self-consistency"}
    for name, res in w.items():
        on, off = res["cache_on"], res["cache_off"]
        assert on["prompt_tokens"] == off["prompt_tokens"] > 0, name
        assert off["prompt_tokens_computed"] == off["prompt_tokens"], name  # nothing reused without the cache
        assert off["hit_rate"] is None and off["prefix_cache_queries"] is None, name
        assert on["num_preemptions"] == off["num_preemptions"] == 0, name
        # With the cache: the prompt tokens not found cached are exactly those computed.
        assert on["prefix_cache_queries"] == on["prompt_tokens"], name
        assert on["prompt_tokens_computed"] == on["prompt_tokens"] - on["prefix_cache_hits"], name
        assert 0 < on["hit_rate"] < 1 and on["prompt_tokens_computed"] < off["prompt_tokens_computed"], name
        ratio = res["ratios_on_over_off"]["prompt_tokens_computed"]
        assert ratio == on["prompt_tokens_computed"] / off["prompt_tokens_computed"], name

    # Multi-turn: the replayed prompts, rebuilt; turn k+1 finds at least turn k's prompt (whole blocks) cached.
    mt = w["multiturn"]
    convs = sample_sharegpt_multiturn(tokenizer, 2, num_turns=3, seed=0, max_output_len=2, max_prompt_len=200)
    lens = [[len(t.prompt_token_ids) for t in c] for c in convs]
    later_prompt = sum(n for c in lens for n in c[1:])
    assert mt["cache_off"]["prompt_tokens"] == sum(map(sum, lens))
    assert mt["cache_off"]["prompt_tokens_later_turns"] == later_prompt
    assert mt["cache_on"]["prompt_tokens_computed_later_turns"] <= sum(
        c[k + 1] - c[k] // bs * bs for c in lens for k in range(len(c) - 1))
    assert mt["cache_on"]["later_turns_reuse"] > 0.5 and mt["cache_off"]["later_turns_reuse"] == 0
    for side in ("cache_on", "cache_off"):
        assert mt[side]["ttft_first_turn"]["count"] == 2 and mt[side]["ttft_later_turns"]["count"] == 4
        assert 0 < mt[side]["ttft_later_turns"]["p50_ms"] <= mt[side]["ttft_later_turns"]["p90_ms"]
        assert mt[side]["output_tokens"] == 6 * 2 and mt[side]["num_requests"] == 6
    assert mt["config"]["concurrency"] == 2
    assert "ttft_later_turns_mean_ms" in mt["ratios_on_over_off"]

    # Few-shot: every question after the first finds the prefix's whole blocks.
    fs = w["fewshot"]
    for side in ("cache_on", "cache_off"):
        assert fs[side]["num_requests"] == 3 and fs[side]["output_tokens"] == 3 * 2
        assert fs[side]["output_tok_per_s"] > 0 and fs[side]["total_tok_per_s"] > fs[side]["output_tok_per_s"]
    assert fs["cache_on"]["prefix_cache_hits"] >= fs["cache_on"]["prefix_tokens"] // bs * bs

    # Self-consistency: sample 0 computes the prompt; the other n - 1 recompute only its partial last block
    # (at least one token), and share its whole blocks instead of holding copies.
    sc = w["self-consistency"]
    p = sc["cache_on"]["prompt_len"]
    assert 40 <= p <= 80 and sc["cache_off"]["prompt_len"] == p
    tail = p - (p - 1) // bs * bs
    assert sc["cache_off"]["prompt_tokens_computed"] == 3 * p
    assert sc["cache_on"]["prompt_tokens_computed"] == p + 2 * tail
    assert sc["cache_on"]["num_samples"] == sc["cache_off"]["num_samples"] == 3
    assert sc["cache_on"]["output_tokens"] == 3 * 2
    per_sample = -(-(p + 1) // bs)  # blocks of the prompt and the first output (the last one is never computed)
    assert sc["cache_off"]["peak_kv_blocks_used"] == 3 * per_sample
    shared = (p - 1) // bs  # whole prompt blocks the forks match (a match leaves >= 1 token to compute)
    assert shared >= 2
    assert sc["cache_on"]["peak_kv_blocks_used"] <= 3 * per_sample - 2 * shared
    assert "greedy_outputs_identical" in mt and "greedy_outputs_identical" in fs


def test_bench_prefix_rejects_bad_sizes(tmp_path, capsys):
    rc = main(["bench", "prefix", "--workload", "fewshot", "--num-questions", "0", "--out-dir", str(tmp_path)])
    assert rc == 2
    assert "--num-questions must be >= 1, got 0" in capsys.readouterr().err
    rc = main(["bench", "prefix", "--max-prompt-len", "500", "--max-tokens", "16", "--max-model-len", "512",
               "--out-dir", str(tmp_path)])
    assert rc == 2
    assert "--max-prompt-len (500) + --max-tokens (16) must be at most --max-model-len (512)" in \
        capsys.readouterr().err


def test_inputs_export_round_trips_and_names_a_missing_workload(tmp_path):
    from roofline.bench.datasets import ChatTurn, FewShotPrompts
    from roofline.bench.prefix_inputs import load_inputs, save_inputs

    inputs = {"multiturn": [[ChatTurn((1, 2, 3), 4, "hi"), ChatTurn((1, 2, 3, 9, 8), 2, "yo")]],
              "fewshot": FewShotPrompts((5, 6), ((5, 6, 7), (5, 6, 8, 9)), (3, 1)),
              "self-consistency": [11, 12, 13]}
    path = tmp_path / "inputs.json"
    save_inputs(inputs, str(path))
    assert load_inputs(str(path), ["multiturn", "fewshot", "self-consistency"]) == inputs
    save_inputs({"fewshot": inputs["fewshot"]}, str(path))
    with pytest.raises(ValueError, match="has no multiturn workload; it has fewshot"):
        load_inputs(str(path), ["multiturn"])
