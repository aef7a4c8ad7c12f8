"""Start-up calibration of the fp8_e4m3 KV cache's static per-(layer, KV head) scales.

Scheme (``roofline.kernels.common`` gives the format): one forward pass over a fixed calibration sequence,
during which every layer records the amax of its post-RoPE K and of its V per KV head
(``AttentionBackend.calibration_forward``); then ``scale = headroom x amax / 448`` with
``FP8_CALIBRATION_HEADROOM`` = 2, and the store saturates anything beyond +-448 x scale.

Why static and per head: E4M3 keeps 3 mantissa bits over its whole normal range [2^-6, 448] (a ratio of
2^15), so the scale only has to place a head's values inside it; heads differ in magnitude by orders
(an outlier head would crush the others' precision under one per-layer scale); and a static scale makes a
token's stored bytes a function of that token alone (batch invariance, reusable prefix-cache blocks),
which a running or per-batch amax would not.

The calibration sequence: BOS (when the model has one) then ``CALIBRATION_NUM_TOKENS - 1`` token ids drawn
uniformly from the vocabulary with a fixed seed, so the scales are reproducible for a given model and need
no dataset or tokenizer in the worker. Headroom 2 covers text whose activations exceed those of the
calibration sequence (see the measurement in tests/attention/test_kv_quant_engine.py); the cost is that
values below amax x 2^-6 x 2 / 448 ~ amax / 14,000 fall into the subnormal range, where their absolute
error (<= scale x 2^-10 ~ amax / 230,000) is negligible next to the error of the largest values.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from roofline.attention.backend import AttentionBackend, AttentionMetadata

CALIBRATION_NUM_TOKENS = 512
CALIBRATION_SEED = 0


def calibration_token_ids(vocab_size: int, bos_token_id: int | None, num_tokens: int = CALIBRATION_NUM_TOKENS,
                          seed: int = CALIBRATION_SEED) -> torch.Tensor:
    """[num_tokens] int64 on CPU: BOS (if any), then seeded uniform ids in [0, vocab_size).

    Raises:
        ValueError: num_tokens < 1 or vocab_size < 1.
    """
    if num_tokens < 1 or vocab_size < 1:
        raise ValueError(f"num_tokens and vocab_size must be >= 1, got {num_tokens} and {vocab_size}")
    ids = torch.randint(0, vocab_size, (num_tokens,), generator=torch.Generator().manual_seed(seed))
    if bos_token_id is not None:
        ids[0] = bos_token_id
    return ids


@torch.inference_mode()
def calibrate_fp8_kv_scales(
    backend: AttentionBackend,
    model: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor],
    token_ids: torch.Tensor,
    device: torch.device,
) -> dict[str, float]:
    """Run ``model(input_ids, positions, meta)`` once over ``token_ids`` (one sequence, positions 0..T-1) with
    ``backend`` in calibration mode, and set its fp8 pool's per-head scales (``calibrate_kv_scales``).

    Returns the scales' min/max (for the start-up log). Nothing is written to the cache (every slot -1).
    """
    n = int(token_ids.shape[0])
    meta = AttentionMetadata(
        slot_mapping=torch.full((n,), -1, dtype=torch.int64, device=device),
        query_start_loc=torch.tensor([0, n], dtype=torch.int32, device=device),
        seq_lens=torch.tensor([n], dtype=torch.int32, device=device),
        block_tables=torch.zeros(1, 1, dtype=torch.int32, device=device),
        max_query_len=n, query_lens_cpu=[n], seq_lens_cpu=[n],
    )
    ids = token_ids.to(device)
    positions = torch.arange(n, dtype=torch.int64, device=device)
    stats = backend.calibrate_kv_scales(lambda: model(ids, positions, meta))
    stats["num_tokens"] = n
    return stats
