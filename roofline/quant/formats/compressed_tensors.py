"""compressed-tensors (llm-compressor) 8-bit per-channel checkpoints: pack and unpack between ``ChannelWeight``
(``roofline.quant.quantize``) and the tensors of the fp8-dynamic, int8-dynamic and w8a16-int8 schemes.

compressed-tensors (checked in vllm-project/compressed-tensors ``compressors/naive_quantized/base.py``,
``compressors/pack_quantized/{base,helpers}.py``, ``quantization/quant_scheme.py`` (presets FP8_DYNAMIC,
INT8_W8A8), ``quantization/quant_args.py``, ``quantization/lifecycle/initialize.py``,
``compressors/model_compressors/model_compressor.py`` ``update_config``; vLLM
``compressed_tensors/compressed_tensors.py`` ``_get_scheme_from_parts`` and
``schemes/compressed_tensors_wNa16.py``):

- "fp8-dynamic" (format "float-quantized"): ``weight`` float8_e4m3fn ``[N, K]``, ``weight_scale`` ``[N, 1]``;
  activations dynamic per token, so no ``input_scale``.
- "int8-dynamic" (format "int-quantized"): ``weight`` int8 ``[N, K]``, ``weight_scale`` ``[N, 1]``.
- "w8a16-int8" (format "pack-quantized"): vLLM loads INT8 weight-only only from pack-quantized
  (``_is_wNa16_group_channel`` -> ``CompressedTensorsWNA16``, bits 4 or 8); an int-quantized weight-only
  config has no vLLM scheme. ``weight_packed`` int32 ``[N, ceil(K/4)]``: byte j of word c is
  ``q[n, 4c + j] + 128`` (offset binary, uint8b128); ``weight_shape`` int64 ``[2]`` = (N, K);
  ``weight_scale`` ``[N, 1]``. Symmetric, so no ``weight_zero_point``.
- llm-compressor writes scales in the model dtype (bf16/fp16/fp32); vLLM copies them into its own
  parameters, any float dtype loads. We write float32 unless told otherwise, so our scales survive exactly.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch

from roofline.quant.formats.layout import check_layout, expected_layout
from roofline.quant.quantize import ChannelWeight

CT_SCHEMES = ("fp8-dynamic", "int8-dynamic", "w8a16-int8")
CT_FORMAT_OF_SCHEME = {"fp8-dynamic": "float-quantized", "int8-dynamic": "int-quantized",
                       "w8a16-int8": "pack-quantized"}
COMPRESSED_TENSORS_VERSION = "0.20.1"  # the release whose compressors our tests decompress with


def _check_scheme(scheme: str) -> None:
    if scheme not in CT_SCHEMES:
        raise ValueError(f"scheme: expected one of {CT_SCHEMES}, got {scheme!r}")


def pack_compressed_tensors(w: ChannelWeight, scheme: str, *, scale_dtype: torch.dtype = torch.float32,
                            name: str = "layer") -> dict[str, torch.Tensor]:
    """Write a per-channel INT8/FP8 weight ``[N, K]`` as llm-compressor does for ``scheme``.

    Args:
        scheme: "fp8-dynamic" (float8_e4m3fn weight), "int8-dynamic" (int8 weight, SmoothQuant output) or
            "w8a16-int8" (int8 weight, pack-quantized).
        scale_dtype: dtype of ``weight_scale`` ``[N, 1]``; llm-compressor writes the model dtype, float32
            (the default) keeps our scales exact.

    Returns:
        fp8/int8-dynamic: ``weight`` ``[N, K]`` and ``weight_scale``; w8a16-int8: ``weight_packed`` int32
        ``[N, ceil(K/4)]`` (byte j of word c = ``q[n, 4c+j] + 128``; a K not divisible by 4 is padded
        with q = -128 as compressed-tensors does), ``weight_shape`` int64 ``[2]``, ``weight_scale``.

    Raises:
        ValueError: unknown scheme, or a weight dtype that does not match it.
    """
    _check_scheme(scheme)
    want = torch.float8_e4m3fn if scheme == "fp8-dynamic" else torch.int8
    if w.q.dtype != want:
        raise ValueError(f"{name}: scheme {scheme!r} stores {want} weights, got {w.q.dtype}")
    n, k = w.shape
    scale = w.scales.reshape(n, 1).to(scale_dtype).contiguous()
    if scheme != "w8a16-int8":
        return {"weight": w.q.contiguous(), "weight_scale": scale}
    u = w.q.to(torch.int64) + 128                                                  # [N, K] in [0, 255]
    words = math.ceil(k / 4)
    u = torch.nn.functional.pad(u, (0, 4 * words - k)).reshape(n, words, 4)
    packed = (u << (torch.arange(4, device=u.device) * 8)).sum(dim=-1)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return {"weight_packed": packed.contiguous(), "weight_shape": torch.tensor([n, k], dtype=torch.int64),
            "weight_scale": scale}


def unpack_compressed_tensors(tensors: Mapping[str, torch.Tensor], scheme: str, *,
                              name: str = "layer") -> ChannelWeight:
    """Read a compressed-tensors linear written with ``scheme`` into a ``ChannelWeight`` (float32 scales).

    Raises:
        ValueError: unknown scheme; a tensor missing or of the wrong shape or dtype (names it and both
            shapes); a ``weight_scale`` that is not per output channel.
    """
    _check_scheme(scheme)
    if scheme == "w8a16-int8":
        if "weight_shape" not in tensors or "weight_packed" not in tensors:
            raise ValueError(f"{name}.weight_shape and weight_packed: expected both, found {sorted(tensors)}")
        # K from weight_shape; N from the packed rows: a fused layer (q/k/v, gate/up) stacks its shards'
        # rows, while each shard's weight_shape names that shard's own N.
        n, k = tensors["weight_packed"].shape[0], int(tensors["weight_shape"][1])
    else:
        if "weight" not in tensors:
            raise ValueError(f"{name}.weight: missing (found {sorted(tensors)})")
        n, k = tensors["weight"].shape
    check_layout(name, tensors, expected_layout(scheme, n, k))
    scales = tensors["weight_scale"].float().reshape(n).contiguous()
    if scheme != "w8a16-int8":
        return ChannelWeight(tensors["weight"].contiguous(), scales)
    words = tensors["weight_packed"].to(torch.int64) & 0xFFFFFFFF
    u = (words[..., None] >> (torch.arange(4, device=words.device) * 8)) & 0xFF    # [N, K/4, 4]
    q = (u.reshape(n, -1)[:, :k] - 128).to(torch.int8)
    return ChannelWeight(q.contiguous(), scales)
