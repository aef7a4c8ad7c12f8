"""Kernel launches per MoE decoder layer in a batch-1 decode step, counted on the CPU through the real engine.

A tiny Qwen3-MoE (HF's classes, random weights, 2 layers, 128 experts, top-8 as Qwen3-30B-A3B) runs greedy decode
through ``roofline.LLM`` on the CPU with the CUDA kernel dispatch forced on (Triton under its CPU interpreter), so
the layers take the path they take on a GPU. Every aten op that would launch a kernel (views, empties and other
metadata ops excluded), every Triton launch and every linear layer (one launch on a GPU, our GEMV or cuBLAS;
on the CPU the bf16 ones run outside aten) inside each decoder layer's forward is counted, for the decode
steps (one token) only. Three configurations in the same process:

- ``before``: the router and Qwen3's q_norm / k_norm (3-D RMSNorms) on their torch paths (as before the fused
  router and the Triton 3-D RMSNorm dispatch);
- ``gate_apart``: the router kernel after a separate gate linear (as before the gate GEMV joined the router,
  ``roofline.kernels.moe_router.gate_select_experts``, issue 33);
- ``after``: the code as it is: one launch for the gate and the router, so one fewer than ``gate_apart``.

Qwen3's q_norm / k_norm are applied by the attention backend (``AttentionBackend.forward(..., qk_norm)``): the
Triton backend fuses them into ``rope_and_cache`` (no launch of their own on a GPU), while the torch backend this
script runs applies the two RMSNorm modules (two launches under the forced dispatch, counted in every row).

Attention and RoPE on the CPU are torch ops, not the GPU's kernels, and the expert-token count
(``ones_like`` + ``scatter_add``) is on by default on a CPU only: the difference between the rows is what the
GPU saves. The interpreter rounds fp32 -> bf16 toward zero (the GPU to nearest even), so in bf16 (the default
``DTYPE``) the fused gate's logits can differ from the torch gate's by one bf16 ulp here; the token check is
exact in ``DTYPE=float32``. Usage: TRITON_INTERPRET=1 .venv/bin/python bench/moe_decode_launches.py
"""

from __future__ import annotations

import collections
import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

# Ops that launch no kernel on a GPU (metadata, allocation) or that the CPU path calls only around the interpreter.
_FREE = {"view", "_unsafe_view", "reshape", "as_strided", "t", "transpose", "permute", "unsqueeze", "squeeze",
         "slice", "select", "split", "split_with_sizes", "narrow", "expand", "detach", "alias", "empty", "empty_like",
         "empty_strided", "new_empty", "_reshape_alias", "unbind", "lift_fresh", "is_nonzero", "item",
         "_local_scalar_dense", "size", "stride", "numel", "dim", "is_same_size", "promote_types", "result_type"}


