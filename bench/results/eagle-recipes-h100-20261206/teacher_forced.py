"""Teacher-forced agreement of EAGLE heads (directories as arguments) on `roofline bench spec`'s 8 held-out ShareGPT
prompts: the target (fp32, CPU) answers greedily (128 tokens), then each head reads the true features and tokens;
top-1 / top-3 (over its draft vocabulary) against the target's argmax, on the rows that predict answer tokens and on all rows."""
import sys, torch
from roofline import LLM, SamplingParams
from roofline.bench.spec import workload_prompts
from roofline.spec_decode import features, train
from roofline.spec_decode.features import target_parts
from roofline.spec_decode.heads import EagleHead, load_head

llm = LLM(dtype="float32", device="cpu", max_model_len=1024)
tok = llm.tokenizer
texts = workload_prompts("sharegpt", tok, 8, seed=0)
prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True) for t in texts]
prompts = [p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p for p in prompts]
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=128), use_tqdm=False)
seqs = [(list(p) + list(o.outputs[0].token_ids), len(p)) for p, o in zip(prompts, outs)]
feats = [features.target_features(llm, ids) for ids, _ in seqs]
_, embed, W, cos_sin = target_parts(llm, torch.device("cpu"))
for d in sys.argv[1:]:
    cfg, t = load_head(d, "eagle")
    head = EagleHead(cfg)
    with torch.no_grad():
        head.fc.weight.copy_(t["fc.weight"]); head.fc.bias.copy_(t["fc.bias"])
    head.layer.load_hf_state_dict({k[6:]: v for k, v in t.items() if k.startswith("layer.")})
    tmap = t.get("token_map")
    a1 = a3 = a1all = n = nall = 0
    with torch.no_grad():
        for (ids, plen), f in zip(seqs, feats):
            ids_t = torch.tensor(ids)
            T = len(ids)
            pred = head(f[:-1], embed[ids_t[1:]], torch.arange(T - 1), cos_sin)
            # row p predicts f_{p+1} -> token p+2; the target's token p+2 is ids[p+2]
            logits = pred @ W.T
            if tmap is not None:
                sub = logits[:, tmap]
                top = tmap[sub.topk(3, dim=-1).indices]
            else:
                top = logits.topk(3, dim=-1).indices
            want = (f[1:] @ W.T).argmax(-1)
            rows = torch.arange(T - 1)
            ans = rows >= plen - 2  # predicting answer tokens (p + 2 >= plen)
            ans &= rows < T - 2
            a1 += int((top[ans, 0] == want[ans]).sum()); a3 += int((top[ans] == want[ans, None]).any(-1).sum()); n += int(ans.sum())
            a1all += int((top[:, 0] == want).sum()); nall += T - 1
    print(f"{d}: answer rows {n}: top-1 {a1/n:.3f} top-3 {a3/n:.3f}; all rows top-1 {a1all/nall:.3f}", flush=True)
