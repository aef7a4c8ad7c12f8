"""The parallel bound: per-GPU bytes under TP x PP, ring all-reduces, the GPipe bubble, layout ranking.

Every expected number is computed by hand in the comment beside it. Shapes: llama-3-8b has P = 8,030,261,248,
32 layers, 32 heads, 8 KV heads, hidden 4096, vocab 128,256 (untied): embedding = LM head = 128,256 x 4096
= 525,336,576, a layer 218,112,000 + the final norm's 4096 / 32 = 218,112,128. llama-3-70b has
P = 70,553,706,496, 80 layers, 64 heads, hidden 8192. H200 preset: 4.8e12 B/s, 989e12 FLOP/s, 141e9 bytes.
"""

from __future__ import annotations

import argparse
import json

import pytest

from roofline import costmodel as cm
from roofline.cost_cli import add_cost_parser, resolve_model
from roofline.hardware import INTERCONNECT_PRESETS, load_interconnect

NVLINK, PCIE, IB = (INTERCONNECT_PRESETS[k] for k in ("nvlink", "pcie", "ib"))
H200_BW, H200_PEAK, H200_CAP = 4.8e12, 989e12, 141e9
P8B, P70B = 8_030_261_248, 70_553_706_496


def shape(name: str) -> cm.ModelShape:
    return resolve_model(name)[0]


def run_cli(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="roofline")
    add_cost_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    return args.func(args)


def h200_step(model: str, tp: int, pp: int = 1, batch: int = 1, **kw) -> cm.ParallelBound:
    kw.setdefault("intra", NVLINK)
    return cm.parallel_step(shape(model), tp, pp, batch, H200_BW, H200_PEAK, **kw)


# --------------------------------------------------------------------------------------------------
# Shapes and bytes
# --------------------------------------------------------------------------------------------------

def test_model_shape_split_of_parameters():
    s = shape("llama-3-8b")
    assert (s.num_attention_heads, s.vocab_size, s.tie_word_embeddings) == (32, 128_256, False)
    assert s.embedding_params == s.lm_head_params == 525_336_576  # 128,256 x 4096
    assert s.layer_params == 218_112_128  # (8,030,261,248 - 2 x 525,336,576) / 32
    # The fixture has no vocabulary: 64 heads from hidden 8192 / head_dim 128, every parameter in a layer.
    assert cm.DENSE_70B_FIXTURE.num_attention_heads == 64
    assert cm.DENSE_70B_FIXTURE.layer_params == 70e9 / 80
    with pytest.raises(ValueError, match=r"num_attention_heads \(12\) must be a multiple of num_kv_heads \(5\)"):
        cm.ModelShape("bad", 1e9, 4, 5, 64, 768, num_attention_heads=12)


def test_per_gpu_weight_bytes_at_tp2():
    # bf16, TP 2, PP 1: every GPU holds P / 2 parameters x 2 bytes = P bytes = 8,030,261,248.
    (st,) = cm.shard_stages(shape("llama-3-8b"), tp=2, pp=1)
    assert st.num_layers == 32 and st.params == P8B / 2
    assert st.weight_bytes == 8_030_261_248
    # TP 2 x PP 2: stage 0 = (16 layers x 218,112,128 + embedding 525,336,576) / 2 = 2,007,565,312 params,
    # 4,015,130,624 bytes; stage 1 holds the LM head instead of the embedding, the same size.
    s0, s1 = cm.shard_stages(shape("llama-3-8b"), tp=2, pp=2)
    assert s0.params == s1.params == 2_007_565_312
    assert s0.weight_bytes == s1.weight_bytes == 4_015_130_624
    # int4_g128 at 4.15 bits: 2,007,565,312 x 4.15 / 8 = 1,041,424,505.6 bytes.
    s0_int4 = cm.shard_stages(shape("llama-3-8b"), tp=2, pp=2, fmt="int4_g128")[0]
    assert s0_int4.weight_bytes == pytest.approx(1_041_424_505.6)


def test_tied_embedding_is_kept_on_the_last_stage_too():
    # smollm2-135m (tied): layer = 576 x 960 + 576 x 576 + 3 x 576 x 1536 + 2 x 576 = 3,540,096, x 30
    # = 106,202,880; embedding 49,152 x 576 = 28,311,552; + final norm 576 -> P = 134,515,008.
    s = shape("smollm2-135m")
    assert s.num_params == 134_515_008
    (one,) = cm.shard_stages(s, tp=1, pp=1)
    assert one.params == pytest.approx(134_515_008)  # the tied matrix once
    # PP 2: 15 layers x (134,515,008 - 28,311,552) / 30 = 53,101,728 + 28,311,552 on each stage = 81,413,280.
    s0, s1 = cm.shard_stages(s, tp=1, pp=2)
    assert s0.params == pytest.approx(81_413_280) and s1.params == pytest.approx(81_413_280)


