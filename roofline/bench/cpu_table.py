"""The CPU formats table (issue 32), run through ``python -m roofline.bench.cpu --gemm | --table [...]``.

``--gemm``: the default model's linears of one decode step (30 layers x qkv 960x576, o 576x576, gate_up
3072x576, down 576x1536, plus lm_head 49152x576), each layer its own weight so that nothing stays in cache,
in fp32, bf16, INT8 W8A16 (``torch._weight_int8pack_mm``, M = 1 only: it takes seconds at 32) and INT8 W8A8
dynamic (``roofline.kernels.cpu_int8``), at M = 1 and 32; the formats alternate inside each of 3 rounds; the best round per format; ratio fp32 / format.

``--table [--rounds R] [--tokens N] [--llamacpp] [--no-hf] [--head-ab] [--prepack-ab] [--json PATH]``: end to end on
the default model.
Roofline fp32, bf16, int8 (``--quantization int8``: W8A8 on CPU, the LM head too) and bf16 + int8 (the int8
linears and head with bf16 norms and attention) engines are built once (``--head-ab``: the two int8 ones again
with a 16-bit LM head; ``--prepack-ab``: bf16 again with its weights not packed for oneDNN), then each round
runs every format at batch 1 (one prompt, N greedy tokens) and batch 32 (32 prompts, N / 2 tokens each),
in turn, so drift on a shared machine hits all alike; the best round's mean decode step is kept, and its
floor (``_floors``: that format's weight bytes plus the KV read, over one read bandwidth measured in this
process; against FLOPs over the measured GEMM rate of the format's arithmetic) is printed beside it. HF
transformers eager fp32 (batch 1, the same prompt, ``use_cache``) and llama.cpp (``--llamacpp``:
``llama_cpp.Llama`` on the same GGUF with ``n_threads`` = ours, greedy) run in the same rounds.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import torch

from roofline.cpu import detect_cpu_features, startup_line

PROMPT = "Once upon a time"
# (name, rows, K) of the default model's linears, and how many of each one decode step runs
SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30), ("down", 576, 1536, 30),
          ("lm_head", 49152, 576, 1)]


def gemm_rates(rounds: int = 3) -> dict[str, dict[str, float]]:
    """ms per decode step's linears for each format at M = 1 and 32: {"M=1": {"fp32": ms, ...}, ...}."""
    from roofline.kernels.cpu_int8 import w8a8_dynamic_linear
    from roofline.quant.quantize import quantize_int8_per_channel

    gen = torch.Generator().manual_seed(0)
    layers = []
    for _, n, k, count in SHAPES:
        for _ in range(count):
            w = torch.randn(n, k, generator=gen) * 0.02
            cw = quantize_int8_per_channel(w)
            layers.append((w, w.bfloat16(), cw.q.contiguous(), cw.scales.float().contiguous()))
    fns = {
        "fp32": lambda x, lay: torch.nn.functional.linear(x, lay[0]),
        "bf16": lambda x, lay: torch.nn.functional.linear(x.bfloat16(), lay[1]),
        "int8 W8A16": lambda x, lay: torch._weight_int8pack_mm(x, lay[2], lay[3]),
        "int8 W8A8": lambda x, lay: w8a8_dynamic_linear(x, lay[2], lay[3]),
    }
    out: dict[str, dict[str, float]] = {}
    for m in (1, 32):
        xs = {k: torch.randn(m, k, generator=gen) for _, _, k, _ in SHAPES}
        run = {k: f for k, f in fns.items() if m == 1 or k != "int8 W8A16"}  # W8A16 at M = 32: ~8 s a pass
        best = {name: float("inf") for name in run}
        for _ in range(rounds):
            for name, fn in run.items():
                t = time.perf_counter()
                for lay in layers:
                    fn(xs[lay[0].shape[1]], lay)
                best[name] = min(best[name], time.perf_counter() - t)
        out[f"M={m}"] = {name: v * 1e3 for name, v in best.items()}
        print(f"linears of one decode step, M={m}: " + ", ".join(
            f"{name} {v * 1e3:.1f} ms ({best['fp32'] / v:.2f}x fp32)" for name, v in best.items()))
    return out


def _roofline_step(llm, batch: int, tokens: int) -> float:
    """Mean decode step (s) of one greedy run of ``batch`` copies of the prompt, ``tokens`` new tokens each."""
    from roofline import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    prompts = [f"{PROMPT} {i}" for i in range(batch)] if batch > 1 else [PROMPT]
    llm.generate(prompts, params, use_tqdm=False)
    return llm.last_run_stats.mean_decode_step_s


