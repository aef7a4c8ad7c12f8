"""Published checkpoint formats: pack and unpack between the canonical forms of ``quantize.py`` and the exact
tensors AutoAWQ, GPTQ (AutoGPTQ / GPTQModel, v1 and v2) and compressed-tensors (llm-compressor) write, and
build / parse their ``quantization_config``, so that what we write loads in vLLM and theirs loads here.

- ``layout``: the declarative tensor layout table and its checks, nibble packing;
- ``gptq_awq``: GPTQ (v1, v2) and AutoAWQ GEMM INT4 tensors;
- ``compressed_tensors``: FP8 / INT8 W8A8 and INT8 W8A16 per-channel tensors;
- ``spec``: ``quantization_config`` to and from ``QuantSpec``.
"""

from roofline.quant.formats.compressed_tensors import (
    COMPRESSED_TENSORS_VERSION,
    CT_FORMAT_OF_SCHEME,
    CT_SCHEMES,
    pack_compressed_tensors,
    unpack_compressed_tensors,
)
from roofline.quant.formats.gptq_awq import (
    AWQ_ORDER,
    AWQ_REVERSE_ORDER,
    GPTQ_CHECKPOINT_FORMATS,
    pack_awq,
    pack_gptq,
    unpack_awq,
    unpack_gptq,
)
from roofline.quant.formats.layout import TENSOR_LAYOUTS, TensorLayout, check_layout, expected_layout
from roofline.quant.formats.spec import (
    SUPPORTED_METHODS,
    QuantSpec,
    make_quantization_config,
    parse_quantization_config,
)

__all__ = ["AWQ_ORDER", "AWQ_REVERSE_ORDER", "COMPRESSED_TENSORS_VERSION", "CT_FORMAT_OF_SCHEME", "CT_SCHEMES",
           "GPTQ_CHECKPOINT_FORMATS", "SUPPORTED_METHODS", "TENSOR_LAYOUTS", "QuantSpec", "TensorLayout", "check_layout",
           "expected_layout", "make_quantization_config", "pack_awq", "pack_compressed_tensors", "pack_gptq",
           "parse_quantization_config", "unpack_awq", "unpack_compressed_tensors", "unpack_gptq"]