def test_kv_heads_sharded_then_replicated():
    assert [cm.kv_heads_per_gpu(8, tp) for tp in (1, 2, 4, 8, 16, 32)] == [8, 4, 2, 1, 1, 1]
    s = shape("llama-3-8b")
    # Full KV at context 1000, bf16: 2 x 32 layers x 8 heads x 128 x 2 bytes x 1000 = 131,072,000.
    assert s.kv_bytes_per_sequence(1000) == 131_072_000
    # TP 4: 2 heads per GPU -> 131,072,000 / 4 = 32,768,000 per GPU.
    assert cm.shard_stages(s, 4, 1, context=1000)[0].kv_bytes_per_seq == 32_768_000
    # TP 16 > 8 KV heads: one head per GPU, 2 x 32 x 1 x 128 x 2 x 1000 = 16,384,000, not 131,072,000 / 16
    # = 8,192,000; the 16 GPUs together hold 262,144,000, twice the cache (each head on 2 GPUs).
    (st,) = cm.shard_stages(s, 16, 1, context=1000)
    assert st.kv_heads == 1 and st.kv_bytes_per_seq == 16_384_000
    assert 16 * st.kv_bytes_per_seq == 2 * 131_072_000
    # PP 2 splits the layers: stage 0 keeps 16 layers x 2 heads -> 16,384,000 at TP 4.
    assert cm.shard_stages(s, 4, 2, context=1000)[0].kv_bytes_per_seq == 16_384_000


def test_allowed_tp_sizes_and_layout_errors():
    assert cm.allowed_tp_sizes(32, 8) == [1, 2, 4, 8, 16, 32]
    # 12 heads, 4 KV heads: 3 and 6 divide 12 but neither divide 4 nor are multiples of it.
    assert cm.allowed_tp_sizes(12, 4) == [1, 2, 4, 12]
    assert cm.allowed_tp_sizes(9, 3) == [1, 3, 9]  # smollm2-135m
    s8 = shape("llama-3-8b")
    with pytest.raises(ValueError, match=r"^tp 3 does not divide the 32 attention heads of llama-3-8b; "
                                         r"allowed tp: 1, 2, 4, 8, 16, 32$"):
        cm.check_parallel_layout(s8, 3, 1)
    odd = cm.ModelShape("odd", 1e9, 4, 4, 64, 768, num_attention_heads=12)
    with pytest.raises(ValueError, match=r"tp 6 neither divides nor is a multiple of the 4 KV heads of odd; "
                                         r"allowed tp: 1, 2, 4, 12"):
        cm.check_parallel_layout(odd, 6, 1)
    with pytest.raises(ValueError, match=r"pp must be an integer in \[1, 32\] \(the layers of llama-3-8b\), got 33"):
        cm.check_parallel_layout(s8, 1, 33)
    with pytest.raises(ValueError, match=r"tp must be an integer >= 1, got 0"):
        cm.check_parallel_layout(s8, 0, 1)


def test_stage_layer_counts():
    assert cm.stage_layer_counts(80, 3) == [27, 27, 26]  # 80 = 3 x 26 + 2
    assert cm.stage_layer_counts(32, 5) == [7, 7, 6, 6, 6]  # 32 = 5 x 6 + 2
    assert cm.stage_layer_counts(32, 1) == [32]


# --------------------------------------------------------------------------------------------------
# Communication
# --------------------------------------------------------------------------------------------------

