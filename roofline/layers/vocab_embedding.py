"""Token embedding and LM head, split along the vocabulary across tensor-parallel ranks.

Rank ``r`` holds rows ``[r * V_p, (r + 1) * V_p)`` of the [vocab, hidden] table, ``V_p = ceil(V / tp)``;
rows past the real vocabulary are zero padding. The embedding looks up the ids in its range and
all-reduces (each id is found on exactly one rank); the head computes its logits slice and all-gathers.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from roofline.distributed.communication import tensor_parallel_all_gather, tensor_parallel_all_reduce
from roofline.distributed.parallel_state import get_tp_rank, get_tp_size
from roofline.kernels.cpu_bf16 import pack_layer
from roofline.kernels.cpu_f32 import layer_linear
from roofline.quant.base import set_weight_attrs


class VocabParallelEmbedding(nn.Module):
    """``forward``: input_ids [T] int64 -> [T, embedding_dim] in the parameter dtype."""

    def __init__(self, num_embeddings: int, embedding_dim: int, prefix: str = "",
                 params_dtype: torch.dtype | None = None):
        super().__init__()
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.prefix = prefix
        self.tp_rank, self.tp_size = get_tp_rank(), get_tp_size()
        self.num_embeddings_per_partition = -(-num_embeddings // self.tp_size)
        self.vocab_start = min(num_embeddings, self.tp_rank * self.num_embeddings_per_partition)
        self.vocab_end = min(num_embeddings, self.vocab_start + self.num_embeddings_per_partition)
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim,
                                               dtype=params_dtype or torch.get_default_dtype()),
                                   requires_grad=False)
        set_weight_attrs(self.weight, {"output_dim": 0, "weight_loader": self.weight_loader})

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if tuple(loaded.shape) != (self.num_embeddings, self.embedding_dim):
            raise ValueError(f"checkpoint has {tuple(loaded.shape)}, the model expects "
                             f"{(self.num_embeddings, self.embedding_dim)}")
        rows = self.vocab_end - self.vocab_start
        param.data[:rows].copy_(loaded[self.vocab_start:self.vocab_end])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        outside = (input_ids < self.vocab_start) | (input_ids >= self.vocab_end)
        local = (input_ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local, self.weight).masked_fill(outside[:, None], 0.0)
        return tensor_parallel_all_reduce(out)


class DenseLMHeadMethod:
    """The 16-bit LM head: ``F.linear`` on its (possibly tied) ``weight``; bf16 on a CPU with bf16 units, a packed
    copy for oneDNN made after loading and the C++ GEMV at one row (``roofline.kernels.cpu_f32.layer_linear``;
    the table stays for the embedding lookup)."""

    def process_weights_after_loading(self, layer: nn.Module) -> None:
        pack_layer(layer)

    def apply(self, layer: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        if (out := layer_linear(layer, hidden)) is not None:
            return out
        return F.linear(hidden, layer.weight)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection; ``compute_logits`` gathers every rank's slice into [N, vocab].

    ``quant_config``: its ``get_lm_head_method()`` (None: the 16-bit head, ``DenseLMHeadMethod``) becomes
    ``quant_method``, which the loader's ``process_weights_after_loading`` calls after the (possibly tied) weight
    is loaded."""

    def __init__(self, num_embeddings: int, embedding_dim: int, prefix: str = "",
                 params_dtype: torch.dtype | None = None, quant_config=None):
        super().__init__(num_embeddings, embedding_dim, prefix, params_dtype)
        method = quant_config.get_lm_head_method() if quant_config is not None else None
        self.quant_method = method if method is not None else DenseLMHeadMethod()

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> logits [N, vocab] in fp32."""
        logits = self.quant_method.apply(self, hidden)
        if self.tp_size > 1:
            logits = tensor_parallel_all_gather(logits, dim=-1)
        return logits[:, :self.num_embeddings].float()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead has no forward; use compute_logits")
