"""A checkpoint's ``quantization_config`` (config.json): ``make_quantization_config`` writes it as the reference
tool does (AutoGPTQ / GPTQModel, AutoAWQ, llm-compressor), ``parse_quantization_config`` reads it into a
``QuantSpec`` (layouts and field sources: ``gptq_awq`` and ``compressed_tensors``)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from roofline.quant.formats.compressed_tensors import (
    COMPRESSED_TENSORS_VERSION,
    CT_FORMAT_OF_SCHEME,
    CT_SCHEMES,
)
from roofline.quant.formats.gptq_awq import GPTQ_CHECKPOINT_FORMATS

SUPPORTED_METHODS = ("gptq", "awq", "compressed-tensors")


@dataclass(frozen=True)
class QuantSpec:
    """What a checkpoint's ``quantization_config`` says, in our terms.

    Attributes:
        format: "gptq" | "awq" | "compressed-tensors".
        weight_bits: 4 (GPTQ, AWQ) or 8 (compressed-tensors).
        weight_type: "int" | "float".
        group_size: input channels per group; -1 = one scale per output channel.
        desc_act: GPTQ act-order (the checkpoint carries g_idx).
        sym: symmetric weights (GPTQ zeros all 8 / no zero points).
        checkpoint_format: "gptq" | "gptq_v2" (GPTQ), "gemm" (AWQ), or the compressed-tensors format
            ("float-quantized", "int-quantized", "pack-quantized").
        scheme: the compressed-tensors scheme ("fp8-dynamic", "int8-dynamic", "w8a16-int8"), else None.
        activation: None (weight-only) or "int8" / "fp8": dynamic, per token.
        ignore: modules left in 16 bits (compressed-tensors ``ignore``, AWQ ``modules_to_not_convert``;
            "lm_head" where the format leaves it unquantized).
        targets: the modules quantized (compressed-tensors ``targets``; ("Linear",) for GPTQ/AWQ).
    """

    format: str
    weight_bits: int
    weight_type: str
    group_size: int
    desc_act: bool
    sym: bool
    checkpoint_format: str
    scheme: str | None = None
    activation: str | None = None
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = ("Linear",)


def _weights_args(scheme: str) -> dict:
    # QuantizationArgs as compressed-tensors 0.20 serializes llm-compressor's FP8_DYNAMIC / W8A8 presets
    # (quant_scheme.py; quant_args.py ``_serialize`` drops unset observer, actorder, scale_dtype, zp_dtype).
    return {"num_bits": 8, "type": "float" if scheme == "fp8-dynamic" else "int", "symmetric": True,
            "group_size": None, "strategy": "channel", "dynamic": False}


def _input_args(scheme: str) -> dict | None:
    if scheme == "w8a16-int8":
        return None
    return {"num_bits": 8, "type": "float" if scheme == "fp8-dynamic" else "int", "symmetric": True,
            "group_size": None, "strategy": "token", "dynamic": True}


def make_quantization_config(method: str, *, group_size: int = 128, desc_act: bool = False,
                             sym: bool = False, checkpoint_format: str = "gptq", damp_percent: float = 0.01,
                             true_sequential: bool = True, scheme: str | None = None,
                             ignore: list[str] | None = None) -> dict:
    """The ``quantization_config`` dict for config.json, as the reference tool writes it.

    Args:
        method: "gptq" (AutoGPTQ/GPTQModel keys), "awq" (AutoAWQ ``to_transformers_dict``) or
            "compressed-tensors" (llm-compressor / ``ModelCompressor.update_config``).
        group_size, desc_act, sym, checkpoint_format, damp_percent, true_sequential: GPTQ fields
            (group_size also AWQ's; AWQ is always asymmetric, ``zero_point: true``).
        scheme: compressed-tensors scheme, one of ``CT_SCHEMES``.
        ignore: modules left unquantized; default ["lm_head"]. GPTQ has no ignore list (only its
            ``lm_head`` flag), so there it may only be [] or ["lm_head"]; AWQ never quantizes lm_head.

    Raises:
        ValueError: unsupported method (lists the supported ones), unknown scheme / checkpoint_format, a bad
            group size, or an ignore list the format cannot express.
    """
    ignore = ["lm_head"] if ignore is None else list(ignore)
    if method not in SUPPORTED_METHODS:
        raise ValueError(f"quant_method: expected one of {SUPPORTED_METHODS}, got {method!r}")
    if method in ("gptq", "awq") and not (group_size == -1 or group_size > 0):
        raise ValueError(f"group_size: expected a positive int or -1, got {group_size!r}")
    if method == "gptq":
        if checkpoint_format not in GPTQ_CHECKPOINT_FORMATS:
            raise ValueError(f"checkpoint_format: expected one of {GPTQ_CHECKPOINT_FORMATS}, "
                             f"got {checkpoint_format!r}")
        if set(ignore) - {"lm_head"}:
            raise ValueError(f"ignore: GPTQ configs can only leave lm_head unquantized, got {ignore}")
        return {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": desc_act, "sym": sym,
                "damp_percent": damp_percent, "true_sequential": true_sequential, "static_groups": False,
                "checkpoint_format": checkpoint_format, "lm_head": "lm_head" not in ignore}
    if method == "awq":
        if "lm_head" not in ignore:
            raise ValueError("ignore: AWQ never quantizes lm_head; keep 'lm_head' in the ignore list")
        rest = [m for m in ignore if m != "lm_head"]
        return {"quant_method": "awq", "bits": 4, "group_size": group_size, "zero_point": True,
                "version": "gemm", "modules_to_not_convert": rest or None}
    if scheme not in CT_SCHEMES:
        raise ValueError(f"scheme: expected one of {CT_SCHEMES}, got {scheme!r}")
    fmt = CT_FORMAT_OF_SCHEME[scheme]
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "version": COMPRESSED_TENSORS_VERSION,
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": _weights_args(scheme),
                                          "input_activations": _input_args(scheme),
                                          "output_activations": None, "format": fmt}},
            "ignore": ignore, "kv_cache_scheme": None, "global_compression_ratio": None,
            "sparsity_config": {}, "transform_config": {}}


_MISSING = object()


def _get(cfg: Mapping, keys: tuple[str, ...], path: str, default=_MISSING):
    for key in keys:
        if key in cfg and cfg[key] is not None:
            return cfg[key]
    if default is _MISSING:
        raise ValueError(f"{path}{keys[0]}: missing")
    return default


def _bool(cfg: Mapping, keys: tuple[str, ...], path: str, default=_MISSING) -> bool:
    v = _get(cfg, keys, path, default)
    if not isinstance(v, bool):
        raise ValueError(f"{path}{keys[0]}: expected true or false, got {v!r}")
    return v


def _int(cfg: Mapping, keys: tuple[str, ...], path: str) -> int:
    v = _get(cfg, keys, path)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{path}{keys[0]}: expected an int, got {v!r}")
    return v


def _group_size(cfg: Mapping, keys: tuple[str, ...], path: str) -> int:
    v = _get(cfg, keys, path)
    if isinstance(v, bool) or not isinstance(v, int) or not (v == -1 or v > 0):
        raise ValueError(f"{path}{keys[0]}: expected a positive int or -1, got {v!r}")
    return v


def _str_list(v, field: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"{field}: expected a list of strings, got {v!r}")
    return tuple(v)


def parse_quantization_config(cfg: Mapping) -> QuantSpec:
    """Parse a checkpoint's ``quantization_config`` (from config.json) into a ``QuantSpec``.

    Reads GPTQ (4-bit; v1 "gptq" or "gptq_v2"), AWQ GEMM (4-bit, with zero points; ``bits``/``w_bit`` and
    ``group_size``/``q_group_size`` both accepted) and compressed-tensors with one scheme: FP8 W8A8 dynamic,
    INT8 W8A8 dynamic per token, INT8 W8A16 per channel (pack-quantized).

    Defaults where the reference tools have one: GPTQ ``sym`` true and ``checkpoint_format`` "gptq"
    (AutoGPTQ ``BaseQuantizeConfig``), ``lm_head`` false; AWQ ``version`` "gemm". GPTQ ``desc_act`` with
    ``group_size`` -1 reads as False (one group per row, as vLLM's gptq_marlin treats it).

    Raises:
        ValueError: a missing or malformed field, named by its path (``quantization_config.group_size:
            expected a positive int or -1, got 'abc'``); an unsupported quant_method (lists the supported
            ones); bits, versions, formats or schemes roofline does not read.
    """
    p = "quantization_config."
    if not isinstance(cfg, Mapping):
        raise ValueError(f"quantization_config: expected a JSON object, got {type(cfg).__name__}")
    method = _get(cfg, ("quant_method",), p)
    if not isinstance(method, str) or method.lower() not in SUPPORTED_METHODS:
        raise ValueError(f"{p}quant_method: roofline reads {list(SUPPORTED_METHODS)}, got {method!r}")
    method = method.lower()
    if method == "gptq":
        bits = _int(cfg, ("bits",), p)
        if bits != 4:
            raise ValueError(f"{p}bits: roofline reads 4-bit GPTQ only, got {bits}")
        gs = _group_size(cfg, ("group_size",), p)
        fmt = _get(cfg, ("checkpoint_format", "format"), p, "gptq")
        if fmt not in GPTQ_CHECKPOINT_FORMATS:
            raise ValueError(f"{p}checkpoint_format: roofline reads {list(GPTQ_CHECKPOINT_FORMATS)}, got {fmt!r}")
        desc_act = _bool(cfg, ("desc_act",), p)
        lm_head = _bool(cfg, ("lm_head",), p, False)
        return QuantSpec("gptq", 4, "int", gs, desc_act and gs != -1, _bool(cfg, ("sym",), p, True), fmt,
                         ignore=() if lm_head else ("lm_head",))
    if method == "awq":
        bits = _int(cfg, ("bits", "w_bit"), p)
        if bits != 4:
            raise ValueError(f"{p}bits: roofline reads 4-bit AWQ only, got {bits}")
        gs = _group_size(cfg, ("group_size", "q_group_size"), p)
        if not _bool(cfg, ("zero_point",), p):
            raise ValueError(f"{p}zero_point: roofline reads AWQ with zero points (true) only, got false")
        version = _get(cfg, ("version",), p, "gemm")
        if not isinstance(version, str) or version.lower() != "gemm":
            raise ValueError(f"{p}version: roofline reads AWQ 'gemm' checkpoints only, got {version!r}")
        skip = _str_list(cfg.get("modules_to_not_convert"), f"{p}modules_to_not_convert")
        return QuantSpec("awq", 4, "int", gs, False, False, "gemm", ignore=("lm_head", *skip))
    return _parse_compressed_tensors(cfg, p)


def _scheme_of(weights: Mapping, acts: Mapping | None, fmt: str, path: str) -> str:
    if not isinstance(weights, Mapping):
        raise ValueError(f"{path}weights: expected an object, got {weights!r}")
    wtype = _get(weights, ("type",), f"{path}weights.", "int")
    bits = _int(weights, ("num_bits",), f"{path}weights.")
    gs = weights.get("group_size")
    strategy = weights.get("strategy") or ("channel" if gs == -1 else "group" if gs else "tensor")
    if wtype not in ("int", "float"):
        raise ValueError(f"{path}weights.type: expected 'int' or 'float', got {wtype!r}")
    if bits != 8 or strategy != "channel":
        raise ValueError(f"{path}weights: roofline reads 8-bit per-channel weights ({list(CT_SCHEMES)}), "
                         f"got num_bits={bits}, strategy={strategy!r}")
    if not _bool(weights, ("symmetric",), f"{path}weights.", True):
        raise ValueError(f"{path}weights.symmetric: roofline reads symmetric 8-bit weights, got false")
    if acts is None:
        if wtype != "int" or fmt != "pack-quantized":
            raise ValueError(f"{path}format: a weight-only INT8 scheme must be 'pack-quantized' "
                             f"(the form vLLM loads), got {fmt!r} with type {wtype!r}")
        return "w8a16-int8"
    if not isinstance(acts, Mapping):
        raise ValueError(f"{path}input_activations: expected an object or null, got {acts!r}")
    atype = _get(acts, ("type",), f"{path}input_activations.", "int")
    if (_int(acts, ("num_bits",), f"{path}input_activations.") != 8 or atype != wtype
            or acts.get("strategy") != "token" or acts.get("dynamic") is not True):
        raise ValueError(f"{path}input_activations: roofline reads dynamic per-token 8-bit activations of "
                         f"the weights' type, got {dict(acts)}")
    scheme = "fp8-dynamic" if wtype == "float" else "int8-dynamic"
    if fmt != CT_FORMAT_OF_SCHEME[scheme]:
        raise ValueError(f"{path}format: scheme {scheme} is stored as {CT_FORMAT_OF_SCHEME[scheme]!r}, got {fmt!r}")
    return scheme


def _parse_compressed_tensors(cfg: Mapping, p: str) -> QuantSpec:
    fmt = _get(cfg, ("format",), p)
    status = cfg.get("quantization_status", "compressed")
    if status != "compressed":
        raise ValueError(f"{p}quantization_status: roofline reads 'compressed' checkpoints, got {status!r}")
    groups = _get(cfg, ("config_groups",), p)
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{p}config_groups: expected a non-empty object, got {groups!r}")
    schemes, targets = set(), []
    for gname, group in groups.items():
        path = f"{p}config_groups.{gname}."
        if not isinstance(group, Mapping):
            raise ValueError(f"{path[:-1]}: expected an object, got {group!r}")
        targets += _str_list(_get(group, ("targets",), path), f"{path}targets")
        schemes.add(_scheme_of(_get(group, ("weights",), path), group.get("input_activations"),
                               group.get("format") or fmt, path))
    if len(schemes) > 1:
        raise ValueError(f"{p}config_groups: roofline reads one scheme per model, got {sorted(schemes)}")
    scheme = schemes.pop()
    return QuantSpec("compressed-tensors", 8, "float" if scheme == "fp8-dynamic" else "int", -1, False, True,
                     CT_FORMAT_OF_SCHEME[scheme], scheme=scheme,
                     activation={"fp8-dynamic": "fp8", "int8-dynamic": "int8"}.get(scheme),
                     ignore=_str_list(cfg.get("ignore"), f"{p}ignore"), targets=tuple(targets))
