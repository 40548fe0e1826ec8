"""The state of one actor during a run: its input queues, output registers and counter.

`Register` is an output register: a fixed number of slots, each free or holding a published
value until every consumer has acked it. `Actor` holds the readable slots of its inputs (reqs
received, in order), its registers and how many times it fired; `can_fire` is the firing
rule and `blocker` says, for a timeout, which register it waits for. The runtime
(`sbpflow.runtime.engine`) holds the lock that guards them. See docs/runtime.md,
'Actors and registers'.
"""

from __future__ import annotations

from collections import deque

from .specs import ActorSpec, Consumer, Plan

__all__ = ["Register", "Actor"]


class Register:
    """An output register of ``slots`` slots read by ``consumers`` (none: a sink, whose values
    go to the caller and whose slot is free again at once)."""

    __slots__ = ("name", "slots", "free", "waiting", "micro_batch", "consumers")

    def __init__(self, name: str, slots: int, consumers: list[Consumer]) -> None:
        self.name, self.slots, self.consumers = name, slots, consumers
        self.free: deque[int] = deque(range(slots))
        self.waiting: dict[int, set] = {}  # slot -> consumers that have not acked it
        self.micro_batch: dict[int, int] = {}  # slot -> the value's index, for messages

    def publish(self, slot: int, index: int) -> None:
        self.waiting[slot] = {(c.rank, c.actor, c.index) for c in self.consumers}
        self.micro_batch[slot] = index

    def reset(self) -> None:
        """Every slot free, as before a run's first firing."""
        self.free = deque(range(self.slots))
        self.waiting.clear()
        self.micro_batch.clear()

    def ack(self, slot: int, consumer: tuple) -> bool:
        """Record ``consumer``'s ack of ``slot``; True when that frees the slot."""
        left = self.waiting[slot]
        left.discard(consumer)
        if left:
            return False
        del self.waiting[slot]
        self.free.append(slot)
        return True

    def describe_waits(self) -> str:
        return "; ".join(f"slot {s} (value {self.micro_batch[s]}) not acked by "
                         + ", ".join(f"{a!r} on rank {r}" for r, a, _ in sorted(left))
                         for s, left in sorted(self.waiting.items()))


class Actor:
    """Run state of the actor ``spec`` on ``rank`` for a run of ``micro_batches``."""

    __slots__ = ("spec", "name", "rank", "fn", "times", "every", "fired", "busy", "since",
                 "inputs", "repeats", "received", "sources", "outputs")

    def __init__(self, spec: ActorSpec, rank: int, plan: Plan, micro_batches: int,
                 now: float) -> None:
        self.spec, self.name, self.rank, self.fn = spec, spec.name, rank, spec.fn
        self.times, self.every = spec.firings(micro_batches), spec.emit_every
        self.fired, self.busy, self.since = 0, False, now
        self.inputs: list[deque] = [deque() for _ in spec.inputs]  # (slot, index, value)
        self.repeats = [ref.repeat for ref in spec.inputs]
        self.received = [0] * len(spec.inputs)  # reqs received an input (their order check)
        # (rank, actor, register, the register's index) an input
        self.sources, outputs = plan.wiring(rank, spec)
        self.outputs = [Register(reg, n, consumers) for reg, n, consumers in outputs]

    def restart(self, now: float) -> None:
        """The state before a run's first firing, after a run that fired in a `FiringOrder`
        (which reads no input queue and publishes into no register: they are as reset)."""
        self.fired, self.busy, self.since = 0, False, now
        self.fn = self.spec.fn  # (a spec's function may be replaced between runs: a wrapper)

    def reset(self, now: float) -> None:
        """The state before a run's first firing (the run's objects are reused: `_next_run`)."""
        self.restart(now)
        for q in self.inputs:
            q.clear()
        self.received = [0] * len(self.inputs)
        for reg in self.outputs:
            reg.reset()

    def emits_now(self) -> bool:
        return (self.fired + 1) % self.every == 0

    def can_fire(self) -> bool:
        """The firing rule: fired fewer times than a run asks, a readable slot in every input,
        and (when this firing publishes) a free slot in every output register."""
        if self.fired >= self.times:
            return False
        for q in self.inputs:
            if not q:
                return False
        if self.emits_now():
            for reg in self.outputs:
                if not reg.free:
                    return False
        return True

    def finished(self) -> bool:
        """Fired all its times and every published slot acked."""
        return self.fired >= self.times and not any(reg.waiting for reg in self.outputs)

    def blocker(self) -> str:
        """What it waits for: an input's req, a free output slot, or consumers' acks."""
        if self.fired < self.times:
            for q, (r, actor, reg, _), k in zip(self.inputs, self.sources, self.repeats):
                if not q:
                    return (f"input register {actor}.{reg} of rank {r} (no req for value "
                            f"{self.fired // k} yet)")
            for reg in self.outputs:
                if not reg.free:
                    return (f"a free slot of its output register {reg.name!r} ({reg.slots} "
                            f"slots: {reg.describe_waits()})")
            return "nothing (it can fire)"
        waits = [reg for reg in self.outputs if reg.waiting]
        return "; ".join(f"the acks of its output register {reg.name!r} ({reg.describe_waits()})"
                         for reg in waits)
