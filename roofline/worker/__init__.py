"""The device side: the worker (model, KV pool, sampler, persistent batch), CUDA graphs, the executor.

This is the only package that makes device tensors.
"""
