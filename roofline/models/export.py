"""Save a loaded model as a Hugging Face checkpoint directory (config.json, safetensors, tokenizer).

Used to turn the GGUF default model into safetensors (and so test the safetensors loader against the same
weights), and by anyone who wants an HF copy of a model the engine loaded.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from roofline.config import ModelConfig


def hf_state_dict(model: torch.nn.Module, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Our fused parameters split back into Hugging Face tensor names (contiguous CPU copies).

    Only for unquantized, unsharded models (tensor-parallel size 1).
    """
    out: dict[str, torch.Tensor] = {}
    packed = getattr(model, "packed_modules_mapping", {})
    for name, p in model.named_parameters():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        module_name, kind = name.rsplit(".", 1)
        parent, leaf = module_name.rsplit(".", 1) if "." in module_name else ("", module_name)
        if leaf in packed:
            sizes = model.get_submodule(module_name).output_partition_sizes
            start = 0
            for hf_leaf, size in zip(packed[leaf], sizes, strict=True):
                out[f"{parent}.{hf_leaf}.{kind}"] = p.detach().narrow(0, start, size).cpu().contiguous().clone()
                start += size
        else:
            out[name] = p.detach().cpu().contiguous().clone()
    return out


def save_hf_checkpoint(
    model: torch.nn.Module, config: ModelConfig, path: str | Path, tokenizer: Any = None,
    num_shards: int = 1,
) -> Path:
    """Write config.json, ``model.safetensors`` (or ``num_shards`` shards plus an index) and tokenizer files."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config.to_hf_config(), indent=2))
    tensors = hf_state_dict(model, config)
    names = sorted(tensors)
    if num_shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    else:
        weight_map = {}
        per = (len(names) + num_shards - 1) // num_shards
        for i in range(num_shards):
            chunk = names[i * per:(i + 1) * per]
            fname = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
            save_file({n: tensors[n] for n in chunk}, str(path / fname), metadata={"format": "pt"})
            weight_map.update({n: fname for n in chunk})
        index = {"metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
                 "weight_map": weight_map}
        (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path