def test_ring_allreduce_time():
    # One token of llama-3-8b: 1 x 4096 x 2 bytes = 8192. TP 4 over NVLink (450e9 B/s, 0.6 us per step):
    # 2 x 3 x 0.6e-6 + 2 x 3/4 x 8192 / 450e9 = 3.6e-6 + 12,288 / 450e9 = 3.6e-6 + 2.7307e-8 = 3.62731e-6.
    assert cm.ring_allreduce_time(8192, 4, 450e9, 0.6e-6) == pytest.approx(3.627307e-6, rel=1e-6)
    # TP 8 over PCIe (64e9, 1 us): 14e-6 + 2 x 7/8 x 8192 / 64e9 = 14e-6 + 14,336 / 64e9 = 1.4224e-5.
    assert cm.ring_allreduce_time(8192, 8, 64e9, 1e-6) == pytest.approx(1.4224e-5, rel=1e-12)
    # Bandwidth term alone: 2 ranks, 1e6 bytes at 1e9 B/s -> 2 x 1/2 x 1e6 / 1e9 = 1e-3 s.
    assert cm.ring_allreduce_time(1e6, 2, 1e9, 0.0) == pytest.approx(1e-3)
    assert cm.ring_allreduce_time(8192, 1, 64e9, 1e-6) == 0.0
    with pytest.raises(ValueError, match=r"num_ranks must be an integer >= 1, got 0"):
        cm.ring_allreduce_time(8192, 0, 64e9, 1e-6)


def test_send_recv_and_slowest_link():
    # (hidden, residual) of one 8B token over IB: 2.7e-6 + 2 x 4096 x 2 / 50e9 = 2.7e-6 + 3.2768e-7.
    assert cm.send_recv_time(16_384, 50e9, 2.7e-6) == pytest.approx(3.02768e-6, rel=1e-12)
    assert cm.slowest_link(NVLINK, PCIE) is PCIE and cm.slowest_link(PCIE, IB) is IB
    mixed = cm.slowest_link(cm.Link("a", 100e9, 5e-6), cm.Link("b", 50e9, 1e-6))
    assert (mixed.bandwidth, mixed.latency_s, mixed.name) == (50e9, 5e-6, "a/b (slowest of)")
    # Ranks 0-3 with 4 GPUs per node share node 0; ranks 2-5 span nodes 0 and 1.
    assert cm.group_link(range(4), 4, NVLINK, PCIE) is NVLINK
    assert cm.group_link(range(2, 6), 4, NVLINK, PCIE) is PCIE
    assert cm.group_link(range(8), 8, NVLINK, PCIE) is NVLINK


def test_pipeline_utilization_gpipe():
    assert cm.pipeline_utilization(4, 2) == pytest.approx(0.8)  # 4 / (4 + 2 - 1)
    assert cm.pipeline_utilization(1, 4) == pytest.approx(0.25)  # 1 / (1 + 4 - 1)
    assert cm.pipeline_utilization(7, 1) == 1.0
    with pytest.raises(ValueError, match=r"num_stages must be an integer >= 1, got 0"):
        cm.pipeline_utilization(4, 0)


def test_interconnect_presets_cite_sources_and_override():
    assert [(k, x.bandwidth, x.latency_s) for k, x in INTERCONNECT_PRESETS.items()] == [
        ("nvlink", 450e9, 0.6e-6), ("pcie", 64e9, 1.0e-6), ("ib", 50e9, 2.7e-6), ("ethernet", 12.5e9, 30e-6)]
    assert "H100 / H200 Tensor Core GPU datasheets" in NVLINK.citation and "tuning.cc" in NVLINK.citation
    assert "PCI Express 5.0" in PCIE.citation and "ConnectX-7" in IB.citation
    assert "802.3" in INTERCONNECT_PRESETS["ethernet"].citation
    assert "estimate" in INTERCONNECT_PRESETS["ethernet"].citation
    x = load_interconnect("pcie", bandwidth_gb_s=25, latency_us=3)
    assert (x.bandwidth, x.latency_s) == (25e9, 3e-6)
    assert x.citation.startswith("given: bandwidth 25 GB/s, latency 3 us per step; preset: PCI-SIG")
    assert load_interconnect("ib") is IB
    with pytest.raises(ValueError, match=r"unknown interconnect 'nvl'; known: nvlink, pcie, ib, ethernet"):
        load_interconnect("nvl")


# --------------------------------------------------------------------------------------------------
# Step bound
# --------------------------------------------------------------------------------------------------

def test_tp1_pp1_is_the_single_gpu_bound():
    # The worksheet: fixture on 3.0 TB/s, 1,000 TFLOP/s, batch 32, context 2048 -> 53.825 ms (bf16).
    b = cm.parallel_step(cm.DENSE_70B_FIXTURE, 1, 1, 32, 3.0e12, 1000e12, NVLINK, context=2048)
    assert f"{b.step_s * 1e3:.3f}" == "53.825" and b.comm_s == 0.0 and b.send_s == ()