class _HF:
    """HF transformers eager fp32 on the same GGUF weights: greedy, one sequence, KV cache on."""

    def __init__(self, path: Path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                          dtype=torch.float32).eval()
        self.ids = tok(PROMPT, return_tensors="pt").input_ids

    @torch.inference_mode()
    def step_s(self, tokens: int) -> float:
        out = self.model(self.ids, use_cache=True)
        pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        t = time.perf_counter()
        for _ in range(tokens - 1):
            out = self.model(nxt, past_key_values=pkv, use_cache=True)
            pkv, nxt = out.past_key_values, out.logits[:, -1].argmax(-1, keepdim=True)
        return (time.perf_counter() - t) / (tokens - 1)


# One llama.cpp measurement, run by the interpreter that has llama_cpp (``--llamacpp-python``): argv = GGUF path,
# threads, new tokens; prints seconds per decode token and the greedy text.
_LLAMACPP_CHILD = """
import sys, time, llama_cpp
path, threads, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
llm = llama_cpp.Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=512, verbose=False, seed=0)
def run(k):
    llm.reset()
    t = time.perf_counter()
    out = llm.create_completion(sys.argv[4], max_tokens=k, temperature=0.0, top_k=1)
    return time.perf_counter() - t, out["usage"]["completion_tokens"], out["choices"][0]["text"]
run(4)
(t_n, got, text), (t_1, _, _) = run(n), run(1)
print(llama_cpp.__version__, (t_n - t_1) / (got - 1), repr(text[:40]))
"""


class _LlamaCpp:
    """llama.cpp (llama-cpp-python, built with AVX-512 VNNI/BF16 and ``GGML_NATIVE=OFF``) on the same GGUF
    (Q4_1 blocks, Q8_0 embeddings): greedy (top_k 1), ``threads`` threads, batch 1, each measurement a fresh
    process of ``python`` (an interpreter that imports ``llama_cpp``; it need not be roofline's venv). Per decode
    token: (time of N new tokens - time of 1) / (N - 1), the KV cache reset between them."""

    def __init__(self, path: Path, threads: int, python: str):
        import subprocess

        self.path, self.threads, self.python = path, threads, python
        probe = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__)"],
                               capture_output=True, text=True)
        if probe.returncode != 0:
            raise ImportError(f"{python} cannot import llama_cpp: {probe.stderr.strip().splitlines()[-1:]}")
        self.version = probe.stdout.strip()
        self.weight_bytes = path.stat().st_size  # the GGUF's tensors are what a step reads (plus metadata)

    def step_s(self, tokens: int) -> float:
        import subprocess

        out = subprocess.run([self.python, "-c", _LLAMACPP_CHILD, str(self.path), str(self.threads), str(tokens),
                              PROMPT], capture_output=True, text=True, check=True, timeout=600).stdout.split()
        return float(out[1])


def _floors(engines: dict, best: dict, shape: dict, others: dict) -> dict[tuple[str, int], dict]:
    """Each roofline row's floor (``costmodel.decode_floor_report``): that engine's weight bytes per step plus
    the KV bytes its mean context reads, over one read bandwidth (the best of 3 probes here, so that every row
    is held to the same machine), against 2 x params x batch FLOPs over the GEMM rate of the format's
    arithmetic (fp32, bf16, or int8 for W8A8), the best of 3 probes each, in this process. HF's row: the fp32
    weight bytes; llama.cpp's: its GGUF file's bytes; both by memory alone (KV bytes left out, so lower)."""
    from roofline import costmodel
    from roofline import hardware as hw

    bandwidth = max(hw.measure_read_bandwidth("cpu") for _ in range(3))
    peaks: dict[str, float] = {}
    out = {}
    for (name, batch), s in best.items():
        llm = engines.get(name)
        if llm is None:  # HF / llama.cpp: below
            continue
        w = llm.engine.worker
        dtype = "int8" if w.quant_config is not None and w.quant_config.name == "int8" else \
            costmodel.canonical_dtype(w.dtype)
        if dtype not in peaks:
            peaks[dtype] = max(hw.measure_gemm_flops("cpu", dtype) for _ in range(3))
        mean_batch, kv_tokens = shape[name, batch]
        out[name, batch] = costmodel.decode_floor_report(
            weight_bytes=w.weight_bytes_per_step, kv_bytes_read=kv_tokens * w.kv_bytes_per_token,
            flops=2.0 * llm.engine.model_config.num_params * mean_batch, bandwidth_bytes_per_s=bandwidth,
            peak_flops=peaks[dtype], measured_step_s=s)
        out[name, batch].update(bandwidth_bytes_per_s=bandwidth, peak_flops=peaks[dtype],
                                weight_bytes=w.weight_bytes_per_step)
    for name, other in others.items():
        wb = getattr(other, "weight_bytes", None) or engines["roofline fp32"].engine.worker.weight_bytes_per_step
        out[name, 1] = costmodel.decode_floor_report(weight_bytes=wb, kv_bytes_read=0.0, flops=0.0,
                                                     bandwidth_bytes_per_s=bandwidth, peak_flops=None,
                                                     measured_step_s=best[name, 1])
        out[name, 1].update(weight_bytes=wb)
    print(f"floor inputs: read bandwidth {bandwidth / 1e9:.1f} GB/s (best of 3), GEMM rates "
          + ", ".join(f"{k} {v / 1e9:.0f} {costmodel.rate_unit(k, 'G')}" for k, v in peaks.items()))
    return out


