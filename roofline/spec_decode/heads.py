"""Learned draft heads on the target's features (its final, normed hidden states, the LM head's input):
the modules ``roofline train-draft`` trains, their JSON config and the safetensors layout the proposers load.

- **EAGLE-1** (Li et al., "EAGLE: Speculative Sampling Requires Rethinking Feature Uncertainty", ICML 2024):
  ``fc(concat(f_p, embed(t_{p+1})))`` [2H -> H] into one decoder layer of the target's architecture, predicting
  the next feature f_{p+1}; the target's frozen LM head turns it into the distribution of t_{p+2}. Trained on
  smooth-L1 feature regression plus 0.1 x cross-entropy against the target's own next-token distribution.
- **Medusa-1** (Cai et al., "Medusa: Simple LLM Inference Acceleration Framework with Multiple Decoding
  Heads", 2024): K heads, head k (1-based) a residual block ``h + SiLU(W_k h + b_k)`` into the shared LM head,
  predicting token t_{p+1+k} from f_p.

Tensor names in ``model.safetensors`` (EAGLE): ``fc.weight`` [H, 2H], ``fc.bias`` [H],
``layer.input_layernorm.weight``, ``layer.self_attn.{q,k,v,o}_proj.weight``, ``layer.mlp.{gate,up,down}_proj.weight``,
``layer.post_attention_layernorm.weight`` (Hugging Face's names inside one Llama layer), with a truncated draft
vocabulary ``token_map`` [draft_vocab_size] int64 (target ids, most frequent first) and, with ``aux_layers`` (n of
them, EAGLE-3's fused low / mid-level features, ``fuse_features``), ``fuse.weight`` [H, nH]; (Medusa)
``heads.{k}.weight`` [H, H] and ``heads.{k}.bias`` [H] for k in [0, K).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from roofline.kernels.rope_cache import ref_rotary

HEAD_METHODS = ("eagle", "medusa")
CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


@dataclass(frozen=True)
class DraftHeadConfig:
    """A trained head's ``config.json``: the method, the target's name and the sizes a loader checks
    (``hidden_size``, ``vocab_size``), the EAGLE layer's shape (the target's), Medusa's head count, and how it
    was trained (``training``: free-form figures for the record)."""

    method: str
    target: str
    hidden_size: int
    vocab_size: int
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    head_dim: int = 0
    intermediate_size: int = 0
    rms_norm_eps: float = 1e-5
    num_heads: int = 0  # Medusa's K
    # EAGLE: a truncated draft vocabulary (FR-Spec; SGLang's --speculative-token-map): the draft's LM head over
    # these many target tokens, ``token_map`` [draft_vocab_size] int64 in model.safetensors (0: the whole vocabulary)
    draft_vocab_size: int = 0
    # EAGLE: EAGLE-3's low / mid-level features fused into the input (``EagleHead``): the target decoder layers
    # whose input residual stream the head also reads ([] : EAGLE-1's final features alone)
    aux_layers: list[int] = field(default_factory=list)
    training: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.method not in HEAD_METHODS:
            raise ValueError(f"draft head method must be one of {', '.join(HEAD_METHODS)}, got {self.method!r}")
        if self.draft_vocab_size and (self.method != "eagle" or not 1 <= self.draft_vocab_size <= self.vocab_size):
            raise ValueError(f"draft_vocab_size must be 0 (the whole vocabulary) or, for an eagle head, in [1, "
                             f"{self.vocab_size}], got {self.draft_vocab_size!r} for a {self.method} head")
        if self.aux_layers and self.method != "eagle":
            raise ValueError(f"aux_layers applies to eagle heads only, got {self.aux_layers!r} for {_a(self.method)} "
                             f"head")
        if not isinstance(self.aux_layers, (list, tuple)) or not all(
                type(i) is int and i >= 0 for i in self.aux_layers) or len(set(self.aux_layers)) != len(
                self.aux_layers):
            raise ValueError(f"aux_layers must be a list of distinct decoder layer indices >= 0 (integers), got "
                             f"{self.aux_layers!r}")
        if self.method == "medusa" and not 1 <= self.num_heads <= 16:
            raise ValueError(f"a Medusa head config needs num_heads in [1, 16], got {self.num_heads!r}")

    @classmethod
    def for_target(cls, method: str, mc: Any, num_heads: int = 0,
                   aux_layers: list[int] | tuple[int, ...] = ()) -> DraftHeadConfig:
        """The config of a ``method`` head for target ``mc`` (a ``ModelConfig``)."""
        return cls(method=method, target=mc.name, hidden_size=mc.hidden_size, vocab_size=mc.vocab_size,
                   num_attention_heads=mc.num_attention_heads, num_key_value_heads=mc.num_key_value_heads,
                   head_dim=mc.head_dim, intermediate_size=mc.intermediate_size, rms_norm_eps=mc.rms_norm_eps,
                   num_heads=num_heads, aux_layers=list(aux_layers))

    def check_target(self, mc: Any, path: str) -> None:
        """Raises ValueError naming both hidden sizes and both vocabularies when the head at ``path`` was not
        made for a target of ``mc``'s shape."""
        if (self.hidden_size, self.vocab_size) != (mc.hidden_size, mc.vocab_size):
            raise ValueError(
                f"speculative_config model {path!r}: this {self.method} head has hidden size {self.hidden_size} and "
                f"vocabulary {self.vocab_size}; the target {mc.name!r} has hidden size {mc.hidden_size} and "
                f"vocabulary {mc.vocab_size} (the head's config says it was trained for {self.target!r})")
        if self.aux_layers and max(self.aux_layers) >= mc.num_hidden_layers:
            raise ValueError(f"speculative_config model {path!r}: this eagle head reads the target's layers "
                             f"{self.aux_layers}; the target {mc.name!r} has layers [0, {mc.num_hidden_layers})")
        if self.method == "eagle" and (self.num_attention_heads, self.num_key_value_heads, self.head_dim,
                                       self.intermediate_size) != (mc.num_attention_heads, mc.num_key_value_heads,
                                                                   mc.head_dim, mc.intermediate_size):
            raise ValueError(f"speculative_config model {path!r}: the EAGLE layer's shape (heads "
                             f"{self.num_attention_heads}/{self.num_key_value_heads}, head_dim {self.head_dim}, "
                             f"MLP {self.intermediate_size}) is not the target {mc.name!r}'s "
                             f"({mc.num_attention_heads}/{mc.num_key_value_heads}, {mc.head_dim}, "
                             f"{mc.intermediate_size})")