def test_tp_step_adds_two_allreduces_per_layer():
    # llama-3-8b, TP 4, batch 1, context 0 on H200, NVLink: 4,015,130,624 bytes / 4.8e12 = 0.836485547 ms
    # (compute 2 x 2,007,565,312 / 989e12 = 4.06 us is below it) + 64 all-reduces x 3.627307 us
    # = 0.232147627 ms -> 1.068633173 ms.
    b = h200_step("llama-3-8b", 4)
    (st,) = b.stages
    assert st.memory_s == pytest.approx(0.836485547e-3, rel=1e-9)
    assert st.num_allreduces == 64 and st.allreduce_s == pytest.approx(3.627307e-6, rel=1e-6)
    assert b.step_s == pytest.approx(1.068633173e-3, rel=1e-9)
    # Batch 8: the message grows to 8 x 8192 = 65,536 bytes: 3.6e-6 + 1.5 x 65,536 / 450e9 = 3.818453 us.
    assert h200_step("llama-3-8b", 4, batch=8).stages[0].allreduce_s == pytest.approx(3.818453e-6, rel=1e-6)


def test_seed_tp8_across_two_pcie_nodes_loses_to_tp4_on_one_node():
    # The seeds' statement, for llama-3-8b (fits at TP 4: 4.0 GB per GPU), batch 1, context 0, H200,
    # 4 GPUs per node, NVLink inside a node and PCIe between the two nodes.
    kw = dict(intra=NVLINK, inter=PCIE, gpus_per_node=4, capacity_bytes=H200_CAP)
    tp4 = h200_step("llama-3-8b", 4, **kw)
    tp8 = h200_step("llama-3-8b", 8, **kw)
    # TP 4: ranks 0-3, one node, NVLink: 1.068633173 ms (test above).
    assert tp4.stages[0].link is NVLINK and tp4.fits["fits"]
    assert tp4.step_s == pytest.approx(1.068633173e-3, rel=1e-9)
    # TP 8: ranks 0-7 span both nodes, every ring step at PCIe's pace: 2,007,565,312 bytes / 4.8e12
    # = 0.418242773 ms + 64 x 14.224 us = 0.910336 ms -> 1.328578773 ms.
    assert tp8.stages[0].link is PCIE
    assert tp8.step_s == pytest.approx(1.328578773e-3, rel=1e-9)
    assert tp8.step_s > tp4.step_s  # halving the bytes saves 0.418 ms; the slow all-reduces cost 0.678 ms more
    ranked = cm.best_layouts(shape("llama-3-8b"), 8, 1, H200_BW, H200_PEAK, **kw)
    assert (ranked[0][0].tp, ranked[0][0].pp) == (4, 1)
    order = [(t.tp, t.pp) for t, _ in ranked]
    assert order.index((4, 1)) < order.index((8, 1))


def test_seed_statement_reverses_for_70b():
    # The verdict depends on bytes per layer: llama-3-70b reads 1.71 GB per layer, so halving it saves more
    # than the slow all-reduces cost. TP 4 (NVLink): 35,276,853,248 / 4.8e12 = 7.349344427 ms
    # + 160 x (3.6e-6 + 1.5 x 16,384 / 450e9 = 3.654613 us) = 0.584738133 ms -> 7.934082560 ms.
    # TP 8 (PCIe): 17,638,426,624 / 4.8e12 = 3.674672213 ms + 160 x (14e-6 + 1.75 x 16,384 / 64e9
    # = 14.448 us) = 2.31168 ms -> 5.986352213 ms.
    kw = dict(intra=NVLINK, inter=PCIE, gpus_per_node=4)
    assert h200_step("llama-3-70b", 4, **kw).step_s == pytest.approx(7.934082560e-3, rel=1e-9)
    assert h200_step("llama-3-70b", 8, **kw).step_s == pytest.approx(5.986352213e-3, rel=1e-9)


