"""The MoE bound: expected touched experts, the floor's bytes, and ``roofline cost`` for an MoE preset."""

from __future__ import annotations

import math

import pytest

from roofline.config import model_preset
from roofline.costmodel.moe import MoEShape, expected_touched_experts, moe_decode_floor


def test_expected_touched_experts():
    assert expected_touched_experts(128, 8, 1) == pytest.approx(8.0)
    assert expected_touched_experts(128, 8, 8) == pytest.approx(128 * (1 - (15 / 16) ** 8))  # 51.62
    assert expected_touched_experts(8, 2, 64) == pytest.approx(8 * (1 - 0.75 ** 64))
    assert expected_touched_experts(8, 2, 0) == 0.0
    with pytest.raises(ValueError, match=r"num_experts_per_tok must be in \[1, num_experts=8\], got 9"):
        expected_touched_experts(8, 9, 1)


def test_moe_shape_and_floor_bytes():
    mc = model_preset("qwen3-30b-a3b")
    moe = MoEShape.from_model_config(mc)
    assert (moe.num_experts, moe.top_k, moe.num_moe_layers) == (128, 8, 48)
    assert moe.expert_params == 3 * 2048 * 768
    # Qwen3-30B-A3B: 30.5 B parameters, 3.3 B active ("A3B").
    assert mc.num_params == pytest.approx(30.53e9, rel=1e-3)
    assert mc.num_active_params == pytest.approx(3.35e9, rel=1e-2)
    r1 = moe_decode_floor(moe, 1, 0.0, 4.0e12, 7.5e14)
    # batch 1: dense bytes + 8 experts in each of 48 layers, bf16
    assert r1["weight_bytes"] == pytest.approx(2 * (moe.dense_params + 48 * 8 * moe.expert_params))
    assert r1["floor_s"] == pytest.approx(r1["weight_bytes"] / 4.0e12)
    r64 = moe_decode_floor(moe, 64, 0.0, 4.0e12, 7.5e14)
    assert 8 < r64["touched_experts"] < 128 and r64["weight_bytes"] > r1["weight_bytes"]
    mix = MoEShape.from_model_config(model_preset("mixtral-8x7b"))
    assert mix.active_params == pytest.approx(12.9e9, rel=1e-2)
    with pytest.raises(ValueError, match="llama-3-8b is not a mixture-of-experts model"):
        MoEShape.from_model_config(model_preset("llama-3-8b"))


def test_cost_cli_prints_touched_experts_by_batch(capsys):
    from roofline.cost_cli import main

    assert main(["cost", "--model", "qwen3-30b-a3b", "--batch", "1,8,64", "--format", "bf16"]) == 0
    out = capsys.readouterr().out
    assert "mixture of experts: 128 experts, top-8, 48 MoE layers" in out
    rows = [line.split() for line in out.splitlines() if line.strip().split()[:1] in (["1"], ["8"], ["64"])]
    touched = {int(r[0]): float(r[1]) for r in rows[-3:]}
    assert touched == {1: 8.0, 8: round(expected_touched_experts(128, 8, 8), 2),
                       64: round(expected_touched_experts(128, 8, 64), 2)}
    assert math.isclose(touched[8], 51.62)
    assert main(["cost", "--model", "qwen3-30b-a3b", "--batch", "0"]) == 2


def test_bench_decode_moe_floor_bytes():
    """``bench decode``'s MoE floor: the engine's all-expert bytes with the routed share replaced by the expected
    touched experts (the bf16 bytes of ``moe_decode_floor``); None for a dense model."""
    from roofline.bench.moe import moe_step_bytes

    mc = model_preset("qwen3-30b-a3b")
    moe = MoEShape.from_model_config(mc)
    all_experts = 2 * (moe.dense_params + 48 * 128 * moe.expert_params)  # bf16
    for batch in (1, 8, 64):
        wbytes, params = moe_step_bytes(mc, all_experts, batch)
        assert wbytes == pytest.approx(moe_decode_floor(moe, batch, 0.0, 1.0, 1.0)["weight_bytes"])
        assert params == mc.num_active_params
    assert moe_step_bytes(model_preset("llama-3-8b"), 1e9, 1) is None


def test_expert_parallel_projection():
    """The EP projection per GPU: a 1/ep share of the dense weights and of the touched experts, plus two ring
    all-reduces per layer; labelled a projection in the CLI."""
    from roofline.cost_cli import main
    from roofline.costmodel.links import ring_allreduce_time
    from roofline.costmodel.moe import moe_ep_projection

    mc = model_preset("qwen3-30b-a3b")
    moe = MoEShape.from_model_config(mc)
    r = moe_ep_projection(moe, 8, 1, 0.0, 4.0e12, 7.5e14, 48, 2048, 450e9, 1e-6)
    assert r["touched_per_gpu"] == pytest.approx(1.0)
    assert r["weight_bytes_per_gpu"] == pytest.approx(2 * (moe.dense_params / 8 + 48 * moe.expert_params))
    assert r["comm_s"] == pytest.approx(96 * ring_allreduce_time(2048 * 2, 8, 450e9, 1e-6))
    assert r["floor_s"] == pytest.approx(r["weight_bytes_per_gpu"] / 4.0e12 + r["comm_s"])
    with pytest.raises(ValueError, match=r"expert parallel size 3 does not divide the 128 experts; sizes that do: "
                                         r"1, 2, 4, 8, 16, 32, 64, 128"):
        moe_ep_projection(moe, 3, 1, 0.0, 4.0e12, 7.5e14, 48, 2048, 450e9, 1e-6)
    assert main(["cost", "--model", "qwen3-30b-a3b", "--batch", "1,64", "--tp", "8", "--format", "bf16"]) == 0
