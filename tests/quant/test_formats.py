"""Checkpoint formats: known-answer packings from the published layouts, exact round trips, the declarative
layout table, quantization_config build/parse, and (when installed) compressed-tensors' own compressors."""

import importlib.util

import pytest
import torch

from roofline.quant.formats import (
    AWQ_ORDER,
    CT_SCHEMES,
    TENSOR_LAYOUTS,
    QuantSpec,
    check_layout,
    expected_layout,
    make_quantization_config,
    pack_awq,
    pack_compressed_tensors,
    pack_gptq,
    parse_quantization_config,
    unpack_awq,
    unpack_compressed_tensors,
    unpack_gptq,
)
from roofline.quant.quantize import (
    Int4Weight,
    quantize_fp8_per_channel,
    quantize_int4_rtn,
    quantize_int8_per_channel,
)


def _int32(x: int) -> int:
    """The int32 whose bits are the unsigned 32-bit ``x``."""
    return x - 2**32 if x >= 2**31 else x


def _weight(q, zeros, group_size, g_idx=None):
    q = torch.as_tensor(q, dtype=torch.uint8)
    zeros = torch.as_tensor(zeros, dtype=torch.uint8)
    scales = torch.full(zeros.shape, 0.5)
    return Int4Weight(q, scales, zeros, group_size, g_idx)


