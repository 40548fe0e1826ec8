"""Random draws from given probabilities, the same in every layout: ``multinomial``.

Row ``r`` of a draw seeded ``seed`` is ``torch.multinomial(probs[r], n, replacement,
generator=torch.Generator().manual_seed(mix_seed(seed, r)))``: each rank draws its own rows, so
nothing is gathered and the tokens do not depend on the layout. Signatures (one mesh dim):
rows split ``(S(0), B) -> S(0)`` (2-D probabilities; the seed is a replicated 0-d tensor) and
all ``B``; a split of the categories is gathered first (a draw needs its whole row).
"""

from __future__ import annotations

import torch

from ..random_regions import mix_seed
from .registry import Signature, TensorMeta, register

__all__ = ["draw_rows"]


def draw_rows(probs: torch.Tensor, seed: int, num_samples: int, replacement: bool,
              first_row: int = 0) -> torch.Tensor:
    """``torch.multinomial`` of each row of ``probs`` (1-D: one row), row ``i`` under its own
    generator seeded ``mix_seed(seed, first_row + i)``."""
    rows = probs.reshape(-1, probs.shape[-1])
    out = torch.empty((rows.shape[0], num_samples), dtype=torch.int64, device=probs.device)
    for i in range(rows.shape[0]):
        g = torch.Generator(device=probs.device).manual_seed(mix_seed(seed, first_row + i))
        out[i] = torch.multinomial(rows[i], num_samples, replacement, generator=g)
    return out.reshape(*probs.shape[:-1], num_samples)


def _multinomial(probs, seed, num_samples: int, replacement: bool = False, *, ctx=None):
    if probs.device.type == "meta":
        return torch.empty((*probs.shape[:-1], num_samples), dtype=torch.int64, device="meta")
    first = ctx.in_boxes[0][0][0] if ctx is not None and probs.ndim == 2 else 0
    return draw_rows(probs, int(seed), num_samples, replacement, first)


def _multinomial_signatures(probs: TensorMeta, seed: TensorMeta, num_samples: int,
                            replacement: bool = False) -> list[Signature]:
    sigs = [Signature(["S(0)", "B"], ["S(0)"])] if probs.ndim == 2 else []
    return sigs + [Signature(["B", "B"], ["B"])]


register("multinomial", _multinomial, _multinomial_signatures, context=True,
         doc="torch.multinomial row by row, row r seeded mix_seed(seed, r): rows stay split")
