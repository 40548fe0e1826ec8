"""What a CDP trainer measured, read from the executed schedule of every rank.

Each rank's `ScheduleLog` takes every F, B and U task its runtime fired (its time step, the
version it used, its wall-clock start and end) and keeps, in memory that does not grow with
the tasks, what the stats read: per time step the rank's F / B ops and its B ops, and the
activations' live intervals as a difference array; the full `Record` of each task only for
the first ``keep`` time steps (the ones a timeline draws); past them, a plan's tasks are
summed once and added run after run (`RunTasks`). `gather_schedule` collects every rank's
log and counters (all-gathers over the world); `summary` computes the stats: live
activations per time step (the spec's convention: from F's step to B's, both included),
gradient chunks per step (B tasks), the idle fraction of the ranks' op slots (the bubble: a
rank runs a step's ops one after another), messages and bytes sent, the measured activation
bytes and the most parameter versions held, the parameter bytes held (after each task). See
docs/cdp.md, 'Stats'.
"""

from __future__ import annotations

from array import array
from typing import Iterable, NamedTuple, Sequence

import torch

__all__ = ["Record", "RunTasks", "run_tasks", "ScheduleLog", "Schedule", "gather_schedule",
           "summary"]

_KINDS = "FBU"
_ITEM = {4: torch.int32, 8: torch.int64}[array("i").itemsize]  # a C int, read as a tensor


class Record(NamedTuple):
    """One executed task: F / B (``version`` used) or U (``version`` made, ``worker`` -1)."""

    kind: str
    worker: int
    stage: int
    cycle: int
    step: int
    version: int
    rank: int
    start: float
    end: float


class RunTasks(NamedTuple):
    """A run's F / B / U tasks on one rank as `ScheduleLog.add_run` adds them (steps and
    cycles relative to the run's): what ``add`` would count, summed once for a plan that
    runs again and again."""

    last: int       # the latest step of any task (-1: none)
    top: int        # the latest step of an F or B (-1: none)
    ops: tuple      # (step, its F and B ops)
    grads: tuple    # (step, its B ops)
    closed: tuple   # (F's step, B's step): a micro-batch's stage whose F and B both ran
    opens: tuple    # ((worker, stage, cycle), F's step): its B runs in a later run
    closes: tuple   # ((worker, stage, cycle), B's step): its F ran in an earlier run


def run_tasks(tasks: Iterable[tuple[str, int, int, int, int]]) -> RunTasks:
    """The `RunTasks` of ``tasks``: (kind, worker, stage, cycle, step) each, an F before the
    B of its micro-batch's stage."""
    last = top = -1
    ops: dict[int, int] = {}
    grads: dict[int, int] = {}
    first: dict[tuple, int] = {}
    closed, closes = [], []
    for kind, worker, stage, cycle, step in tasks:
        last = max(last, step)
        if kind == "U":
            continue
        top = max(top, step)
        ops[step] = ops.get(step, 0) + 1
        key = (worker, stage, cycle)
        if kind == "F":
            first[key] = step
            continue
        grads[step] = grads.get(step, 0) + 1
        if key in first:
            closed.append((first.pop(key), step))
        else:
            closes.append((key, step))
    return RunTasks(last, top, tuple(ops.items()), tuple(grads.items()), tuple(closed),
                    tuple(first.items()), tuple(closes))