def _a(word: str) -> str:
    """``word`` with its indefinite article ("an eagle", "a medusa")."""
    return f"{'an' if word[:1] in 'aeiou' else 'a'} {word}"


def _rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()).to(x.dtype)


class EagleLayer(nn.Module):
    """One Llama decoder layer in plain torch (training; causal attention over one sequence or a right-padded
    batch of them)."""

    def __init__(self, cfg: DraftHeadConfig):
        super().__init__()
        h, nh, nkv, d = cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.cfg = cfg
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(h, nh * d, bias=False)
        self.k_proj = nn.Linear(h, nkv * d, bias=False)
        self.v_proj = nn.Linear(h, nkv * d, bias=False)
        self.o_proj = nn.Linear(nh * d, h, bias=False)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """x [T, H] (one sequence) or [B, T, H] (B sequences, right-padded: causal attention keeps a row from
        reading the padding after it), positions [T] (shared) or [B, T] -> same shape as x."""
        c = self.cfg
        single = x.dim() == 2
        if single:
            x = x[None]
        b, t = x.shape[:2]
        pos = positions.expand(b, t).reshape(-1) if positions.dim() == 1 else positions.reshape(-1)
        h = _rmsnorm(x, self.input_layernorm, c.rms_norm_eps)
        q = self.q_proj(h).view(b * t, c.num_attention_heads, c.head_dim)
        k = self.k_proj(h).view(b * t, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(h).view(b, t, c.num_key_value_heads, c.head_dim)
        q, k = ref_rotary(pos, q, k, cos_sin)
        q, k = q.view(b, t, c.num_attention_heads, c.head_dim), k.view(b, t, c.num_key_value_heads, c.head_dim)
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        h = _rmsnorm(x, self.post_attention_layernorm, c.rms_norm_eps)
        x = x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))
        return x[0] if single else x

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Hugging Face's names inside one layer (see the module docstring)."""
        sd = {"input_layernorm.weight": self.input_layernorm, "post_attention_layernorm.weight":
              self.post_attention_layernorm}
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            sd[f"self_attn.{n}.weight"] = getattr(self, n).weight
        for n in ("gate_proj", "up_proj", "down_proj"):
            sd[f"mlp.{n}.weight"] = getattr(self, n).weight
        return {k: v.detach() for k, v in sd.items()}

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            self.input_layernorm.copy_(sd["input_layernorm.weight"])
            self.post_attention_layernorm.copy_(sd["post_attention_layernorm.weight"])
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                getattr(self, n).weight.copy_(sd[f"self_attn.{n}.weight"])
            for n in ("gate_proj", "up_proj", "down_proj"):
                getattr(self, n).weight.copy_(sd[f"mlp.{n}.weight"])


