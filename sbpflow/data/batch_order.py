"""Which samples make each batch of an epoch, and which rows of a batch a rank reads.

The order depends only on the dataset's length, the batch size, ``shuffle``, ``seed`` and the
epoch (a ``torch.Generator`` seeded with ``seed + epoch`` permutes ``range(n)``, as torch's
``DistributedSampler`` does), never on the placement: the batches are logical, and a rank
reads the rows of each batch that its shard holds (the local-shard rule, `sbp.shard_box`).
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..placement import Placement
from ..sbp import B, Sbp, Split, shard_box

__all__ = ["epoch_order", "batch_indices", "num_batches", "row_range"]


def epoch_order(n: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The sample indices of one epoch, in order: a seeded permutation of ``range(n)`` (seed
    ``seed + epoch``, as ``DistributedSampler``) when ``shuffle``, else ``range(n)``."""
    if not shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(seed + epoch)
    return torch.randperm(n, generator=g).tolist()


def num_batches(n: int, batch_size: int, drop_last: bool) -> int:
    """Batches an epoch of ``n`` samples has (a last smaller batch unless ``drop_last``)."""
    return n // batch_size if drop_last else -(-n // batch_size)


def batch_indices(n: int, batch_size: int, *, shuffle: bool, seed: int, epoch: int,
                  drop_last: bool) -> list[list[int]]:
    """The logical batches of one epoch: consecutive ``batch_size`` chunks of `epoch_order`
    (every sample once; the last chunk is smaller or dropped by ``drop_last``)."""
    order = epoch_order(n, shuffle, seed, epoch)
    count = num_batches(n, batch_size, drop_last)
    return [order[b * batch_size:(b + 1) * batch_size] for b in range(count)]


def row_range(n_rows: int, placement: Placement, nd_sbp: Sequence[Sbp],
              coord: Sequence[int] | None) -> tuple[int, int]:
    """``(start, size)``: the rows (batch axis 0) of an ``n_rows`` batch that the rank at mesh
    ``coord`` holds under ``nd_sbp`` (``(0, 0)`` outside the placement, ``coord=None``).

    Splits of other axes do not change which rows a rank holds, so they count as ``B`` here
    (the rank reads those whole samples and keeps its part of each)."""
    if coord is None:
        return 0, 0
    rows_only = [s if isinstance(s, Split) and s.axis == 0 else B for s in nd_sbp]
    return shard_box((n_rows,), placement.shape, rows_only, coord)[0]