def _with_16bit_head(llm):
    """``llm`` with its LM head back on the 16-bit ``F.linear`` (the INT8 head's copy dropped): the A/B of
    ``roofline.quant.int8.CpuW8A8LMHeadMethod`` inside one run."""
    head = llm.engine.worker.model.lm_head
    for name in ("qweight", "weight_scale"):
        if name in head._parameters:
            del head._parameters[name]
    return llm


def _unpacked_bf16():
    """A bf16 engine whose weights are not packed for oneDNN (``roofline.kernels.cpu_bf16``): the A/B of the
    packing inside one run."""
    from roofline import LLM
    from roofline.kernels import cpu_bf16

    old, cpu_bf16.PREPACK = cpu_bf16.PREPACK, False  # read when the weights are processed after loading
    try:
        return LLM(device="cpu", dtype="bfloat16", max_model_len=512)
    finally:
        cpu_bf16.PREPACK = old


def table(rounds: int = 3, tokens: int = 64, llamacpp: str | None = None, hf: bool = True,
          json_path: str | None = None, head_ab: bool = False, prepack_ab: bool = False) -> list[dict]:
    """The README's CPU table (module docstring), printed and returned as rows. ``llamacpp``: the Python
    interpreter that imports ``llama_cpp`` (None: no llama.cpp row). ``head_ab``: also the int8 engines with a
    16-bit LM head (rows named "..., 16-bit head"). ``prepack_ab``: also bf16 with unpacked weights."""
    from roofline import LLM
    from roofline.models.loader import default_model_path

    threads = torch.get_num_threads()
    feats = detect_cpu_features()
    print(startup_line(feats, "float32", threads))
    engines = {
        "roofline fp32": LLM(device="cpu", dtype="float32", max_model_len=512),
        "roofline bf16": LLM(device="cpu", dtype="bfloat16", max_model_len=512),
        "roofline int8 (W8A8)": LLM(device="cpu", dtype="float32", quantization="int8", max_model_len=512),
        "roofline bf16 + int8 (W8A8)": LLM(device="cpu", dtype="bfloat16", quantization="int8", max_model_len=512),
    }
    if head_ab:
        for dtype, name in (("float32", "roofline int8 (W8A8), 16-bit head"),
                            ("bfloat16", "roofline bf16 + int8 (W8A8), 16-bit head")):
            engines[name] = _with_16bit_head(LLM(device="cpu", dtype=dtype, quantization="int8", max_model_len=512))
    if prepack_ab:
        engines["roofline bf16, weights not prepacked"] = _unpacked_bf16()
    others: dict[str, object] = {}
    if hf:
        others["HF transformers eager fp32"] = _HF(default_model_path())
    if llamacpp:
        try:
            lc = _LlamaCpp(default_model_path(), threads, llamacpp)
            others[f"llama.cpp {lc.version} Q4_1 GGUF"] = lc
        except (ImportError, OSError) as e:
            print(f"llama.cpp: no row ({e}; build llama-cpp-python as the README's CPU section says)")
    for llm in engines.values():  # warm-up: first-call allocations, oneDNN primitive caches
        _roofline_step(llm, 1, 4)
        _roofline_step(llm, 32, 4)
    best: dict[tuple[str, int], float] = {}
    shape: dict[tuple[str, int], tuple[float, float]] = {}  # (mean batch, mean KV tokens read per step)
    for _ in range(rounds):
        for batch in (1, 32):
            for name, llm in engines.items():
                s = _roofline_step(llm, batch, tokens if batch == 1 else tokens // 2)
                if s < best.get((name, batch), float("inf")):
                    st = llm.last_run_stats
                    best[name, batch] = s
                    shape[name, batch] = (st.mean_decode_batch or batch, st.mean_decode_kv_tokens or 0.0)
        for name, other in others.items():
            s = other.step_s(tokens)
            best[name, 1] = min(best.get((name, 1), float("inf")), s)
    floors = _floors(engines, best, shape, others)
    rows = []
    base = best["roofline fp32", 1]
    hf_s = best.get(("HF transformers eager fp32", 1))
    print(f"{'engine':38s} {'batch':>5s} {'step ms':>8s} {'tok/s':>8s} {'floor ms':>8s} {'of floor':>8s} "
          f"{'tok/s / fp32 b1':>10s} {'vs HF':>6s}")
    for (name, batch), s in sorted(best.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        fl = floors.get((name, batch), {})
        floor_ms = fl.get("floor_s", 0.0) * 1e3
        row = dict(engine=name, batch=batch, step_ms=s * 1e3, tok_per_s=batch / s, floor_ms=floor_ms or None,
                   fraction_of_floor=(fl["floor_s"] / s) if fl else None, bound_by=fl.get("bound_by"),
                   weight_bytes=fl.get("weight_bytes"))
        rows.append(row)
        floor_txt = f"{floor_ms:8.2f} {fl['floor_s'] / s:8.0%}" if fl else f"{'-':>8s} {'-':>8s}"
        vs_hf = f"{hf_s / s:6.2f}" if hf_s and batch == 1 else f"{'':>6s}"
        print(f"{name:38s} {batch:5d} {s * 1e3:8.2f} {batch / s:8.1f} {floor_txt} {base / s * batch:10.2f} {vs_hf}")
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        import datetime
        import subprocess

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=Path(__file__).parent).stdout.strip() or None
        Path(json_path).write_text(json.dumps(dict(
            benchmark="cpu-formats", date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            git_commit=commit, torch=torch.__version__, cpu=startup_line(feats, "float32", threads),
            threads=threads, rounds=rounds, tokens=tokens, prompt=PROMPT, rows=rows), indent=1))
    return rows


_TABLE_ONLY = ("rounds", "tokens", "llamacpp", "no_hf", "head_ab", "prepack_ab", "json")


def add_arguments(p) -> None:
    """The ``--gemm`` / ``--table`` options, on ``python -m roofline.bench.cpu``'s one parser."""
    p.add_argument("--gemm", action="store_true", help="(d): the decode step's linears in each format")
    p.add_argument("--table", action="store_true", help="(e): the README's CPU table, end to end")
    p.add_argument("--rounds", type=int, default=None, help="--table: rounds, the best kept (>= 1; default 3)")
    p.add_argument("--tokens", type=int, default=None,
                   help="--table: new tokens at batch 1 (>= 4; half at 32; default 64)")
    p.add_argument("--llamacpp", nargs="?", const=sys.executable, default=None, metavar="PYTHON",
                   help="--table: add llama.cpp: the interpreter that imports llama_cpp (default: this one)")
    p.add_argument("--no-hf", action="store_true", help="--table: leave out HF transformers eager")
    p.add_argument("--head-ab", action="store_true",
                   help="--table: add the int8 rows with a 16-bit LM head (the INT8 head's A/B, same rounds)")
    p.add_argument("--prepack-ab", action="store_true",
                   help="--table: add bf16 with its weights not packed for oneDNN (the packing's A/B, same rounds)")
    p.add_argument("--json", default=None, metavar="PATH", help="--table: write the rows as JSON")


def check_arguments(p, args) -> None:
    """Refuse what ``add_arguments``' options cannot mean, before anything runs, then fill the defaults.

    Raises:
        SystemExit: (``p.error``, exit 2) a --table option without --table, ``--rounds`` < 1, ``--tokens`` < 4,
            or a ``--json`` path that is empty, a directory or in a missing directory (names the value).
    """
    if not args.table:
        given = [f"--{name.replace('_', '-')}" for name in _TABLE_ONLY if getattr(args, name) not in (None, False)]
        if given:
            p.error(f"{', '.join(given)} appl{'ies' if len(given) == 1 else 'y'} to --table only; add --table "
                    f"or drop {'it' if len(given) == 1 else 'them'}")
    if args.rounds is not None and args.rounds < 1:
        p.error(f"--rounds must be >= 1, got {args.rounds}")
    if args.tokens is not None and args.tokens < 4:
        p.error(f"--tokens must be >= 4, got {args.tokens}")
    if args.json is not None:
        if not args.json.strip():
            p.error(f"--json needs a file path, got {args.json!r}")
        if os.path.isdir(args.json):
            p.error(f"--json {args.json!r} is a directory; give a file path")
        parent = os.path.dirname(os.path.abspath(args.json))
        if not os.path.isdir(parent):
            p.error(f"--json {args.json!r}: the directory {parent!r} does not exist")
    args.rounds = 3 if args.rounds is None else args.rounds
    args.tokens = 64 if args.tokens is None else args.tokens


def run(args) -> None:
    """Run (d) and/or (e) for parsed ``args`` (``add_arguments``, checked by ``check_arguments``)."""
    if args.gemm:
        print(startup_line(detect_cpu_features(), "float32", torch.get_num_threads()))
        gemm_rates()
    if args.table:
        table(args.rounds, args.tokens, args.llamacpp, not args.no_hf, args.json, args.head_ab, args.prepack_ab)
