"""End-to-end GPTQ variants against RTN on the default model (CPU, fp32): KL(dense || quantized), perplexity and
top-1 agreement on held-out eval tokens, each quantized model loaded densely (dequantized weights) into a dummy
copy of the architecture, as ``tests/quant/test_calibrate.py``'s default-model test does.

Variants, at each group size: rtn; gptq from the raw Hessian ``2/n sum_t x_t^T x_t``; gptq from Hessians whose
rows' norms are capped at C x the median row norm of their 512-token chunk (``capture.cap_row_norms``), for each
C in ``--caps``. One capture pass gives every Hessian (H does not depend on the group size); the model weights
are the same fp32 ones for every variant, the eval tokens the same held-out ShareGPT windows.

    python bench/gptq_variants.py --group-sizes 64,32 --calib-samples 8 --eval-tokens 2048 --caps 10,3
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--group-sizes", default="64,32")
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--caps", default="10,3")
    p.add_argument("--damps", default="", help="extra gptq variants at these percdamp values (capped H at the "
                                                "first cap)")
    p.add_argument("--sequential", action="store_true",
                   help="also gptq from Hessians captured on the gptq-quantized model (two passes)")
    p.add_argument("--skip-caps", action="store_true", help="only the damp / sequential variants")
    p.add_argument("--seq-damp", type=float, default=0.01, help="percdamp of both sequential passes")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    from roofline import LLM
    from roofline.calibration import calibration_samples, dense_state_dict
    from roofline.eval.data import load_heldout_text
    from roofline.models.loader import load_weights
    from roofline.quant.calibrate import linear_groups, quantize_state
    from roofline.quant.calibrate.capture import cap_row_norms
    from roofline.quant.calibrate.gptq import gptq_quantize, split_rows
    from roofline.quant.quantize import Int4Weight

    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    llm = LLM(device="cpu", dtype="float32", max_model_len=1024, num_kv_blocks=80,
              max_num_batched_tokens=args.seq_len, enable_prefix_caching=False, enforce_eager=True)
    caps = [float(c) for c in args.caps.split(",") if c]
    groups = linear_groups(llm.engine.model_config)
    state = dense_state_dict(llm)
    heldout = load_heldout_text(llm.tokenizer, args.eval_tokens).token_ids
    windows = [heldout[i:i + 1024] for i in range(0, len(heldout), 1024)]
    ref = [llm.score_logprobs(w) for w in windows]
    samples = calibration_samples(llm.tokenizer, args.calib_samples, args.seq_len)
    # Raw and capped x^T x of every group's input, per chunk (one sample = one chunk of seq_len tokens).
    sums: dict[str, dict] = {g.module: {} for g in groups}
    handles = []
    hooks = {}
    for g in groups:
        def hook(_m, a, acc=sums[g.module]):
            x = a[0].detach().reshape(-1, a[0].shape[-1]).float()
            acc["n"] = acc.get("n", 0) + x.shape[0]
            for cap in [None, *caps]:
                xc = x if cap is None else cap_row_norms(x, cap)
                acc[cap] = acc[cap] + xc.T @ xc if cap in acc else xc.T @ xc
        hooks[g.module] = hook
        handles.append(llm.engine.worker.model.get_submodule(g.module).register_forward_pre_hook(hook))
    def run_capture() -> None:
        for ids in samples:
            llm.score_logprobs(ids, chunk_size=len(ids))

    run_capture()
    for h in handles:
        h.remove()
    print(f"reference and capture in {time.perf_counter() - t0:.0f} s", flush=True)

    def gptq(cap, gs: int, damp: float = 0.01, source: dict | None = None) -> dict:
        out = dict(state)
        for g in groups:
            ws = [state[f"{lin}.weight"] for lin in g.linears]
            src = (source or sums)[g.module]
            hess = src[cap] * (2.0 / src["n"])
            qw = gptq_quantize(torch.cat(ws).float(), hess, gs, damp_percent=damp, name=g.module)
            for lin, part in zip(g.linears, split_rows(qw, [w.shape[0] for w in ws]), strict=True):
                out[f"{lin}.weight"] = part
        return out

    def dense(out: dict) -> dict:
        return {n: t.dequantize() if isinstance(t, Int4Weight) else t for n, t in out.items()}

    def score(out: dict) -> dict:
        load_weights(llm.engine.worker.model, iter(dense(out).items()))
        kl = nll = agree = n = 0.0
        for w, r in zip(windows, ref, strict=True):
            lp = llm.score_logprobs(w)
            tgt = torch.tensor(w[1:])
            kl += float((r.exp() * (r - lp)).sum(-1)[:-1].sum())
            nll += float(-lp[:-1].gather(1, tgt[:, None]).sum())
            agree += float((lp[:-1].argmax(-1) == r[:-1].argmax(-1)).sum())
            n += len(w) - 1
        load_weights(llm.engine.worker.model, iter(state.items()))
        return {"kl": kl / n, "ppl": float(torch.tensor(nll / n).exp()), "top1": agree / n}

    base_nll = 0.0
    n = 0
    for w, r in zip(windows, ref, strict=True):
        base_nll += float(-r[:-1].gather(1, torch.tensor(w[1:])[:, None]).sum())
        n += len(w) - 1
    rows = {"dense": {"kl": 0.0, "ppl": float(torch.tensor(base_nll / n).exp()), "top1": 1.0}}
    for gs in [int(g) for g in args.group_sizes.split(",")]:
        rows[f"rtn g{gs}"] = score(quantize_state(state, groups, {}, "rtn", group_size=gs))
        print(f"rtn g{gs}", rows[f"rtn g{gs}"], flush=True)
        for cap in [] if args.skip_caps else [None, *caps]:
            name = f"gptq g{gs} " + ("raw H" if cap is None else f"H rows capped at {cap:g}x median")
            rows[name] = score(gptq(cap, gs))
            print(name, rows[name], flush=True)
        for damp in [float(d) for d in args.damps.split(",") if d]:
            name = f"gptq g{gs} damp {damp:g} (H capped at {caps[0]:g}x)"
            rows[name] = score(gptq(caps[0], gs, damp))
            print(name, rows[name], flush=True)
        if args.sequential:
            # Pass 2: every group's inputs from the model quantized by pass 1 (earlier layers quantized).
            first = gptq(caps[0], gs, args.seq_damp)
            load_weights(llm.engine.worker.model, iter(dense(first).items()))
            saved = {m: dict(v) for m, v in sums.items()}
            for v in sums.values():
                v.clear()
            hs = [llm.engine.worker.model.get_submodule(g.module).register_forward_pre_hook(hooks[g.module])
                  for g in groups]
            run_capture()
            for h in hs:
                h.remove()
            seq = {m: dict(v) for m, v in sums.items()}
            for m in sums:
                sums[m].clear()
                sums[m].update(saved[m])
            load_weights(llm.engine.worker.model, iter(state.items()))
            name = f"gptq g{gs} sequential (2 passes, damp {args.seq_damp:g}, H capped at {caps[0]:g}x)"
            rows[name] = score(gptq(caps[0], gs, args.seq_damp, source=seq))
            print(name, rows[name], flush=True)
    print(json.dumps(rows, indent=1))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
