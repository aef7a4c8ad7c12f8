"""``roofline {generate, chat, serve, bench, cost, probe, eval, quantize, train-draft}``.

Subcommands live beside what they drive and register themselves through ``add_parser(subparsers)``;
each module is imported only when its parser is built, and heavy imports happen inside handlers.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

# (module, function) pairs that add subcommands; bench subcommands are nested under `roofline bench`.
_COMMANDS = [
    ("roofline.commands", "add_generate_parser"),
    ("roofline.commands", "add_chat_parser"),
    ("roofline.server.cli", "add_parser"),
    ("roofline.cost_cli", "add_cost_parser"),
    ("roofline.cost_cli", "add_probe_parser"),
    ("roofline.eval.cli", "add_eval_parser"),
    ("roofline.quantize_cli", "add_quantize_parser"),
    ("roofline.spec_decode.train_cli", "add_train_draft_parser"),
]
_BENCH_COMMANDS = [
    ("roofline.bench.serve", "add_parser"),
    ("roofline.bench.decode", "add_parser"),
    ("roofline.bench.throughput", "add_parser"),
    ("roofline.bench.attention", "add_parser"),
    ("roofline.bench.prefix", "add_parser"),
    ("roofline.bench.spec", "add_parser"),
    ("roofline.bench.moe", "add_parser"),
]


def _register(subparsers: argparse._SubParsersAction, entries: list[tuple[str, str]]) -> None:
    for module_name, func in entries:
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("roofline"):
                continue  # subcommand not built into this checkout
            raise
        getattr(module, func)(subparsers)


class _Parser(argparse.ArgumentParser):
    """An argparse parser whose errors are one line (and a pointer to --help), not the whole usage first.
    Subparsers inherit the class."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="roofline", description="LLM inference measured against its floor")
    sub = parser.add_subparsers(dest="command", required=True)
    _register(sub, _COMMANDS)
    bench = sub.add_parser("bench", help="benchmarks (serve, decode, throughput, attention)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    _register(bench_sub, _BENCH_COMMANDS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ValueError, FileNotFoundError, MemoryError) as e:
        print(f"roofline: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
