"""One rank's state of the layers above comm, as named fields (`Communicator.rank_state`).

Each field is owned by the module named in its comment; a field holds what that module keeps
for this rank between calls. Keys not yet moved here still live in the ``Communicator.state``
dict. Slotted: a field read on the dispatch path (the seed counter) costs an attribute read.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class RankState:
    """The per-rank fields; every rank of a world starts from the defaults."""

    seed: int = 0  # tensor.creation: the seed of this rank's stream of default seeds
    seed_counter: int = 0  # tensor.creation: default seeds drawn so far (graph replays set it)
    retained_grads: Any = None  # tensor: IdentityMap of local tensors that called retain_grad
    boxing_trace: list | None = None  # boxing.record_steps: (phase, BoxingStep) run, or None
    launch_calls: int = 0  # comm.world: launch result channels used (a new name per call)
    graph_plans: int = 0  # graph.compiled: graph plans built on this rank (same on every rank)
