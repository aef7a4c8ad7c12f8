"""Paged attention: backends (which own the KV cache and its store), their metadata, and the KV pool.

Kernels live in ``roofline.kernels``; the model reaches them only through ``Attention`` (layer.py).
"""

from roofline.attention.backend import AttentionBackend, AttentionMetadata, QKNorm, get_attention_backend
from roofline.attention.kv_cache import KVCache, KVCachePool
from roofline.attention.layer import Attention

__all__ = ["Attention", "AttentionBackend", "AttentionMetadata", "KVCache", "KVCachePool", "QKNorm",
           "get_attention_backend"]
