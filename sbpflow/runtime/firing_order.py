"""A quiet run fired again in the order the last one fired: no firing rule, no registers.

A run that talks to no other rank (no peer in its plan, no message waiting on its channel) and
runs inline depends on nothing but its plan: which actor the rule picks next is a function of
the counts, never of the values. So the next run of the same plan and micro-batch count fires
the same actors in the same order; `FiringOrder` is that order, from the last run's timeline,
each firing's inputs worked out from the wiring (input ``i`` of firing ``f`` reads value
``f // repeat`` of its producer's register). Running it costs a call and a few list operations
a firing instead of the rule's scan, the req / ack bookkeeping and its conditions. The actors
get the same arguments, the timeline the same events, the sinks the same values; a value is
dropped after its last read, as its slot would be freed; an actor's exception fails the run as
a firing's does, and the run after a failed one goes by the rule. See docs/runtime.md.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

from .actors import Actor

__all__ = ["FiringOrder", "Firing"]


class Firing(NamedTuple):
    """One firing of a `FiringOrder`: ``actor`` fires its ``index``-th time, reading ``reads`` (per
    input: the value's key, and whether this is its last read by this input) and, when it
    ``emits``, publishing a value into each output register (``outs``, a register each: the
    key of the run's result it goes to, or None; the key it is held under for its readers,
    and their number). ``one``: the actor has one output register; ``name``, ``kind`` and
    ``stage`` are its event's."""

    actor: Actor
    index: int
    reads: tuple
    emits: bool
    outs: tuple
    one: bool
    name: str
    kind: str
    stage: int


def _firing(a: Actor, index: int) -> Firing:
    reads = tuple(((producer, reg, index // k), (index + 1) % k == 0)
                  for (_, producer, _, reg), k in zip(a.sources, a.repeats))
    one = len(a.outputs) == 1
    outs = tuple((None if reg.consumers else (a.name if one else f"{a.name}.{reg.name}"),
                  (a.name, k, index // a.every), len(reg.consumers))
                 for k, reg in enumerate(a.outputs))
    return Firing(a, index, reads, (index + 1) % a.every == 0, outs, one, a.name, a.spec.kind,
                  a.spec.stage)


class FiringOrder:
    """The firings of a run that ended well, in its order (``events``: its timeline; every
    input's producer on the same rank, which a run with no peer ensures)."""

    __slots__ = ("firings",)

    def __init__(self, actors: dict[str, Actor], events: list[dict]) -> None:
        self.firings = [_firing(actors[e["actor"]], e["micro_batch"]) for e in events]

    def run(self, run: Any, split) -> None:
        """Fire ``run``'s actors in this order (``run``: a `_PlanRun` just reset, its lock held
        by the caller and released here while the actors run, as a firing releases it;
        ``split``: the engine's reading of a function's result into register values). On an
        actor's exception the run fails as a firing's failure fails it."""
        events, results, rank = run.events, run.results, run.rank
        held: dict = {}  # (actor, register, value index) -> [value, reads left]
        clock = time.perf_counter
        cell = None
        run.lock.release()
        try:
            for f in self.firings:
                a = f.actor
                args = []
                for key, last in f.reads:
                    cell = held[key]
                    args.append(cell[0])
                    if last:
                        cell[1] -= 1
                        if not cell[1]:
                            del held[key]
                a.busy = True
                start = a.since = clock()
                try:
                    out = a.fn(f.index, *args)
                    values = ((out,) if f.one else split(a, out)) if f.emits else ()
                except BaseException as exc:  # noqa: BLE001 - fails the run, as a firing's
                    run.watch.fail(exc, a, f.index)
                    return
                end = a.since = clock()
                a.busy = False
                a.fired += 1
                events.append({"rank": rank, "actor": f.name, "kind": f.kind,
                               "stage": f.stage, "micro_batch": f.index, "start": start,
                               "end": end})
                for (sink, key, readers), value in zip(f.outs, values):
                    if sink is not None:
                        results.setdefault(sink, []).append(value)
                    else:
                        held[key] = [value, readers]
                # (a firing's locals would keep its values alive into the next firing, where
                # the rule's `_fire` has returned: a value goes with its last read)
                args = cell = out = values = value = None
            run.left = 0
        finally:
            run.lock.acquire()
