"""Perplexity, KL divergence and top-1 agreement of a candidate's next-token distributions against a baseline's.

Per scored position t (target ``x[t+1]``), with baseline log-probs ``b`` and candidate log-probs ``c`` over the
vocabulary:
- NLL = -c[x[t+1]]; perplexity = exp(mean NLL) over every scored position of every window;
- KL(baseline || candidate) = sum_v exp(b_v) (b_v - c_v), summed in float64 from the fp32 log-probs, so
  the sum adds no error beyond the log-probs' own rounding (a candidate identical to the baseline gives
  exactly 0); reported as the mean and the 99th percentile (numpy's linear interpolation) over positions,
  since quantization damage hides in the tail;
- top-1 agreement: the fraction of positions where argmax b == argmax c (first index on ties).
Windows are compared one at a time, so memory holds two [window, vocab] tensors, not the whole run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

_ROWS_PER_CHUNK = 256  # rows of the float64 KL at once: 256 x 49152 x 8 B = 96 MiB


def kl_per_position(base: torch.Tensor, cand: torch.Tensor) -> torch.Tensor:
    """KL(base || cand) per row. base, cand: [N, V] log-probs (any float dtype) -> [N] float64, nats."""
    if base.shape != cand.shape:
        raise ValueError(f"baseline and candidate log-probs differ in shape: {tuple(base.shape)} vs "
                         f"{tuple(cand.shape)}")
    out = torch.empty(base.shape[0], dtype=torch.float64, device=base.device)
    for i in range(0, base.shape[0], _ROWS_PER_CHUNK):
        b = base[i:i + _ROWS_PER_CHUNK].double()
        c = cand[i:i + _ROWS_PER_CHUNK].double()
        out[i:i + _ROWS_PER_CHUNK] = (b.exp() * (b - c)).sum(dim=-1)
    return out


@dataclass
class QualityAccumulator:
    """Running sums over windows for one configuration scored against the baseline."""

    nll_sum: float = 0.0
    num_scored: int = 0
    num_agree: int = 0
    kls: list[np.ndarray] = field(default_factory=list)  # float64 per position; 8 B x 50k = 400 kB

    def add(self, base: torch.Tensor, cand: torch.Tensor | None, targets: torch.Tensor) -> None:
        """base, cand: [N, V] log-probs of the N scored rows (cand None: the baseline itself, KL 0 and
        agreement 1 by definition, not computed); targets: [N] int64 next-token ids."""
        n = int(targets.shape[0])
        scored = base if cand is None else cand
        self.nll_sum -= float(scored.gather(1, targets.to(scored.device)[:, None]).double().sum())
        self.num_scored += n
        if cand is None:
            self.num_agree += n
            self.kls.append(np.zeros(n))
        else:
            self.num_agree += int((base.argmax(dim=-1) == cand.argmax(dim=-1)).sum())
            self.kls.append(kl_per_position(base, cand).cpu().numpy())

    def summary(self) -> dict[str, Any]:
        """perplexity, mean_nll (nats), kl_mean, kl_p99, kl_max (nats), top1_agreement, num_scored_tokens."""
        if self.num_scored == 0:
            raise ValueError("no positions were scored")
        kls = np.concatenate(self.kls)
        mean_nll = self.nll_sum / self.num_scored
        return {
            "num_scored_tokens": self.num_scored,
            "mean_nll": mean_nll,
            "perplexity": math.exp(mean_nll),
            "kl_mean": float(kls.mean()),
            "kl_p99": float(np.percentile(kls, 99)),
            "kl_max": float(kls.max()),
            "top1_agreement": self.num_agree / self.num_scored,
        }