def fuse_features(top: torch.Tensor, aux: torch.Tensor, fuse_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """EAGLE-3's feature fusion on EAGLE-1's input: the final normed features ``top`` [..., H] and n residual streams
    of lower layers ``aux`` [..., nH] -> f + W [rms(a_1) | ... | rms(a_n)], [..., H] in ``top``'s dtype; each a_i
    scaled to unit RMS (no weight; the residual stream grows with depth), ``fuse_weight`` W [H, nH]."""
    h = top.shape[-1]
    a = F.rms_norm(aux.unflatten(-1, (-1, h)).float(), (h,), eps=eps).flatten(-2).to(fuse_weight.dtype)
    return top + F.linear(a, fuse_weight).to(top.dtype)


class EagleHead(nn.Module):
    """EAGLE-1's draft (module docstring). ``forward(features [T, H], next_embeds [T, H], positions [T])`` ->
    predicted next features [T, H]: row p reads f_p and the embedding of token p + 1 (or [B, T, H] each, a
    right-padded batch, ``EagleLayer``). With ``cfg.aux_layers`` (n of them) the features may be
    [..., (1 + n) H] (f, then the streams), fused by ``fuse_features`` through ``fuse`` [H, nH], which starts at zero: the head then starts
    as the EAGLE-1 head it may be initialised from (Li et al., "EAGLE-3: Scaling up Inference Acceleration of
    Large Language Models via Training-Time Test", 2025, fuses low, middle and top-layer features)."""

    def __init__(self, cfg: DraftHeadConfig):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layer = EagleLayer(cfg)
        self.fuse = None
        if cfg.aux_layers:
            self.fuse = nn.Linear(len(cfg.aux_layers) * cfg.hidden_size, cfg.hidden_size, bias=False)
            nn.init.zeros_(self.fuse.weight)

    def forward(self, features: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor,
                cos_sin: torch.Tensor) -> torch.Tensor:
        h = self.cfg.hidden_size
        if self.fuse is not None and features.shape[-1] > h:  # the head's own features (width H) pass unfused
            features = fuse_features(features[..., :h], features[..., h:], self.fuse.weight, self.cfg.rms_norm_eps)
        return self.layer(self.fc(torch.cat([features, next_embeds], dim=-1)), positions, cos_sin)

    def load_export(self, sd: dict[str, torch.Tensor]) -> None:
        """Load ``export``'s tensors (an EAGLE-1 head's into a fused one: ``fuse`` stays at zero)."""
        with torch.no_grad():
            self.fc.weight.copy_(sd["fc.weight"])
            self.fc.bias.copy_(sd["fc.bias"])
            if self.fuse is not None and "fuse.weight" in sd:
                self.fuse.weight.copy_(sd["fuse.weight"])
        self.layer.load_hf_state_dict({k[len("layer."):]: v for k, v in sd.items() if k.startswith("layer.")})

    def export(self) -> dict[str, torch.Tensor]:
        sd = {"fc.weight": self.fc.weight.detach(), "fc.bias": self.fc.bias.detach()}
        if self.fuse is not None:
            sd["fuse.weight"] = self.fuse.weight.detach()
        sd.update({f"layer.{k}": v for k, v in self.layer.hf_state_dict().items()})
        return sd


class MedusaHeads(nn.Module):
    """Medusa-1's K residual blocks. ``forward(features [N, H])`` -> [K, N, H], head k's input to the LM head
    (token p + 2 + k for k in [0, K) from the feature at p). ``W_k`` starts at zero, so every head starts as
    the target's own next-token head (Medusa's initialization)."""

    def __init__(self, cfg: DraftHeadConfig):
        super().__init__()
        self.cfg = cfg
        self.heads = nn.ModuleList(nn.Linear(cfg.hidden_size, cfg.hidden_size) for _ in range(cfg.num_heads))
        for h in self.heads:
            nn.init.zeros_(h.weight)
            nn.init.zeros_(h.bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return torch.stack([features + F.silu(h(features)) for h in self.heads])

    def export(self) -> dict[str, torch.Tensor]:
        return {k: v.detach() for k, v in self.state_dict().items()}


def save_head(directory: str, cfg: DraftHeadConfig, tensors: dict[str, torch.Tensor],
              dtype: torch.dtype = torch.float32) -> None:
    """Write ``config.json`` and ``model.safetensors`` (floating tensors in ``dtype``, integer ones as they are,
    contiguous) into ``directory``."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file({k: (v.detach().to(dtype) if v.is_floating_point() else v.detach()).contiguous().cpu()
               for k, v in tensors.items()},
              os.path.join(directory, WEIGHTS_NAME))
    with open(os.path.join(directory, CONFIG_NAME), "w") as f:
        json.dump(asdict(cfg), f, indent=1)
    # safetensors writes its file 0600; give it config.json's mode (the umask's), so a shared head dir is readable
    os.chmod(os.path.join(directory, WEIGHTS_NAME), os.stat(os.path.join(directory, CONFIG_NAME)).st_mode & 0o777)


def load_head(directory: str, method: str) -> tuple[DraftHeadConfig, dict[str, torch.Tensor]]:
    """The config and tensors (floating ones in fp32) of the head in ``directory``.

    Raises:
        ValueError: the directory lacks ``config.json`` or ``model.safetensors``, holds a head of another
            method (names both), or a ``token_map`` that does not match ``draft_vocab_size``.
    """
    from safetensors.torch import load_file

    cfg = read_head_config(directory, method)
    wpath = os.path.join(directory, WEIGHTS_NAME)
    tensors = {k: v.float() if v.is_floating_point() else v for k, v in load_file(wpath).items()}
    fw, h, n = tensors.get("fuse.weight"), cfg.hidden_size, len(cfg.aux_layers)
    if (fw is None) != (n == 0) or (fw is not None and (tuple(fw.shape) != (h, n * h) or not fw.is_floating_point())):
        found = "none" if fw is None else f"{tuple(fw.shape)} {str(fw.dtype).replace('torch.', '')}"
        raise ValueError(f"speculative_config model {directory!r}: aux_layers {cfg.aux_layers} needs "
                         + (f"a floating fuse.weight of shape [{h}, {n * h}]" if n else "no fuse.weight")
                         + f", found {found}")
    bad = [k for k, v in tensors.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
    if bad:
        raise ValueError(f"speculative_config model {directory!r}: non-finite values (NaN or inf) in {', '.join(bad)}")
    tm = tensors.get("token_map")
    if cfg.draft_vocab_size and (tm is None or tm.shape != (cfg.draft_vocab_size,) or tm.is_floating_point()
                                 or int(tm.min()) < 0 or int(tm.max()) >= cfg.vocab_size
                                 or len(torch.unique(tm)) != len(tm)):
        raise ValueError(f"speculative_config model {directory!r}: draft_vocab_size {cfg.draft_vocab_size} needs "
                         f"a token_map of that many distinct integer ids in [0, {cfg.vocab_size}), got "
                         f"{None if tm is None else (tuple(tm.shape), str(tm.dtype))}")
    return cfg, tensors


def read_head_config(directory: str, method: str) -> DraftHeadConfig:
    """The config of the ``method`` head in ``directory`` (its ``config.json``; the weights are not read).

    Raises:
        ValueError: the directory lacks ``config.json`` or ``model.safetensors``, or holds a head of another
            method (names both).
    """
    cpath, wpath = os.path.join(directory, CONFIG_NAME), os.path.join(directory, WEIGHTS_NAME)
    if not (os.path.isfile(cpath) and os.path.isfile(wpath)):
        raise ValueError(f"speculative_config model {directory!r} is not a draft head directory (it needs "
                         f"{CONFIG_NAME} and {WEIGHTS_NAME}, as `roofline train-draft` writes)")
    with open(cpath) as f:
        raw = json.load(f)
    known = set(DraftHeadConfig.__dataclass_fields__)
    try:
        cfg = DraftHeadConfig(**{k: v for k, v in raw.items() if k in known})
    except (TypeError, ValueError) as e:
        raise ValueError(f"speculative_config model {directory!r}: {cpath}: {e}") from None
    if cfg.method != method:
        raise ValueError(f"speculative_config model {directory!r} holds {_a(cfg.method)} head, not {_a(method)} "
                         f"head; use method {cfg.method!r}")
    return cfg


def check_head(spec: Any, mc: Any) -> tuple[DraftHeadConfig, str]:
    """The head ``spec`` names (``spec.model``, or the one bundled for target ``mc``) and its directory, checked
    against the target from its config alone, so that the CLI, ``LLM`` and the server refuse a mismatch before
    the target's weights load.

    Raises:
        ValueError: no head given and none bundled for the target; a directory that is not a head of
            ``spec.method``; a head made for another hidden size or vocabulary (names both of each); a Medusa
            ``num_speculative_tokens`` above the head count (names the allowed range [1, K]).
    """
    method = spec.method
    path = spec.model or bundled_head(method, mc)
    if path is None:
        raise ValueError(f"speculative_config method {method!r} needs \"model\": a head directory written by "
                         f"`roofline train-draft --method {method}` (none ships for the target {mc.name!r})")
    cfg = read_head_config(path, method)
    cfg.check_target(mc, path)
    k = spec.num_speculative_tokens
    if method == "medusa" and k is not None and not 1 <= k <= cfg.num_heads:
        raise ValueError(f"speculative_config num_speculative_tokens must be in [1, {cfg.num_heads}] for the "
                         f"Medusa head {path!r} ({cfg.num_heads} heads), got {k}")
    return cfg, path


_BUNDLED = {"SmolLM2-135M-Instruct": "smollm2-135m"}  # target name prefix -> heads/ directory stem


def bundled_head(method: str, mc: Any) -> str | None:
    """The directory of the head shipped in the package for target ``mc`` (``heads/<name>-<method>``), or None."""
    name = next((d for prefix, d in _BUNDLED.items() if mc.name.startswith(prefix)), None)
    if name is None:
        return None
    path = os.path.join(os.path.dirname(__file__), "heads", f"{name}-{method}")
    return path if os.path.isfile(os.path.join(path, CONFIG_NAME)) else None
