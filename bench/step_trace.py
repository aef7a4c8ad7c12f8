"""Summarize the engine's debug-level step trace: where a run's wall time goes, by how its steps ran.

The engine logs one ``step trace:`` line per processed step at debug level (``LLMEngine._trace``); run a server
with ``--log-level debug`` and pass its log here. A step's period is the time from the previous step's end to its
own; gaps longer than ``--idle-ms`` (the engine waiting for requests) are left out, and a gap longer than
``--run-gap-s`` starts a new run (a benchmark client's next run against the same server).

    python bench/step_trace.py server.log [--idle-ms 50] [--run-gap-s 2]

Prints, per (mode, decode-only or mixed): steps, wall seconds, mean period, decode tokens emitted (one per
decoding request plus accepted drafts) and emitted tokens per second of that wall time.
"""

from __future__ import annotations

import argparse
import re
from collections import defaultdict

LINE = re.compile(r"step trace: (.*)$")


def parse(path: str) -> list[dict[str, float | str]]:
    rows = []
    with open(path, errors="replace") as f:
        for line in f:
            m = LINE.search(line)
            if m is None:
                continue
            row: dict[str, float | str] = {}
            for field in m.group(1).split():
                k, v = field.split("=", 1)
                row[k] = v if k == "mode" else float(v)
            rows.append(row)
    return rows


def summarize(rows: list[dict[str, float | str]], idle_s: float) -> list[tuple]:
    acc: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    prev = None
    for r in rows:
        end = float(r["end"])
        if prev is not None and end - prev <= idle_s:
            key = (str(r["mode"]), "mixed" if float(r["prefill_tokens"]) > 0 else "decode")
            a = acc[key]
            a[0] += 1
            a[1] += end - prev
            a[2] += float(r["decode"]) + float(r["accepted"])
            a[3] += float(r["drafted"])
        prev = end
    out = []
    for (mode, kind), (n, wall, tokens, drafted) in sorted(acc.items()):
        out.append((mode, kind, int(n), wall, wall / n * 1e3, int(tokens), int(drafted), tokens / wall if wall else 0))
    return out


def split_runs(rows: list[dict[str, float | str]], gap_s: float) -> list[list[dict[str, float | str]]]:
    runs: list[list[dict[str, float | str]]] = []
    prev = None
    for r in rows:
        end = float(r["end"])
        if prev is None or end - prev > gap_s:
            runs.append([])
        runs[-1].append(r)
        prev = end
    return runs


def print_table(rows: list[tuple]) -> None:
    print(f"{'mode':6} {'steps':6} {'kind':6} {'wall s':>8} {'ms/step':>8} {'tokens':>8} {'drafted':>8} {'tok/s':>9}")
    for mode, kind, n, wall, ms, tokens, drafted, tps in rows:
        print(f"{mode:6} {n:6d} {kind:6} {wall:8.3f} {ms:8.3f} {tokens:8d} {drafted:8d} {tps:9.0f}")
    total_wall = sum(r[3] for r in rows)
    total_tokens = sum(r[5] for r in rows)
    print(f"total  {sum(r[2] for r in rows):6d} {'':6} {total_wall:8.3f} {'':8} {total_tokens:8d} {'':8} "
          f"{total_tokens / total_wall if total_wall else 0:9.0f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("log")
    ap.add_argument("--idle-ms", type=float, default=50.0)
    ap.add_argument("--run-gap-s", type=float, default=2.0)
    args = ap.parse_args()
    for i, run in enumerate(split_runs(parse(args.log), args.run_gap_s)):
        print(f"run {i}: {len(run)} steps")
        print_table(summarize(run, args.idle_ms / 1e3))


if __name__ == "__main__":
    main()
