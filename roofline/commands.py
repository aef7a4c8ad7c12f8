"""``roofline generate`` (offline batch, the README's main job) and ``roofline chat`` (interactive)."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from roofline.args import EngineArgs


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 128) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1, help="-1 or 0: disabled (default -1)")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--n", type=int, default=1)
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")


def sampling_params_from_args(args: argparse.Namespace, **overrides: Any):
    from roofline.sampling_params import SamplingParams

    kw = dict(
        n=args.n, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k, min_p=args.min_p,
        repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
        stop=args.stop, ignore_eos=args.ignore_eos, seed=args.sampling_seed,
    )
    kw.update(overrides)
    return SamplingParams(**kw)


# ---------------------------------------------------------------------------------------------- generate


def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="offline batch generation (prompts, a file, or a ShareGPT sample)")
    EngineArgs.add_cli_args(p)
    src = p.add_argument_group("prompts (default: --sharegpt 32)")
    src.add_argument("--prompt", action="append", default=None, help="a prompt (repeatable)")
    src.add_argument("--prompts-file", default=None, help="one prompt per line, or JSONL with a 'prompt' key")
    src.add_argument("--sharegpt", type=int, default=None, metavar="N", help="N prompts drawn from ShareGPT")
    src.add_argument("--dataset-seed", type=int, default=0)
    src.add_argument("--dataset-output-lens", action="store_true",
                     help="use ShareGPT's completion lengths as max_tokens (with ignore_eos)")
    p.add_argument("--chat-template", action=argparse.BooleanOptionalAction, default=None,
                   help="wrap prompts in the model's chat template (default: on for ShareGPT prompts)")
    p.add_argument("--show", type=int, default=3, help="how many outputs to print")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--floor", choices=["probe", "none"], default="probe",
                   help="compare the mean decode step with its bound (probe the bandwidth in-process)")
    p.add_argument("--hardware", default=None, help="probe JSON or preset for the floor instead of probing")
    add_sampling_args(p)
    p.set_defaults(func=run_generate)


def _read_prompts(path: str) -> list[str]:
    """The prompts of ``--prompts-file``: one per non-blank line, or the ``prompt`` key of each JSONL line.

    Raises:
        FileNotFoundError: the path does not exist.
        ValueError: not a regular file (a directory, /dev/null), unreadable, empty, no prompts, or a bad JSONL
            line; the message names the path (and the line).
    """
    import json
    import os
    import stat

    what = f"--prompts-file {path!r}"
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise FileNotFoundError(f"{what} does not exist") from None
    except OSError as e:
        raise ValueError(f"{what} cannot be read: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "a device, pipe or socket"
        raise ValueError(f"{what} is not a regular file ({kind}); give a text file with one prompt per line")
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ValueError(f"{what} cannot be read: {e.strerror}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{what} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not text:
        raise ValueError(f"{what} is empty; give one prompt per line")
    prompts = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        if path.endswith(".jsonl"):
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{what} line {lineno} is not JSON ({e.msg})") from None
            ids = record.get("prompt_token_ids") if isinstance(record, dict) else None
            if ids is not None:  # vLLM's TokensPrompt: a model without a tokenizer takes these only
                if not isinstance(ids, list) or not ids or not all(type(t) is int and t >= 0 for t in ids):
                    raise ValueError(f"{what} line {lineno}: 'prompt_token_ids' must be a non-empty list of "
                                     f"integers >= 0, got {json.dumps(ids)[:80]}")
                prompts.append({"prompt_token_ids": ids})
                continue
            if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
                raise ValueError(f"{what} line {lineno} must be a JSON object with a string 'prompt' key "
                                 f"(or a 'prompt_token_ids' list), got {line[:80]!r}")
            prompts.append(record["prompt"])
        else:
            prompts.append(line)
    if not prompts:
        raise ValueError(f"{what} has no prompts (only blank lines)")
    return prompts


def run_generate(args: argparse.Namespace) -> int:
    from roofline.engine.llm_engine import check_unicode
    from roofline.llm import LLM
    from roofline.report import print_run_summary

    engine_args = EngineArgs.from_cli_args(args)
    base_params = sampling_params_from_args(args)  # validate flags before the model loads
    if args.sharegpt is not None and args.sharegpt < 1:
        raise ValueError(f"--sharegpt must be >= 1, got {args.sharegpt}")
    if args.show < 0:
        raise ValueError(f"--show must be >= 0 (outputs to print), got {args.show}")
    if args.hardware:
        from roofline.hardware import load_hardware

        load_hardware(args.hardware)  # fail now, not after the run
    file_prompts = _read_prompts(args.prompts_file) if args.prompts_file and not args.prompt else None
    for i, text in enumerate(args.prompt or []):
        check_unicode(text, f"--prompt {i + 1}")  # non-UTF-8 bytes on the command line: before the model loads
    llm = LLM(**engine_args.to_dict())
    if (startup := startup_lines(llm.engine)):
        print(startup, flush=True)
    print(llm.engine.kv_cache_summary, flush=True)
    params_list = None
    if args.prompt:
        prompts: list[Any] = list(args.prompt)
    elif file_prompts is not None:
        prompts = file_prompts
    else:
        from roofline.bench.datasets import sample_sharegpt

        if llm.tokenizer is None:
            raise ValueError("this model has no tokenizer (dummy weights, or a GGUF file without a vocabulary), so "
                             "ShareGPT prompts cannot be encoded; give --prompts-file FILE.jsonl with one "
                             '{"prompt_token_ids": [...]} object per line')
        n = args.sharegpt or 32
        max_len = llm.engine.config.scheduler_config.max_model_len
        reqs = sample_sharegpt(llm.tokenizer, n, seed=args.dataset_seed,
                               max_prompt_len=min(1024, max_len // 2), max_total_len=min(2048, max_len))
        prompts = [r.prompt for r in reqs]
        if args.dataset_output_lens:
            params_list = [sampling_params_from_args(args, max_tokens=r.output_len, ignore_eos=True) for r in reqs]
    use_template = args.chat_template
    if use_template is None:
        use_template = not (args.prompt or args.prompts_file) and llm.tokenizer is not None \
            and getattr(llm.tokenizer, "chat_template", None) is not None
    display = [p if isinstance(p, str) else None for p in prompts]
    if use_template:  # text prompts only: token ids go in as they are
        prompts = [{"prompt_token_ids": llm.apply_chat_template([{"role": "user", "content": p}])}
                   if isinstance(p, str) else p for p in prompts]
    params = params_list or base_params
    outputs = llm.generate(prompts, params, use_tqdm=not args.no_progress)
    for i, ro in enumerate(outputs[: args.show]):
        prompt = ro.prompt or display[i] or f"<{len(ro.prompt_token_ids)} tokens>"
        print("-" * 80)
        print(f"prompt ({len(ro.prompt_token_ids)} tokens): {prompt[:200]!r}")
        if ro.error:
            print(f"error: {ro.error}")
        for c in ro.outputs:
            print(f"output [{c.index}] ({len(c.token_ids)} tokens, finish_reason={c.finish_reason}): {c.text[:400]!r}")
    errors = [ro for ro in outputs if ro.error]
    for ro in errors:
        print(f"request {ro.request_id} rejected: {ro.error}", file=sys.stderr)
    print("-" * 80)
    print_run_summary(llm, floor=args.floor, hardware=args.hardware)
    return 1 if errors else 0  # the valid requests completed; say that some did not


# ---------------------------------------------------------------------------------------------- chat


def add_chat_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("chat", help="interactive chat with the model's chat template")
    EngineArgs.add_cli_args(p)
    p.add_argument("--system", default=None, help="system prompt")
    add_sampling_args(p, max_tokens=256)
    p.set_defaults(func=run_chat, temperature=0.7)


def startup_lines(engine: Any) -> str:
    """What ``engine`` (an ``LLMEngine``) chose at start-up, for the console (``generate``, ``chat``, ``serve``): the CPU line, what ``--quantization auto`` picked (with
    its quality) and the CPU decode plan's state (the worker's summary, one process on CPU); elsewhere (GPUs,
    worker processes) just the ``--quantization auto`` line, if it was asked for."""
    if (cpu_summary := getattr(getattr(engine, "worker", None), "cpu_summary", None)) is not None:
        return cpu_summary
    note = engine.config.quantization_note
    return f"quantization auto: {note}" if note is not None else ""


def run_chat(args: argparse.Namespace) -> int:
    from roofline.llm import LLM

    params = sampling_params_from_args(args)  # validate flags before the model loads
    llm = LLM(**EngineArgs.from_cli_args(args).to_dict())
    if (startup := startup_lines(llm.engine)):
        print(startup, flush=True)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("roofline chat: type a message; /reset clears the history, /exit or Ctrl-D quits.")
    while True:
        try:
            line = input("> ")
        except EOFError:
            print()
            return 0
        text = line.strip()
        if not text:
            continue
        if text in ("/exit", "/quit"):
            return 0
        if text == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": text})
        out = llm.chat(messages, params, use_tqdm=False)[0]
        if out.error:
            print(f"error: {out.error}")
            messages.pop()
            continue
        reply = out.outputs[0].text
        print(reply)
        messages.append({"role": "assistant", "content": reply})
