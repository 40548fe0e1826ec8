"""A quiet run fired again in the order the last one fired: no firing rule, no registers.

A run that talks to no other rank (no peer in its plan, no message waiting on its channel) and
runs inline depends on nothing but its plan: which actor the rule picks next is a function of
the counts, never of the values. So the next run of the same plan and micro-batch count fires
the same actors in the same order; `FiringOrder` is that order, from the last run's timeline,
each firing's inputs worked out from the wiring (input ``i`` of firing ``f`` reads value
``f // repeat`` of its producer's register), run as one generated function of straight-line
code (`_program`: a value a local variable; made at its first replay, or for a long order
after `COMPILE_AFTER` replays by a loop) instead of the rule's scan, the req / ack
bookkeeping and its conditions. The actors get the same arguments, the timeline the same
events, the sinks the same values; a value is dropped after its last read, as its slot would
be freed; an actor's exception fails the run as a firing's does, and the run after a failed
one goes by the rule. See docs/runtime.md.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, NamedTuple

from ..utils import generated_function
from .actors import Actor

__all__ = ["FiringOrder", "Firing"]

# Generating costs about 0.25 ms a firing here, as much as 60-170 of the loop's replays save:
# an order of at most COMPILE_NOW firings is generated at its first replay (0.25 s at most);
# a longer one replays by the loop until COMPILE_AFTER replays, so no one-off pause is paid
# by an order that replays a few times only
COMPILE_NOW = 1024
COMPILE_AFTER = 64


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

    __slots__ = ("firings", "program", "replays")

    def __init__(self, actors: dict[str, Actor], events: list[dict]) -> None:
        self.firings = [_firing(actors[e["actor"]], e["micro_batch"]) for e in events]
        self.program: Any = None  # the firings as one generated function (`_program`)
        self.replays = 0

    def run(self, run: Any, split) -> None:
        """Fire ``run``'s actors in this order (``run``: a `_PlanRun` just reset, its lock held
        by the caller and released here while the actors run, as a firing releases it;
        ``split``: the engine's reading of a function's result into register values). On an
        actor's exception the run fails as a firing's failure fails it."""
        if self.program is None and (len(self.firings) <= COMPILE_NOW
                                     or self.replays >= COMPILE_AFTER):
            self.program = _program(self.firings)
        self.replays += 1
        fire = self.program or partial(_loop, self.firings)
        run.lock.release()
        try:
            if fire(run.events, run.results, time.perf_counter, run.watch.fail, split,
                    run.rank):
                run.left = 0
        finally:
            run.lock.acquire()


def _loop(firings: list[Firing], events: list, results: dict, clock, fail, split,
          rank: int) -> bool:
    """`_program`'s function for ``firings``, as a loop over them (values held in a dict)."""
    held: dict = {}  # (actor, register, value index) -> [value, reads left]
    cell = None
    for f in firings:
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
            fail(exc, a, f.index)
            return False
        end = a.since = clock()
        a.busy = False
        a.fired += 1
        events.append({"rank": rank, "actor": f.name, "kind": f.kind, "stage": f.stage,
                       "micro_batch": f.index, "start": start, "end": end})
        for (sink, key, readers), value in zip(f.outs, values):
            if sink is not None:
                results.setdefault(sink, []).append(value)
            else:
                held[key] = [value, readers]
        # (a firing's locals would keep its values alive into the next firing, where the
        # rule's `_fire` has returned: a value goes with its last read)
        args = cell = out = values = value = None
    return True


def _program(firings: list[Firing]) -> Any:
    """``run(events, results, clock, fail, split, rank)``: ``firings`` as straight-line code,
    True once all fired (False: one raised, and ``fail`` was told). Each value the firings
    hand on is a local variable, set to None after its last read (as its slot would be
    freed); a firing's own result is dropped before the next firing."""
    ns: dict[str, Any] = {}
    out = ["def run(events, results, clock, fail, split, rank):"]
    held: dict[tuple, list] = {}  # value key -> [its variable, reads left]
    for k, f in enumerate(firings):
        ns[f"A{k}"], ns[f"N{k}"], ns[f"K{k}"], ns[f"S{k}"] = f.actor, f.name, f.kind, f.stage
        args, dropped = [f"{f.index}"], []
        for key, last in f.reads:
            var = held[key]  # (a run's order reads only what an earlier firing made)
            args.append(var[0])
            if last:
                var[1] -= 1
                if not var[1]:
                    dropped.append(var[0])
                    del held[key]
        body = [f"a = A{k}", "a.busy = True", "start = a.since = clock()", "try:",
                f"    out = a.fn({', '.join(args)})"]
        after = []
        if f.emits:
            values = "(out,)" if f.one else "split(a, out)"
            body.append(f"    vals = {values}")
            for j, (sink, key, readers) in enumerate(f.outs):
                if sink is not None:
                    ns[f"R{k}_{j}"] = sink
                    after.append(f"results.setdefault(R{k}_{j}, []).append(vals[{j}])")
                else:
                    held[key] = [f"v{k}_{j}", readers]
                    after.append(f"v{k}_{j} = vals[{j}]")
        body += ["except BaseException as exc:  # fails the run, as a firing's",
                 f"    fail(exc, a, {f.index})", "    return False",
                 "end = a.since = clock()", "a.busy = False", "a.fired += 1",
                 f"events.append({{'rank': rank, 'actor': N{k}, 'kind': K{k}, 'stage': S{k}, "
                 f"'micro_batch': {f.index}, 'start': start, 'end': end}})"]
        body += after + [f"{v} = None" for v in dropped] + ["out = vals = None"]
        out += ["    " + line for line in body]
    out.append("    return True")
    return generated_function("\n".join(out) + "\n", "firing order", ns)
