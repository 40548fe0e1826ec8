"""Samples to this rank's shards: read the samples of a rank's rows, stack them (as torch's
``default_collate`` does for tensors, numpy arrays and numbers), and cut the shard.

A sample is one value or a tuple / list of values; the batch is then one tensor or a tuple of
them, each of logical shape ``(rows of the batch, *the value's shape)``. Errors name the
sample index, the batch, the epoch and the rank (`DataLoaderError`, `ShapeError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..errors import DataLoaderError, DtypeMismatchError, ShapeError
from ..placement import Placement
from ..sbp import Sbp, check_axes, format_nd_sbp, shard_box

__all__ = ["Shards", "read_samples", "stack_samples", "cut_shard"]


@dataclass(frozen=True)
class Shards:
    """One batch on one rank: its local shards and their logical shapes, and whether the
    dataset's items are tuples (the loader then yields a tuple of global tensors)."""

    is_tuple: bool
    locals: tuple
    shapes: tuple


def read_samples(dataset: Any, indices: Sequence[int], where: str,
                 progress: dict | None = None) -> list:
    """``[dataset[i] for i in indices]`` (one ``__getitems__`` call when the dataset has it, as
    torch's fetcher does). ``progress["index"]`` says which sample is being read (for timeout
    messages). A failing read raises `DataLoaderError` naming the index and ``where``."""
    getitems = getattr(dataset, "__getitems__", None)
    if getitems:
        if progress is not None:
            progress["index"] = list(indices)
        try:
            return list(getitems(list(indices)))
        except Exception as exc:  # noqa: BLE001 - re-raised with the samples named
            raise DataLoaderError(f"DataLoader: reading samples {list(indices)} ({where}) "
                                  f"with __getitems__ failed: {type(exc).__name__}: {exc}") from exc
    out = []
    for i in indices:
        if progress is not None:
            progress["index"] = i
        try:
            out.append(dataset[i])
        except Exception as exc:  # noqa: BLE001 - re-raised with the sample named
            raise DataLoaderError(f"DataLoader: reading sample {i} ({where}) failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
    return out


def _leaf(value: Any, index: int, element: int | None, where: str) -> torch.Tensor:
    """One value of a sample as a tensor (numbers as ``default_collate``: int -> int64,
    float -> float64, bool -> bool)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "biufc":
        return torch.as_tensor(value)
    if isinstance(value, bool):
        return torch.tensor(value)
    if isinstance(value, int):
        return torch.tensor(value, dtype=torch.int64)
    if isinstance(value, float):
        return torch.tensor(value, dtype=torch.float64)
    part = f" element {element}" if element is not None else ""
    raise DataLoaderError(f"DataLoader: sample {index}{part} ({where}) is a "
                          f"{type(value).__name__}; the loader batches tensors, numeric numpy "
                          f"arrays and numbers (return those from __getitem__)")


def _leaves(sample: Any, index: int, where: str) -> tuple[bool, list[torch.Tensor]]:
    if isinstance(sample, (tuple, list)):
        return True, [_leaf(v, index, k, where) for k, v in enumerate(sample)]
    return False, [_leaf(sample, index, None, where)]


def stack_samples(samples: Sequence, indices: Sequence[int],
                  where: str) -> tuple[bool, list[torch.Tensor]]:
    """Stack samples (read from ``indices``) into ``(is_tuple, [tensor of shape (len, *item)
    per element])``. Samples must agree in structure, shapes and dtypes, as for torch's
    ``default_collate``; otherwise the error names the two samples that differ."""
    first_tuple, first = _leaves(samples[0], indices[0], where)
    columns = [[leaf] for leaf in first]
    for sample, i in zip(samples[1:], indices[1:]):
        is_tuple, leaves = _leaves(sample, i, where)
        if is_tuple != first_tuple or len(leaves) != len(first):
            raise DataLoaderError(
                f"DataLoader: sample {i} ({where}) has another structure than sample "
                f"{indices[0]}: {_structure(is_tuple, leaves)} vs {_structure(first_tuple, first)}")
        for k, (leaf, ref) in enumerate(zip(leaves, first)):
            if leaf.shape != ref.shape:
                raise ShapeError(f"DataLoader: sample {i} element {k} has shape "
                                 f"{tuple(leaf.shape)} but sample {indices[0]} has "
                                 f"{tuple(ref.shape)} ({where}); the samples of a batch must "
                                 f"have equal shapes (pad them in the dataset)")
            if leaf.dtype != ref.dtype:
                raise DtypeMismatchError(f"DataLoader: sample {i} element {k} is {leaf.dtype} "
                                         f"but sample {indices[0]} is {ref.dtype} ({where})")
            columns[k].append(leaf)
    return first_tuple, [torch.stack(col) for col in columns]


def _structure(is_tuple: bool, leaves: list) -> str:
    shapes = [tuple(leaf.shape) for leaf in leaves]
    return f"a tuple of {len(leaves)} {shapes}" if is_tuple else f"one value {shapes[0]}"


def cut_shard(rows: torch.Tensor, n_rows: int, placement: Placement, nd_sbp: Sequence[Sbp],
              coord: Sequence[int] | None) -> tuple[torch.Tensor, tuple]:
    """``(local shard, logical shape)`` of one element: ``rows`` are the rank's rows of an
    ``n_rows`` batch (already cut along axis 0); splits of other axes are cut here."""
    shape = (n_rows,) + tuple(rows.shape[1:])
    check_axes(nd_sbp, len(shape), shape=shape, placement=placement)
    if coord is None:
        return rows[:0], shape
    box = shard_box(shape, placement.shape, nd_sbp, coord)
    if box[0][1] != rows.shape[0]:  # the caller's row range and the shard rule must agree
        raise ShapeError(f"DataLoader: {rows.shape[0]} rows read but the shard of {shape} on "
                         f"{placement} with sbp {format_nd_sbp(nd_sbp)} has {box[0][1]}")
    for axis, (start, size) in enumerate(box[1:], start=1):
        if size != shape[axis]:
            rows = rows.narrow(axis, start, size)
    return rows.contiguous(), shape
