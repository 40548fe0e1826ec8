"""A plan as data: per rank, the actors it runs and the registers that join them.

An `ActorSpec` names an actor, its kind and stage, the function it runs, its input registers
(`Input`: an output register of a producer actor, possibly on another rank) and its output
registers with their slot counts. A `Plan` holds the specs of every rank (each rank runs only
its own, but producers must know their consumers on other ranks) and checks that they fit
together. See docs/runtime.md, 'Actors and registers'.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from ..errors import PlanError

__all__ = ["KINDS", "QUEUES", "Input", "ActorSpec", "Plan"]

KINDS = ("forward", "backward", "send", "recv", "collective", "load", "update", "compute")
# The thread ("queue") a kind runs on unless its spec says otherwise: kernels on one compute
# thread (a device runs one kernel at a time), transfers and collectives beside them.
QUEUES = {"forward": "compute", "backward": "compute", "compute": "compute",
          "update": "compute", "send": "comm", "recv": "comm", "collective": "comm",
          "load": "data"}
DEFAULT_SLOTS = 2  # double buffering: a producer fills one slot while its consumers read one


@dataclass(frozen=True)
class Input:
    """Input register of an actor: output register ``register`` of actor ``actor`` on rank
    ``rank`` (None: the consumer's own rank). ``repeat``: each value serves that many
    consecutive firings and is acked after the last (a once-a-run value read by every
    micro-batch)."""

    actor: str
    register: str = "out"
    rank: int | None = None
    repeat: int = 1


@dataclass
class ActorSpec:
    """One actor. ``fn(micro_batch, *input_values)`` runs at each firing and returns the value
    of its output register (a tuple, one value a register, when it has several).

    ``inputs``: `Input`s, or names of producers on the same rank (register "out").
    ``outputs``: register name -> slot count, or an int: one register "out" with that many
    slots. ``times``: firings a run (None: the run's micro-batch count). ``emit_every``: the
    output is published on every n-th firing only (an accumulator; the other firings need no
    free slot and their result is dropped). ``queue``: the thread it runs on (default by kind).
    """

    name: str
    kind: str
    fn: Callable[..., Any]
    stage: int = 0
    inputs: Sequence[Input | str] = ()
    outputs: Mapping[str, int] | int = DEFAULT_SLOTS
    times: int | None = None
    emit_every: int = 1
    queue: str | None = None

    def __post_init__(self) -> None:
        self.inputs = tuple(Input(i) if isinstance(i, str) else i for i in self.inputs)
        if isinstance(self.outputs, int):
            self.outputs = {"out": self.outputs}
        self.outputs = dict(self.outputs)
        if self.queue is None:
            self.queue = QUEUES.get(self.kind, "compute")

    def firings(self, micro_batches: int) -> int:
        return micro_batches if self.times is None else self.times

    def emits(self, micro_batches: int) -> int:
        """How many values each output register publishes in a run."""
        return self.firings(micro_batches) // self.emit_every


@dataclass(frozen=True)
class Consumer:
    """Who reads a register: input ``index`` of actor ``actor`` on rank ``rank``."""

    rank: int
    actor: str
    index: int


@dataclass
class Plan:
    """The actors of every rank: ``actors[rank]`` is that rank's list of `ActorSpec`s.
    ``name`` names the message channel its runtimes talk on (unique among runtimes that run at
    the same time). ``inline``: the actors' functions wait only in the communicator (whose
    waits end at its timeout or at the runtime's interrupt), so a rank whose actors run on the
    calling thread can always be stopped (`runs_inline`). ``solo``: the ranks whose actors'
    functions never wait for another rank (no collective, no transfer: a forward-only stage
    with no boxing), which may run inline on any communicator."""

    actors: Mapping[int, Sequence[ActorSpec]]
    name: str = "plan"
    inline: bool = False
    solo: frozenset = frozenset()
    consumers: dict = field(init=False, repr=False)
    _wiring: dict = field(init=False, repr=False, compare=False)
    _rates: set = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.actors = {int(r): list(specs) for r, specs in self.actors.items()}
        self._wiring, self._rates = {}, set()  # `wiring`, `check_rates` memos
        self.consumers = {}  # (rank, actor, register) -> [Consumer]
        self._check_names()
        for r, specs in self.actors.items():
            for spec in specs:
                for i, ref in enumerate(spec.inputs):
                    key = self._resolve(r, spec, ref)
                    self.consumers.setdefault(key, []).append(Consumer(r, spec.name, i))

    @property
    def ranks(self) -> list[int]:
        """The ranks with actors (worked out once a plan: each run's messaging reads it)."""
        got = self._wiring.get("ranks")
        if got is None:
            got = self._wiring["ranks"] = sorted(r for r, specs in self.actors.items() if specs)
        return list(got)

    def actor_ids(self) -> tuple[dict[str, int], dict[int, str]]:
        """Each actor name of the plan as a number and back: the first 63 bits of its BLAKE2b
        digest, so the same on every rank whatever the order of the specs (how the runtime's
        messages name actors in their fixed-size binary records, `sbpflow.comm.records`).
        Worked out once a plan; two names with one number (never seen) are a `PlanError`."""
        got = self._wiring.get("ids")
        if got is None:
            ids: dict[str, int] = {}
            names: dict[int, str] = {}
            for specs in self.actors.values():
                for s in specs:
                    if s.name not in ids:
                        n = int.from_bytes(hashlib.blake2b(s.name.encode(), digest_size=8)
                                           .digest(), "big") >> 1
                        if n in names:
                            raise PlanError(f"actors {names[n]!r} and {s.name!r} of plan "
                                            f"{self.name!r} hash alike: rename one")
                        ids[s.name], names[n] = n, s.name
            got = self._wiring["ids"] = (ids, names)
        return got

    def spec(self, rank: int, name: str) -> ActorSpec:
        for s in self.actors.get(rank, ()):
            if s.name == name:
                return s
        raise PlanError(f"no actor {name!r} on rank {rank} in plan {self.name!r}")

    def producer(self, rank: int, ref: Input) -> tuple[int, str, str]:
        """``(rank, actor, register)`` of the register input ``ref`` of an actor of ``rank``."""
        return (rank if ref.rank is None else ref.rank, ref.actor, ref.register)

    def _check_names(self) -> None:
        for r, specs in self.actors.items():
            seen: set[str] = set()
            for s in specs:
                where = f"actor {s.name!r} on rank {r}"
                if s.name in seen:
                    raise PlanError(f"two actors named {s.name!r} on rank {r}")
                seen.add(s.name)
                if s.kind not in KINDS:
                    raise PlanError(f"{where}: unknown kind {s.kind!r}; one of {KINDS}")
                if not callable(s.fn):
                    raise PlanError(f"{where}: fn {s.fn!r} is not callable")
                bad = {k: v for k, v in s.outputs.items() if not isinstance(v, int) or v < 1}
                if bad:
                    raise PlanError(f"{where}: output registers need at least 1 slot: {bad}")
                if not isinstance(s.emit_every, int) or s.emit_every < 1:
                    raise PlanError(f"{where}: emit_every must be an int >= 1, got "
                                    f"{s.emit_every!r}")
                if s.times is not None and (not isinstance(s.times, int) or s.times < 0):
                    raise PlanError(f"{where}: times must be None or an int >= 0, got "
                                    f"{s.times!r}")
                if any(not isinstance(i.repeat, int) or i.repeat < 1 for i in s.inputs):
                    raise PlanError(f"{where}: an input's repeat must be an int >= 1: "
                                    f"{[i.repeat for i in s.inputs]}")

    def _resolve(self, rank: int, spec: ActorSpec, ref: Input) -> tuple[int, str, str]:
        key = self.producer(rank, ref)
        src = [s for s in self.actors.get(key[0], ()) if s.name == key[1]]
        if not src:
            raise PlanError(f"actor {spec.name!r} on rank {rank} reads register {key[2]!r} of "
                            f"actor {key[1]!r} on rank {key[0]}, which is not in the plan")
        if key[2] not in src[0].outputs:
            raise PlanError(f"actor {spec.name!r} on rank {rank} reads register {key[2]!r} of "
                            f"actor {key[1]!r} on rank {key[0]}, whose registers are "
                            f"{sorted(src[0].outputs)}")
        return key

    def runs_inline(self, rank: int) -> bool:
        """Whether ``rank`` runs its actors on the calling thread, with no hand-off to queue
        threads: the plan says it may (``inline``), its actors share one queue (nothing to
        overlap across threads) and none reads or feeds another rank's actor (a data-parallel
        stage: its collectives run inside the actors, their asynchronous parts on the
        communicator's own threads). See docs/runtime.md, 'Actors and registers'."""
        specs = self.actors.get(rank, ())
        if not self.inline or len({s.queue for s in specs}) > 1:
            return False
        for s in specs:
            if any(self.producer(rank, ref)[0] != rank for ref in s.inputs):
                return False
            if any(c.rank != rank for reg in s.outputs
                   for c in self.consumers.get((rank, s.name, reg), ())):
                return False
        return True

    def wiring(self, rank: int, spec: ActorSpec) -> tuple[list, list]:
        """What an actor of ``rank`` is joined to, worked out once a plan: per input ``(rank,
        actor, register, the register's index among the producer's)``; per output register
        ``(name, slots, consumers)``."""
        key = (rank, spec.name)
        got = self._wiring.get(key)
        if got is None:
            sources = []
            for ref in spec.inputs:
                r, actor, reg = self.producer(rank, ref)
                sources.append((r, actor, reg, list(self.spec(r, actor).outputs).index(reg)))
            outputs = [(reg, n, self.consumers.get((rank, spec.name, reg), []))
                       for reg, n in spec.outputs.items()]
            got = self._wiring[key] = (sources, outputs)
        return got

    def check_rates(self, micro_batches: int) -> None:
        """Each consumer fires exactly as often as each of its producers publishes (checked
        once a plan and micro-batch count)."""
        if micro_batches in self._rates:
            return
        self._check_rates(micro_batches)
        self._rates.add(micro_batches)

    def _check_rates(self, micro_batches: int) -> None:
        for (r, name, reg), consumers in self.consumers.items():
            src = self.spec(r, name)
            if src.firings(micro_batches) % src.emit_every:
                raise PlanError(f"actor {name!r} on rank {r} fires "
                                f"{src.firings(micro_batches)} times, not a multiple of its "
                                f"emit_every {src.emit_every}")
            made = src.emits(micro_batches)
            for c in consumers:
                spec = self.spec(c.rank, c.actor)
                want, repeat = spec.firings(micro_batches), spec.inputs[c.index].repeat
                if want != made * repeat:
                    raise PlanError(f"actor {c.actor!r} on rank {c.rank} fires {want} times "
                                    f"a run ({micro_batches} micro-batches) but its input "
                                    f"{name}.{reg} on rank {r} publishes {made} values, each "
                                    f"read {repeat} time(s)")

    def describe(self, rank: int) -> str:
        """The actors of ``rank`` with their registers, one line each."""
        lines = [f"plan {self.name!r}, rank {rank}:"]
        for s in self.actors.get(rank, ()):
            ins = ", ".join(f"{i.actor}.{i.register}" + ("" if i.rank is None else f"@{i.rank}")
                            for i in s.inputs) or "-"
            outs = []
            for reg, n in s.outputs.items():
                readers = self.consumers.get((rank, s.name, reg), [])
                who = ", ".join(f"{c.actor}@{c.rank}" for c in readers) or "the caller"
                outs.append(f"{reg}[{n} slots] -> {who}")
            lines.append(f"  {s.name} ({s.kind}, stage {s.stage}, {s.queue} thread): "
                         f"reads {ins}; writes {'; '.join(outs)}")
        return "\n".join(lines)