class ScheduleLog:
    """One rank's executed tasks: the `Record`s of the time steps before ``keep`` (None: all),
    and for every step the counts the stats read (module docstring)."""

    def __init__(self, keep: int | None) -> None:
        self.keep = keep
        self.records: list[Record] = []
        # (4 bytes a step each: a long run's steps are many)
        self.ops = array("i")    # per time step: the F and B ops this rank ran
        self.grads = array("i")  # per time step: its B ops (gradient chunks)
        self.delta = array("i")  # live intervals closed on this rank, as differences
        self.open: dict[tuple, int] = {}  # (worker, stage, cycle) -> its F's step, B to come
        self.last = -1   # the latest step of any task
        self.span = 0    # 1 + the latest step a closed interval covers

    def add(self, kind: str, worker: int, stage: int, cycle: int, step: int, version: int,
            rank: int, start: float, end: float) -> None:
        if self.keep is None or step < self.keep:
            self.records.append(Record(kind, worker, stage, cycle, step, version, rank, start,
                                       end))
        if step > self.last:
            self.last = step
        if kind == "U":
            return
        self._reach(step)
        self.ops[step] += 1
        if kind == "F":
            self.open[(worker, stage, cycle)] = step
            return
        self.grads[step] += 1
        self._close((worker, stage, cycle), step)

    def keeps(self, step: int) -> bool:
        """Whether a task at time step ``step`` keeps its `Record`."""
        return self.keep is None or step < self.keep

    def add_run(self, tasks: RunTasks, cycle: int, step: int) -> None:
        """A run's tasks, its cycles from ``cycle`` and time steps from ``step``, none of
        them kept as a record (`keeps`): the counts ``add`` would make, task by task."""
        self.last = max(self.last, tasks.last + step if tasks.last >= 0 else -1)
        if tasks.top < 0:
            return
        self._reach(tasks.top + step)
        ops, grads, delta = self.ops, self.grads, self.delta
        for k, count in tasks.ops:
            ops[k + step] += count
        for k, count in tasks.grads:
            grads[k + step] += count
        for k, end in tasks.closed:
            delta[k + step] += 1
            delta[end + step + 1] -= 1
        if tasks.closed:
            self.span = max(self.span, max(end for _, end in tasks.closed) + step + 1)
        for (w, j, c), k in tasks.opens:
            self.open[(w, j, c + cycle)] = k + step
        for (w, j, c), k in tasks.closes:
            self._close((w, j, c + cycle), k + step)

    def _reach(self, step: int) -> None:
        """The count arrays reach past ``step``."""
        if len(self.delta) < step + 2:
            grow = [0] * (step + 2 - len(self.delta))
            self.ops.extend(grow)
            self.grads.extend(grow)
            self.delta.extend(grow)

    def _close(self, key: tuple, step: int) -> None:
        """The B of ``key`` at ``step`` closes the live interval its F opened."""
        first = self.open.pop(key, None)
        if first is not None:  # (F and B of a micro-batch's stage run on one rank)
            self.delta[first] += 1
            self.delta[step + 1] -= 1
            self.span = max(self.span, step + 1)

    def packed(self) -> torch.Tensor:
        """The counts as one int64 vector: last, span, the number of steps S, ops (S),
        grads (S), delta (S), then the open intervals' first steps."""
        head = torch.tensor([self.last, self.span, len(self.ops)], dtype=torch.int64)
        counts = [torch.frombuffer(a, dtype=_ITEM).to(torch.int64) if len(a) else
                  torch.zeros(0, dtype=torch.int64) for a in (self.ops, self.grads, self.delta)]
        return torch.cat([head, *counts, torch.tensor(list(self.open.values()),
                                                      dtype=torch.int64)])


class Schedule(NamedTuple):
    """Every rank's log, gathered: the kept records, and per rank its counts."""

    records: list[Record]
    ops: list[torch.Tensor]   # per rank, per time step
    grads: torch.Tensor       # per time step, all ranks
    live: list[int]           # per time step, all ranks (open intervals up to the last step)


class _Part(NamedTuple):
    """One rank's `ScheduleLog.packed`, read back (int64 tensors)."""

    last: int
    span: int
    ops: torch.Tensor
    grads: torch.Tensor
    delta: torch.Tensor
    open: torch.Tensor


def _part(v: torch.Tensor) -> _Part:
    last, span, s = (int(x) for x in v[:3])
    body = v[3:]
    return _Part(last, span, body[:s], body[s:2 * s], body[2 * s:3 * s], body[3 * s:])


