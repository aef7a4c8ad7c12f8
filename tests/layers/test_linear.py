"""Tensor-parallel linear layers and the ``LinearMethod`` seam, on CPU without any communication.

Ranks are simulated by building one layer per rank under ``tensor_parallel_state(rank, size)`` and loading
the same full (Hugging Face) tensors through each rank's ``weight_loader``. Column-parallel shards must
concatenate back to the full tensor; row-parallel partial products must sum to the full layer's output
(the sum is done here by hand, in place of the all-reduce).

The last tests plug a fake weight format (a ``QuantConfig`` returning a ``LinearMethod`` that stores every
weight transposed) into the real ``LlamaForCausalLM`` and check that it reaches every linear layer, that
``load_weights`` fills it through its own loader, and that the output equals the 16-bit model's.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from roofline.attention import AttentionMetadata
from roofline.attention.backend import get_attention_backend
from roofline.config import ModelConfig
from roofline.distributed.parallel_state import get_tp_rank, get_tp_size, tensor_parallel_state
from roofline.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    ReplicatedLinear,
    RowParallelLinear,
)
from roofline.layers.rotary import RotaryEmbedding
from roofline.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from roofline.models import loader
from roofline.models.registry import build_model
from roofline.quant.base import LinearMethod, QuantConfig, UnquantizedLinearMethod, set_weight_attrs

HIDDEN = 16
HEAD_DIM = 4


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _build(rank: int, size: int, cls, *args, **kwargs):
    """``cls(*args, **kwargs)`` as rank ``rank`` of ``size``, its parameters filled with NaN (so that a row
    the loader leaves unwritten shows)."""
    with tensor_parallel_state(rank, size):
        layer = cls(*args, **kwargs)
    with torch.no_grad():
        for p in layer.parameters():
            p.fill_(float("nan"))
    return layer


def _ranks(size: int, cls, *args, **kwargs) -> list:
    return [_build(r, size, cls, *args, **kwargs) for r in range(size)]


def _load(layer, name: str, tensor: torch.Tensor, shard_id=None) -> None:
    param = getattr(layer, name)
    if shard_id is None:
        param.weight_loader(param, tensor)
    else:
        param.weight_loader(param, tensor, shard_id)


def test_tensor_parallel_state_is_scoped():
    assert (get_tp_rank(), get_tp_size()) == (0, 1)
    with tensor_parallel_state(1, 2):
        assert (get_tp_rank(), get_tp_size()) == (1, 2)
        with tensor_parallel_state(3, 4):
            assert (get_tp_rank(), get_tp_size()) == (3, 4)
        assert (get_tp_rank(), get_tp_size()) == (1, 2)
    assert (get_tp_rank(), get_tp_size()) == (0, 1)
    with pytest.raises(ValueError, match="tp_rank must be in \\[0, 2\\), got 2"):
        with tensor_parallel_state(2, 2):
            pass


# ---------------------------------------------------------------------------------------------- column


def test_column_parallel_tp2_splits_rows_and_outputs():
    w, b, x = _randn(12, HIDDEN, seed=0), _randn(12, seed=1), _randn(3, HIDDEN, seed=2)
    ranks = _ranks(2, ColumnParallelLinear, HIDDEN, 12, bias=True)
    for r, layer in enumerate(ranks):
        assert layer.weight.shape == (6, HIDDEN) and layer.bias.shape == (6,)
        _load(layer, "weight", w)
        _load(layer, "bias", b)
        assert torch.equal(layer.weight, w[6 * r:6 * (r + 1)])
    assert torch.equal(torch.cat([layer.weight for layer in ranks]), w)
    assert torch.equal(torch.cat([layer.bias for layer in ranks]), b)
    out = torch.cat([layer(x) for layer in ranks], dim=-1)
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=0, atol=1e-6)


def test_merged_column_parallel_tp2_concatenates_per_shard():
    inter = 6
    gate, up = _randn(inter, HIDDEN, seed=3), _randn(inter, HIDDEN, seed=4)
    x = _randn(5, HIDDEN, seed=5)
    ranks = _ranks(2, MergedColumnParallelLinear, HIDDEN, [inter, inter])
    for layer in ranks:
        assert layer.weight.shape == (inter, HIDDEN)  # gate/2 + up/2 rows
        _load(layer, "weight", gate, 0)
        _load(layer, "weight", up, 1)
        assert not layer.weight.isnan().any()
    half = inter // 2
    assert torch.equal(torch.cat([layer.weight[:half] for layer in ranks]), gate)
    assert torch.equal(torch.cat([layer.weight[half:] for layer in ranks]), up)
    # Each rank's output is [gate slice | up slice] of its own columns. (On a CPU with AVX-512F the layers run
    # roofline.kernels.cpu_f32's loop, which sums K in another order than F.linear's MKL: 2 ulps apart at most.)
    outs = [layer(x) for layer in ranks]
    full_gate, full_up = F.linear(x, gate), F.linear(x, up)
    torch.testing.assert_close(torch.cat([o[:, :half] for o in outs], -1), full_gate, rtol=1e-6, atol=2e-6)
    torch.testing.assert_close(torch.cat([o[:, half:] for o in outs], -1), full_up, rtol=1e-6, atol=2e-6)


def _qkv_full(num_heads: int, num_kv_heads: int, bias: bool = False) -> dict[str, torch.Tensor]:
    full = {"q": _randn(num_heads * HEAD_DIM, HIDDEN, seed=10), "k": _randn(num_kv_heads * HEAD_DIM, HIDDEN, seed=11),
            "v": _randn(num_kv_heads * HEAD_DIM, HIDDEN, seed=12)}
    if bias:
        full.update({f"{s}_bias": _randn(full[s].shape[0], seed=13 + i) for i, s in enumerate("qkv")})
    return full


def _load_qkv(layer: QKVParallelLinear, full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load q/k/v through the layer's loader; return this rank's q/k/v rows (and biases)."""
    for s in "qkv":
        _load(layer, "weight", full[s], s)
        if layer.bias is not None:
            _load(layer, "bias", full[f"{s}_bias"], s)
    q, kv = layer.q_size, layer.kv_size
    parts = dict(zip("qkv", layer.weight.split([q, kv, kv]), strict=True))
    if layer.bias is not None:
        parts.update({f"{s}_bias": t for s, t in zip("qkv", layer.bias.split([q, kv, kv]), strict=True)})
    return parts


