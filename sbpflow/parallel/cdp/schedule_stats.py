"""What a CDP trainer measured, read from the executed schedule of every rank.

Each rank keeps a `Record` of every F, B and U task its runtime fired (its time step, the
version it used, its wall-clock start and end); `gather_records` collects every rank's records
and counters (an all-gather over the world); `summary` computes the stats: live activations
per time step (the spec's convention: from F's step to B's, both included), gradient chunks
per step (B tasks), the idle fraction of the ranks' op slots (the bubble: a rank runs a
step's ops one after another), messages and bytes sent, the measured activation bytes and the
most parameter versions held, the parameter bytes held (after each task). See
docs/cdp.md, 'Stats'.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

from .cycles import live_profile

__all__ = ["Record", "gather_records", "summary"]

_KINDS = "FBU"


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


def gather_records(comm, records: Sequence[Record], counters: Sequence[float]
                   ) -> tuple[list[Record], list[list[float]]]:
    """Every rank's records, and its ``counters`` (one list a rank, in rank order)."""
    group = list(range(comm.world_size))
    rows = torch.tensor([[_KINDS.index(r.kind), *r[1:]] for r in records],
                        dtype=torch.float64).reshape(-1, 9)
    mine = torch.tensor(list(counters), dtype=torch.float64)
    all_rows = comm.all_gather(rows, group, count_as="meta")
    all_counters = comm.all_gather(mine, group, count_as="meta")
    out = [Record(_KINDS[int(r[0])], *(int(v) for v in r[1:7].tolist()), float(r[7]),
                  float(r[8])) for rows_ in all_rows for r in rows_]
    return out, [c.tolist() for c in all_counters]


def _live(records: Sequence[Record]) -> list[int]:
    first: dict[tuple, int] = {}
    last: dict[tuple, int] = {}
    end = max((r.step for r in records), default=0)
    for r in records:
        key = (r.worker, r.stage, r.cycle)
        if r.kind == "F":
            first[key] = r.step
        elif r.kind == "B":
            last[key] = r.step
    return live_profile((k, last.get(key, end)) for key, k in first.items())


def summary(records: Sequence[Record], counters: Sequence[Sequence[float]], n: int,
            ranks: Sequence[int]) -> dict:
    """The stats of a trainer of ``n`` stages on ``ranks``. ``counters[r]``: rank r's [in
    the trainer, messages, bytes, peak activation bytes, steps fed, peak parameter bytes,
    max versions of each stage]."""
    live = _live(records)
    chunks: dict[int, int] = {}
    cells: dict[tuple, int] = {}   # (rank, step) -> ops the rank runs in that step
    for r in records:
        if r.kind == "B":
            chunks[r.step] = chunks.get(r.step, 0) + 1
        if r.kind in "FB":
            cells[(r.rank, r.step)] = cells.get((r.rank, r.step), 0) + 1
    # a rank runs a step's ops one after another: the step lasts its busiest rank's count
    longest: dict[int, int] = {}
    for (_, k), c in cells.items():
        longest[k] = max(longest.get(k, 0), c)
    slots = sum(longest.values()) * len(ranks)
    mine = [c for c in counters if c and c[0]]
    steps = int(max((c[4] for c in mine), default=0))
    messages = sum(c[1] for c in mine)
    nbytes = sum(c[2] for c in mine)
    return {
        "steps": steps,
        "peak_live_activations": max(live, default=0),
        "live_activations": live,
        "peak_activation_bytes": int(max((c[3] for c in mine), default=0)),
        "activation_bytes_by_rank": {int(r): int(c[3]) for r, c in enumerate(counters)
                                     if c and c[0]},
        "peak_param_bytes": int(max((c[5] for c in mine), default=0)),
        "param_bytes_by_rank": {int(r): int(c[5]) for r, c in enumerate(counters)
                                if c and c[0]},
        "max_versions": [int(max(c[6 + j] for c in mine)) for j in range(n)] if mine else [],
        "messages_per_step": messages / steps if steps else 0.0,
        "bytes_per_step": nbytes / steps if steps else 0.0,
        "max_grad_chunks_per_step": max(chunks.values(), default=0),
        "bubble_fraction": 1 - sum(cells.values()) / slots if slots else 0.0,
    }