class _Count(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.on = False
        self.ops: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        inplace = name.endswith("_")
        name = name.rstrip("_")
        # A cast or copy that returns its input (``x.to(x.dtype)``, ``contiguous`` of a contiguous x) launches
        # nothing; an in-place op returns its input too, and does launch.
        if self.on and name not in _FREE and (inplace or not (args and out is args[0])):
            self.ops[f"aten.{name}"] += 1
        return out


def main() -> int:
    import transformers as tf
    import triton.runtime.interpreter as interp

    from roofline import LLM, SamplingParams
    from roofline.kernels import moe_router
    from roofline.layers import dispatch, moe
    from roofline.layers.linear import LinearBase
    from roofline.models.llama import LlamaDecoderLayer

    kernels = dispatch._load_kernels()
    if kernels is None:
        raise SystemExit("triton is needed (the interpreter runs the kernels)")
    real_kernels_for, real_run = dispatch.kernels_for, interp.InterpretedFunction.run
    counter = _Count()
    mode = {"before": False}
    real_fused_max = moe.FUSED_GATE_MAX_TOKENS

    def forced_kernels_for(x):
        if mode["before"] and x.dim() == 3:  # the old RMSNorm dispatch: 2-D only
            return None
        return kernels

    def router(logits, top_k, renormalize):
        if mode["before"]:
            return moe_router.ref_select_experts(logits, top_k, renormalize)
        return moe_router.select_experts(logits.contiguous(), top_k, renormalize)

    def counted_run(self, *args, **kwargs):
        was, counter.on = counter.on, False  # the interpreter's own torch calls are not kernels
        try:
            if was:
                counter.ops[f"triton.{self.fn.__name__}"] += 1
            return real_run(self, *args, **kwargs)
        finally:
            counter.on = was

    names = ("before", "gate_apart", "after")
    per_layer: dict[str, list[collections.Counter]] = {name: [] for name in names}
    state = {"layer": None, "name": None}

    def pre(module, args):
        hidden = args[1] if len(args) > 1 else None
        if hidden is not None and hidden.shape[0] == 1:
            counter.ops = collections.Counter()
            counter.on = True
            state["layer"] = module

    def post(module, args, out):
        if state["layer"] is module:
            counter.on = False
            state["layer"] = None
            per_layer[state["name"]].append(counter.ops)

    def linear_pre(module, args):
        state[module] = counter.on
        counter.on = False  # a linear layer is one launch on the GPU (our GEMV or cuBLAS), whatever the CPU runs

    def linear_post(module, args, out):
        counter.on = state.pop(module)
        if counter.on:
            counter.ops[f"linear.{module.prefix.rsplit('.', 1)[-1]}"] += 1

    cfg = tf.Qwen3MoeConfig(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                            num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=128,
                            num_experts_per_tok=8, moe_intermediate_size=32, norm_topk_prob=True,
                            max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model_dtype = os.environ.get("DTYPE", "bfloat16")
    with tempfile.TemporaryDirectory() as tmp:
        tf.Qwen3MoeForCausalLM(cfg).float().eval().save_pretrained(tmp, safe_serialization=True)
        llm = LLM(tmp, device="cpu", dtype=model_dtype, attention_backend="torch", max_model_len=64, num_kv_blocks=8,
                  enforce_eager=True)
        model = llm.engine.executor.worker.model
        layers = [m for m in model.modules() if isinstance(m, LlamaDecoderLayer)]
        for m in layers:
            m.register_forward_pre_hook(pre)
            m.register_forward_hook(post)
        for m in model.modules():
            if isinstance(m, LinearBase):
                m.register_forward_pre_hook(linear_pre)
                m.register_forward_hook(linear_post)
        dispatch.kernels_for = forced_kernels_for
        moe.dispatch.kernels_for = forced_kernels_for
        interp.InterpretedFunction.run = counted_run
        real_select = moe.select_experts
        moe.select_experts = router
        outputs = {}
        try:
            with counter:
                for name in names * 2:  # alternating, same process
                    mode["before"] = name == "before"
                    state["name"] = name
                    moe.FUSED_GATE_MAX_TOKENS = real_fused_max if name == "after" else 0
                    outs = llm.generate([[1, 17, 42, 99, 5]], SamplingParams(temperature=0.0, max_tokens=4))
                    outputs.setdefault(name, outs[0].outputs[0].token_ids)
        finally:
            dispatch.kernels_for, interp.InterpretedFunction.run = real_kernels_for, real_run
            moe.dispatch.kernels_for = real_kernels_for
            moe.select_experts = real_select
            moe.FUSED_GATE_MAX_TOKENS = real_fused_max
    same = all(outputs[name] == outputs["before"] for name in names)
    if model_dtype == "float32":
        assert same, outputs
    print(f"greedy tokens identical across {', '.join(names)}: {same} {outputs}")
    totals = {}
    for name, rows in per_layer.items():
        n = sum(sum(c.values()) for c in rows) / len(rows)
        totals[name] = n
        merged = collections.Counter()
        for c in rows:
            merged.update(c)
        print(f"\n{name}: {n:.1f} launches per MoE layer (mean of {len(rows)} decode-step layers)")
        for op, cnt in merged.most_common():
            print(f"  {cnt / len(rows):5.1f}  {op}")
    print(f"\nthe fused gate saves {totals['gate_apart'] - totals['after']:.1f} launches per layer (expected 1)")
    saved = totals["before"] - totals["after"]
    print(f"\nsaved {saved:.1f} launches per layer against before; at Qwen3-30B-A3B's 48 layers and 1.5-2.5 us per small kernel "
          f"in a CUDA graph (bench/results/profile-20261204): {48 * saved * 1.5e-3:.2f}-{48 * saved * 2.5e-3:.2f} ms "
          f"per decode step")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