def test_qkv_parallel_tp2_splits_heads():
    full = _qkv_full(num_heads=4, num_kv_heads=2, bias=True)
    x = _randn(3, HIDDEN, seed=20)
    ranks = _ranks(2, QKVParallelLinear, HIDDEN, HEAD_DIM, 4, 2, bias=True)
    parts = []
    for layer in ranks:
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_replicas) == (2, 1, 1)
        assert layer.weight.shape == ((2 + 2 * 1) * HEAD_DIM, HIDDEN)
        parts.append(_load_qkv(layer, full))
        assert not layer.weight.isnan().any() and not layer.bias.isnan().any()
    for key in ("q", "k", "v", "q_bias", "k_bias", "v_bias"):
        assert torch.equal(torch.cat([p[key] for p in parts]), full[key]), key
    # Forward: rank r's [q | k | v] columns are the full projection's rows of its heads.
    q_size, kv_size = 2 * HEAD_DIM, HEAD_DIM
    outs = [layer(x) for layer in ranks]
    for s, (start, size) in {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size)}.items():
        got = torch.cat([o[:, start:start + size] for o in outs], -1)
        torch.testing.assert_close(got, F.linear(x, full[s], full[f"{s}_bias"]), rtol=0, atol=1e-6)


def test_qkv_parallel_replicates_a_single_kv_head_at_tp2():
    full = _qkv_full(num_heads=4, num_kv_heads=1)
    ranks = _ranks(2, QKVParallelLinear, HIDDEN, HEAD_DIM, 4, 1)
    parts = []
    for layer in ranks:
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_replicas) == (2, 1, 2)
        parts.append(_load_qkv(layer, full))
    assert torch.equal(torch.cat([p["q"] for p in parts]), full["q"])
    for s in "kv":
        assert torch.equal(parts[0][s], full[s]) and torch.equal(parts[1][s], full[s])