def _merge(rows: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor, list[int]]:
    """Per rank its ops a step; per step the B ops and the live activations of all ranks."""
    parts = [_part(r) for r in rows if r.numel()]
    last = max((p.last for p in parts), default=-1)
    delta = torch.zeros(last + 2, dtype=torch.int64)
    grads = torch.zeros(last + 2, dtype=torch.int64)
    span = 0
    for p in parts:
        delta[:len(p.delta)] += p.delta
        grads[:len(p.grads)] += p.grads
        if len(p.open):  # an F whose B has not run: live up to the last step of any task
            delta.index_add_(0, p.open, torch.ones_like(p.open))
            delta[last + 1] -= len(p.open)
            span = last + 1
        span = max(span, p.span)
    return [p.ops for p in parts], grads[:last + 1], torch.cumsum(delta[:span], 0).tolist()


def gather_schedule(comm, log: ScheduleLog | None, counters: Sequence[float]
                    ) -> tuple[Schedule, list[list[float]]]:
    """Every rank's log (None: a rank outside the trainer) and its ``counters`` (one list a
    rank, in rank order)."""
    group = list(range(comm.world_size))
    records = log.records if log is not None else []
    rows = torch.tensor([[_KINDS.index(r.kind), *r[1:]] for r in records],
                        dtype=torch.float64).reshape(-1, 9)
    packed = log.packed() if log is not None else torch.zeros(0, dtype=torch.int64)
    all_rows = comm.all_gather(rows, group, count_as="meta")
    all_packed = comm.all_gather(packed, group, count_as="meta")
    all_counters = comm.all_gather(torch.tensor(list(counters), dtype=torch.float64), group,
                                   count_as="meta")
    out = [Record(_KINDS[int(r[0])], *(int(v) for v in r[1:7].tolist()), float(r[7]),
                  float(r[8])) for rows_ in all_rows for r in rows_]
    ops, grads, live = _merge(all_packed)
    return Schedule(out, ops, grads, live), [c.tolist() for c in all_counters]


def summary(schedule: Schedule, counters: Sequence[Sequence[float]], n: int,
            ranks: Sequence[int]) -> dict:
    """The stats of a trainer of ``n`` stages on ``ranks``. ``counters[r]``: rank r's [in
    the trainer, messages, bytes, peak activation bytes, steps fed, peak parameter bytes,
    max versions of each stage]."""
    # a rank runs a step's ops one after another: the step lasts its busiest rank's count
    longest = torch.zeros(max((len(o) for o in schedule.ops), default=0), dtype=torch.int64)
    for o in schedule.ops:
        longest[:len(o)] = torch.maximum(longest[:len(o)], o)
    slots = int(longest.sum()) * len(ranks)
    done = sum(int(o.sum()) for o in schedule.ops)
    mine = [c for c in counters if c and c[0]]
    steps = int(max((c[4] for c in mine), default=0))
    messages = sum(c[1] for c in mine)
    nbytes = sum(c[2] for c in mine)
    return {
        "steps": steps,
        "peak_live_activations": max(schedule.live, default=0),
        "live_activations": schedule.live,
        "peak_activation_bytes": int(max((c[3] for c in mine), default=0)),
        "activation_bytes_by_rank": {int(r): int(c[3]) for r, c in enumerate(counters)
                                     if c and c[0]},
        "peak_param_bytes": int(max((c[5] for c in mine), default=0)),
        "param_bytes_by_rank": {int(r): int(c[5]) for r, c in enumerate(counters)
                                if c and c[0]},
        "max_versions": [int(max(c[6 + j] for c in mine)) for j in range(n)] if mine else [],
        "messages_per_step": messages / steps if steps else 0.0,
        "bytes_per_step": nbytes / steps if steps else 0.0,
        "max_grad_chunks_per_step": int(schedule.grads.max()) if len(schedule.grads) else 0,
        "bubble_fraction": 1 - done / slots if slots else 0.0,
    }
