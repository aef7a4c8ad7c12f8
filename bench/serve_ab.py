"""Interleaved serve sweep: the same `roofline bench serve` runs against several live servers, alternating.

Run-to-run spread of one server at high request rates is as large as the effect under test (the plain server on
the H200 gave 4.49-6.86 ms mean TPOT at HumanEval 32 req/s over four runs, `bench/results/spec-20261202d/`), and
one sweep per server confounds the configuration with the server process and with drift. Here all servers run at
once (an idle one sleeps), and for every dataset and rate their runs alternate, the order rotated each repeat
(A B C, B C A, C A B, ...); the tokenizer and datasets load once, in this process. A second server of the baseline
configuration (an A/A pair) measures the spread between server processes, the noise a verdict must beat.

    python bench/serve_ab.py --server plain=http://127.0.0.1:8123 --server plain2=http://127.0.0.1:8125 \
        --server ngram=http://127.0.0.1:8124 --tokenizer MODEL.gguf --datasets sharegpt humaneval \
        --rates 2 8 32 inf --repeats 3 --out-dir DIR

Writes ``DIR/runs/<name>-<dataset>-rate<r>-rep<i>.json`` (bench serve's result) and ``DIR/serve-ab.json`` (mean
TPOT per run and, per dataset and rate, each server's mean over repeats and its ratio to the first server's), and
prints the table.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from roofline.cli import main as roofline_main


def _side(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith("http"):
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {text!r}")
    return name, url


def run_one(url: str, tokenizer: str, dataset: str, rate: str, num_prompts: int, path: Path) -> dict:
    rc = roofline_main(["bench", "serve", "--base-url", url, "--tokenizer", tokenizer, "--dataset", dataset,
                        "--num-prompts", str(num_prompts), "--max-output-len", "128", "--request-rate", rate,
                        "--seed", "0", "--disable-tqdm", "--save-result", str(path)])
    if rc != 0:
        raise RuntimeError(f"bench serve against {url} ({dataset}, rate {rate}) exited {rc}")
    return json.loads(path.read_text())


def summarize(runs: list[dict], names: list[str]) -> list[dict]:
    """Per (dataset, rate): each server's mean TPOT over its repeats, min and max, and its mean over the first
    server's."""
    rows = []
    keys = sorted({(r["dataset"], r["rate"]) for r in runs}, key=lambda k: (k[0], float(k[1])))
    for ds, rate in keys:
        row: dict = {"dataset": ds, "rate": rate}
        for name in names:
            t = [r["mean_tpot_ms"] for r in runs if (r["dataset"], r["rate"], r["config"]) == (ds, rate, name)]
            row[name] = {"mean_tpot_ms": statistics.mean(t), "min": min(t), "max": max(t), "runs": t,
                         "ratio": statistics.mean(t) / row[names[0]]["mean_tpot_ms"] if name != names[0] else 1.0}
        rows.append(row)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--server", type=_side, action="append", required=True,
                    help="NAME=URL, repeated; the first is the baseline")
    ap.add_argument("--tokenizer", required=True)
    ap.add_argument("--datasets", nargs="+", default=["sharegpt", "humaneval"])
    ap.add_argument("--rates", nargs="+", default=["2", "8", "32", "inf"])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--num-prompts", type=int, default=100)
    ap.add_argument("--out-dir", type=Path, required=True)
    args = ap.parse_args()
    servers = args.server
    names = [n for n, _ in servers]
    if len(servers) < 2 or len(set(names)) != len(names):
        ap.error(f"need at least two --server with distinct names, got {names}")
    (args.out_dir / "runs").mkdir(parents=True, exist_ok=True)
    runs = []
    for ds in args.datasets:
        for rate in args.rates:
            for i in range(args.repeats):
                k = i % len(servers)
                for name, url in servers[k:] + servers[:k]:
                    res = run_one(url, args.tokenizer, ds, rate, args.num_prompts,
                                  args.out_dir / "runs" / f"{name}-{ds}-rate{rate}-rep{i}.json")
                    runs.append({"config": name, "dataset": ds, "rate": rate, "repeat": i,
                                 "mean_tpot_ms": res["mean_tpot_ms"], "output_throughput": res["output_throughput"],
                                 "mean_tokens_per_chunk": res.get("mean_tokens_per_chunk")})
                    print(f"{name:8} {ds:9} rate {rate:>4} rep {i}: mean TPOT {res['mean_tpot_ms']:.2f} ms", flush=True)
    table = summarize(runs, names)
    (args.out_dir / "serve-ab.json").write_text(json.dumps({"servers": names, "runs": runs, "table": table}, indent=1))
    print(f"mean TPOT (ms) over {args.repeats} runs [min, max], and its ratio to {names[0]}'s")
    print(f"{'dataset':9} {'rate':>4}  " + "  ".join(f"{n:>30}" for n in names))
    for r in table:
        cells = [f"{r[n]['mean_tpot_ms']:6.2f} [{r[n]['min']:6.2f}, {r[n]['max']:6.2f}] {r[n]['ratio']:5.2f}x"
                 for n in names]
        print(f"{r['dataset']:9} {r['rate']:>4}  " + "  ".join(f"{c:>30}" for c in cells))


if __name__ == "__main__":
    main()
