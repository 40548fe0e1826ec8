"""Samples to this rank's shards: read the samples of a rank's rows, stack them (as torch's
``default_collate`` does for tensors, numpy arrays and numbers), and cut the shard.

A sample is one value, or a tuple / list / namedtuple / dict of values; the batch is then one
tensor, or the same structure of them (`ItemForm`), each of logical shape ``(rows of the batch,
*the value's shape)``. Errors name the sample index, the batch, the epoch and the rank
(`DataLoaderError`, `ShapeError`).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Any, NamedTuple, Sequence

import numpy as np
import torch

from ..errors import DataLoaderError, DtypeMismatchError, ShapeError
from ..placement import Placement
from ..sbp import Sbp, check_axes, format_nd_sbp, shard_box
from ..utils import sequence_of

__all__ = ["ItemForm", "Shards", "read_samples", "reading_index", "stack_samples", "cut_rule",
           "apply_cut", "cut_shard"]


class ItemForm(NamedTuple):
    """The structure of a dataset's items, which the loader's batches take: ``kind`` None (one
    value: a batch is one tensor), ``tuple``, ``list``, a namedtuple class, or ``dict`` (then
    ``keys``, in the first sample's order)."""

    kind: type | None
    keys: tuple = ()

    def build(self, values: Sequence) -> Any:
        """The batch: ``values`` (one per element, in order) in this structure."""
        if self.kind is None:
            return values[0]
        if self.kind is tuple:  # the common case first (the consumer builds every batch)
            return tuple(values)
        if issubclass(self.kind, dict):
            return dict(zip(self.keys, values))
        return sequence_of(self.kind, values)


ONE_VALUE = ItemForm(None)


@dataclass(frozen=True)
class Shards:
    """One batch on one rank: its local shards and their logical shapes, and the structure of
    the dataset's items (`ItemForm`: the loader yields the global tensors in it)."""

    form: ItemForm
    locals: tuple
    shapes: tuple


def read_samples(dataset: Any, indices: Sequence[int], where: str,
                 progress: dict | None = None) -> list:
    """``[dataset[i] for i in indices]`` (one ``__getitems__`` call when the dataset has it, as
    torch's fetcher does). ``progress["index"]`` says which samples are being read, or
    ``progress["reading"]`` is ``(indices, samples read so far)`` (for timeout messages: see
    `reading_index`). A failing read raises `DataLoaderError` naming the index and ``where``."""
    getitems = getattr(dataset, "__getitems__", None)
    if getitems:
        if progress is not None:
            progress["index"] = list(indices)
        try:
            return list(getitems(list(indices)))
        except Exception as exc:  # noqa: BLE001 - re-raised with the samples named
            raise DataLoaderError(f"DataLoader: reading samples {list(indices)} ({where}) "
                                  f"with __getitems__ failed: {type(exc).__name__}: {exc}") from exc
    out: list = []
    if progress is not None:  # the sample being read is indices[len(out)]: no write a sample
        progress["reading"] = (indices, out)
    append, i = out.append, None
    try:  # one try for the loop: this loop is the loading thread's Python under the GIL
        for i in indices:
            append(dataset[i])
    except Exception as exc:  # noqa: BLE001 - re-raised with the sample named
        raise DataLoaderError(f"DataLoader: reading sample {i} ({where}) failed: "
                              f"{type(exc).__name__}: {exc}") from exc
    return out


def reading_index(progress: dict) -> Any:
    """The sample (or samples) `read_samples` is reading, from its ``progress`` dict."""
    if progress.get("index") is not None:
        return progress["index"]
    indices, out = progress.get("reading") or ((), ())
    return indices[min(len(out), len(indices) - 1)] if indices else None


_NUMBERS = {bool: torch.bool, int: torch.int64, float: torch.float64}  # as default_collate
# the same dtypes in numpy: np.array of a list of numbers is a quarter of torch.tensor's cost
_NUMPY_NUMBERS = {bool: np.bool_, int: np.int64, float: np.float64}
_dtype_of = attrgetter("dtype")


def _leaf(value: Any, index: int, element: int | None, where: str) -> torch.Tensor:
    """One value of a sample as a tensor (numbers as ``default_collate``: int -> int64,
    float -> float64, bool -> bool; a subclass of int or float, e.g. an ``IntEnum``, as its
    base, as torch's ``isinstance`` test does)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (np.ndarray, np.generic)) and value.dtype.kind in "biufc":
        return torch.as_tensor(value)
    if type(value) in _NUMBERS:
        return torch.tensor(value, dtype=_NUMBERS[type(value)])
    for base in (float, int):  # (a bool is caught above: bool cannot be subclassed)
        if isinstance(value, base):
            return torch.tensor(base(value), dtype=_NUMBERS[base])
    part = f" element {element}" if element is not None else ""
    raise DataLoaderError(f"DataLoader: sample {index}{part} ({where}) is a "
                          f"{type(value).__name__}; the loader batches tensors, numeric numpy "
                          f"arrays and numbers (return those from __getitem__)")


def _stack_column(values: Sequence, indices: Sequence[int], k: int | None,
                  where: str) -> torch.Tensor:
    """Element ``k`` of every sample stacked. The common cases (all tensors, all numbers of
    one type) take one torch call; anything else goes through `_checked_stack`, which names
    the sample that differs."""
    kinds = set(map(type, values))
    if len(kinds) == 1:
        kind = next(iter(kinds))
        if kind in _NUMBERS:  # exact types: a bool is no int here (an int64 beyond: overflow)
            try:
                return torch.from_numpy(np.array(values, dtype=_NUMPY_NUMBERS[kind]))
            except OverflowError:
                return torch.tensor(values, dtype=_NUMBERS[kind])  # torch's own error
        if issubclass(kind, torch.Tensor) and len(set(map(_dtype_of, values))) == 1:
            try:
                return torch.stack(values)
            except RuntimeError:
                pass  # shapes differ: name them below
    return _checked_stack([_leaf(v, i, k, where) for v, i in zip(values, indices)], indices,
                          k, where)


def _checked_stack(leaves: list, indices: Sequence[int], k: int | None,
                   where: str) -> torch.Tensor:
    ref, element = leaves[0], "" if k is None else f" element {k}"
    for leaf, i in zip(leaves[1:], indices[1:]):
        if leaf.shape != ref.shape:
            raise ShapeError(f"DataLoader: sample {i}{element} has shape {tuple(leaf.shape)} "
                             f"but sample {indices[0]} has {tuple(ref.shape)} ({where}); the "
                             f"samples of a batch must have equal shapes (pad them in the "
                             f"dataset)")
        if leaf.dtype != ref.dtype:
            raise DtypeMismatchError(f"DataLoader: sample {i}{element} is {leaf.dtype} but "
                                     f"sample {indices[0]} is {ref.dtype} ({where})")
    return torch.stack(leaves)


def stack_samples(samples: Sequence, indices: Sequence[int],
                  where: str) -> tuple[ItemForm, list[torch.Tensor]]:
    """Stack samples (read from ``indices``) into ``(form, [tensor of shape (len, *item) per
    element])``. Samples must agree in structure, shapes and dtypes, as for torch's
    ``default_collate``; otherwise the error names the two samples that differ."""
    form = _form(samples[0])
    _check_structure(samples, indices, form, where)
    if form.kind is None:
        return form, [_stack_column(samples, indices, None, where)]
    if form.keys:
        columns = [[sample[key] for sample in samples] for key in form.keys]
    else:
        columns = list(zip(*samples))
    return form, [_stack_column(col, indices, k, where) for k, col in enumerate(columns)]


def _form(sample: Any) -> ItemForm:
    if isinstance(sample, dict):
        return ItemForm(dict, tuple(sample))
    return ItemForm(type(sample)) if isinstance(sample, (tuple, list)) else ONE_VALUE


def _shown(form: ItemForm, sample: Any) -> str:
    if form.kind is None:
        return "one value"
    if form.keys:
        return f"a dict with keys {list(form.keys)}"
    return f"a {form.kind.__name__} of {len(sample)}"


def _check_structure(samples: Sequence, indices: Sequence[int], form: ItemForm,
                     where: str) -> None:
    """Every sample is built as the first (whose `ItemForm` the batch takes, as torch's
    ``default_collate`` takes the first sample's type): one value; a tuple / list (of any of
    those types) of the same length; or a dict with the same keys, in any order (the batch's
    are the first sample's, in its order, as torch's)."""
    kinds = set(map(type, samples))  # C loops first: the common, well-formed case is cheap
    if len(kinds) == 1 and form.kind in (tuple, list):  # every sample of the first's type
        if len(set(map(len, samples))) == 1:
            return
    elif form.kind is None and not any(issubclass(k, (tuple, list, dict)) for k in kinds):
        return
    if form.keys and kinds == {form.kind} and all(tuple(s) == form.keys for s in samples):
        return
    if form.kind is not None and not form.keys and \
            all(issubclass(k, (tuple, list)) for k in kinds) and len(set(map(len, samples))) == 1:
        return
    for sample, i in zip(samples, indices):
        if _built_as(sample) != _built_as(samples[0]):
            raise DataLoaderError(f"DataLoader: sample {i} ({where}) is "
                                  f"{_shown(_form(sample), sample)} but sample {indices[0]} is "
                                  f"{_shown(form, samples[0])}")


def _built_as(sample: Any) -> tuple:
    """What must agree between the samples of a batch: dict keys (a set) or sequence length."""
    if isinstance(sample, dict):
        return ("dict", frozenset(sample))
    return ("seq", len(sample)) if isinstance(sample, (tuple, list)) else ("one",)


def cut_rule(rows_shape: tuple, n_rows: int, placement: Placement, nd_sbp: Sequence[Sbp],
             coord: Sequence[int] | None) -> tuple[tuple, tuple | None]:
    """``(logical shape, narrows)`` for rows of shape ``rows_shape`` (the rank's rows of an
    ``n_rows`` batch, already cut along axis 0): ``narrows`` the ``(axis, start, size)`` cuts of
    other axes the shard needs, ``None`` outside the placement (the shard is empty). The same
    for every batch of one size: the loader computes it once."""
    shape = (n_rows,) + tuple(rows_shape[1:])
    check_axes(nd_sbp, len(shape), shape=shape, placement=placement)
    if coord is None:
        return shape, None
    box = shard_box(shape, placement.shape, nd_sbp, coord)
    if box[0][1] != rows_shape[0]:  # the caller's row range and the shard rule must agree
        raise ShapeError(f"DataLoader: {rows_shape[0]} rows read but the shard of {shape} on "
                         f"{placement} with sbp {format_nd_sbp(nd_sbp)} has {box[0][1]}")
    return shape, tuple((axis, start, size) for axis, (start, size) in enumerate(box[1:], 1)
                        if size != shape[axis])


def apply_cut(rows: torch.Tensor, narrows: tuple | None) -> torch.Tensor:
    """The local shard of ``rows`` by `cut_rule`'s ``narrows``."""
    if narrows is None:
        return rows[:0]
    if not narrows:
        return rows
    for axis, start, size in narrows:
        rows = rows.narrow(axis, start, size)
    return rows.contiguous()


def cut_shard(rows: torch.Tensor, n_rows: int, placement: Placement, nd_sbp: Sequence[Sbp],
              coord: Sequence[int] | None) -> tuple[torch.Tensor, tuple]:
    """``(local shard, logical shape)`` of one element: ``rows`` are the rank's rows of an
    ``n_rows`` batch (already cut along axis 0); splits of other axes are cut here."""
    shape, narrows = cut_rule(tuple(rows.shape), n_rows, placement, nd_sbp, coord)
    return apply_cut(rows, narrows), shape