def _random_int4(n, k, group_size, seed=0, g_idx=None, min_zero=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    zeros = torch.randint(min_zero, 16, (n, k // group_size), generator=g, dtype=torch.uint8)
    scales = torch.rand(n, k // group_size, generator=g) * 0.1 + 1e-3
    return Int4Weight(q, scales, zeros, group_size, g_idx)


# ------------------------------------------------------------------ known answers from the published layouts

def test_gptq_qweight_packs_k_low_nibble_first():
    # q[n, k] = k for k = 0..7, every row. GPTQ packs 8 consecutive k of one column n into one word,
    # k = 8r + j in bits 4j..4j+3: word = sum_j j << 4j = 0x76543210.
    w = _weight([list(range(8))] * 8, [[1]] * 8, group_size=8)
    t = pack_gptq(w)
    assert t["qweight"].shape == (1, 8) and t["qweight"].dtype == torch.int32
    assert t["qweight"].tolist() == [[0x76543210] * 8]
    # q[n, k] = 15 - k: nibbles F, E, ..., 8 from the low end = 0x89ABCDEF, negative as int32.
    t = pack_gptq(_weight([[15 - k for k in range(8)]] * 8, [[1]] * 8, group_size=8))
    assert t["qweight"].tolist() == [[_int32(0x89ABCDEF)] * 8] == [[-1985229329] * 8]


def test_gptq_qzeros_v1_stores_zero_minus_one():
    # zeros of outputs n = 0..7 are n + 1. qzeros packs along N; v1 stores zero - 1 = n in nibble n:
    # 0x76543210. v2 stores the zero as is: nibbles 1..8 = 0x87654321.
    w = _weight([[3] * 8] * 8, [[n + 1] for n in range(8)], group_size=8)
    assert pack_gptq(w)["qzeros"].tolist() == [[0x76543210]]
    assert pack_gptq(w, checkpoint_format="gptq_v2")["qzeros"].tolist() == [[_int32(0x87654321)]]
    # The symmetric grid (every zero 8) is 0x77777777 in v1, the word every sym=True GPTQ checkpoint has.
    sym = _weight([[3] * 8] * 8, [[8]] * 8, group_size=8)
    assert pack_gptq(sym, sym=True)["qzeros"].tolist() == [[0x77777777]]


def test_gptq_v1_refuses_zero_point_zero_and_reads_nibble_15_as_16():
    w = _weight([[3] * 8] * 8, [[0]] + [[5]] * 7, group_size=8)
    with pytest.raises(ValueError, match=r"layer: 1 zero point\(s\) are 0, which GPTQ v1 cannot store"):
        pack_gptq(w)
    # v2 stores it; the same words read as v1 get +1 everywhere, as vLLM's gptq_gemm does.
    t = pack_gptq(w, checkpoint_format="gptq_v2")
    assert t["qzeros"].tolist() == [[0x55555550]]
    v1 = unpack_gptq({**t, "qzeros": torch.tensor([[_int32(0x5555555F)]], dtype=torch.int32)}, 8)
    assert v1.zeros[:, 0].tolist() == [16, 6, 6, 6, 6, 6, 6, 6]
    with pytest.raises(ValueError, match="sym=True needs every zero to be 8"):
        pack_gptq(w, sym=True, checkpoint_format="gptq_v2")


def test_awq_packs_n_in_interleaved_order():
    # q[n, k] = n for n = 0..7. AWQ packs 8 outputs into one word, nibble i holding column AWQ_ORDER[i]:
    # nibbles (low to high) 0, 2, 4, 6, 1, 3, 5, 7 -> 0x75316420. Zeros pack the same way, with no -1.
    assert AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    w = _weight([[n] * 8 for n in range(8)], [[n] for n in range(8)], group_size=8)
    t = pack_awq(w)
    assert t["qweight"].shape == (8, 1)
    assert t["qweight"].flatten().tolist() == [0x75316420] * 8
    assert t["qzeros"].tolist() == [[0x75316420]]
    assert t["scales"].dtype == torch.float16 and t["scales"].shape == (1, 8)


def test_w8a16_packs_four_offset_bytes_per_word():
    # Row q = [-128, -1, 0, 127, 1]: stored bytes q + 128 = 0x00, 0x7F, 0x80, 0xFF | 0x81 (then padding 0):
    # word 0 = 0xFF807F00 (byte j in bits 8j), word 1 = 0x00000081. weight_shape keeps K = 5.
    w = quantize_int8_per_channel(torch.ones(1, 5))
    w.q = torch.tensor([[-128, -1, 0, 127, 1]], dtype=torch.int8)
    t = pack_compressed_tensors(w, "w8a16-int8")
    assert t["weight_packed"].tolist() == [[_int32(0xFF807F00), 0x81]]
    assert t["weight_shape"].tolist() == [1, 5] and t["weight_shape"].dtype == torch.int64
    assert torch.equal(unpack_compressed_tensors(t, "w8a16-int8").q, w.q)


# ------------------------------------------------------------------ round trips

@pytest.mark.parametrize("act_order", [False, True])
def test_gptq_round_trip(act_order):
    n, k, gs = 32, 128, 32
    g_idx = None
    if act_order:  # groups assigned in a shuffled (activation) order, as GPTQ desc_act writes them
        g_idx = (torch.randperm(k, generator=torch.Generator().manual_seed(3)) // gs).to(torch.int32)
    w = _random_int4(n, k, gs, seed=1, g_idx=g_idx, min_zero=1)
    t = pack_gptq(w)
    assert {name: tuple(x.shape) for name, x in t.items()} == {
        "qweight": (k // 8, n), "qzeros": (k // gs, n // 8), "scales": (k // gs, n), "g_idx": (k,)}
    back = unpack_gptq(t, gs)
    assert torch.equal(back.q, w.q) and torch.equal(back.zeros, w.zeros)
    assert (back.g_idx is None) == (not act_order)
    if act_order:
        assert torch.equal(back.g_idx, g_idx)
    # Scales pass through fp16: the packed weight is (q - z) * fp16(s), exactly.
    assert torch.equal(back.scales, w.scales.half().float())
    ref = Int4Weight(w.q, w.scales.half().float(), w.zeros, gs, g_idx).dequantize()
    assert torch.equal(back.dequantize(), ref)
    assert (back.dequantize() - w.dequantize()).abs().max() <= w.scales.max() * 16 * 2**-11


def test_gptq_v2_round_trip_keeps_zero_point_zero():
    w = _random_int4(16, 64, 16, seed=2, min_zero=0)
    assert bool((w.zeros == 0).any())
    back = unpack_gptq(pack_gptq(w, checkpoint_format="gptq_v2"), 16, checkpoint_format="gptq_v2")
    assert torch.equal(back.q, w.q) and torch.equal(back.zeros, w.zeros)


def test_gptq_per_channel_group_size_minus_one():
    w = _random_int4(8, 64, 64, seed=4, min_zero=1)
    back = unpack_gptq(pack_gptq(w), -1)
    assert back.group_size == 64 and torch.equal(back.q, w.q) and torch.equal(back.zeros, w.zeros)


def test_awq_round_trip_and_act_order_refused():
    w = quantize_int4_rtn(torch.randn(24, 96, generator=torch.Generator().manual_seed(5)), 32)
    back = unpack_awq(pack_awq(w), 32)
    assert torch.equal(back.q, w.q) and torch.equal(back.zeros, w.zeros) and back.g_idx is None
    assert torch.equal(back.scales, w.scales.half().float())
    shuffled = (torch.randperm(96, generator=torch.Generator().manual_seed(6)) // 32).to(torch.int32)
    with pytest.raises(ValueError, match="AWQ has no g_idx, so it cannot store act-order"):
        pack_awq(Int4Weight(w.q, w.scales, w.zeros, 32, shuffled))
    # An explicit g_idx equal to k // group_size is not act-order and packs.
    trivial = (torch.arange(96) // 32).to(torch.int32)
    assert torch.equal(pack_awq(Int4Weight(w.q, w.scales, w.zeros, 32, trivial))["qweight"],
                       pack_awq(w)["qweight"])


@pytest.mark.parametrize("scheme", CT_SCHEMES)
@pytest.mark.parametrize("k", [64, 38])
def test_compressed_tensors_round_trip(scheme, k):
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(7))
    w = quantize_fp8_per_channel(x) if scheme == "fp8-dynamic" else quantize_int8_per_channel(x)
    t = pack_compressed_tensors(w, scheme)
    assert t["weight_scale"].shape == (16, 1)
    back = unpack_compressed_tensors(t, scheme)
    assert back.q.dtype == w.q.dtype and torch.equal(back.q.view(torch.int8), w.q.view(torch.int8))
    assert torch.equal(back.scales, w.scales)
    # llm-compressor's usual bf16 scales: the weight survives, the scales round to bf16.
    bf = unpack_compressed_tensors(pack_compressed_tensors(w, scheme, scale_dtype=torch.bfloat16), scheme)
    assert torch.equal(bf.scales, w.scales.bfloat16().float())


def test_compressed_tensors_scheme_and_dtype_mismatch():
    w = quantize_int8_per_channel(torch.randn(4, 8))
    with pytest.raises(ValueError, match="scheme 'fp8-dynamic' stores torch.float8_e4m3fn weights, got torch.int8"):
        pack_compressed_tensors(w, "fp8-dynamic")
    with pytest.raises(ValueError, match=r"scheme: expected one of \('fp8-dynamic', 'int8-dynamic', 'w8a16-int8'\)"):
        pack_compressed_tensors(w, "w4a16")


# ------------------------------------------------------------------ the layout table and check_layout

def test_layout_table_packed_dims():
    def dims(fmt, suffix):
        t = next(t for t in TENSOR_LAYOUTS[fmt] if t.suffix == suffix)
        return t.output_dim, t.input_dim, t.packed_dim, t.pack_factor

    assert dims("gptq", "qweight") == (1, 0, 0, 8)  # [K/8, N]: K packed by 8
    assert dims("gptq", "qzeros") == (1, 0, 1, 8)   # [G, N/8]: N packed by 8
    assert dims("gptq", "scales") == (1, 0, None, 1)
    assert dims("gptq", "g_idx") == (None, 0, None, 1)
    assert dims("awq", "qweight") == (1, 0, 1, 8)   # [K, N/8]
    assert dims("awq", "qzeros") == (1, 0, 1, 8)
    assert dims("w8a16-int8", "weight_packed") == (0, 1, 1, 4)
    assert dims("fp8-dynamic", "weight_scale") == (0, None, None, 1)
    assert expected_layout("gptq", 4096, 11008, 128) == {
        "qweight": ((1376, 4096), torch.int32), "qzeros": ((86, 512), torch.int32),
        "scales": ((86, 4096), torch.float16), "g_idx": ((11008,), torch.int32)}
    assert expected_layout("awq", 4096, 4096, -1)["scales"] == ((1, 4096), torch.float16)
    assert expected_layout("w8a16-int8", 10, 38)["weight_packed"] == ((10, 10), torch.int32)


@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_fused_shards_placed_by_the_table(fmt):
    # q/k/v packed one by one and concatenated along each tensor's output dim (offsets / pack_factor on a
    # packed output dim) equal the packing of the fused weight: what the loader relies on.
    shards = [_random_int4(n, 64, 16, seed=10 + n, min_zero=1) for n in (32, 16, 16)]
    fused = Int4Weight(torch.cat([s.q for s in shards]), torch.cat([s.scales for s in shards]),
                       torch.cat([s.zeros for s in shards]), 16)
    pack = pack_gptq if fmt == "gptq" else pack_awq
    whole, parts = pack(fused), [pack(s) for s in shards]
    for layout in TENSOR_LAYOUTS[fmt]:
        if layout.output_dim is None:
            continue
        placed = torch.cat([p[layout.suffix] for p in parts], dim=layout.output_dim)
        assert torch.equal(placed, whole[layout.suffix]), layout.suffix


def test_check_layout_names_tensor_and_shapes():
    t = pack_gptq(_random_int4(16, 64, 16, min_zero=1))
    check_layout("model.layers.0.mlp.down_proj", t, expected_layout("gptq", 16, 64, 16))
    with pytest.raises(ValueError, match=r"^model\.layers\.0\.mlp\.down_proj\.qweight: expected shape \(8, 32\), "
                                         r"got \(8, 16\)$"):
        check_layout("model.layers.0.mlp.down_proj", t, expected_layout("gptq", 32, 64, 16))
    with pytest.raises(ValueError, match=r"^layer\.g_idx: missing"):
        check_layout("layer", {k: v for k, v in t.items() if k != "g_idx"}, expected_layout("gptq", 16, 64, 16))
    with pytest.raises(ValueError, match=r"^layer\.qweight: expected dtype torch\.int32, got torch\.int64$"):
        check_layout("layer", {**t, "qweight": t["qweight"].long()}, expected_layout("gptq", 16, 64, 16))
    # A bf16 scale is accepted where fp16 is declared (GPTQModel writes the model dtype).
    check_layout("layer", {**t, "scales": t["scales"].bfloat16()}, expected_layout("gptq", 16, 64, 16))
    with pytest.raises(ValueError, match=r"^layer\.scales: expected shape \(4, 16\), got \(16, 4\)$"):
        unpack_gptq({**t, "scales": t["scales"].t()}, 16)


# ------------------------------------------------------------------ quantization_config

def test_gptq_config_build_and_parse():
    cfg = make_quantization_config("gptq", group_size=128, desc_act=True, sym=True)
    assert cfg == {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True,
                   "damp_percent": 0.01, "true_sequential": True, "static_groups": False,
                   "checkpoint_format": "gptq", "lm_head": False}
    assert parse_quantization_config(cfg) == QuantSpec("gptq", 4, "int", 128, True, True, "gptq",
                                                       ignore=("lm_head",))
    v2 = parse_quantization_config(make_quantization_config("gptq", group_size=-1, desc_act=True,
                                                            checkpoint_format="gptq_v2"))
    assert (v2.checkpoint_format, v2.group_size, v2.desc_act, v2.sym) == ("gptq_v2", -1, False, False)


def test_parse_published_gptq_and_awq_configs():
    # A TheBloke-era AutoGPTQ config.json (no checkpoint_format: v1) and GPTQModel's "format" key.
    thebloke = {"bits": 4, "group_size": 128, "damp_percent": 0.1, "desc_act": True, "sym": True,
                "true_sequential": True, "model_name_or_path": None, "model_file_base_name": "model",
                "quant_method": "gptq"}
    assert parse_quantization_config(thebloke) == QuantSpec("gptq", 4, "int", 128, True, True, "gptq",
                                                            ignore=("lm_head",))
    gptqmodel = {"bits": 4, "group_size": 32, "desc_act": False, "sym": False, "lm_head": False,
                 "quant_method": "gptq", "format": "gptq_v2", "checkpoint_format": "gptq_v2"}
    assert parse_quantization_config(gptqmodel).checkpoint_format == "gptq_v2"
    # AutoAWQ's own quant_config.json spelling (w_bit, q_group_size) and its config.json spelling.
    autoawq = {"quant_method": "awq", "zero_point": True, "q_group_size": 64, "w_bit": 4, "version": "GEMM"}
    assert parse_quantization_config(autoawq) == QuantSpec("awq", 4, "int", 64, False, False, "gemm",
                                                           ignore=("lm_head",))


def test_awq_config_build_and_parse():
    cfg = make_quantization_config("awq", group_size=128, ignore=["lm_head", "visual"])
    assert cfg == {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
                   "modules_to_not_convert": ["visual"]}
    assert parse_quantization_config(cfg) == QuantSpec("awq", 4, "int", 128, False, False, "gemm",
                                                       ignore=("lm_head", "visual"))
    assert make_quantization_config("awq")["modules_to_not_convert"] is None


@pytest.mark.parametrize("scheme,fmt,act,wtype", [("fp8-dynamic", "float-quantized", "fp8", "float"),
                                                  ("int8-dynamic", "int-quantized", "int8", "int"),
                                                  ("w8a16-int8", "pack-quantized", None, "int")])
def test_compressed_tensors_config_build_and_parse(scheme, fmt, act, wtype):
    cfg = make_quantization_config("compressed-tensors", scheme=scheme, ignore=["lm_head"])
    assert cfg["quant_method"] == "compressed-tensors" and cfg["format"] == fmt
    assert cfg["quantization_status"] == "compressed" and cfg["ignore"] == ["lm_head"]
    group = cfg["config_groups"]["group_0"]
    assert group["targets"] == ["Linear"] and group["format"] == fmt
    assert group["weights"] == {"num_bits": 8, "type": wtype, "symmetric": True, "group_size": None,
                                "strategy": "channel", "dynamic": False}
    if act is None:
        assert group["input_activations"] is None
    else:
        assert group["input_activations"] == {"num_bits": 8, "type": wtype, "symmetric": True,
                                              "group_size": None, "strategy": "token", "dynamic": True}
    assert parse_quantization_config(cfg) == QuantSpec(
        "compressed-tensors", 8, wtype, -1, False, True, fmt, scheme=scheme, activation=act,
        ignore=("lm_head",), targets=("Linear",))


def _ct(scheme="int8-dynamic"):
    return make_quantization_config("compressed-tensors", scheme=scheme)


@pytest.mark.parametrize("cfg,message", [
    ({"quant_method": "gptq", "bits": 4, "group_size": "abc", "desc_act": False},
     "quantization_config.group_size: expected a positive int or -1, got 'abc'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 0, "desc_act": False},
     "quantization_config.group_size: expected a positive int or -1, got 0"),
    ({"quant_method": "gptq", "group_size": 128, "desc_act": False}, "quantization_config.bits: missing"),
    ({"quant_method": "gptq", "bits": 8, "group_size": 128, "desc_act": False},
     "quantization_config.bits: roofline reads 4-bit GPTQ only, got 8"),
    ({"quant_method": "gptq", "bits": "4", "group_size": 128, "desc_act": False},
     "quantization_config.bits: expected an int, got '4'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": "yes"},
     "quantization_config.desc_act: expected true or false, got 'yes'"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "quantization_config.desc_act: missing"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "checkpoint_format": "marlin"},
     "quantization_config.checkpoint_format: roofline reads ['gptq', 'gptq_v2'], got 'marlin'"),
    ({"quant_method": "bitsandbytes"},
     "quantization_config.quant_method: roofline reads ['gptq', 'awq', 'compressed-tensors'], got 'bitsandbytes'"),
    ({"bits": 4}, "quantization_config.quant_method: missing"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemv"},
     "quantization_config.version: roofline reads AWQ 'gemm' checkpoints only, got 'gemv'"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False},
     "quantization_config.zero_point: roofline reads AWQ with zero points (true) only, got false"),
    ({"quant_method": "awq", "bits": 4, "group_size": 128}, "quantization_config.zero_point: missing"),
    ({**_ct(), "config_groups": {}}, "quantization_config.config_groups: expected a non-empty object, got {}"),
    ({**_ct(), "quantization_status": "frozen"},
     "quantization_config.quantization_status: roofline reads 'compressed' checkpoints, got 'frozen'"),
    ({**_ct(), "ignore": "lm_head"}, "quantization_config.ignore: expected a list of strings, got 'lm_head'"),
])
def test_malformed_config_names_the_field(cfg, message):
    with pytest.raises(ValueError) as err:
        parse_quantization_config(cfg)
    assert str(err.value) == message


def test_malformed_compressed_tensors_groups_name_the_path():
    cfg = _ct()
    cfg["config_groups"]["group_0"]["weights"]["num_bits"] = 4
    with pytest.raises(ValueError, match=r"^quantization_config\.config_groups\.group_0\.weights: roofline reads "
                                         r"8-bit per-channel weights .* got num_bits=4, strategy='channel'$"):
        parse_quantization_config(cfg)
    cfg = _ct("w8a16-int8")
    cfg["format"] = cfg["config_groups"]["group_0"]["format"] = "int-quantized"
    with pytest.raises(ValueError, match=r"group_0\.format: a weight-only INT8 scheme must be 'pack-quantized'"):
        parse_quantization_config(cfg)
    cfg = _ct()
    del cfg["config_groups"]["group_0"]["weights"]
    with pytest.raises(ValueError, match=r"^quantization_config\.config_groups\.group_0\.weights: missing$"):
        parse_quantization_config(cfg)
    cfg = _ct()
    cfg["config_groups"]["group_1"] = _ct("fp8-dynamic")["config_groups"]["group_0"]
    with pytest.raises(ValueError, match=r"roofline reads one scheme per model, got \['fp8-dynamic', 'int8-dynamic'\]"):
        parse_quantization_config(cfg)


def test_make_config_errors():
    with pytest.raises(ValueError, match=r"quant_method: expected one of \('gptq', 'awq', 'compressed-tensors'\)"):
        make_quantization_config("hqq")
    with pytest.raises(ValueError, match="group_size: expected a positive int or -1, got 0"):
        make_quantization_config("gptq", group_size=0)
    with pytest.raises(ValueError, match="ignore: GPTQ configs can only leave lm_head unquantized"):
        make_quantization_config("gptq", ignore=["lm_head", "model.layers.0.mlp.down_proj"])
    with pytest.raises(ValueError, match="AWQ never quantizes lm_head"):
        make_quantization_config("awq", ignore=[])
    with pytest.raises(ValueError, match="scheme: expected one of"):
        make_quantization_config("compressed-tensors")


# ------------------------------------------------------------------ the real compressed-tensors package

_HAS_CT = importlib.util.find_spec("compressed_tensors") is not None


@pytest.mark.skipif(not _HAS_CT, reason="compressed-tensors not installed (pip install --no-deps compressed-tensors loguru)")
@pytest.mark.parametrize("scheme", CT_SCHEMES)
def test_compressed_tensors_package_reads_and_writes_our_layout(scheme):
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme

    cfg = make_quantization_config("compressed-tensors", scheme=scheme)
    qcfg = QuantizationConfig.model_validate(cfg)
    assert qcfg.format == cfg["format"] and qcfg.quantization_status == "compressed"
    group = QuantizationScheme.model_validate(cfg["config_groups"]["group_0"])
    compressor = BaseCompressor.get_value_from_registry(cfg["format"])
    x = torch.randn(16, 38, generator=torch.Generator().manual_seed(8))
    w = quantize_fp8_per_channel(x) if scheme == "fp8-dynamic" else quantize_int8_per_channel(x)
    ours = pack_compressed_tensors(w, scheme)
    # Their decompressor reads what we write...
    assert torch.equal(compressor.decompress(dict(ours), group)["weight"].float(), w.dequantize())
    # ...and their compressor, given the same weight and scale, writes the same tensors bit for bit.
    theirs = compressor.compress({"weight": w.dequantize(), "weight_scale": w.scales[:, None].clone()}, group)
    assert sorted(theirs) == sorted(ours)
    for name, tensor in ours.items():
        assert theirs[name].dtype == tensor.dtype
        assert torch.equal(theirs[name].view(torch.int8) if tensor.dtype == torch.float8_e4m3fn else theirs[name],
                           tensor.view(torch.int8) if tensor.dtype == torch.float8_e4m3fn else tensor), name
    # And their serializer dumps our config groups unchanged (the keys llm-compressor writes).
    dumped = qcfg.model_dump()["config_groups"]["group_0"]
    assert dumped == cfg["config_groups"]["group_0"]
