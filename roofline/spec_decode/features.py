"""The target's features for draft-head training: its final normed hidden states f [T, H] per sequence
(``roofline train-draft``, ``roofline.spec_decode.train``).

- ``target_features``: one sequence through the engine (one chunked prefill, ``Worker.score(hidden_states=True)``),
  any architecture.
- ``batched_target_features``: many sequences at once through a plain-torch copy of a Llama target's layers
  (right-padded batches on the GPU: ~700 sequences/s on the H200 against ~60 one at a time).
"""

from __future__ import annotations

import time
from typing import Any

import torch

from roofline.spec_decode.heads import DraftHeadConfig


def target_features(llm: Any, token_ids: list[int], on_device: bool = False) -> torch.Tensor:
    """The target's final normed hidden states [T, H] for one sequence: fp32 on the CPU, or (``on_device``)
    in the model's dtype on its device (scratch KV blocks from the engine's allocator, as
    ``LLM.score_logprobs``)."""
    from roofline.llm import _ScratchBlocks

    bm = llm.engine.block_pool
    holder = _ScratchBlocks()
    bm.allocate(holder, len(token_ids))
    try:
        with torch.inference_mode():
            h = llm.engine.worker.score(token_ids, holder.block_table, hidden_states=True)
        if on_device:
            return h.clone()  # a normal tensor (autograd refuses inference-mode tensors)
        return h.float().cpu().clone()
    finally:
        bm.free(holder)


