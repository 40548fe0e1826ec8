"""Data loading: `DataLoader` yields the batches of a map-style dataset as global tensors, each
rank reading only its shard's samples, prefetched by a thread a rank; called in a graph's
``build`` it is the plan's loading actor. See docs/runtime.md, 'Data loading'."""

from .batch_order import batch_indices, epoch_order, num_batches, row_range
from .dataloader import DataLoader, LoaderIterator

__all__ = ["DataLoader", "LoaderIterator", "batch_indices", "epoch_order", "num_batches",
           "row_range"]