def test_qkv_parallel_tp4_with_two_kv_heads():
    full = _qkv_full(num_heads=4, num_kv_heads=2)
    ranks = _ranks(4, QKVParallelLinear, HIDDEN, HEAD_DIM, 4, 2)
    parts = []
    for layer in ranks:
        assert (layer.num_heads, layer.num_kv_heads, layer.num_kv_replicas) == (1, 1, 2)
        parts.append(_load_qkv(layer, full))
    assert torch.equal(torch.cat([p["q"] for p in parts]), full["q"])
    for s in "kv":
        # KV head 0 on ranks 0 and 1, KV head 1 on ranks 2 and 3.
        for r in range(4):
            head = r // 2
            assert torch.equal(parts[r][s], full[s][head * HEAD_DIM:(head + 1) * HEAD_DIM]), (s, r)
        assert torch.equal(torch.cat([parts[0][s], parts[2][s]]), full[s])


# ---------------------------------------------------------------------------------------------- row


def test_row_parallel_tp2_splits_columns_and_partial_sums_add_up():
    w, b, x = _randn(6, HIDDEN, seed=30), _randn(6, seed=31), _randn(4, HIDDEN, seed=32)
    ranks = _ranks(2, RowParallelLinear, HIDDEN, 6, bias=True)
    for r, layer in enumerate(ranks):
        assert layer.weight.shape == (6, HIDDEN // 2) and layer.bias.shape == (6,)
        _load(layer, "weight", w)
        _load(layer, "bias", b)
        assert torch.equal(layer.weight, w[:, r * 8:(r + 1) * 8])
        assert torch.equal(layer.bias, b)  # replicated: added once, after the reduction
    assert torch.equal(torch.cat([layer.weight for layer in ranks], dim=1), w)
    # The all-reduce, by hand: rank r multiplies its slice of x's columns without the bias.
    partials = [layer.quant_method.apply(layer, x[:, r * 8:(r + 1) * 8], None) for r, layer in enumerate(ranks)]
    torch.testing.assert_close(partials[0] + partials[1] + b, F.linear(x, w, b), rtol=1e-6, atol=1e-6)
    full = RowParallelLinear(HIDDEN, 6, bias=True)
    _load(full, "weight", w)
    _load(full, "bias", b)
    torch.testing.assert_close(partials[0] + partials[1] + b, full(x), rtol=1e-6, atol=1e-6)


def test_row_parallel_without_reduce_sums_to_the_full_output():
    w, b, x = _randn(6, HIDDEN, seed=33), _randn(6, seed=34), _randn(4, HIDDEN, seed=35)
    ranks = _ranks(2, RowParallelLinear, HIDDEN, 6, bias=True, reduce_results=False)
    for layer in ranks:
        _load(layer, "weight", w)
        _load(layer, "bias", b)
    outs = [layer(x[:, r * 8:(r + 1) * 8]) for r, layer in enumerate(ranks)]
    torch.testing.assert_close(outs[0] + outs[1], F.linear(x, w, b), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize("build, value", [
    (lambda: QKVParallelLinear(HIDDEN, HEAD_DIM, 6, 6), "6"),  # 6 query heads over 4 ranks
    (lambda: QKVParallelLinear(HIDDEN, HEAD_DIM, 8, 6), "6"),  # 6 KV heads over 4 ranks (tp < kv heads)
    (lambda: ColumnParallelLinear(HIDDEN, 6), "6"),
    (lambda: MergedColumnParallelLinear(HIDDEN, [6, 6]), "6"),
    (lambda: RowParallelLinear(6, HIDDEN), "6"),
], ids=["qkv-heads", "qkv-kv-heads", "column", "merged", "row"])
def test_indivisible_sizes_raise_naming_the_value(build, value):
    with tensor_parallel_state(0, 4), pytest.raises(ValueError) as info:
        build()
    msg = str(info.value)
    assert re.search(rf"\b{value} is not divisible by the tensor-parallel size 4\b", msg), msg


def test_kv_heads_not_dividing_tp_names_num_kv_heads():
    with tensor_parallel_state(0, 4), pytest.raises(ValueError) as info:
        QKVParallelLinear(HIDDEN, HEAD_DIM, 12, 3)
    msg = str(info.value)
    assert "num_kv_heads 3" in msg or "num_kv_heads (3)" in msg, msg
    assert "tensor-parallel size 3" not in msg, msg


@pytest.mark.parametrize("tp", [1, 2])
def test_wrong_shaped_checkpoint_tensor_names_both_shapes(tp):
    with tensor_parallel_state(0, tp):
        qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, 4, 2)
        merged = MergedColumnParallelLinear(HIDDEN, [8, 8])
        column = ColumnParallelLinear(HIDDEN, 8)
        row = RowParallelLinear(8, HIDDEN)
        replicated = ReplicatedLinear(HIDDEN, 8)
    cases = [
        (qkv, _randn(15, HIDDEN, seed=0), "q", (16, HIDDEN)),
        (qkv, _randn(8, HIDDEN + 1, seed=0), "k", (8, HIDDEN)),
        (merged, _randn(9, HIDDEN, seed=0), 1, (8, HIDDEN)),
        (column, _randn(8, HIDDEN - 1, seed=0), None, (8, HIDDEN)),
        (row, _randn(HIDDEN, 7, seed=0), None, (HIDDEN, 8)),
        (replicated, _randn(HIDDEN, 8, seed=0), None, (8, HIDDEN)),
    ]
    for layer, tensor, shard_id, want in cases:
        with pytest.raises(ValueError) as info:
            _load(layer, "weight", tensor, shard_id)
        msg = str(info.value)
        assert str(tuple(tensor.shape)) in msg and str(want) in msg, (type(layer).__name__, msg)


def test_load_weights_names_the_tensor_and_both_shapes():
    cfg = _tiny_config()
    model = _model(cfg, None)
    state = _hf_state_dict(cfg)
    state["model.layers.1.mlp.up_proj.weight"] = torch.zeros(cfg.intermediate_size + 2, cfg.hidden_size)
    with pytest.raises(ValueError) as info:
        loader.load_weights(model, iter(state.items()))
    msg = str(info.value)
    assert "'model.layers.1.mlp.up_proj.weight'" in msg, msg
    assert str((cfg.intermediate_size + 2, cfg.hidden_size)) in msg, msg
    assert str((cfg.intermediate_size, cfg.hidden_size)) in msg, msg


# ---------------------------------------------------------------------------------------------- vocab


@pytest.mark.parametrize("cls", [VocabParallelEmbedding, ParallelLMHead])
def test_vocab_parallel_tp2_holds_its_slice_with_zero_padding(cls):
    vocab = 7  # odd: 4 rows per rank, the last one padding on rank 1
    table = _randn(vocab, HIDDEN, seed=40)
    ranks = _ranks(2, cls, vocab, HIDDEN)
    for layer in ranks:
        assert layer.weight.shape == (4, HIDDEN)
        _load(layer, "weight", table)
    assert (ranks[0].vocab_start, ranks[0].vocab_end, ranks[1].vocab_start, ranks[1].vocab_end) == (0, 4, 4, 7)
    assert torch.equal(ranks[0].weight, table[:4])
    assert torch.equal(ranks[1].weight[:3], table[4:])
    assert torch.equal(ranks[1].weight[3], torch.zeros(HIDDEN))
    if cls is VocabParallelEmbedding:
        # Each id is found on exactly one rank; the others give zeros, so the (manual) sum is the lookup.
        # Outside the tensor_parallel_state block the all-reduce is the identity.
        ids = torch.tensor([0, 3, 4, 6, 2, 5])
        parts = [layer(ids) for layer in ranks]
        assert torch.equal(parts[0][2:4], torch.zeros(2, HIDDEN)) and torch.equal(parts[1][:2], torch.zeros(2, HIDDEN))
        assert torch.equal(parts[0] + parts[1], F.embedding(ids, table))
    else:
        h = _randn(2, HIDDEN, seed=41)
        logits = torch.cat([F.linear(h, layer.weight) for layer in ranks], -1)[:, :vocab]
        torch.testing.assert_close(logits, F.linear(h, table), rtol=0, atol=1e-6)


def test_vocab_parallel_rejects_a_wrong_shaped_table():
    with tensor_parallel_state(1, 2):
        emb = VocabParallelEmbedding(7, HIDDEN)
    with pytest.raises(ValueError) as info:
        _load(emb, "weight", torch.zeros(8, HIDDEN))
    assert str((8, HIDDEN)) in str(info.value) and str((7, HIDDEN)) in str(info.value)


def test_vocab_parallel_rank_past_the_vocabulary_is_all_padding():
    table = _randn(5, HIDDEN, seed=42)
    ranks = _ranks(4, VocabParallelEmbedding, 5, HIDDEN)
    for layer in ranks:
        _load(layer, "weight", table)
    assert torch.equal(ranks[3].weight, torch.zeros(2, HIDDEN))
    assert torch.equal(torch.cat([layer.weight for layer in ranks])[:5], table)


# ---------------------------------------------------------------------------------------------- LinearMethod seam


class TransposedLinearMethod(LinearMethod):
    """A stand-in weight format: ``weight`` stored [in, out] (input_dim 0, output_dim 1), filled by a loader
    that transposes each checkpoint tensor and hands it to the layer's own loader. ``apply`` refuses to run
    until ``process_weights_after_loading`` has."""

    def __init__(self, log: dict[str, list]):
        self.log = log

    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, params_dtype, weight_loader):
        weight = nn.Parameter(torch.full((input_size_per_partition, sum(output_partition_sizes)), float("nan"),
                                         dtype=params_dtype), requires_grad=False)

        def load_transposed(param, loaded, shard_id=None):
            self.log["loads"].append(layer.prefix)
            weight_loader(param, loaded.t(), shard_id)

        set_weight_attrs(weight, {"input_dim": 0, "output_dim": 1, "weight_loader": load_transposed})
        layer.register_parameter("weight", weight)

    def process_weights_after_loading(self, layer):
        self.log["processed"].append(layer.prefix)
        assert not layer.weight.isnan().any(), layer.prefix
        layer.weight_t_ready = True

    def apply(self, layer, x, bias=None):
        if not getattr(layer, "weight_t_ready", False):
            raise RuntimeError(f"{layer.prefix}: apply before process_weights_after_loading")
        self.log["applies"].append(layer.prefix)
        out = x @ layer.weight
        return out + bias if bias is not None else out


