"""The timeline of Cyclic Data Parallelism as data: which worker runs which stage op at each
time step, for synchronous DP and for CDP (../shared/CDP.md, section (a)).

Workers, stages and cycles count from 0 here (the spec counts workers and stages from 1).
Worker ``i`` runs cycles of ``2N`` ops from step ``offset(i) + 2N c``: F_0 .. F_{N-1}, then
B_{N-1} .. B_0. The offset is 0 for DP and ``2 i`` for CDP. Stage ``j``'s update of cycle
``c`` follows the last worker's B_j. `live_profile` counts live activations per step (an
activation is live from its F's step to its B's step, both included); `chunks_per_step`
counts the stage-gradient chunks that become ready at each step. See docs/cdp.md,
'The schedule'.
"""

from __future__ import annotations

from typing import Iterable, NamedTuple

from ...errors import PlanError
from ...utils import renamed

__all__ = ["TIMELINES", "StageOp", "offset", "step_of", "op_at", "ops", "table", "update_step",
           "live_profile", "live_activations", "chunks_per_step", "stage_concurrency",
           "check_n"]

TIMELINES = ("dp", "cdp")


class StageOp(NamedTuple):
    """One stage op of one worker: ``kind`` "F" or "B", at time step ``step``."""

    kind: str
    worker: int
    stage: int
    cycle: int
    step: int

    def label(self) -> str:
        """The spec's notation, 1-based stage: ``F2c0``."""
        return f"{self.kind}{self.stage + 1}c{self.cycle}"


def check_n(n: int) -> None:
    if not isinstance(n, int) or n < 2:
        raise PlanError(f"cyclic data parallelism needs N >= 2 stages and workers, got {n!r}")


def _check(timeline: str) -> None:
    if timeline not in TIMELINES:
        raise PlanError(f"unknown timeline {timeline!r}; one of {TIMELINES}")


def offset(timeline: str, worker: int) -> int:
    """The step at which ``worker`` starts its cycle 0: 0 (DP) or ``2 worker`` (CDP)."""
    _check(timeline)
    return 0 if timeline == "dp" else 2 * worker


def step_of(timeline: str, n: int, kind: str, worker: int, stage: int, cycle: int) -> int:
    """The time step of op ``kind`` (F / B) of ``stage`` by ``worker`` in ``cycle``."""
    phase = stage if kind == "F" else 2 * n - 1 - stage
    return offset(timeline, worker) + 2 * n * cycle + phase


def op_at(timeline: str, n: int, worker: int, step: int) -> StageOp | None:
    """The op ``worker`` runs at ``step`` (None before its first cycle starts)."""
    p = step - offset(timeline, worker)
    if p < 0:
        return None
    cycle, phase = divmod(p, 2 * n)
    if phase < n:
        return StageOp("F", worker, phase, cycle, step)
    return StageOp("B", worker, 2 * n - 1 - phase, cycle, step)


def ops(timeline: str, n: int, cycles: int) -> list[StageOp]:
    """Every op of cycles ``0 .. cycles-1``, by step then worker."""
    check_n(n)
    out = [StageOp(kind, i, j, c, step_of(timeline, n, kind, i, j, c))
           for c in range(cycles) for i in range(n) for j in range(n) for kind in "FB"]
    return sorted(out, key=lambda o: (o.step, o.worker))


def table(timeline: str, n: int, cycles: int) -> list[list[str]]:
    """The timeline as the spec prints it: a row a step, a column a worker, ``"F1c0"`` or
    ``"-"`` where the worker is idle (before its start, or after its last cycle)."""
    rows: dict[int, list[str]] = {}
    for o in ops(timeline, n, cycles):
        rows.setdefault(o.step, ["-"] * n)[o.worker] = o.label()
    last = max(rows)
    return [rows.get(k, ["-"] * n) for k in range(last + 1)]


def update_step(timeline: str, n: int, stage: int, cycle: int) -> int:
    """The step after which stage ``stage``'s update of ``cycle`` fires: the last worker's
    B of that stage."""
    return step_of(timeline, n, "B", n - 1, stage, cycle)


def live_profile(intervals: Iterable[tuple[int, int]]) -> list[int]:
    """Per step, how many ``(first, last)`` step intervals (both ends included) cover it."""
    delta: dict[int, int] = {}
    for first, last in intervals:
        delta[first] = delta.get(first, 0) + 1
        delta[last + 1] = delta.get(last + 1, 0) - 1
    if not delta:
        return []
    out, n = [], 0
    for k in range(max(delta)):
        n += delta.get(k, 0)
        out.append(n)
    return out


def live_activations(timeline: str, n: int, cycles: int) -> list[int]:
    """Live (micro-batch, stage) activations per step over ``cycles`` cycles."""
    return live_profile((step_of(timeline, n, "F", i, j, c), step_of(timeline, n, "B", i, j, c))
                        for c in range(cycles) for i in range(n) for j in range(n))


def chunks_per_step(timeline: str, n: int, cycles: int) -> list[int]:
    """Stage-gradient chunks made per step (one a B op) over ``cycles`` cycles."""
    count: dict[int, int] = {}
    for o in ops(timeline, n, cycles):
        if o.kind == "B":
            count[o.step] = count.get(o.step, 0) + 1
    return [count.get(k, 0) for k in range(max(count) + 1)]


def stage_concurrency(timeline: str, n: int) -> list[int]:
    """Per stage, the most micro-batches in flight on it at once in the steady state: CDP
    ``N - j`` (the spec's N - j + 1, 1-based), DP ``N``. Model parallelism needs that many
    devices for the stage."""
    check_n(n)
    return [n if timeline == "dp" else n - j for j in range(n)]


__getattr__ = renamed(__name__, {"Op": "StageOp"})  # one release
