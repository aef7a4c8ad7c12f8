"""Expert parallelism on CPU (gloo): a tiny Qwen3-MoE (HF's own class, 6 experts, top-2, one dense layer) run with
tensor_parallel_size 2 and 3 and ``enable_expert_parallel`` (each rank holds 3 or 2 whole experts; attention stays
tensor-parallel) gives the single process's greedy tokens; so does plain TP (each expert's width split) and EP=2
composed with PP=2. Sizes that do not divide the experts are refused, listing those that do.
"""

from __future__ import annotations

import pytest
import torch

from roofline import LLM, SamplingParams

PROMPTS = [{"prompt_token_ids": [1, 17, 42, 99, 5, 230, 64]},
           {"prompt_token_ids": [1] + list(range(30, 70))},
           {"prompt_token_ids": [1, 200, 3, 3, 3, 9]}]
SP = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
COMMON = dict(device="cpu", dtype="float32", max_model_len=96, num_kv_blocks=24, block_size=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    import transformers as tf

    cfg = tf.Qwen3MoeConfig(vocab_size=256, hidden_size=96, intermediate_size=96, num_hidden_layers=3,
                            num_attention_heads=6, num_key_value_heads=6, head_dim=16, num_experts=6,
                            num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True,
                            mlp_only_layers=[1], max_position_embeddings=256, initializer_range=0.2,
                            bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = tf.Qwen3MoeForCausalLM(cfg).float().eval()
    with torch.no_grad():
        gen = torch.Generator().manual_seed(1)
        for name, p in model.named_parameters():
            if name.endswith("gate.weight"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    path = tmp_path_factory.mktemp("qwen3moe")
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


@pytest.fixture(scope="module")
def reference(checkpoint):
    llm = LLM(checkpoint, **COMMON)
    return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, SP, use_tqdm=False)]


def _run(checkpoint, **kw):
    llm = LLM(checkpoint, **COMMON, **kw)
    try:
        return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, SP, use_tqdm=False)]
    finally:
        llm.engine.executor.shutdown()


@pytest.mark.parametrize("layout", [dict(tensor_parallel_size=2, enable_expert_parallel=True),
                                    dict(tensor_parallel_size=3, enable_expert_parallel=True),
                                    dict(tensor_parallel_size=2),
                                    dict(tensor_parallel_size=2, pipeline_parallel_size=2,
                                         enable_expert_parallel=True)],
                         ids=["ep2", "ep3", "tp2", "ep2xpp2"])
def test_parallel_layouts_are_token_identical(checkpoint, reference, layout):
    assert _run(checkpoint, **layout) == reference


def test_expert_parallel_shards_the_experts():
    """Built as rank 1 of 3 with EP, a layer holds experts 2..3 whole; without EP, all 6 at a third of the width."""
    from roofline.distributed.parallel_state import ParallelState, parallel_state
    from roofline.layers.moe import FusedMoE

    with parallel_state(ParallelState(1, 3, enable_expert_parallel=True)):
        ep = FusedMoE(6, 2, 16, 12, prefix="e")
    assert (ep.num_local_experts, ep.expert_start, tuple(ep.w13_weight.shape)) == (2, 2, (2, 24, 16))
    assert sorted(ep.w13_weight.expected_shards) == [(2, 0), (2, 1), (3, 0), (3, 1)]
    w = torch.randn(12, 16)
    ep.weight_loader(ep.w13_weight, w, (0, 0))  # another rank's expert: skipped
    ep.weight_loader(ep.w13_weight, w, (3, 1))
    assert torch.equal(ep.w13_weight.data[1, 12:], w)
    with parallel_state(ParallelState(1, 3)):
        tp = FusedMoE(6, 2, 16, 12, prefix="e")
    assert (tp.num_local_experts, tuple(tp.w2_weight.shape)) == (6, (6, 16, 4))
    with parallel_state(ParallelState(1, 4, enable_expert_parallel=True)), pytest.raises(
            ValueError, match=r"expert parallel size 4 .* does not divide the 6 experts; sizes that do: 1, 2, 3, 6"):
        FusedMoE(6, 2, 16, 12, prefix="e")


def test_expert_parallel_size_not_dividing_experts_is_refused(checkpoint):
    with pytest.raises(ValueError, match=r"expert parallel size 4 \(tensor_parallel_size with enable_expert_parallel\) "
                                         r"does not divide the 6 experts of .*; sizes that do: 1, 2, 3, 6"):
        LLM(checkpoint, tensor_parallel_size=4, enable_expert_parallel=True, **COMMON)


def test_expert_parallel_on_a_dense_model_is_a_logged_no_op(caplog):
    # Accepted, as vLLM does, but never silent: the start-up log says the flag does nothing here.
    from roofline.model_config import model_preset
    from roofline.parallel_config import ParallelConfig

    dense = model_preset("llama-3-8b")
    with caplog.at_level("WARNING", logger="roofline.parallel_config"):
        ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).check_model(dense)
    assert "enable_expert_parallel has no effect: llama-3-8b is a dense model" in caplog.text