def test_pp_token_time_and_gpipe_step():
    # llama-3-8b, TP 1 x PP 2, one GPU per node (the stage boundary crosses IB), context 0.
    # Each stage: 16 x 218,112,128 + 525,336,576 = 4,015,130,624 params, 8,030,261,248 bytes / 4.8e12
    # = 1.672971093 ms. Send: 2.7e-6 + 2 x 4096 x 2 / 50e9 = 3.02768 us.
    kw = dict(intra=NVLINK, inter=IB, gpus_per_node=1)
    tok = h200_step("llama-3-8b", 1, 2, **kw)
    assert tok.send_links == (IB,) and tok.send_s[0] == pytest.approx(3.02768e-6, rel=1e-12)
    assert tok.step_s == pytest.approx(2 * 1.672971093e-3 + 3.02768e-6, rel=1e-9)  # 3.348969867 ms
    # Batch 4 in 4 micro-batches of 1: sum + 3 x max + send = 5 x 1.672971093 ms + 3.02768 us
    # = 8.367883147 ms; utilization 4 / 5 = 0.8; 4 / 8.367883147e-3 = 478.02 tok/s.
    b = h200_step("llama-3-8b", 1, 2, batch=4, num_micro_batches=4, **kw)
    assert b.step_s == pytest.approx(8.367883147e-3, rel=1e-9)
    assert b.utilization == pytest.approx(0.8) and b.tokens_per_s == pytest.approx(478.02, rel=1e-4)
    # One node of 8: the send stays on NVLink: 0.6e-6 + 16,384 / 450e9 = 0.636409 us.
    assert h200_step("llama-3-8b", 1, 2).send_s[0] == pytest.approx(0.636409e-6, rel=1e-5)
    with pytest.raises(ValueError, match=r"num_micro_batches must be an integer in \[1, batch 4\], got 5"):
        h200_step("llama-3-8b", 1, 2, batch=4, num_micro_batches=5)


def test_fits_per_gpu():
    # Fixture (140e9 bytes bf16) on an 80e9-byte GPU with the 10% reserve (8e9): TP 1 cannot hold it.
    # TP 2: 70e9 per GPU; KV per GPU per sequence at 2048 = 671,088,640 / 2 = 335,544,320; room for KV
    # 80e9 - 8e9 - 70e9 = 2e9 -> floor(2e9 / 335,544,320) = 5 sequences (6 would need 2,013,265,920).
    kw = dict(context=2048, capacity_bytes=80e9)
    one = cm.parallel_step(cm.DENSE_70B_FIXTURE, 1, 1, 1, 3e12, 1e15, NVLINK, **kw)
    two = cm.parallel_step(cm.DENSE_70B_FIXTURE, 2, 1, 5, 3e12, 1e15, NVLINK, **kw)
    assert one.fits["fits"] is False and one.fits["max_batch"] == 0
    assert two.fits["fits"] is True and two.fits["max_batch"] == 5
    assert two.fits["needed_bytes"] == 70e9 + 5 * 335_544_320 + 8e9
    assert cm.parallel_step(cm.DENSE_70B_FIXTURE, 2, 1, 6, 3e12, 1e15, NVLINK, **kw).fits["fits"] is False


def test_best_layouts_70b_on_8_nvlink_gpus():
    ranked = cm.best_layouts(shape("llama-3-70b"), 8, 32, H200_BW, H200_PEAK, NVLINK, IB, context=2048,
                             capacity_bytes=H200_CAP)
    # TP in {1, 2, 4, 8} with PP up to 8 // TP: 8 + 4 + 2 + 1 = 15 layouts.
    assert len(ranked) == 15
    assert (ranked[0][0].tp, ranked[0][0].pp) == (8, 1)
    # bf16 70B on one 141 GB GPU: 141.1 GB of weights > 126.9 GB free of the reserve -> last, not fitting.
    last_tok, last_b = ranked[-1]
    assert (last_tok.tp, last_tok.pp) == (1, 1) and last_b.fits["fits"] is False


# --------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------

SEED_ARGS = ["cost", "--model", "llama-3-8b", "--hardware", "h200", "--batch", "1", "--context", "0",
             "--gpus-per-node", "4", "--interconnect", "nvlink", "--inter-node-interconnect", "pcie"]


def test_cli_seed_statement(capsys):
    got = {}
    for tp in ("4", "8"):
        assert run_cli([*SEED_ARGS, "--tp", tp, "--json"]) == 0
        par = json.loads(capsys.readouterr().out)["parallel"]
        got[tp] = par["layout"]["token"]
        assert par["links"]["inter_node"]["name"] == "pcie"
    assert got["4"]["step_s"] == pytest.approx(1.068633173e-3, rel=1e-9)  # as in the library test
    assert got["8"]["step_s"] == pytest.approx(1.328578773e-3, rel=1e-9)
    assert got["4"]["stages"][0]["tp_link"] == "nvlink" and got["8"]["stages"][0]["tp_link"] == "pcie"
    assert run_cli([*SEED_ARGS, "--gpus", "8", "--best-layout"]) == 0
    out = capsys.readouterr().out
    assert "layouts on at most 8 GPUs, ranked by batch-1 token time" in out
    rows = [line.split() for line in out.splitlines() if line.strip()[:2] in ("1 ", "2 ", "3 ")]
    assert rows[0][:4] == ["1", "4", "x", "1"] and "layout TP 4 x PP 1 = 4 GPUs" in out
    assert any(r[1:4] == ["8", "x", "1"] and r[5] == "pcie" for r in rows)


