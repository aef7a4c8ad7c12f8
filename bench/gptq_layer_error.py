"""GPTQ against round-to-nearest, layer by layer, on the default model's captured linear inputs (CPU, fp32).

For every input-sharing group (q/k/v, o, gate/up, down of each layer) it captures, from calibration windows
(``calibration_samples``, the front of the ShareGPT shuffle) and from held-out windows after them:
- ``H_cal``: ``2/n sum_t x_t^T x_t`` over the calibration tokens (what ``gptq_quantize`` minimizes);
- ``H_test``: the same over the held-out windows, and ``H_test_rest`` without the first token of each window
  (the attention-sink token whose activations are orders of magnitude larger in some channels).

and prints the relative output error ``tr(dW H dW^T) / tr(W H W^T)`` (= ||W X - Q X||^2 / ||W X||^2 over the
tokens of H) of RTN and GPTQ at one group size, per group, with a summary (how many layers GPTQ loses).

    python bench/gptq_layer_error.py --group-size 64 --calib-samples 32 --test-samples 16
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def capture(llm, samples, groups):
    """``{module: (H_all [K, K], H_first [K, K], n_all, n_first)}`` sums of x^T x (not normalized)."""
    model = llm.engine.worker.model
    acc: dict[str, list] = {}
    handles = []
    for g in groups:
        def hook(_m, args, name=g.module):
            x = args[0].detach().reshape(-1, args[0].shape[-1]).float()
            a = acc.setdefault(name, [0.0, 0.0, 0, 0])
            a[0] = a[0] + x.T @ x
            a[1] = a[1] + torch.outer(x[0], x[0])
            a[2] += x.shape[0]
            a[3] += 1
        handles.append(model.get_submodule(g.module).register_forward_pre_hook(hook))
    try:
        for ids in samples:
            llm.score_logprobs(ids, chunk_size=len(ids))  # one chunk: row 0 of the hook's x is the window's first token
    finally:
        for h in handles:
            h.remove()
    return acc


def rel_err(dw: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> float:
    dw, w, h = dw.double(), w.double(), h.double()
    return float(((dw @ h) * dw).sum() / ((w @ h) * w).sum())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--test-samples", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--desc-act", action="store_true")
    p.add_argument("--output-json", default=None)
    args = p.parse_args()

    from roofline import LLM
    from roofline.calibration import calibration_samples, dense_state_dict
    from roofline.quant.calibrate import linear_groups
    from roofline.quant.calibrate.gptq import gptq_quantize
    from roofline.quant.quantize import quantize_int4_rtn

    torch.set_grad_enabled(False)
    t0 = time.perf_counter()
    n = args.calib_samples + args.test_samples
    llm = LLM(device="cpu", dtype="float32", max_model_len=args.seq_len + 1,
              num_kv_blocks=-(-(args.seq_len + 1) // 16) + 8, max_num_batched_tokens=args.seq_len,
              enable_prefix_caching=False, enforce_eager=True)
    samples = calibration_samples(llm.tokenizer, n, args.seq_len)
    groups = linear_groups(llm.engine.model_config)
    state = dense_state_dict(llm)
    cal = capture(llm, samples[:args.calib_samples], groups)
    test = capture(llm, samples[args.calib_samples:], groups)
    print(f"captured {n} x {args.seq_len} tokens in {time.perf_counter() - t0:.0f} s")
    rows = []
    gs = args.group_size
    for g in groups:
        w = torch.cat([state[f"{lin}.weight"].float() for lin in g.linears])
        ha, hf, na, nf = cal[g.module]
        h_cal = ha * (2.0 / na)
        h_cal_rest = (ha - hf) * (2.0 / (na - nf))
        ta, tf, tn, tnf = test[g.module]
        h_test = ta * (2.0 / tn)
        h_test_rest = (ta - tf) * (2.0 / (tn - tnf))
        q_rtn = quantize_int4_rtn(w, gs).dequantize()
        q_gptq = gptq_quantize(w, h_cal, gs, desc_act=args.desc_act).dequantize()
        q_gptq_rest = gptq_quantize(w, h_cal_rest, gs, desc_act=args.desc_act).dequantize()
        r = {"module": g.module}
        for qname, q in (("rtn", q_rtn), ("gptq", q_gptq), ("gptq_rest", q_gptq_rest)):
            dw = q - w
            r[f"{qname}_cal"] = rel_err(dw, w, h_cal)
            r[f"{qname}_test"] = rel_err(dw, w, h_test)
            r[f"{qname}_test_rest"] = rel_err(dw, w, h_test_rest)
        # How much of H's trace the first tokens carry.
        r["first_token_trace_share"] = float(torch.trace(hf) / torch.trace(ha))
        rows.append(r)
        print(f"{g.module:42s} first-token share of tr(H) {r['first_token_trace_share']:.3f} | own objective "
              f"rtn {r['rtn_cal']:.2e} gptq {r['gptq_cal']:.2e} | held-out w/o first token: rtn "
              f"{r['rtn_test_rest']:.2e} gptq {r['gptq_test_rest']:.2e} gptq(H w/o first) "
              f"{r['gptq_rest_test_rest']:.2e}", flush=True)
    for key in ("cal", "test", "test_rest"):
        lose = [r["module"] for r in rows if r[f"gptq_{key}"] > r[f"rtn_{key}"]]
        lose2 = [r["module"] for r in rows if r[f"gptq_rest_{key}"] > r[f"rtn_{key}"]]
        print(f"{key}: GPTQ loses to RTN on {len(lose)}/{len(rows)} groups, GPTQ(H w/o first token) on "
              f"{len(lose2)}/{len(rows)}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump({"args": vars(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
