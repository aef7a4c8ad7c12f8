"""The bound model: how fast a decode step could possibly be.

A decode step cannot finish before ``max(memory_time, compute_time)``: it must stream every weight
and every KV entry it attends to from HBM, and it must do ``2 x parameters`` FLOPs per token
(Pope et al. 2022, "Efficiently Scaling Transformer Inference", sections 2-3). Speculative decoding
trades extra FLOPs for fewer weight reads; its expected gain follows Leviathan et al. 2023,
"Fast Inference from Transformers via Speculative Decoding", section 3.

Every time this module returns is a **lower bound** (seconds), not a latency: real steps add kernel
launch gaps, attention inefficiency and host work on top. Pure Python; no torch import.

Parallelism (:func:`parallel_step`, :func:`best_layouts`): tensor parallelism (TP) splits each layer
over a group of GPUs and sums partial outputs with two all-reduces per layer (Shoeybi et al. 2019,
"Megatron-LM"); pipeline parallelism (PP) splits the layers into stages that hand activations on. Per
GPU, the memory and compute terms are the bounds above; all-reduces and sends follow the ring
latency-bandwidth model (Thakur et al. 2005, "Optimization of Collective Communication Operations in
MPICH") on the slowest link of their group, a floor-side estimate rather than a strict bound; the
pipeline bubble follows GPipe (Huang et al. 2019).

Units: bytes, seconds, FLOP, FLOP/s, bytes/s. "GB" is 1e9 bytes, "GiB" is 2**30 bytes.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

GB = 1e9
GIB = float(2**30)

PAPER_POPE = 'Pope et al. 2022, "Efficiently Scaling Transformer Inference" (arXiv:2211.05102)'
PAPER_LEVIATHAN = ('Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding" '
                   "(ICML 2023, arXiv:2211.17192)")

# Bits per stored weight, including quantization metadata.
# int4_g128: 4 bits + a 16-bit scale per 128 weights (0.125) + zero-point overhead, 4.15 as GPTQ
# (Frantar et al. 2023) estimates; the worksheet uses 4.15 exactly.
WEIGHT_FORMAT_BITS: dict[str, float] = {
    "bf16": 16.0,
    "fp16": 16.0,
    "fp8_e4m3": 8.0,
    "int8": 8.0,
    "int4_g128": 4.15,
}
DEFAULT_FORMATS: tuple[str, ...] = ("bf16", "fp8_e4m3", "int4_g128")

# Bytes per KV-cache element.
KV_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8_e4m3": 1.0,
    "fp8": 1.0,
    "int8": 1.0,
}
# Scale bytes per token per KV head, for K and again for V (roofline.attention.kv_cache):
# int8 keeps one float32 scale per token and KV head (symmetric, amax / 127); fp8_e4m3 keeps one static
# scale per (layer, KV head), a constant [layers, H_kv] table that adds nothing per token.
KV_SCALE_BYTES: dict[str, float] = {"int8": 4.0}

MAX_GAMMA = 8
DEFAULT_RESERVE_FRACTION = 0.10  # of device memory, for activations, CUDA context and fragmentation


def _check_positive(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")


def _check_non_negative(name: str, value: float) -> None:
    if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")


def _check_count(name: str, value: int, low: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")


def _check_alpha(alpha: float) -> None:
    if not (isinstance(alpha, int | float) and 0.0 <= alpha < 1.0):
        raise ValueError(f"alpha (acceptance rate) must be in [0, 1), got {alpha!r}")


def _check_gamma(gamma: int) -> None:
    if isinstance(gamma, bool) or not isinstance(gamma, int) or gamma < 0:
        raise ValueError(f"gamma (draft tokens per step) must be an integer >= 0, got {gamma!r}")


# --------------------------------------------------------------------------------------------------
# Bytes
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class WeightFormat:
    """A weight storage format: bits per weight including scales and zero points.

    ``grouped(bits, group_size)`` models group-wise quantization (GPTQ/AWQ style): each group of
    ``group_size`` weights carries one ``scale_bits`` scale and one ``zero_bits`` zero point.
    """

    name: str
    bits_per_weight: float

    def __post_init__(self) -> None:
        if not (isinstance(self.bits_per_weight, int | float) and 0 < self.bits_per_weight <= 64):
            raise ValueError(f"bits_per_weight must be in (0, 64], got {self.bits_per_weight!r}")

    @classmethod
    def grouped(cls, bits: int, group_size: int, scale_bits: int = 16, zero_bits: int | None = None,
                name: str | None = None) -> WeightFormat:
        """``bits + (scale_bits + zero_bits) / group_size`` bits per weight; ``zero_bits`` defaults to ``bits``."""
        if not 1 <= bits <= 16:
            raise ValueError(f"bits must be in [1, 16], got {bits!r}")
        if group_size < 1:
            raise ValueError(f"group_size must be >= 1, got {group_size!r}")
        zb = bits if zero_bits is None else zero_bits
        return cls(name or f"int{bits}_g{group_size}", bits + (scale_bits + zb) / group_size)


def parse_weight_format(spec: str | float | WeightFormat) -> WeightFormat:
    """A format by name (``bf16``, ``fp8_e4m3``, ``int8``, ``int4_g128``, ``fp16``), ``intN_gG`` for a
    custom group size (see :meth:`WeightFormat.grouped`), or a number of bits (``"5.5"``).

    Raises:
        ValueError: the spec names no format; the message lists the known names.
    """
    if isinstance(spec, WeightFormat):
        return spec
    if isinstance(spec, int | float) and not isinstance(spec, bool):
        return WeightFormat(f"{float(spec):g}bit", float(spec))
    text = str(spec).strip()
    if text in WEIGHT_FORMAT_BITS:
        return WeightFormat(text, WEIGHT_FORMAT_BITS[text])
    if text.startswith("int") and "_g" in text:
        b, _, g = text[3:].partition("_g")
        if b.isdigit() and g.isdigit():
            return WeightFormat.grouped(int(b), int(g), name=text)
    try:
        bits = float(text.removesuffix("bit").removesuffix("bits"))
    except ValueError:
        bits = None
    if bits is not None and math.isfinite(bits):
        return WeightFormat(f"{bits:g}bit", bits)
    raise ValueError(
        f"unknown weight format {text!r}; known: {', '.join(WEIGHT_FORMAT_BITS)}, intN_gG "
        "(N in [1, 16] bits, group size G >= 1), or bits per weight as a number in (0, 64]"
    )


def weight_bytes(num_params: float, fmt: str | float | WeightFormat = "bf16") -> float:
    """Bytes of weights: ``num_params x bits_per_weight / 8`` (Pope et al. 2022, section 3.1)."""
    _check_positive("num_params", num_params)
    return num_params * parse_weight_format(fmt).bits_per_weight / 8


def weight_bytes_per_tensor(tensors: Iterable[tuple[float, float]]) -> float:
    """Bytes of a checkpoint given its real per-tensor widths: ``sum(numel x bits / 8)``.

    Args:
        tensors: ``(numel, bits_per_element)`` pairs, e.g. Q4_1 blocks at 5.0 bits and F32 norms at 32.
    """
    total = 0.0
    for numel, bits in tensors:
        _check_non_negative("numel", numel)
        _check_positive("bits_per_element", bits)
        total += numel * bits / 8
    return total


def kv_dtype_bytes(kv_dtype: str) -> float:
    """Bytes per KV element for ``kv_dtype``; raises ``ValueError`` listing the known dtypes."""
    if kv_dtype not in KV_DTYPE_BYTES:
        raise ValueError(f"unknown KV dtype {kv_dtype!r}; known: {', '.join(KV_DTYPE_BYTES)}")
    return KV_DTYPE_BYTES[kv_dtype]


def kv_scale_bytes(kv_dtype: str) -> float:
    """Scale bytes per token per KV head (for each of K and V) of ``kv_dtype``: 4 for int8, else 0.

    Raises:
        ValueError: an unknown ``kv_dtype`` (lists the known ones).
    """
    kv_dtype_bytes(kv_dtype)
    return KV_SCALE_BYTES.get(kv_dtype, 0.0)


def kv_bytes_per_sequence(num_layers: int, num_kv_heads: int, head_dim: int,
                          context_tokens: int, kv_bytes_per_element: float = 2.0,
                          scale_bytes_per_head: float = 0.0) -> float:
    """KV-cache bytes of one sequence:
    ``2 (K and V) x layers x kv_heads x (head_dim x bytes + scale bytes) x tokens`` (Pope et al. 2022,
    section 3.3; the per-token, per-head scale of a quantized cache is counted too)."""
    for name, v in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                    ("kv_bytes_per_element", kv_bytes_per_element)):
        _check_positive(name, v)
    _check_non_negative("context_tokens", context_tokens)
    _check_non_negative("scale_bytes_per_head", scale_bytes_per_head)
    return 2 * num_layers * num_kv_heads * (head_dim * kv_bytes_per_element + scale_bytes_per_head) * context_tokens


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_dtype: str) -> float:
    """Bytes one token adds to the KV cache across all layers (K and V), scales included:
    ``kv_bytes_per_sequence`` at one token for the named ``kv_dtype``. The engine's KV pool sizes itself
    with this very function, so ``roofline cost --kv-dtype`` and the pool agree.

    E.g. SmolLM2-135M (30 layers, 3 KV heads, D 64): fp32 46,080; bf16 23,040; fp8_e4m3 11,520;
    int8 12,240 (= 2 x 30 x 3 x (64 + 4)).

    Raises:
        ValueError: an unknown ``kv_dtype`` (lists the known ones).
    """
    return kv_bytes_per_sequence(num_layers, num_kv_heads, head_dim, 1, kv_dtype_bytes(kv_dtype),
                                 kv_scale_bytes(kv_dtype))


# --------------------------------------------------------------------------------------------------
# Time lower bounds
# --------------------------------------------------------------------------------------------------

def memory_time(weight_bytes: float, kv_bytes_per_seq: float, batch: int, bandwidth: float) -> float:
    """Lower bound (s) from bytes: ``(weights + batch x KV per sequence) / bandwidth`` (Pope et al. 2022).

    Every step reads all weights once and each sequence's KV once, whatever the number of positions.
    """
    _check_non_negative("weight_bytes", weight_bytes)
    _check_non_negative("kv_bytes_per_seq", kv_bytes_per_seq)
    _check_non_negative("batch", batch)
    _check_positive("bandwidth", bandwidth)
    return (weight_bytes + batch * kv_bytes_per_seq) / bandwidth


def compute_time(num_params: float, batch: int, positions: int, peak_flops: float) -> float:
    """Lower bound (s) from FLOPs: ``2 x parameters x batch x positions / peak`` (Pope et al. 2022, 3.1).

    ``positions`` is tokens per sequence in the step: 1 for plain decoding, ``gamma + 1`` when verifying.
    Attention FLOPs are left out (small next to the matmuls at these contexts), so this stays a bound.
    """
    _check_non_negative("num_params", num_params)
    _check_non_negative("batch", batch)
    _check_positive("positions", positions)
    _check_positive("peak_flops", peak_flops)
    return 2 * num_params * batch * positions / peak_flops


@dataclass(frozen=True)
class StepBound:
    """Lower bound of one forward step. Times in seconds, intensity in FLOP/byte."""

    memory_s: float
    compute_s: float
    flops: float
    bytes_moved: float
    hardware_ratio: float  # peak FLOP/s / bandwidth bytes/s

    @property
    def bound_s(self) -> float:
        """The step lower bound: ``max(memory_s, compute_s)``."""
        return max(self.memory_s, self.compute_s)

    @property
    def bound_by(self) -> str:
        return "compute" if self.compute_s > self.memory_s else "memory"

    @property
    def arithmetic_intensity(self) -> float:
        """FLOP per byte moved; compute-bound when above :attr:`hardware_ratio` (Pope et al. 2022)."""
        return self.flops / self.bytes_moved if self.bytes_moved else math.inf

    def as_dict(self) -> dict[str, float | str]:
        return {"memory_lower_bound_s": self.memory_s, "compute_lower_bound_s": self.compute_s,
                "step_lower_bound_s": self.bound_s, "bound_by": self.bound_by, "flops": self.flops,
                "bytes_moved": self.bytes_moved, "arithmetic_intensity": self.arithmetic_intensity,
                "hardware_ratio": self.hardware_ratio}


def step_bound(num_params: float, weight_bytes: float, kv_bytes_per_seq: float, batch: int,
               bandwidth: float, peak_flops: float, positions: int = 1) -> StepBound:
    """``max(memory_time, compute_time)`` for a step of ``batch`` sequences x ``positions`` tokens."""
    mem = memory_time(weight_bytes, kv_bytes_per_seq, batch, bandwidth)
    comp = compute_time(num_params, batch, positions, peak_flops)
    return StepBound(memory_s=mem, compute_s=comp, flops=2 * num_params * batch * positions,
                     bytes_moved=weight_bytes + batch * kv_bytes_per_seq,
                     hardware_ratio=peak_flops / bandwidth)


def hardware_ratio(peak_flops: float, bandwidth: float) -> float:
    """FLOP/byte at which a kernel turns compute-bound (the roofline ridge point)."""
    _check_positive("peak_flops", peak_flops)
    _check_positive("bandwidth", bandwidth)
    return peak_flops / bandwidth


def min_compute_bound_batch(num_params: float, weight_bytes: float, kv_bytes_per_seq: float,
                            bandwidth: float, peak_flops: float, positions: int = 1,
                            max_batch: int = 1 << 20) -> int | None:
    """Smallest batch with ``compute_time >= memory_time`` for ``positions`` tokens per sequence.

    Solves ``b (2 P positions / peak - KV / bandwidth) >= weights / bandwidth``. Returns ``None`` when
    KV reads grow faster with batch than FLOPs do (never compute-bound), or past ``max_batch``.
    """
    per_seq = 2 * num_params * positions / peak_flops - kv_bytes_per_seq / bandwidth
    if per_seq <= 0:
        return None
    b = max(1, math.ceil(weight_bytes / bandwidth / per_seq) - 1)

    def is_compute_bound(n: int) -> bool:
        return (compute_time(num_params, n, positions, peak_flops)
                >= memory_time(weight_bytes, kv_bytes_per_seq, n, bandwidth))

    while not is_compute_bound(b):  # guard the closed form against rounding
        b += 1
    while b > 1 and is_compute_bound(b - 1):
        b -= 1
    return b if b <= max_batch else None


def fits_on_device(weight_bytes: float, kv_bytes_per_seq: float, batch: int, capacity_bytes: float,
                   reserve_bytes: float | None = None) -> dict[str, float | bool]:
    """Whether weights + ``batch`` sequences of KV + a reserve fit in device memory.

    The reserve (activations, CUDA context, allocator fragmentation) defaults to
    ``DEFAULT_RESERVE_FRACTION`` (10%) of capacity. Returns the bytes needed, the capacity, the
    reserve, ``fits`` and ``max_batch`` (largest batch that fits; 0 if weights alone do not).
    """
    _check_positive("capacity_bytes", capacity_bytes)
    reserve = DEFAULT_RESERVE_FRACTION * capacity_bytes if reserve_bytes is None else reserve_bytes
    _check_non_negative("reserve_bytes", reserve)
    needed = weight_bytes + batch * kv_bytes_per_seq + reserve
    free_for_kv = capacity_bytes - reserve - weight_bytes
    if free_for_kv < 0:
        max_batch = 0
    elif kv_bytes_per_seq == 0:
        max_batch = -1  # unlimited by memory
    else:
        max_batch = int(free_for_kv // kv_bytes_per_seq)
    return {"fits": needed <= capacity_bytes, "needed_bytes": needed, "capacity_bytes": capacity_bytes,
            "reserve_bytes": reserve, "max_batch": max_batch}


# --------------------------------------------------------------------------------------------------
# Speculative decoding (Leviathan et al. 2023, section 3)
# --------------------------------------------------------------------------------------------------

def expected_tokens_per_step(alpha: float, gamma: int) -> float:
    """E[tokens per target step] = ``(1 - alpha^(gamma+1)) / (1 - alpha)`` (Leviathan et al. 2023, eq. 1).

    ``alpha`` is the per-token acceptance rate in [0, 1); ``gamma`` the number of draft tokens.
    """
    _check_alpha(alpha)
    _check_gamma(gamma)
    return (1 - alpha ** (gamma + 1)) / (1 - alpha)


def speculative_speedup(alpha: float, gamma: int, draft_cost: float, verify_cost_ratio: float = 1.0) -> float:
    """Walltime improvement ``E / (gamma c + verify_cost_ratio)`` (Leviathan et al. 2023, theorem 3.8).

    ``draft_cost`` c is one draft step's time over one plain target step. With free verification
    (``verify_cost_ratio`` 1, the paper's assumption) this is the paper's formula; at batch, the target
    pass over ``gamma + 1`` positions costs :func:`verify_cost_ratio` plain steps.
    """
    _check_non_negative("draft_cost", draft_cost)
    _check_positive("verify_cost_ratio", verify_cost_ratio)
    return expected_tokens_per_step(alpha, gamma) / (gamma * draft_cost + verify_cost_ratio)


def verify_cost_ratio(num_params: float, weight_bytes: float, kv_bytes_per_seq: float, batch: int,
                      bandwidth: float, peak_flops: float, gamma: int) -> float:
    """``step_bound(gamma + 1 positions) / step_bound(1 position)`` at ``batch``; 1.0 while memory-bound.

    Replaces the "+1" of Leviathan et al. 2023 when verification is not free (Pope et al. 2022 bounds).
    """
    _check_gamma(gamma)
    args = (num_params, weight_bytes, kv_bytes_per_seq, batch, bandwidth, peak_flops)
    return step_bound(*args, positions=gamma + 1).bound_s / step_bound(*args, positions=1).bound_s


def iteration_time(plain_step_s: float, gamma: int, draft_cost: float, verify_cost_ratio: float = 1.0) -> float:
    """Seconds per speculative iteration: ``plain_step x (gamma c + verify_cost_ratio)``.

    A lower bound when ``plain_step_s`` is one (Leviathan et al. 2023, section 3.4).
    """
    _check_positive("plain_step_s", plain_step_s)
    _check_gamma(gamma)
    _check_non_negative("draft_cost", draft_cost)
    return plain_step_s * (gamma * draft_cost + verify_cost_ratio)


def average_tpot(plain_step_s: float, alpha: float, gamma: int, draft_cost: float,
                 verify_cost_ratio: float = 1.0) -> float:
    """Average time per output token (s): iteration time / E[tokens per step]."""
    return (iteration_time(plain_step_s, gamma, draft_cost, verify_cost_ratio)
            / expected_tokens_per_step(alpha, gamma))


def break_even_alpha(gamma: int, draft_cost: float, verify_cost_ratio: float = 1.0) -> float | None:
    """Smallest acceptance rate at which speculation is no slower than plain decoding.

    Solves ``E(alpha) = gamma c + verify_cost_ratio`` by bisection (E rises from 1 at alpha 0 towards
    ``gamma + 1``). Returns 0.0 when speculation never loses, ``None`` when it never wins.
    """
    _check_gamma(gamma)
    _check_non_negative("draft_cost", draft_cost)
    cost = gamma * draft_cost + verify_cost_ratio
    if cost <= 1.0:
        return 0.0
    if cost >= gamma + 1:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(200):
        mid = (lo + hi) / 2
        if expected_tokens_per_step(mid, gamma) < cost:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-15:
            break
    return hi


def best_gamma(alpha: float, draft_cost: float,
               verify_cost_ratio: float | Callable[[int], float] = 1.0,
               gammas: Iterable[int] = range(1, MAX_GAMMA + 1)) -> tuple[int, float]:
    """The ``gamma`` in 1..8 that maximizes :func:`speculative_speedup`; returns ``(gamma, speedup)``.

    ``verify_cost_ratio`` may be a function of gamma (at batch it grows with gamma).
    """
    best: tuple[int, float] | None = None
    for g in gammas:
        ratio = verify_cost_ratio(g) if callable(verify_cost_ratio) else verify_cost_ratio
        s = speculative_speedup(alpha, g, draft_cost, ratio)
        if best is None or s > best[1]:
            best = (g, s)
    if best is None:
        raise ValueError("gammas must not be empty")
    return best


# --------------------------------------------------------------------------------------------------
# Report for a real run
# --------------------------------------------------------------------------------------------------

def decode_floor_report(weight_bytes: int, kv_bytes_read: float, flops: float,
                        bandwidth_bytes_per_s: float, peak_flops: float | None,
                        measured_step_s: float) -> dict[str, Any]:
    """The measured mean decode step beside its floor (lower bound), for the end of a run.

    Args:
        weight_bytes: bytes of the weights actually read per step (from the real tensors).
        kv_bytes_read: KV bytes read per step at the actual context lengths, summed over the batch.
        flops: FLOPs of one step (``2 x params x batch`` for plain decoding).
        bandwidth_bytes_per_s: measured (probe) or datasheet read bandwidth.
        peak_flops: FLOP/s, or ``None`` to bound by memory only.
        measured_step_s: mean measured decode-step time.

    Returns:
        ``floor_s``, ``measured_s``, ``fraction_of_floor`` (= floor / measured, 1.0 at the floor),
        ``memory_floor_s``, ``compute_floor_s``, ``bound_by`` and ``text``, e.g.
        ``"decode step 41.2 ms, floor 12.3 ms (30% of floor)"`` (Pope et al. 2022 bound).
    """
    _check_non_negative("weight_bytes", weight_bytes)
    _check_non_negative("kv_bytes_read", kv_bytes_read)
    _check_non_negative("flops", flops)
    _check_positive("bandwidth_bytes_per_s", bandwidth_bytes_per_s)
    _check_positive("measured_step_s", measured_step_s)
    mem = (weight_bytes + kv_bytes_read) / bandwidth_bytes_per_s
    comp = 0.0
    if peak_flops is not None:
        _check_positive("peak_flops", peak_flops)
        comp = flops / peak_flops
    floor = max(mem, comp)
    fraction = floor / measured_step_s
    text = f"decode step {measured_step_s * 1e3:.1f} ms, floor {floor * 1e3:.1f} ms ({fraction * 100:.0f}% of floor)"
    return {"floor_s": floor, "measured_s": measured_step_s, "fraction_of_floor": fraction,
            "memory_floor_s": mem, "compute_floor_s": comp,
            "bound_by": "compute" if comp > mem else "memory", "text": text}


# --------------------------------------------------------------------------------------------------
# Model shapes
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ModelShape:
    """What the bound needs from a model: parameter count P and the KV-cache geometry.

    The parallel bound also needs ``num_attention_heads`` (TP must divide it; 0 derives
    ``hidden_size // head_dim``) and the vocabulary (``vocab_size``, ``tie_word_embeddings``) to place
    the embedding on the first pipeline stage and the LM head on the last. ``vocab_size`` 0 (unknown,
    as for the fixture) counts every parameter as a layer parameter.

    Raises:
        ValueError: a size is not positive, the KV heads do not divide the attention heads, or the
            embedding and LM head hold more than ``num_params``.
    """

    name: str
    num_params: float
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    num_attention_heads: int = 0
    vocab_size: int = 0
    tie_word_embeddings: bool = False

    def __post_init__(self) -> None:
        for field_name in ("num_params", "num_layers", "num_kv_heads", "head_dim", "hidden_size"):
            _check_positive(field_name, getattr(self, field_name))
        if self.num_attention_heads == 0:
            object.__setattr__(self, "num_attention_heads", max(1, self.hidden_size // self.head_dim))
        _check_positive("num_attention_heads", self.num_attention_heads)
        _check_non_negative("vocab_size", self.vocab_size)
        if self.num_attention_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_kv_heads ({self.num_kv_heads})")
        if self.layer_params <= 0:
            raise ValueError(f"the embedding and LM head ({self.embedding_params + self.lm_head_params:.4g} "
                             f"parameters) leave none of num_params ({self.num_params:.4g}) for the layers")

    @property
    def embedding_params(self) -> float:
        """``vocab_size x hidden_size``: the input embedding (0 when the vocabulary is unknown)."""
        return float(self.vocab_size * self.hidden_size)

    @property
    def lm_head_params(self) -> float:
        """The LM head's own parameters: ``vocab_size x hidden_size``, or 0 when tied to the embedding."""
        return 0.0 if self.tie_word_embeddings else self.embedding_params

    @property
    def layer_params(self) -> float:
        """Parameters of one decoder layer: ``(P - embedding - LM head) / layers``. The final norm's
        ``hidden_size`` weights are spread over the layers (under 1e-6 of P for Llama 3 8B)."""
        return (self.num_params - self.embedding_params - self.lm_head_params) / self.num_layers

    @classmethod
    def from_model_config(cls, cfg: Any) -> ModelShape:
        """From a :class:`roofline.config.ModelConfig` (P from ``ModelConfig.num_params``)."""
        return cls(name=cfg.name, num_params=float(cfg.num_params), num_layers=cfg.num_hidden_layers,
                   num_kv_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, hidden_size=cfg.hidden_size,
                   num_attention_heads=cfg.num_attention_heads, vocab_size=cfg.vocab_size,
                   tie_word_embeddings=bool(cfg.tie_word_embeddings))

    def kv_bytes_per_sequence(self, context_tokens: int, kv_dtype: str = "bf16") -> float:
        """KV bytes of one sequence of ``context_tokens`` in ``kv_dtype`` (scales included)."""
        return kv_bytes_per_sequence(self.num_layers, self.num_kv_heads, self.head_dim, context_tokens,
                                     kv_dtype_bytes(kv_dtype), kv_scale_bytes(kv_dtype))


# The published worksheet's fixture: a dense 70B model (Llama-2/3-70B-like KV geometry), BF16 KV,
# context 2048, batch 32; evaluated on the hypothetical 3.0 TB/s, 1,000 TFLOP/s device with
# alpha 0.8, gamma 4, c 0.1 and a 25 ms plain step.
DENSE_70B_FIXTURE = ModelShape(name="dense-70b-fixture-r1", num_params=70e9, num_layers=80, num_kv_heads=8,
                               head_dim=128, hidden_size=8192)
FIXTURE_SHAPES: dict[str, ModelShape] = {DENSE_70B_FIXTURE.name: DENSE_70B_FIXTURE}
WORKSHEET = {"batch": 32, "context": 2048, "kv_dtype": "bf16", "alpha": 0.8, "gamma": 4,
             "draft_cost": 0.1, "plain_step_s": 0.025, "hardware": "worksheet"}


# --------------------------------------------------------------------------------------------------
# Parallelism: tensor parallel (TP) within a pipeline stage, pipeline parallel (PP) across stages
# --------------------------------------------------------------------------------------------------
# Placement: global rank r = stage x tp + tp_rank sits on node r // gpus_per_node (TP innermost, as
# Megatron-LM and vLLM place it, so a TP group stays inside a node whenever it can).

PAPER_MEGATRON = ('Shoeybi et al. 2019, "Megatron-LM: Training Multi-Billion Parameter Language Models Using '
                  'Model Parallelism" (arXiv:1909.08053)')
PAPER_THAKUR = ('Thakur, Rabenseifner and Gropp 2005, "Optimization of Collective Communication Operations in '
                'MPICH" (IJHPCA 19(1):49-66)')
PAPER_GPIPE = ('Huang et al. 2019, "GPipe: Efficient Training of Giant Neural Networks using Pipeline '
               'Parallelism" (NeurIPS 2019, arXiv:1811.06965)')
ACTIVATION_BYTES = 2.0  # bf16: bytes per element of what a TP all-reduce or a PP send carries
ALLREDUCES_PER_LAYER = 2  # after attention's o_proj and after the MLP's down_proj (Megatron-LM, section 3)


@dataclass(frozen=True)
class Link:
    """A GPU-to-GPU link in the latency-bandwidth (alpha-beta) model of Thakur et al. 2005.

    Presets with their sources are ``roofline.hardware.INTERCONNECT_PRESETS``.

    Attributes:
        name: preset name or a label.
        bandwidth: bytes/s per direction per GPU (beta = 1 / bandwidth).
        latency_s: seconds per message, i.e. per ring step (alpha).
        citation: where the numbers come from.
    """

    name: str
    bandwidth: float
    latency_s: float
    citation: str = ""

    def __post_init__(self) -> None:
        _check_positive("bandwidth", self.bandwidth)
        _check_non_negative("latency_s", self.latency_s)


def slowest_link(*links: Link) -> Link:
    """The link a ring over all of ``links`` runs at: the least bandwidth and the most latency.

    Every ring step waits for its slowest transfer, so one slow hop sets the pace of the whole group.
    Returns the link itself when one link is slowest on both counts.
    """
    if not links:
        raise ValueError("slowest_link needs at least one link")
    bw = min(x.bandwidth for x in links)
    lat = max(x.latency_s for x in links)
    for x in links:
        if x.bandwidth == bw and x.latency_s == lat:
            return x
    names = "/".join(dict.fromkeys(x.name for x in links))
    return Link(f"{names} (slowest of)", bw, lat, citation="least bandwidth and most latency of: " + names)


def ring_allreduce_time(message_bytes: float, num_ranks: int, bandwidth: float, latency_s: float) -> float:
    """Seconds for a ring all-reduce of ``message_bytes`` over ``num_ranks`` GPUs:
    ``2 (N-1) x latency + 2 (N-1)/N x message_bytes / bandwidth``; 0 for one rank.

    A ring reduce-scatter then a ring all-gather, N-1 steps each, every step sending 1/N of the
    message to the next GPU (Thakur et al. 2005: a ring all-gather costs ``(p-1) alpha + (p-1)/p n
    beta``, a reduce-scatter the same plus the reduction, which is left out here). NCCL's ring uses the
    same 2(N-1) steps (``nsteps`` in ``src/graph/tuning.cc``) and the same ``2 (N-1)/N`` bus-bandwidth
    factor (nccl-tests ``doc/PERFORMANCE.md``). NCCL's fixed per-call base latency (6.6 us for
    Ring/LL in that file) and the kernel launch are left out, which keeps the term on the floor side.
    """
    _check_non_negative("message_bytes", message_bytes)
    _check_count("num_ranks", num_ranks)
    _check_positive("bandwidth", bandwidth)
    _check_non_negative("latency_s", latency_s)
    if num_ranks == 1:
        return 0.0
    n = num_ranks
    return 2 * (n - 1) * latency_s + 2 * (n - 1) / n * message_bytes / bandwidth


def send_recv_time(message_bytes: float, bandwidth: float, latency_s: float) -> float:
    """Seconds for one point-to-point message: ``latency + message_bytes / bandwidth`` (alpha-beta)."""
    _check_non_negative("message_bytes", message_bytes)
    _check_positive("bandwidth", bandwidth)
    _check_non_negative("latency_s", latency_s)
    return latency_s + message_bytes / bandwidth


def pipeline_utilization(num_micro_batches: int, num_stages: int) -> float:
    """Busy fraction of a flushed pipeline: ``m / (m + p - 1)`` for m micro-batches over p stages
    (GPipe, Huang et al. 2019, section 2: bubble ``(p - 1) / (m + p - 1)``). E.g. m 4, p 2: 0.8."""
    _check_count("num_micro_batches", num_micro_batches)
    _check_count("num_stages", num_stages)
    return num_micro_batches / (num_micro_batches + num_stages - 1)


def allowed_tp_sizes(num_attention_heads: int, num_kv_heads: int) -> list[int]:
    """TP sizes that shard attention cleanly: divisors of the attention heads that divide the KV heads
    or are multiples of them (then each KV head is replicated, as vLLM does). E.g. 32 heads, 8 KV heads:
    1, 2, 4, 8, 16, 32."""
    return [t for t in range(1, num_attention_heads + 1)
            if num_attention_heads % t == 0 and (num_kv_heads % t == 0 or t % num_kv_heads == 0)]


def check_parallel_layout(shape: ModelShape, tp: int, pp: int, tp_name: str = "tp", pp_name: str = "pp") -> None:
    """Raise ``ValueError`` unless ``tp`` is in :func:`allowed_tp_sizes` and ``pp`` in [1, layers].

    The message names the value, the model's heads or layers and the allowed values, using ``tp_name``
    and ``pp_name`` for the two (the CLI passes ``--tp`` and ``--pp``).
    """
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"{tp_name} must be an integer >= 1, got {tp!r}")
    allowed = allowed_tp_sizes(shape.num_attention_heads, shape.num_kv_heads)
    if tp not in allowed:
        why = (f"does not divide the {shape.num_attention_heads} attention heads"
               if shape.num_attention_heads % tp else
               f"neither divides nor is a multiple of the {shape.num_kv_heads} KV heads")
        raise ValueError(f"{tp_name} {tp} {why} of {shape.name}; allowed {tp_name}: "
                         f"{', '.join(map(str, allowed))}")
    if isinstance(pp, bool) or not isinstance(pp, int) or not 1 <= pp <= shape.num_layers:
        raise ValueError(f"{pp_name} must be an integer in [1, {shape.num_layers}] (the layers of {shape.name}), "
                         f"got {pp!r}")


def kv_heads_per_gpu(num_kv_heads: int, tp: int) -> int:
    """KV heads each GPU of a TP group stores: ``max(1, num_kv_heads / tp)``; past ``tp = num_kv_heads``
    every GPU keeps one head, replicated ``tp / num_kv_heads`` times across the group."""
    _check_positive("num_kv_heads", num_kv_heads)
    _check_positive("tp", tp)
    return max(1, num_kv_heads // tp)


def stage_layer_counts(num_layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage: ``num_layers // pp`` each, the remainder one apiece to the first stages."""
    if not 1 <= pp <= num_layers:
        raise ValueError(f"pp must be in [1, {num_layers}] (the number of layers), got {pp!r}")
    base, extra = divmod(num_layers, pp)
    return [base + (1 if s < extra else 0) for s in range(pp)]


@dataclass(frozen=True)
class StageShard:
    """What each GPU of one pipeline stage holds; all GPUs of a TP group hold the same amount.

    ``params`` and ``weight_bytes`` are per GPU; ``kv_bytes_per_seq`` is per GPU per sequence at the
    context it was computed for, ``kv_heads`` per GPU per layer.
    """

    stage: int
    num_layers: int
    params: float
    weight_bytes: float
    kv_heads: int
    kv_bytes_per_seq: float


def shard_stages(shape: ModelShape, tp: int, pp: int, fmt: str | float | WeightFormat = "bf16",
                 context: int = 0, kv_dtype: str = "bf16") -> list[StageShard]:
    """Per-GPU weights and KV of each of the ``pp`` stages under TP ``tp``.

    Stage s holds its layers' parameters / tp (Megatron-LM, section 3: column- then row-parallel
    matmuls), plus the vocab-parallel embedding / tp on the first stage and the LM head / tp on the
    last (a tied embedding is kept a second time on the last stage when ``pp > 1``). The RMSNorm
    weights, which TP replicates, are divided too (under 1e-4 of a layer). KV: each layer of the stage
    keeps :func:`kv_heads_per_gpu` heads per GPU.

    Raises:
        ValueError: the layout does not fit the model (see :func:`check_parallel_layout`).
    """
    check_parallel_layout(shape, tp, pp)
    bits = parse_weight_format(fmt).bits_per_weight
    heads = kv_heads_per_gpu(shape.num_kv_heads, tp)
    shards = []
    for s, n in enumerate(stage_layer_counts(shape.num_layers, pp)):
        params = n * shape.layer_params
        if s == 0:
            params += shape.embedding_params
        if s == pp - 1:
            params += shape.embedding_params if (pp > 1 and shape.tie_word_embeddings) else shape.lm_head_params
        params /= tp
        kv = kv_bytes_per_sequence(n, heads, shape.head_dim, context, kv_dtype_bytes(kv_dtype),
                                   kv_scale_bytes(kv_dtype))
        shards.append(StageShard(stage=s, num_layers=n, params=params, weight_bytes=params * bits / 8,
                                 kv_heads=heads, kv_bytes_per_seq=kv))
    return shards


def group_link(ranks: Iterable[int], gpus_per_node: int, intra: Link, inter: Link) -> Link:
    """The link governing a group of global ``ranks``: ``intra`` inside one node (rank // gpus_per_node),
    else the slowest of ``intra`` and ``inter`` (:func:`slowest_link`)."""
    _check_positive("gpus_per_node", gpus_per_node)
    nodes = {r // gpus_per_node for r in ranks}
    return intra if len(nodes) <= 1 else slowest_link(intra, inter)


@dataclass(frozen=True)
class StageBound:
    """One stage of a decode step on each of its GPUs, at ``micro_batch`` sequences. Seconds.

    ``memory_s`` and ``compute_s`` are lower bounds (Pope et al. 2022); ``allreduce_s`` is one ring
    all-reduce (:func:`ring_allreduce_time`) over ``link``, done ``num_allreduces`` times.
    """

    shard: StageShard
    micro_batch: int
    link: Link
    memory_s: float
    compute_s: float
    allreduce_s: float
    num_allreduces: int

    @property
    def comm_s(self) -> float:
        return self.num_allreduces * self.allreduce_s

    @property
    def stage_s(self) -> float:
        """``max(memory_s, compute_s) + comm_s``: a layer's all-reduce cannot overlap the matmul whose
        output it sums, and the next layer waits for it."""
        return max(self.memory_s, self.compute_s) + self.comm_s

    def as_dict(self) -> dict[str, Any]:
        return {"stage": self.shard.stage, "num_layers": self.shard.num_layers,
                "params_per_gpu": self.shard.params, "weight_bytes_per_gpu": self.shard.weight_bytes,
                "kv_heads_per_gpu": self.shard.kv_heads, "kv_bytes_per_sequence_per_gpu": self.shard.kv_bytes_per_seq,
                "micro_batch": self.micro_batch, "tp_link": self.link.name,
                "memory_lower_bound_s": self.memory_s, "compute_lower_bound_s": self.compute_s,
                "allreduce_s": self.allreduce_s, "num_allreduces": self.num_allreduces,
                "allreduce_total_s": self.comm_s, "stage_s": self.stage_s}


@dataclass(frozen=True)
class ParallelBound:
    """A decode step of ``batch`` sequences under TP ``tp`` x PP ``pp``, in ``num_micro_batches``
    micro-batches of ``ceil(batch / m)``. Seconds; ``fits`` as :func:`fits_on_device` (worst stage),
    ``None`` when the capacity is unknown.

    ``send_s[i]`` is one micro-batch's (hidden, residual) send from stage i to i + 1 over
    ``send_links[i]``.
    """

    tp: int
    pp: int
    batch: int
    num_micro_batches: int
    stages: tuple[StageBound, ...]
    send_s: tuple[float, ...]
    send_links: tuple[Link, ...]
    fits: dict[str, Any] | None

    @property
    def num_gpus(self) -> int:
        return self.tp * self.pp

    @property
    def step_s(self) -> float:
        """``sum(stage_s) + (m - 1) max(stage_s) + sum(send_s)``: the last micro-batch enters after the
        slowest stage has taken the other m - 1, then crosses every stage and boundary (GPipe, a
        flushed pipeline). For uniform stages, ``(m + p - 1) stage + sends``; at m 1 the token time."""
        times = [s.stage_s for s in self.stages]
        return sum(times) + (self.num_micro_batches - 1) * max(times) + sum(self.send_s)

    @property
    def tokens_per_s(self) -> float:
        return self.batch / self.step_s

    @property
    def utilization(self) -> float:
        return pipeline_utilization(self.num_micro_batches, self.pp)

    @property
    def comm_s(self) -> float:
        """Seconds of the step spent in all-reduces and sends, on the last micro-batch's path."""
        return sum(s.comm_s for s in self.stages) + sum(self.send_s)

    def as_dict(self) -> dict[str, Any]:
        return {"tp": self.tp, "pp": self.pp, "num_gpus": self.num_gpus, "batch": self.batch,
                "num_micro_batches": self.num_micro_batches, "step_s": self.step_s,
                "tokens_per_s": self.tokens_per_s, "pipeline_utilization": self.utilization,
                "communication_s": self.comm_s, "send_s": list(self.send_s),
                "send_links": [x.name for x in self.send_links], "fits": self.fits,
                "stages": [s.as_dict() for s in self.stages]}


def parallel_step(shape: ModelShape, tp: int, pp: int, batch: int, bandwidth: float, peak_flops: float,
                  intra: Link, inter: Link | None = None, gpus_per_node: int = 8,
                  fmt: str | float | WeightFormat = "bf16", context: int = 0, kv_dtype: str = "bf16",
                  num_micro_batches: int = 1, capacity_bytes: float | None = None,
                  activation_bytes: float = ACTIVATION_BYTES) -> ParallelBound:
    """The decode step of ``batch`` sequences on ``tp x pp`` GPUs (``bandwidth`` bytes/s and
    ``peak_flops`` FLOP/s each).

    Per stage and GPU, at micro-batch ``b = ceil(batch / m)``:
    ``max((weights + b x KV) / bandwidth, 2 x params x b / peak) + 2 x layers x all-reduce``, the
    all-reduce over ``b x hidden x activation_bytes`` bytes on the TP group's link (``intra``, or the
    slowest of ``intra`` and ``inter`` when the group spans nodes of ``gpus_per_node``). Between stages,
    ``2 x b x hidden x activation_bytes`` (hidden state and residual) by :func:`send_recv_time`.
    ``inter`` defaults to ``intra``. The embedding's all-reduce and the logits gather are left out (one
    message per step, against ``2 x layers``).

    Raises:
        ValueError: a bad layout (:func:`check_parallel_layout`), ``num_micro_batches`` outside
            [1, batch], or a non-positive size.
    """
    _check_count("batch", batch)
    if isinstance(num_micro_batches, bool) or not isinstance(num_micro_batches, int) \
            or not 1 <= num_micro_batches <= batch:
        raise ValueError(f"num_micro_batches must be an integer in [1, batch {batch}], got {num_micro_batches!r}")
    _check_count("gpus_per_node", gpus_per_node)
    _check_positive("activation_bytes", activation_bytes)
    inter = intra if inter is None else inter
    micro = math.ceil(batch / num_micro_batches)
    shards = shard_stages(shape, tp, pp, fmt, context, kv_dtype)
    message = micro * shape.hidden_size * activation_bytes  # one [micro, hidden] activation
    stages = []
    for sh in shards:
        link = group_link(range(sh.stage * tp, (sh.stage + 1) * tp), gpus_per_node, intra, inter)
        stages.append(StageBound(
            shard=sh, micro_batch=micro, link=link,
            memory_s=memory_time(sh.weight_bytes, sh.kv_bytes_per_seq, micro, bandwidth),
            compute_s=compute_time(sh.params, micro, 1, peak_flops),
            allreduce_s=ring_allreduce_time(message, tp, link.bandwidth, link.latency_s),
            num_allreduces=ALLREDUCES_PER_LAYER * sh.num_layers if tp > 1 else 0))
    # TP rank i of stage s sends to TP rank i of stage s + 1; the tp sends run side by side.
    send_links = tuple(slowest_link(*(group_link((s * tp + i, (s + 1) * tp + i), gpus_per_node, intra, inter)
                                      for i in range(tp))) for s in range(pp - 1))
    sends = tuple(send_recv_time(2 * message, x.bandwidth, x.latency_s) for x in send_links)
    fits = None
    if capacity_bytes is not None:
        per_stage = [fits_on_device(sh.weight_bytes, sh.kv_bytes_per_seq, batch, capacity_bytes) for sh in shards]
        batches = [f["max_batch"] for f in per_stage if f["max_batch"] >= 0]
        fits = {"fits": all(f["fits"] for f in per_stage),
                "needed_bytes": max(f["needed_bytes"] for f in per_stage),
                "capacity_bytes": capacity_bytes, "reserve_bytes": per_stage[0]["reserve_bytes"],
                "max_batch": min(batches) if batches else -1}
    return ParallelBound(tp=tp, pp=pp, batch=batch, num_micro_batches=num_micro_batches, stages=tuple(stages),
                         send_s=sends, send_links=send_links, fits=fits)


def best_layouts(shape: ModelShape, num_gpus: int, batch: int, bandwidth: float, peak_flops: float,
                 intra: Link, inter: Link | None = None, gpus_per_node: int = 8,
                 fmt: str | float | WeightFormat = "bf16", context: int = 0, kv_dtype: str = "bf16",
                 num_micro_batches: int = 1, capacity_bytes: float | None = None
                 ) -> list[tuple[ParallelBound, ParallelBound]]:
    """Every TP x PP layout on at most ``num_gpus`` GPUs, ranked: ``(batch-1 token, step at batch)``
    pairs of :func:`parallel_step`, those that fit at ``batch`` first, then by batch-1 token time
    (fewer GPUs first on a tie).

    TP runs over :func:`allowed_tp_sizes`, PP over 1..layers, with ``tp x pp <= num_gpus``.
    ``num_micro_batches`` is capped at ``batch``.
    """
    _check_count("num_gpus", num_gpus)
    common: dict[str, Any] = dict(bandwidth=bandwidth, peak_flops=peak_flops, intra=intra, inter=inter,
                                  gpus_per_node=gpus_per_node, fmt=fmt, context=context, kv_dtype=kv_dtype,
                                  capacity_bytes=capacity_bytes)
    out = []
    for tp in allowed_tp_sizes(shape.num_attention_heads, shape.num_kv_heads):
        for pp in range(1, min(shape.num_layers, num_gpus // tp) + 1):
            token = parallel_step(shape, tp, pp, 1, **common)
            at_batch = parallel_step(shape, tp, pp, batch, num_micro_batches=min(num_micro_batches, batch), **common)
            out.append((token, at_batch))
    out.sort(key=lambda r: (r[1].fits is not None and not r[1].fits["fits"], r[0].step_s, r[0].num_gpus))
    return out
