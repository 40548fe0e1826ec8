"""The tasks of a CDP schedule as data: per cycle, the stage ops (F, B), the gradient
accumulations (A), the updates (U) and the point-to-point transfers, each with its rank, time
step and a sort key.

Values are named by keys: ``("act", i, c, j)`` the output of F_j, ``("gact", i, c, j)`` the
gradient of B_j's input, ``("g", i, c, j)`` B_j's parameter gradients, ``("gsum", i, c, j)``
their sum over workers ``0 .. i``, ``("param", j, v)`` version ``v`` of stage ``j`` (ZeRO:
``("paramb", j, v)`` the copy relayed again for B_j). Every
dependency goes from a smaller key to a larger one, and each rank's ops and each pair's
transfers run in key order, so no order of firing can deadlock. `window` cuts the tasks of a
run (``2N`` time steps); `shift` moves tasks between cycles (a run's plan is reused). See
docs/cdp.md, 'How it runs'.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

from ...utils import renamed

from .cycles import step_of, update_step
from .roles import Roles
from .rules import timeline_of, version

__all__ = ["Work", "PeerTransfer", "cycle_tasks", "window", "shift", "version_uses",
           "refetched", "relay_reads"]


class Work(NamedTuple):
    """A task on ``rank``: ``kind`` "F" forward, "B" backward, "A" accumulate the gradient
    into the running sum, "U" update (``worker`` -1). It reads the values ``needs`` and
    writes ``makes``; ``key`` orders it."""

    kind: str
    worker: int
    stage: int
    cycle: int
    step: int
    rank: int
    key: tuple
    needs: tuple
    makes: tuple

    @property
    def chained(self) -> bool:
        """F and B run in key order on their rank; A and U fire as soon as they can."""
        return self.kind in "FB"

    @property
    def name(self) -> str:
        who = "" if self.worker < 0 else f"w{self.worker}"
        return f"{self.kind}{self.stage}{who}c{self.cycle}"


class PeerTransfer(NamedTuple):
    """Value ``payload`` sent from ``src`` to ``dst`` (a send actor on ``src``, a receive
    actor on ``dst``, run in ``key`` order per pair)."""

    payload: tuple
    src: int
    dst: int
    cycle: int
    step: int
    key: tuple

    @property
    def stage(self) -> int:
        return self.payload[1] if self.payload[0] in PARAMS else self.payload[3]


PARAMS = ("param", "paramb")  # a version's relay for a forward, for a backward (ZeRO)


def refetched(roles: Roles, n: int, rank: int, stage: int) -> bool:
    """ZeRO: whether ``rank`` frees ``stage``'s relayed parameters after its F_j and gets
    them relayed again for its B_j. Not the owner (it keeps its own copy) nor the last stage
    (its B directly follows its F)."""
    return roles.mode == "zero" and stage < n - 1 and rank != roles.owner(stage)


def _ops(c: int, base: int, n: int, rule: str, roles: Roles) -> list[Work]:
    tl = timeline_of(rule)
    out = []
    for i in range(n):
        for j in range(n):
            r = roles.rank_of(i, j, c)
            kf = base + step_of(tl, n, "F", i, j, 0)
            kb = base + step_of(tl, n, "B", i, j, 0)
            needs = (("act", i, c, j - 1),) if j else ()
            needs += (("param", j, version(rule, c, i, j, n)),)
            makes = (("act", i, c, j),) if j < n - 1 else ()
            out.append(Work("F", i, j, c, kf, r, (kf, 1, i), needs, makes))
            needs = (("gact", i, c, j + 1),) if j < n - 1 else ()
            if refetched(roles, n, r, j):
                needs += (("paramb", j, version(rule, c, i, j, n)),)
            makes = ((("gact", i, c, j),) if j else ()) + (("g", i, c, j),)
            out.append(Work("B", i, j, c, kb, r, (kb, 0, i), needs, makes))
            needs = (("g", i, c, j),) + ((("gsum", i - 1, c, j),) if i else ())
            out.append(Work("A", i, j, c, kb, r, (kb, 4, j, i, 0), needs, (("gsum", i, c, j),)))
    for j in range(n):
        ku = base + update_step(tl, n, j, 0)
        out.append(Work("U", -1, j, c, ku, roles.owner(j), (ku, 4, j, n, 0),
                        (("gsum", n - 1, c, j), ("param", j, c)), (("param", j, c + 1),)))
    return out


def _moves(c: int, base: int, n: int, rule: str, roles: Roles) -> list[PeerTransfer]:
    """The activations, their gradients and the gradient sums that cross ranks."""
    tl, out = timeline_of(rule), []
    for i in range(n):
        for j in range(n):
            r = roles.rank_of(i, j, c)
            kf = base + step_of(tl, n, "F", i, j, 0)
            kb = base + step_of(tl, n, "B", i, j, 0)
            if j < n - 1 and roles.rank_of(i, j + 1, c) != r:
                out.append(PeerTransfer(("act", i, c, j), r, roles.rank_of(i, j + 1, c), c, kf,
                                    (kf, 2, i, j, 0)))
            if j and roles.rank_of(i, j - 1, c) != r:
                out.append(PeerTransfer(("gact", i, c, j), r, roles.rank_of(i, j - 1, c), c, kb,
                                    (kb, 2, i, j, 1)))
            nxt = roles.rank_of(i + 1, j, c) if i < n - 1 else roles.owner(j)
            if nxt != r:
                out.append(PeerTransfer(("gsum", i, c, j), r, nxt, c, kb, (kb, 4, j, i, 1)))
    return out


def _distribution(c: int, base: int, n: int, rule: str, roles: Roles) -> list[PeerTransfer]:
    """Each new version relayed from the owner to the stage's other holders, the one that
    needs it first first (v2's fresh consumers; the spec's N -> N-j+1 -> ... order)."""
    tl, out = timeline_of(rule), []
    for j in range(n):
        owner, v = roles.owner(j), c + 1
        ku = base + update_step(tl, n, j, 0)
        first: dict[int, int] = {}
        for cc in (c + 1, c + 2):
            for i in range(n):
                if version(rule, cc, i, j, n) == v:
                    r = roles.rank_of(i, j, cc)
                    k = base + step_of(tl, n, "F", i, j, cc - c)
                    first[r] = min(first.get(r, k), k)
        order = sorted((k, r) for r, k in first.items() if r != owner)
        src = owner
        for h, (_, r) in enumerate(order):
            out.append(PeerTransfer(("param", j, v), src, r, c, ku, (ku, 4, j, n, 1 + h)))
            src = r
    return out


def _relays(c: int, base: int, n: int, rule: str, roles: Roles, kind: str
            ) -> list[PeerTransfer]:
    """ZeRO: each worker gets the stage's version it uses for its ``kind`` op (F, or B when
    it `refetched` it) from the previous worker that used the same version (after that
    worker's op), the first of each version from the owner (before its op)."""
    tl, out = timeline_of(rule), []
    label, tag = ("param", 2) if kind == "F" else ("paramb", 3)
    for j in range(n - 1 if kind == "B" else n):  # the last stage is kept from F to B
        owner, src, prev_v = roles.owner(j), None, None
        for i in range(n):
            v, r = version(rule, c, i, j, n), roles.rank_of(i, j, c)
            k = base + step_of(tl, n, kind, i, j, 0)
            kp = base + step_of(tl, n, kind, i - 1, j, 0) if i else k
            if v != prev_v or src is None or kp >= k:  # DP: all at once, from the owner
                src, key = owner, (k, -1, i, j)
            else:
                key = (kp, 2, i - 1, j, tag) if src != owner else (k, -1, i, j)
            if r != src and r != owner:  # the owner reads its own copy
                out.append(PeerTransfer((label, j, v), src, r, c, key[0], key))
            src, prev_v = r, v
    return out


def cycle_tasks(c: int, base: int, n: int, rule: str, roles: Roles
                ) -> tuple[list[Work], list[PeerTransfer]]:
    """Every task of cycle ``c``, whose worker 0 starts at step ``base``."""
    moves = _moves(c, base, n, rule, roles)
    if roles.mode == "zero":
        moves += _relays(c, base, n, rule, roles, "F") + _relays(c, base, n, rule, roles, "B")
    else:
        moves += _distribution(c, base, n, rule, roles)
    return _ops(c, base, n, rule, roles), moves


def window(cycles: list[tuple[int, int]], lo: int, hi: int, n: int, rule: str, roles: Roles
           ) -> tuple[list[Work], list[PeerTransfer]]:
    """The tasks of cycles ``[(c, base), ...]`` whose step is in ``[lo, hi)``, in key order."""
    works, moves = [], []
    for c, base in cycles:
        w, m = cycle_tasks(c, base, n, rule, roles)
        works += [t for t in w if lo <= t.step < hi]
        moves += [t for t in m if lo <= t.step < hi]
    return sorted(works, key=lambda t: t.key), sorted(moves, key=lambda t: t.key)


def _shift_value(key: tuple, dc: int) -> tuple:
    """A value key moved by ``dc`` cycles: its cycle (or, for a version, its number) is at
    index 2."""
    return key[:2] + (key[2] + dc,) + key[3:]


def shift(task: Work | PeerTransfer, dc: int, dk: int) -> Work | PeerTransfer:
    """``task`` moved by ``dc`` cycles (versions too) and ``dk`` steps."""
    key = (task.key[0] + dk,) + task.key[1:]
    if isinstance(task, Work):
        return task._replace(cycle=task.cycle + dc, step=task.step + dk, key=key,
                             needs=tuple(_shift_value(v, dc) for v in task.needs),
                             makes=tuple(_shift_value(v, dc) for v in task.makes))
    return task._replace(payload=_shift_value(task.payload, dc), cycle=task.cycle + dc,
                         step=task.step + dk, key=key)


@functools.lru_cache(maxsize=4096)
def _uses(n: int, rule: str, roles: Roles, rank: int, stage: int, v: int) -> int:
    want, count = ("param", stage, v), 0
    for c in range(max(0, v - 2), v + 3):
        works, moves = cycle_tasks(c, 0, n, rule, roles)
        count += sum(1 for t in works if t.rank == rank and want in t.needs)
        count += sum(1 for t in moves if t.src == rank and t.payload[0] in PARAMS
                     and t.payload[1:] == want[1:])
    return count


def version_uses(n: int, rule: str, roles: Roles, rank: int, stage: int, v: int) -> int:
    """How many tasks of ``rank`` read version ``v`` of ``stage`` (its forwards, its sends
    of it, the owner's update that starts from it): its copy is freed after the last."""
    if v >= 4:  # the steady state repeats with the rank assignment's period
        v = 4 + (v - 4) % roles.period
    return _uses(n, rule, roles, rank, stage, v)


@functools.lru_cache(maxsize=4096)
def _relay_reads(n: int, rule: str, roles: Roles, rank: int, label: str, stage: int,
                 c: int) -> int:
    _, moves = cycle_tasks(c, 0, n, rule, roles)
    return 1 + sum(1 for t in moves if t.src == rank and t.payload[:2] == (label, stage))


def relay_reads(n: int, rule: str, roles: Roles, rank: int, label: str, stage: int,
                cycle: int) -> int:
    """ZeRO: how many tasks of ``rank`` read a copy of ``stage`` relayed to it for ``cycle``
    (``label`` "param": for its F, "paramb": for its B): the op, and its send to the next
    worker if it relays it on. The copy goes after the last."""
    return _relay_reads(n, rule, roles, rank, label, stage, min(cycle, 2))


__getattr__ = renamed(__name__, {"Transfer": "PeerTransfer"})  # one release