def test_cli_link_overrides(capsys):
    # TP 2 with NVLink overridden to 100 GB/s and 5 us per step: 2 x 1 x 5e-6 + 2 x 1/2 x 8192 / 100e9
    # = 1.008192e-5 s per all-reduce.
    assert run_cli([*SEED_ARGS, "--tp", "2", "--link-bandwidth", "100", "--link-latency-us", "5", "--json"]) == 0
    par = json.loads(capsys.readouterr().out)["parallel"]
    assert par["links"]["intra_node"]["bandwidth_bytes_per_s"] == 100e9
    assert par["links"]["intra_node"]["citation"].startswith("given: bandwidth 100 GB/s, latency 5 us per step")
    assert par["layout"]["token"]["stages"][0]["allreduce_s"] == pytest.approx(1.008192e-5, rel=1e-12)
    # TP 8 across the nodes, the inter-node link overridden to 10 GB/s and 20 us: 14 x 20e-6
    # + 1.75 x 8192 / 10e9 = 2.8e-4 + 1.4336e-6 = 2.814336e-4 s.
    assert run_cli([*SEED_ARGS, "--tp", "8", "--inter-node-bandwidth", "10", "--inter-node-latency-us", "20",
                    "--json"]) == 0
    par = json.loads(capsys.readouterr().out)["parallel"]
    assert par["layout"]["token"]["stages"][0]["allreduce_s"] == pytest.approx(2.814336e-4, rel=1e-12)


def test_cli_pp_and_micro_batches(capsys):
    assert run_cli(["cost", "--model", "llama-3-8b", "--hardware", "h200", "--batch", "4", "--context", "0",
                    "--pp", "2", "--gpus-per-node", "1", "--micro-batches", "4", "--json"]) == 0
    at = json.loads(capsys.readouterr().out)["parallel"]["layout"]["at_batch"]
    assert at["step_s"] == pytest.approx(8.367883147e-3, rel=1e-9)  # test_pp_token_time_and_gpipe_step
    assert at["pipeline_utilization"] == pytest.approx(0.8) and at["send_links"] == ["ib"]


def test_cli_without_parallel_flags_is_unchanged(capsys):
    assert run_cli(["cost", "--model", "llama-3-8b", "--json"]) == 0
    assert "parallel" not in json.loads(capsys.readouterr().out)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--tp", "0"], "--tp must be an integer >= 1, got 0"),
        (["--tp", "3"], "--tp 3 does not divide the 32 attention heads of llama-3-8b; allowed --tp: 1, 2, 4, 8, 16, 32"),
        (["--pp", "0"], "--pp must be an integer in [1, 32] (the layers of llama-3-8b), got 0"),
        (["--pp", "33"], "--pp must be an integer in [1, 32] (the layers of llama-3-8b), got 33"),
        (["--tp", "8", "--gpus", "4"], "--tp x --pp = 8 x 1 = 8 GPUs is more than --gpus 4"),
        (["--interconnect", "nvl"], "unknown --interconnect 'nvl'; known: nvlink, pcie, ib, ethernet"),
        (["--tp", "2", "--inter-node-interconnect", "roce"],
         "unknown --inter-node-interconnect 'roce'; known: nvlink, pcie, ib, ethernet"),
        (["--tp", "2", "--link-bandwidth", "0"], "--link-bandwidth must be a finite number of GB/s > 0, got 0.0"),
        (["--tp", "2", "--link-latency-us", "-1"],
         "--link-latency-us must be a finite number of microseconds >= 0, got -1.0"),
        (["--tp", "2", "--gpus-per-node", "0"], "--gpus-per-node must be an integer >= 1, got 0"),
        (["--pp", "2", "--micro-batches", "40"], "--micro-batches must be an integer in [1, --batch 32], got 40"),
        (["--best-layout"], "--best-layout needs --gpus N"),
    ],
)
def test_cli_bad_parallel_values(capsys, extra, message):
    assert run_cli(["cost", "--model", "llama-3-8b", *extra]) == 2
    err = capsys.readouterr().err
    assert err.startswith("roofline cost: error: ") and message in err and "Traceback" not in err
