"""Tile configs of the fused MoE kernel (``roofline.kernels.fused_moe``), per shape and token count, as vLLM keeps
them (``fused_moe/configs/E=..,N=..,device_name=...json``, keyed by M): a measured table per device, and a
heuristic by M where the table has no entry.

Table: ``roofline/kernels/moe_configs/<device name>.json`` (spaces -> ``_``; written by
``bench/gpu_moe_tune.py`` on the device). Its layout::

    {"_source": "...", "E=8,N=14336,K=4096,dtype=bfloat16": {"1": {config}, "8": {config}, ...}, ...}

N is each expert's intermediate width I (vLLM's N is 2I; ours names the layer), K the hidden size H, dtype the
expert weights' format (bfloat16, float16, int8, fp8). A config is ``MoeConfig``'s fields. The entry of the
nearest measured M is taken (vLLM's rule); a shape without an entry gets ``default_config``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

_TABLES = Path(__file__).with_name("moe_configs")
_table_override: Path | str | None = None  # set_config_table: a path, "none" (heuristic only), or None


@dataclasses.dataclass(frozen=True)
class MoeConfig:
    """One launch config of the fused MoE layer.

    Attributes:
        path: "grouped" (align + two grouped GEMMs), "gemv" (the small-M stream: one program per (pair,
            ``block_n`` rows)) or "loop" (the expert loop, cuBLAS per expert: only where it was measured
            faster; never inside CUDA-graph capture, where its host syncs are not allowed).
        block_m, block_n, block_k: tile rows (pairs), columns (output channels), depth (grouped path); the GEMV
            path uses block_n (rows per program) and block_k (elements per row per step).
        group_m: blocks of rows that share one weight column tile in launch order (the L2 swizzle).
        num_warps, num_stages: Triton's launch options (num_stages: the software pipeline depth of tl.dot).
        down_block_n, down_block_k, down_num_warps: the GEMV path's down kernel (one program per (token,
            ``down_block_n`` rows), a loop over the token's k experts); 0: the same as block_n, block_k,
            num_warps.
        down_slots: experts of a token whose down tiles that kernel loads at once (a power of two; 1: one
            expert after another, a chain of k dependent tiles per K step; k: every expert's tile in flight).
        persistent: the GEMV path's gate_up kernel on a persistent grid of ``persistent`` programs per SM, each
            streaming its (pair, ``block_n`` rows) items as one chain of tiles with the next always in flight
            (``_moe_gemv_persistent_kernel``); 0: one program per item (``_moe_gemv_kernel``).
        down_persistent: the same for the down kernel (``_moe_down_sum_persistent_kernel``; items are (token,
            ``down_block_n`` rows)); 0: ``_moe_down_sum_kernel``, one program per item.
        fused_config: on the loop path, the fastest kernel config (what runs inside CUDA-graph capture).
    """

    path: str = "grouped"
    block_m: int = 64
    block_n: int = 64
    block_k: int = 64
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fused_config: MoeConfig | None = None
    down_block_n: int = 0
    down_block_k: int = 0
    down_num_warps: int = 0
    down_slots: int = 1
    persistent: int = 0
    down_persistent: int = 0

    def __post_init__(self):
        if self.path not in ("grouped", "gemv", "loop"):
            raise ValueError(f"MoeConfig.path must be grouped, gemv or loop, got {self.path!r}")
        for name in ("block_m", "block_n", "block_k", "group_m", "num_warps", "down_slots"):
            v = getattr(self, name)
            if v < 1 or v & (v - 1):
                raise ValueError(f"MoeConfig.{name} must be a power of two >= 1, got {v}")
        for name in ("down_block_n", "down_block_k", "down_num_warps"):
            v = getattr(self, name)
            if v < 0 or v & (v - 1):
                raise ValueError(f"MoeConfig.{name} must be 0 (as the gate_up tile) or a power of two, got {v}")
        for name in ("persistent", "down_persistent"):
            if not 0 <= getattr(self, name) <= 64:
                raise ValueError(f"MoeConfig.{name} must be in [0, 64] programs per SM, got {getattr(self, name)}")
        if self.path == "grouped" and self.block_m < 16:
            raise ValueError(f"MoeConfig.block_m must be >= 16 on the grouped path (tl.dot), got {self.block_m}")
        if not 1 <= self.num_stages <= 8:
            raise ValueError(f"MoeConfig.num_stages must be in [1, 8], got {self.num_stages}")

    def down_tile(self) -> tuple[int, int, int]:
        """(block_n, block_k, num_warps) of the GEMV path's down kernel."""
        return (self.down_block_n or self.block_n, self.down_block_k or self.block_k,
                self.down_num_warps or self.num_warps)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def table_key(num_experts: int, inter: int, hidden: int, dtype_name: str) -> str:
    return f"E={num_experts},N={inter},K={hidden},dtype={dtype_name}"


def set_config_table(path: Path | str | None) -> None:
    """Use the table at ``path`` (a JSON file) instead of the committed one; "none": the heuristic only;
    None: back to the committed table of the device."""
    global _table_override
    _table_override = path
    load_table.cache_clear()


@functools.cache
def load_table(device_name: str) -> dict:
    """The measured configs of ``device_name``: {table_key: {M: MoeConfig}}, {} if none."""
    if _table_override == "none":
        return {}
    path = Path(_table_override) if _table_override is not None else _TABLES / (device_name.replace(" ", "_")
                                                                                 + ".json")
    if not path.is_file():
        return {}
    raw = json.loads(path.read_text())
    return {key: {int(m): _config(cfg) for m, cfg in entry.items()} for key, entry in raw.items()
            if not key.startswith("_")}


def _config(fields: dict) -> MoeConfig:
    """A table entry -> MoeConfig (timings and other extra fields dropped)."""
    kw = {f: v for f, v in fields.items() if f in MoeConfig.__dataclass_fields__}
    if kw.get("fused_config") is not None:
        kw["fused_config"] = _config(kw["fused_config"])
    return MoeConfig(**kw)


def default_config(num_tokens: int, num_experts: int, top_k: int, inter: int, hidden: int, coded: bool,
                   num_sms: int) -> MoeConfig:
    """The heuristic by M (no table entry): the GEMV stream at M <= 4; grouped tiles sized by the expected
    pairs per expert, up to 128x128x64 with 8 warps and the GROUP_M swizzle where each expert has >= 128 rows
    (compute-bound prefill: the tile that feeds the tensor cores, each weight tile read once from DRAM)."""
    if num_tokens <= 4:
        pairs = num_tokens * top_k
        block_k = 512 if coded else 256  # 16-byte (int8/fp8) or 2x16-byte (16-bit) loads per thread per row
        block_n = 16
        while block_n > 4 and pairs * -(-min(inter, hidden) // block_n) < 4 * num_sms:
            block_n //= 2  # >= 4 programs per SM on both GEMVs
        down_n = 16  # the down kernel's grid is (token, H / down_n): the same >= 4 programs per SM, >= 4 rows
        while down_n > 4 and num_tokens * -(-hidden // down_n) < 4 * num_sms:
            down_n //= 2
        return MoeConfig(path="gemv", block_n=block_n, block_k=block_k, num_warps=4, num_stages=1,
                         down_block_n=down_n)
    per_expert = num_tokens * top_k / num_experts
    if per_expert <= 16:
        return MoeConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    if per_expert <= 32:
        return MoeConfig(block_m=32, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    if per_expert <= 96:
        return MoeConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=4, num_stages=4)
    return MoeConfig(block_m=128, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)


def get_config(num_tokens: int, num_experts: int, top_k: int, inter: int, hidden: int, dtype_name: str,
               device) -> MoeConfig:
    """The measured config of the nearest M for this shape and format on ``device`` (a torch.device), else
    ``default_config``."""
    import torch

    on_cuda = device.type == "cuda"
    entry = load_table(torch.cuda.get_device_name(device)).get(
        table_key(num_experts, inter, hidden, dtype_name)) if on_cuda else None
    if entry:
        return entry[min(entry, key=lambda m: (abs(m - num_tokens), m))]
    sms = torch.cuda.get_device_properties(device).multi_processor_count if on_cuda else 1
    return default_config(num_tokens, num_experts, top_k, inter, hidden, dtype_name in ("int8", "fp8"), sms)
