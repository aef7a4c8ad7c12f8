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

Writes ``DIR/runs/<name>-<dataset>-rate<r>-rep<i>.json`` (bench serve's result) and ``DIR/serve-ab.json`` (per run:
mean TPOT, tokens per chunk and the inter-token gaps over 20 ms; per dataset and rate, each server's mean TPOT
over repeats and its ratio to the first server's), and prints the table. ``--summarize-only`` rebuilds it from
``DIR/runs``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
from pathlib import Path

from roofline.cli import main as roofline_main


def _side(text: str) -> tuple[str, str]:
    name, sep, url = text.partition("=")
    if not sep or not name or not url.startswith("http"):
        raise argparse.ArgumentTypeError(f"expected NAME=URL, got {text!r}")
    return name, url


def run_one(url: str, tokenizer: str, dataset: str, rate: str, num_prompts: int, path: Path,
            endpoint: str = "completions") -> dict:
    rc = roofline_main(["bench", "serve", "--base-url", url, "--endpoint", endpoint, "--tokenizer", tokenizer,
                        "--dataset", dataset,
                        "--num-prompts", str(num_prompts), "--max-output-len", "128", "--request-rate", rate,
                        "--seed", "0", "--disable-tqdm", "--save-result", str(path)])
    if rc != 0:
        raise RuntimeError(f"bench serve against {url} ({dataset}, rate {rate}) exited {rc}")
    return json.loads(path.read_text())


def run_record(name: str, dataset: str, rate: str, repeat: int, res: dict, stall_ms: float = 20.0) -> dict:
    """One run's figures: mean TPOT, output tok/s, tokens per streamed chunk, and its stalls, the inter-token
    gaps longer than ``stall_ms`` (on a host-bound server, mostly waits behind eager prefill steps): how many,
    and their total seconds over all requests."""
    itl = [x for r in res["requests"] for x in r["itl_s"]]
    stalls = [x for x in itl if x > stall_ms / 1e3]
    return {"config": name, "dataset": dataset, "rate": rate, "repeat": repeat, "mean_tpot_ms": res["mean_tpot_ms"],
            "output_throughput": res["output_throughput"], "mean_tokens_per_chunk": res.get("mean_tokens_per_chunk"),
            "median_itl_ms": res["median_itl_ms"], f"num_itl_over_{stall_ms:g}ms": len(stalls),
            f"itl_over_{stall_ms:g}ms_s": sum(stalls)}


def permutation_p(candidate: list[float], baseline: list[float]) -> float:
    """One-sided exact permutation test that ``candidate`` is larger than ``baseline``: the fraction of the ways
    to split the pooled values into groups of their sizes whose difference of means is at least the observed
    one (3 runs against 6 give C(9, 3) = 84 splits, so p >= 1/84)."""
    pooled, k = candidate + baseline, len(candidate)
    observed = statistics.mean(candidate) - statistics.mean(baseline)
    splits = list(itertools.combinations(range(len(pooled)), k))
    hits = 0
    for idx in splits:
        a = [pooled[i] for i in idx]
        b = [pooled[i] for i in range(len(pooled)) if i not in idx]
        hits += statistics.mean(a) - statistics.mean(b) >= observed - 1e-12
    return hits / len(splits)


def summarize(runs: list[dict], names: list[str]) -> list[dict]:
    """Per (dataset, rate): each server's mean TPOT over its repeats, min and max, its mean over the first
    server's, and for a server of another configuration the permutation p-value (``permutation_p``) that its
    TPOT is higher than the baseline's, the baseline being every server named like the first (``plain``,
    ``plain2``: an A/A pair pools)."""
    rows = []
    keys = sorted({(r["dataset"], r["rate"]) for r in runs}, key=lambda k: (k[0], float(k[1])))
    for ds, rate in keys:
        row: dict = {"dataset": ds, "rate": rate}
        for name in names:
            t = [r["mean_tpot_ms"] for r in runs if (r["dataset"], r["rate"], r["config"]) == (ds, rate, name)]
            row[name] = {"mean_tpot_ms": statistics.mean(t), "min": min(t), "max": max(t), "runs": t,
                         "ratio": statistics.mean(t) / row[names[0]]["mean_tpot_ms"] if name != names[0] else 1.0}
        base = [t for n in names if n.startswith(names[0]) for t in row[n]["runs"]]
        for name in names:
            if not name.startswith(names[0]):
                row[name]["p_slower_than_baseline"] = permutation_p(row[name]["runs"], base)
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
    ap.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                    help="chat: /v1/chat/completions, the prompts as user messages (a learned drafter's data)")
    ap.add_argument("--out-dir", type=Path, required=True)
    ap.add_argument("--summarize-only", action="store_true", help="rebuild serve-ab.json from DIR/runs, run nothing")
    args = ap.parse_args()
    servers = args.server
    names = [n for n, _ in servers]
    if len(servers) < 2 or len(set(names)) != len(names):
        ap.error(f"need at least two --server with distinct names, got {names}")
    (args.out_dir / "runs").mkdir(parents=True, exist_ok=True)
    runs = []
    for ds in [] if args.summarize_only else args.datasets:
        for rate in args.rates:
            for i in range(args.repeats):
                k = i % len(servers)
                for name, url in servers[k:] + servers[:k]:
                    res = run_one(url, args.tokenizer, ds, rate, args.num_prompts,
                                  args.out_dir / "runs" / f"{name}-{ds}-rate{rate}-rep{i}.json", args.endpoint)
                    runs.append(run_record(name, ds, rate, i, res))
                    print(f"{name:8} {ds:9} rate {rate:>4} rep {i}: mean TPOT {res['mean_tpot_ms']:.2f} ms", flush=True)
    if args.summarize_only:  # the runs already saved under DIR/runs
        for path in sorted((args.out_dir / "runs").glob("*.json")):
            name, ds, rate, rep = path.stem.rsplit("-", 3)
            if name in names:
                runs.append(run_record(name, ds, rate.removeprefix("rate"), int(rep.removeprefix("rep")),
                                       json.loads(path.read_text())))
    table = summarize(runs, names)
    (args.out_dir / "serve-ab.json").write_text(json.dumps({"servers": names, "runs": runs, "table": table}, indent=1))
    print(f"mean TPOT (ms) over {args.repeats} runs [min, max], its ratio to {names[0]}'s, and p: the one-sided "
          f"permutation test that it is slower than the pooled {names[0]}* runs")
    print(f"{'dataset':9} {'rate':>4}  " + "  ".join(f"{n:>37}" for n in names))
    for r in table:
        cells = [f"{r[n]['mean_tpot_ms']:6.2f} [{r[n]['min']:6.2f}, {r[n]['max']:6.2f}] {r[n]['ratio']:5.2f}x"
                 + (f" p={r[n]['p_slower_than_baseline']:.2f}" if "p_slower_than_baseline" in r[n] else "")
                 for n in names]
        print(f"{r['dataset']:9} {r['rate']:>4}  " + "  ".join(f"{c:>37}" for c in cells))


if __name__ == "__main__":
    main()
