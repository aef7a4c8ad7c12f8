"""Collectives over the tensor-parallel group (torch.distributed; this pipeline stage's ranks). Identity at
size 1."""

from __future__ import annotations

import torch

from roofline.distributed.parallel_state import get_tp_group, get_tp_size


def tensor_parallel_all_reduce(x: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """Sum (or ``op="max"``) ``x`` over the tensor-parallel ranks (in place where torch.distributed runs);
    ``x`` at size 1."""
    if get_tp_size() == 1:
        return x
    import torch.distributed as dist

    dist.all_reduce(x, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=get_tp_group())
    return x


def tensor_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order); ``x`` at size 1."""
    size = get_tp_size()
    if size == 1:
        return x
    import torch.distributed as dist

    parts = [torch.empty_like(x) for _ in range(size)]
    dist.all_gather(parts, x.contiguous(), group=get_tp_group())
    return torch.cat(parts, dim=dim)
