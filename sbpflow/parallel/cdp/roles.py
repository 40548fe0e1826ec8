"""Where each piece of a CDP schedule runs, per setting (``mode``): the rank of every stage op,
the owner of each stage (its optimizer and latest parameters) and the holders (ranks that keep
its versions between cycles).

- ``single``: one rank runs all N workers.
- ``dp``: rank ``i`` runs worker ``i`` with a copy of the model; the last worker's rank owns
  every stage (it ends each gradient chain) and relays the new versions to the others.
- ``pp``: rank ``j`` runs stage ``j`` for every worker and owns it.
- ``mp``: stage ``j`` has a block of ranks, as many as micro-batches in flight on it (CDP
  ``N - j``, DP ``N``), served round-robin in arrival order ``N c + i``; the block's first rank
  owns it.
- ``zero``: rank ``i`` runs worker ``i``; stage ``j`` is owned by rank ``j`` only and relayed.
See docs/cdp.md, 'Settings'.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

from ...errors import PlanError
from .cycles import check_n, stage_concurrency

__all__ = ["MODES", "Roles", "ranks_needed", "make_roles"]

MODES = ("single", "dp", "pp", "mp", "zero")


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise PlanError(f"unknown CDP mode {mode!r}; one of {MODES}")


def ranks_needed(mode: str, n: int, timeline: str) -> int:
    """How many ranks ``mode`` needs for N stages on ``timeline``."""
    _check_mode(mode)
    check_n(n)
    if mode == "single":
        return 1
    if mode == "mp":
        return sum(stage_concurrency(timeline, n))
    return n


class Roles(NamedTuple):
    """The ranks of one trainer's setting. ``ranks``: its ranks in order; ``blocks``: per
    stage, the ranks that run it (every rank for single / dp / zero: worker ``i`` is on
    ``ranks[i]``; mp: the stage's own block)."""

    mode: str
    n: int
    ranks: tuple
    blocks: tuple

    def rank_of(self, worker: int, stage: int, cycle: int) -> int:
        """The rank that runs F and B of (``worker``, ``stage``) in ``cycle``."""
        if self.mode == "single":
            return self.ranks[0]
        if self.mode == "pp":
            return self.ranks[stage]
        if self.mode == "mp":
            block = self.blocks[stage]
            return block[(self.n * cycle + worker) % len(block)]
        return self.ranks[worker]

    def owner(self, stage: int) -> int:
        """The rank that holds ``stage``'s optimizer and runs its updates."""
        if self.mode in ("single", "pp", "mp"):
            return self.blocks[stage][0]
        if self.mode == "dp":
            return self.ranks[-1]
        return self.ranks[stage]  # zero

    def holders(self, stage: int) -> tuple:
        """The ranks that keep ``stage``'s versions between cycles (they get each new version
        from the owner); under ``zero`` only the owner (the workers get it relayed a use)."""
        if self.mode == "zero":
            return (self.owner(stage),)
        return tuple(self.blocks[stage])

    @property
    def period(self) -> int:
        """Cycles after which the rank assignment repeats (a multiple of mp's round-robin
        periods; 1 for the other modes)."""
        if self.mode != "mp":
            return 1
        return math.lcm(*(len(b) for b in self.blocks))


def make_roles(mode: str, n: int, timeline: str, ranks: Sequence[int]) -> Roles:
    """The roles of ``mode`` on ``ranks`` (exactly `ranks_needed` of them, distinct)."""
    need = ranks_needed(mode, n, timeline)
    ranks = tuple(int(r) for r in ranks)
    if len(ranks) != need or len(set(ranks)) != len(ranks):
        raise PlanError(f"CDP mode {mode!r} with N = {n} on the {timeline} timeline needs "
                        f"{need} distinct ranks, got placement ranks {list(ranks)}; pass "
                        f"placement=sf.placement('cpu', list(range({need}))) or leave it to "
                        f"the default (the first {need} ranks of the world)")
    if mode == "single":
        blocks = tuple((ranks[0],) for _ in range(n))
    elif mode == "pp":
        blocks = tuple((r,) for r in ranks)
    elif mode == "mp":
        out, start = [], 0
        for size in stage_concurrency(timeline, n):
            out.append(ranks[start:start + size])
            start += size
        blocks = tuple(out)
    else:
        blocks = tuple(ranks for _ in range(n))
    return Roles(mode, n, ranks, blocks)