def target_parts(llm: Any, device: torch.device, dtype: torch.dtype = torch.float32
                  ) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(model config, embedding [V, H], LM head [V, H], RoPE cos/sin table) on ``device`` in ``dtype`` (the
    table in fp32), frozen copies."""
    from roofline.layers.rotary import RotaryEmbedding

    w = llm.engine.worker
    mc = w.model_config
    embed = w.model.model.embed_tokens.weight.detach()[:mc.vocab_size].to(device, dtype).clone()
    head = w.model.lm_head.weight.detach()[:mc.vocab_size].to(device, dtype).clone()
    return mc, embed, head, RotaryEmbedding.from_config(mc, str(device)).cos_sin_cache.float()


def layer_state_dict(layer: Any) -> dict[str, torch.Tensor]:
    """One target decoder layer's weights under Hugging Face's names (``EagleLayer.load_hf_state_dict``), fp32
    on the CPU: the fused qkv / gate_up split back into their parts."""
    attn = layer.self_attn
    q, k, v = attn.qkv_proj.weight.detach().float().cpu().split([attn.q_size, attn.kv_size, attn.kv_size], dim=0)
    gate, up = layer.mlp.gate_up_proj.weight.detach().float().cpu().chunk(2, dim=0)
    return {"input_layernorm.weight": layer.input_layernorm.weight.detach().float().cpu(),
            "post_attention_layernorm.weight": layer.post_attention_layernorm.weight.detach().float().cpu(),
            "self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
            "self_attn.o_proj.weight": attn.o_proj.weight.detach().float().cpu(),
            "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
            "mlp.down_proj.weight": layer.mlp.down_proj.weight.detach().float().cpu()}


def _plain_llama(llm: Any, device: torch.device, dtype: torch.dtype) -> tuple[Any, ...] | None:
    """The target as plain-torch modules for batched feature extraction: (embedding [V, H], [EagleLayer] with
    its weights, final norm weight [H], eps, RoPE table), or None where the target is not a plain Llama
    decoder (q/k norm, biases, MoE, quantized or tensor-parallel weights): the engine path serves those."""
    from roofline.layers.rotary import RotaryEmbedding
    from roofline.spec_decode.heads import EagleLayer

    w = llm.engine.worker
    mc = w.model_config
    layers = getattr(getattr(w.model, "model", None), "layers", None)
    if (mc.architecture != "LlamaForCausalLM" or getattr(mc, "num_experts", 0) or getattr(mc, "qk_norm", False)
            or layers is None or getattr(w.config.parallel_config, "tensor_parallel_size", 1) > 1):
        return None
    try:
        sds = [layer_state_dict(layer) for layer in layers]
    except AttributeError:
        return None
    if any(not torch.is_floating_point(v) or v.dim() < 1 for sd in sds for v in sd.values()) or any(
            getattr(layer.self_attn.qkv_proj, "bias", None) is not None for layer in layers):
        return None
    cfg = DraftHeadConfig.for_target("eagle", mc)
    mods = []
    for sd in sds:
        m = EagleLayer(cfg)
        m.load_hf_state_dict(sd)
        mods.append(m.to(device=device, dtype=dtype).eval())
    embed = w.model.model.embed_tokens.weight.detach()[:mc.vocab_size].to(device, dtype)
    norm = w.model.model.norm.weight.detach().to(device, dtype)
    return embed, mods, norm, mc.rms_norm_eps, RotaryEmbedding.from_config(mc, str(device)).cos_sin_cache.float()


def batched_target_features(llm: Any, seqs: list[tuple[list[int], int]], max_seconds: float | None = None,
                            batch_tokens: int | None = None, progress: bool = False,
                            aux_layers: tuple[int, ...] = ()) -> list[torch.Tensor | None] | None:
    """The target's final normed hidden states [T_i, H] for many sequences at once, as ``target_features``
    gives one at a time, from a plain-torch copy of a Llama target (``EagleLayer`` per decoder layer; right-padded
    batches of at most ``batch_tokens`` padded tokens, longest first, causal attention): fp32 on the CPU, or on
    the target's GPU in its dtype. The engine's per-sequence path ran ~60 sequences/s on the H200 and left
    two thirds of a 60 s regeneration unused (``bench/results/spec-gpu-heads-20261204/``).

    The values differ from the engine's kernels by rounding only (fp32: ~1e-5 relative; the test checks it).
    Returns one entry per sequence of ``seqs``, None for those not reached within ``max_seconds`` (longest
    first); None instead of the list where the target is not a plain Llama (``_plain_llama``). With
    ``aux_layers`` (decoder layer indices) each entry is [T_i, (1 + len(aux_layers)) H]: the final normed
    features, then the residual stream entering each of those layers (``heads.EagleHead``'s fused features).
    """
    dev = torch.device(llm.engine.worker.device)
    on_device = dev.type != "cpu"
    dtype = llm.engine.worker.dtype if on_device else torch.float32
    parts = _plain_llama(llm, dev, dtype)
    if parts is None:
        return None
    embed, mods, norm, eps, cos_sin = parts
    from roofline.spec_decode.heads import _rmsnorm

    cap = batch_tokens or (32768 if on_device else 4096)
    order = sorted(range(len(seqs)), key=lambda i: -len(seqs[i][0]))
    out: list[torch.Tensor | None] = [None] * len(seqs)
    t0 = time.perf_counter()
    from tqdm import tqdm

    bar = tqdm(total=len(seqs), desc="target features (batched)", disable=not progress)
    j = 0
    with torch.inference_mode():
        while j < len(order):
            t = len(seqs[order[j]][0])
            batch = order[j:j + max(1, cap // t)]  # longest first: t is the batch's padded length
            j += len(batch)
            ids = pad_rows([torch.tensor(seqs[i][0]) for i in batch], dev)
            x = embed[ids]
            pos = torch.arange(t, device=dev)
            aux = {}
            for li, m in enumerate(mods):
                if li in aux_layers:
                    aux[li] = x
                x = m(x, pos, cos_sin)
            x = _rmsnorm(x, norm, eps)
            if aux_layers:
                x = torch.cat([x] + [aux[li] for li in aux_layers], dim=-1)
            for b, i in enumerate(batch):
                f = x[b, :len(seqs[i][0])]
                out[i] = f.clone() if on_device else f.float().cpu().clone()
            bar.update(len(batch))
            if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
                break
    bar.close()
    return out


def pad_rows(rows: list[torch.Tensor], device: torch.device, value: float = 0) -> torch.Tensor:
    """Right-pad ``rows`` ([T_i, ...] each) into [B, max T_i, ...] on ``device``."""
    return torch.nn.utils.rnn.pad_sequence([r.to(device) for r in rows], batch_first=True, padding_value=value)
