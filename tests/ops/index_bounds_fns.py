"""Rank functions that `test_index_bounds` launches on gloo processes (a module of its own: every
rank imports the launched function's module by name, and this one imports no pytest)."""

from __future__ import annotations

import torch

import sbpflow as sf
from sbpflow.errors import IndexOutOfRange


def split_table_and_classes_verdicts() -> list[str]:
    """The issue's two calls on 4 ranks (vocab-split embedding, class-split cross-entropy, each
    with one bad index), then the collective each path would run next: reading the result
    (an all-reduce) if the call returned, an all-gather if it raised. If the ranks disagreed,
    they would meet in different collectives: a `CommError` or a timeout, not a result."""
    mesh = sf.placement("cpu", ranks=[0, 1, 2, 3])
    emb = sf.nn.Embedding(10, 4)
    sf.parallel.apply(emb, mesh, {"*": sf.S(0)})
    logits = sf.randn(4, 5, placement=mesh, sbp=sf.S(1), seed=0)
    calls = [lambda: emb(sf.tensor(torch.tensor([1, 12, 3]), mesh, sf.B)),
             lambda: sf.nn.functional.cross_entropy(
                 logits, sf.tensor(torch.tensor([0, 9, 1, 2]), mesh, sf.B))]
    verdicts = []
    for call in calls:
        try:
            call().full_tensor()
            verdicts.append("returned")
        except IndexOutOfRange:
            sf.arange(4, placement=mesh, sbp=sf.S(0)).full_tensor()
            verdicts.append("raised")
    return verdicts