class FakeQuantConfig(QuantConfig):
    name = "fake-transposed"

    def __init__(self):
        self.log: dict[str, list] = {"layers": [], "loads": [], "processed": [], "applies": []}

    def get_linear_method(self, layer, prefix):
        self.log["layers"].append((prefix, type(layer).__name__))
        return TransposedLinearMethod(self.log)


def _tiny_config(**overrides) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
                          **overrides})


def _model(cfg: ModelConfig, quant_config):
    rotary = RotaryEmbedding.from_config(cfg)
    backend = get_attention_backend("torch")(cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, rotary)
    backend.allocate_kv_cache(cfg.num_hidden_layers, 4, 16, torch.float32, torch.device("cpu"))
    return build_model(cfg, backend, quant_config=quant_config).eval()


def _hf_state_dict(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(50)

    def rand(*shape):
        return torch.randn(*shape, generator=gen) * 0.2

    h, i, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.q_size, cfg.kv_size
    state = {"model.embed_tokens.weight": rand(cfg.vocab_size, h), "model.norm.weight": 1 + rand(h),
             "lm_head.weight": rand(cfg.vocab_size, h)}
    for n in range(cfg.num_hidden_layers):
        p = f"model.layers.{n}"
        state.update({
            f"{p}.self_attn.q_proj.weight": rand(q, h), f"{p}.self_attn.k_proj.weight": rand(kv, h),
            f"{p}.self_attn.v_proj.weight": rand(kv, h), f"{p}.self_attn.o_proj.weight": rand(h, q),
            f"{p}.mlp.gate_proj.weight": rand(i, h), f"{p}.mlp.up_proj.weight": rand(i, h),
            f"{p}.mlp.down_proj.weight": rand(h, i),
            f"{p}.input_layernorm.weight": 1 + rand(h), f"{p}.post_attention_layernorm.weight": 1 + rand(h),
        })
        if cfg.attention_bias:
            state.update({f"{p}.self_attn.{s}_proj.bias": rand(n_) for s, n_ in (("q", q), ("k", kv), ("v", kv))})
        if cfg.qk_norm:
            state.update({f"{p}.self_attn.q_norm.weight": 1 + rand(cfg.head_dim),
                          f"{p}.self_attn.k_norm.weight": 1 + rand(cfg.head_dim)})
    return state


def _prefill(model, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's prefill of ``num_tokens`` tokens into blocks 0.. of the cache: (hidden, logits)."""
    meta = AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.arange(-(-num_tokens // 16), dtype=torch.int32)[None, :],
        max_query_len=num_tokens, query_lens_cpu=[num_tokens], seq_lens_cpu=[num_tokens],
    )
    ids = torch.randint(0, model.config.vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(60))
    meta = model.model.layers[0].self_attn.attn.backend.build_metadata(meta)
    with torch.inference_mode():
        hidden = model(ids, torch.arange(num_tokens), meta)
        return hidden, model.compute_logits(hidden)


@pytest.mark.parametrize("overrides", [{}, dict(attention_bias=True, qk_norm=True, tie_word_embeddings=True)],
                         ids=["llama", "bias-qknorm-tied"])
def test_fake_linear_method_reaches_every_layer_and_matches_16_bit(overrides):
    cfg = _tiny_config(**overrides)
    fake = FakeQuantConfig()
    model = _model(cfg, fake)
    reference = _model(cfg, None)

    # Every linear layer got the fake method, under its Hugging Face prefix; nothing else asked for one.
    kinds = {"self_attn.qkv_proj": "QKVParallelLinear", "self_attn.o_proj": "RowParallelLinear",
             "mlp.gate_up_proj": "MergedColumnParallelLinear", "mlp.down_proj": "RowParallelLinear"}
    want = sorted((f"model.layers.{n}.{name}", cls) for n in range(cfg.num_hidden_layers) for name, cls in kinds.items())
    assert sorted(fake.log["layers"]) == want
    for n, layer in enumerate(model.model.layers):
        for name in kinds:
            module = layer.get_submodule(name)
            assert isinstance(module.quant_method, TransposedLinearMethod), (n, name)
            assert module.prefix == f"model.layers.{n}.{name}"
            assert module.weight.shape == (module.input_size_per_partition, sum(module.output_partition_sizes))
    for n, layer in enumerate(reference.model.layers):
        for name in kinds:
            assert type(layer.get_submodule(name).quant_method) is UnquantizedLinearMethod, (n, name)

    state = _hf_state_dict(cfg)
    loader.load_weights(model, iter(state.items()))
    loader.load_weights(reference, iter(state.items()))

    # The fake's loader saw every HF weight of a linear layer (q/k/v and gate/up separately: 7 per layer),
    # and process_weights_after_loading ran exactly once per linear layer.
    linear_prefixes = [p for p, _ in want]
    assert sorted(set(fake.log["loads"])) == linear_prefixes
    assert len(fake.log["loads"]) == 7 * cfg.num_hidden_layers
    assert sorted(fake.log["processed"]) == linear_prefixes
    # The stored (transposed) weight is the 16-bit model's, transposed.
    for ours, theirs in zip(model.model.layers, reference.model.layers, strict=True):
        for name in kinds:
            assert torch.equal(ours.get_submodule(name).weight, theirs.get_submodule(name).weight.t()), name
            bias = ours.get_submodule(name).bias
            if bias is not None:
                assert torch.equal(bias, theirs.get_submodule(name).bias)

    hidden, logits = _prefill(model, 10)
    want_hidden, want_logits = _prefill(reference, 10)
    assert sorted(set(fake.log["applies"])) == linear_prefixes
    assert want_hidden.abs().max() > 0.1  # not a degenerate comparison
    torch.testing.assert_close(hidden, want_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))
