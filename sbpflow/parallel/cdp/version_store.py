"""The parameter versions one rank holds, and the optimizer of each stage it owns.

`VersionStore` keeps ``(stage, version) -> tensors`` with a count of the tasks of the rank
that still read them (its forwards, its sends, the owner's update); the copy goes when the
count reaches 0. In-flight micro-batches keep their version alive through autograd (the
stash from F_j to B_j); `hold` / `drop` count them, so `max_versions` is the most distinct
versions of a stage alive at once on the rank. `StageOwner` runs a stage's optimizer: each
update starts from a copy of the latest version (in-flight micro-batches keep theirs) and
its result is the next version. See docs/cdp.md, 'Rules and versions'.
"""

from __future__ import annotations

import threading
from typing import Callable, Sequence

import torch

from ...errors import PlanError
from ...nn.parameter import Parameter
from ...placement import Placement
from ...sbp import B
from ...tensor import GlobalTensor
from .rules import average

__all__ = ["VersionStore", "StageOwner"]


class VersionStore:
    """Versions on one rank; ``uses(stage, version)`` says how many reads a new copy gets."""

    def __init__(self, n: int, uses: Callable[[int, int], int]) -> None:
        self.uses = uses
        self.lock = threading.Lock()  # receive threads put while the compute thread reads
        self.entries: dict[tuple[int, int], list] = {}   # -> [tensors, reads left]
        self.held: list[dict[int, int]] = [{} for _ in range(n)]  # stage -> version -> mbs
        self.max_versions = [0] * n

    def _note(self, stage: int) -> None:
        live = {v for (s, v) in self.entries if s == stage} | set(self.held[stage])
        self.max_versions[stage] = max(self.max_versions[stage], len(live))

    def put(self, stage: int, version: int, tensors: Sequence[torch.Tensor]) -> None:
        """A version arrived (or was made); kept for its reads on this rank."""
        reads = self.uses(stage, version)
        if reads <= 0:
            return
        key = (stage, version)
        with self.lock:
            # ``uses`` counts every read of the version on this rank, however many times it
            # is delivered (ZeRO relays version 0 for cycles 0 and 1): a second copy is dropped
            if key not in self.entries:
                self.entries[key] = [list(tensors), reads]
            self._note(stage)

    def take(self, stage: int, version: int) -> list[torch.Tensor]:
        """One read of a version (freed after its last)."""
        with self.lock:
            entry = self.entries.get((stage, version))
            if entry is None:
                have = sorted(v for (s, v) in self.entries if s == stage)
                raise PlanError(f"CDP: version {version} of stage {stage} is not on this rank "
                                f"(it holds versions {have}): a schedule bug")
            entry[1] -= 1
            if entry[1] == 0:
                del self.entries[(stage, version)]
            return entry[0]

    def latest(self, stage: int) -> int | None:
        with self.lock:
            have = [v for (s, v) in self.entries if s == stage]
        return max(have) if have else None

    def peek(self, stage: int, version: int) -> list[torch.Tensor]:
        """A version's tensors, without counting a read."""
        return self.entries[(stage, version)][0]

    def hold(self, stage: int, version: int) -> None:
        """A micro-batch's forward keeps ``version`` until its backward."""
        with self.lock:
            h = self.held[stage]
            h[version] = h.get(version, 0) + 1
            self._note(stage)

    def drop(self, stage: int, version: int) -> None:
        with self.lock:
            h = self.held[stage]
            h[version] -= 1
            if h[version] == 0:
                del h[version]


class StageOwner:
    """The optimizer of one stage, built by ``optimizer(params)`` on parameters laid out on
    this rank alone (``pl``); ``n`` workers' gradient sums are averaged before each step."""

    def __init__(self, first: Sequence[torch.Tensor], pl: Placement, n: int,
                 optimizer: Callable) -> None:
        self.n = n
        self.params = [Parameter(GlobalTensor(t.detach(), tuple(t.shape), pl, (B,)))
                       for t in first]
        self.optimizer = optimizer(self.params)

    def step(self, latest: Sequence[torch.Tensor], total: Sequence[torch.Tensor]
             ) -> list[torch.Tensor]:
        """The next version from the ``latest`` one and the workers' gradient sum."""
        for p, t, g in zip(self.params, latest, average(total, self.n)):
            local = t.detach().clone().requires_grad_(True)
            local.grad = g
            p._local = local  # a fresh copy: micro-batches in flight keep the old one
        self.optimizer.step()
        out = []
        for p in self.params:
            p.local.grad = None
            out.append(p.local)
        return out
